"""Held-out accuracy of the starting actor and a trained one, over sampling seeds (RLVR runs).

The held-out problems, their template, the response prefix, the sampling settings and the
verifier all come from the run's config (its `eval.*`, `data.*`, `generation.*` and
`reward.*`: `eval.prompts: task` gives the task's held-out problems of `eval.task_seed`, none
of them trained on), so the figures are the trainer's `eval/accuracy` for more seeds. Each
actor answers every problem once per seed (temperature `eval.temperature`, or greedy with
`eval.greedy`); the script prints per seed the accuracy of base and trained, then the mean
over seeds and the rise with its min / max. `--json PATH` writes them.

The base is the config's starting actor: `model.actor` (with `model.lora.adapter` when the run
starts from one), loaded as the trainer loads it (`ppo_jax.saved_actor.load_actor`); another
starting model is `--set model.actor=DIR`. `--base`, when given, must name that same model: a
different one is refused (it would compare the trained actor with a model it never started
from). The trained actor is an HF directory (`<run>/actor_hf`) or a PEFT adapter directory
(`<run>/actor_adapter`, on the config's `model.actor`).

Without a trained actor only the base is evaluated (its accuracy per seed and the mean):
`--set data.task.name=leg_counting --set data.task.kwargs.max_animals=2` measures the starting
model on another task or difficulty (`--set` as train.py's).

Usage:
  .venv/bin/python scripts/compare_accuracy.py [runs/rlvr/actor_hf] --config configs/rlvr.yaml
      [--seeds 0 1 2] [--num-prompts 64] [--set KEY=VALUE ...] [--show 2] [--json PATH]

Errors: a missing model directory or config, a `--base` that is not the config's
`model.actor`, or a config whose reward function reports no `accuracy`, prints `error: ...`
and exits 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import numpy as np

from ppo_jax.models import load_tokenizer
from ppo_jax.models.lora import join
from ppo_jax.rollout.sampler import generate
from ppo_jax.trainer.config import ConfigError, load_config
from ppo_jax.trainer.rewards.functions import get_reward_function, score_texts
from ppo_jax.saved_actor import actor_dir_kind, load_actor
from ppo_jax.trainer.loading.models import build_prompts, pad_token_id, resolve_model_path, stop_token_ids


def same_model(given: str, source: str) -> bool:
    """`given` names the model source `source`: the same name, or the same directory."""
    if given == source:
        return True
    a, b = Path(given).expanduser(), Path(source).expanduser()
    return a.is_dir() and b.is_dir() and a.resolve() == b.resolve()


def base_source(cfg, given: str | None) -> Path:
    """The run's starting actor: `model.lora.adapter` (on `model.actor`) when set, else the
    `model.actor` directory.

    Raises:
      ConfigError: `given` (`--base`) is not the config's `model.actor`, naming both.
      FileNotFoundError: `model.actor` is no model (`resolve_model_path`).
    """
    actor = cfg.model.actor
    if given is not None and not same_model(given, actor):
        raise ConfigError(f"--base {given!r} is not the config's model.actor {actor!r}: the "
                          "run started from model.actor, so that is the base; drop --base, or "
                          f"set the config's starting model with --set model.actor={given}")
    path = resolve_model_path(actor, "model.actor")
    return Path(cfg.model.lora.adapter) if cfg.model.lora.adapter else path


def accuracies(source: Path, cfg, seeds, reward_fn) -> tuple[list[float], list[list[str]], list[str]]:
    """Load the actor at `source` (an HF or adapter directory, `load_actor`) once; per seed the
    mean accuracy over the held-out problems and the responses; the problems' prompts."""
    loaded, tok_dir = load_actor(cfg, source)
    tokenizer, model_cfg = load_tokenizer(tok_dir), loaded.cfg
    graphdef, params = loaded.graphdef, join(loaded.frozen, loaded.params)
    e = cfg.eval
    prompts = build_prompts(cfg, tokenizer, model_cfg, path=e.prompts, key="eval.prompts",
                            max_new_tokens=e.max_new_tokens)
    n = min(e.num_prompts, len(prompts))
    ids, mask, texts = prompts.ids[:n], prompts.mask[:n], prompts.texts[:n]
    rows = None if prompts.rows is None else prompts.rows[:n]
    pad, prefix = pad_token_id(tokenizer), cfg.data.response_prefix or ""

    def decode(r, m):
        return [prefix + tokenizer.decode(a[b > 0].tolist(), skip_special_tokens=True)
                for a, b in zip(r, m)]

    out, responses = [], []
    for seed in seeds:
        r, m = generate(graphdef, params, ids, mask, jax.random.PRNGKey(seed),
                        max_new_tokens=e.max_new_tokens or cfg.generation.max_new_tokens,
                        temperature=e.temperature, greedy=e.greedy, top_k=cfg.generation.top_k,
                        top_p=cfg.generation.top_p, pad_token_id=pad,
                        stop_token_ids=stop_token_ids(cfg, tokenizer, model_cfg))
        text, _, parts = score_texts(reward_fn, decode, texts, np.asarray(r), np.asarray(m), rows)
        if "accuracy" not in parts:
            raise ConfigError(f"reward.function={cfg.reward.function!r} reports no accuracy")
        out.append(float(np.mean(parts["accuracy"])))
        responses.append(text)
    return out, responses, texts


def figures(seeds, before: list[float], after: list[float]) -> dict:
    """Per-seed accuracies and the rise's mean / min / max over seeds."""
    per_seed = [{"seed": s, "before": b, "after": a, "rise": a - b}
                for s, b, a in zip(seeds, before, after)]
    rises = [r["rise"] for r in per_seed]
    return {"per_seed": per_seed, "mean_before": float(np.mean(before)),
            "mean_after": float(np.mean(after)), "mean_rise": float(np.mean(rises)),
            "min_rise": min(rises), "max_rise": max(rises)}


def base_only(args, result) -> int:
    """Print (and with --json write) the base's accuracy per seed and its mean."""
    acc, _, texts, base = result
    for seed, a in zip(args.seeds, acc):
        print(f"seed {seed}: accuracy {a:.3f}")
    print(f"held-out accuracy of {base} over {len(texts)} problems and {len(args.seeds)} "
          f"seeds: {np.mean(acc):.3f} (min {min(acc):.3f}, max {max(acc):.3f})")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "base": str(base), "config": args.config, "overrides": args.overrides,
            "num_prompts": len(texts), "seeds": args.seeds, "accuracy": acc,
            "mean": float(np.mean(acc))}, indent=2) + "\n")
    return 0


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trained", nargs="?",
                        help="HF directory of the trained actor (runs/<run>/actor_hf); none: "
                        "the base alone")
    parser.add_argument("--config", required=True, help="the run's config (its eval and reward)")
    parser.add_argument("--base", help="the config's model.actor (the default, and the only one "
                        "accepted: --set model.actor=... starts from another)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--num-prompts", type=int, help="held-out problems (default eval.num_prompts)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="config override, as train.py's (repeatable)")
    parser.add_argument("--show", type=int, default=2, help="print this many problems' answers")
    parser.add_argument("--json", help="write the figures to this file")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        overrides = args.overrides + ([f"eval.num_prompts={args.num_prompts}"]
                                      if args.num_prompts else [])
        cfg = load_config(args.config, overrides)
        reward_fn = get_reward_function(cfg.reward.function, **cfg.reward.function_kwargs)
        paths = [base_source(cfg, args.base)]
        if args.trained:
            actor_dir_kind(args.trained, "trained")
            paths.append(Path(args.trained))
        results = [(*accuracies(p, cfg, args.seeds, reward_fn), p) for p in paths]
    except (FileNotFoundError, ValueError) as e:  # ConfigError among them
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not args.trained:
        return base_only(args, results[0])
    (before, b_text, texts, base), (after, a_text, _, _) = results
    for i in range(min(args.show, len(texts))):
        print(f"problem: {texts[i]}\n  base:    {b_text[0][i]!r}\n  trained: {a_text[0][i]!r}\n")
    result = figures(args.seeds, before, after)
    for r in result["per_seed"]:
        print(f"seed {r['seed']}: accuracy base {r['before']:.3f}, trained {r['after']:.3f}, "
              f"rise {r['rise']:+.3f}")
    print(f"held-out accuracy over {len(texts)} problems and {len(args.seeds)} seeds: base "
          f"{result['mean_before']:.3f}, trained {result['mean_after']:.3f}, rise "
          f"{result['mean_rise']:+.3f} (min {result['min_rise']:+.3f}, max "
          f"{result['max_rise']:+.3f})")
    if args.json:
        meta = {"trained": args.trained, "base": str(base), "config": args.config,
                "num_prompts": len(texts), "seeds": args.seeds}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({**meta, **result}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
