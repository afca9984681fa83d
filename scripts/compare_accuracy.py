"""Held-out accuracy of the starting actor and a trained one, over sampling seeds (RLVR runs).

The held-out problems, their template, the response prefix, the sampling settings and the
verifier all come from the run's config (its `eval.*`, `data.*`, `generation.*` and
`reward.*`: `eval.prompts: task` gives the task's held-out problems of `eval.task_seed`, none
of them trained on), so the figures are the trainer's `eval/accuracy` for more seeds. Each
actor answers every problem once per seed (temperature `eval.temperature`, or greedy with
`eval.greedy`); the script prints per seed the accuracy of base and trained, then the mean
over seeds and the rise with its min / max. `--json PATH` writes them.

Beside the verifier's accuracy, three figures that learning the answer's format cannot
inflate (docs/rlvr.md, "Accuracy that format cannot inflate"), printed as a table of means over
seeds and written per seed under `figures` in the JSON:
- `format`: the format rate, the fraction of responses with a closed `<answer>` tag (the
  reward's `format` part);
- `accuracy_format_free`: the verifier's comparison on the response's last number, tag or not
  (the reward's `accuracy_format_free` part, `rewards.verifiers.format_free_answer`);
- `accuracy_plain`: a second pass per seed over the same problems asked with a plain
  instruction (`eval.plain_instruction`, by default `data.tasks.PLAIN_INSTRUCTION`: "Give the
  final answer as a number at the end.") in place of `data.task.instruction` and without
  `data.response_prefix`, scored by the format-free accuracy. Only for `eval.prompts: task` (a
  prompt file's instruction is part of its text): otherwise null, printed "n/a"; so is a
  figure whose part the reward function does not report.

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
from ppo_jax.rollout.static_batch import generate
from ppo_jax.trainer.config import ConfigError, load_config
from ppo_jax.trainer.data.prompts import plain_instruction_config
from ppo_jax.trainer.data.tasks import PLAIN_INSTRUCTION, TASK_SOURCE
from ppo_jax.trainer.rewards.calls import score_texts
from ppo_jax.trainer.rewards.functions import get_reward_function
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


def shown_path(path) -> str:
    """`path` as the JSON records it: relative to the working directory when it lies under it
    (a checkout's `.cache/...`), else as given, so no machine's own path lands in a result."""
    path = Path(path)
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


# the figures of one actor on one seed, in the order printed, and their row labels
FIGURES = {"accuracy": "accuracy (verifier, tagged answer)", "format": "format rate (closed tag)",
           "accuracy_format_free": "format-free accuracy (last number)",
           "accuracy_plain": "plain-instruction accuracy (last number)"}


def plain_config(cfg):
    """The config of the plain-instruction pass (`eval.plain_instruction`, else
    `PLAIN_INSTRUCTION`), or None when the held-out prompts are not a task's."""
    if cfg.eval.prompts != TASK_SOURCE:
        return None
    return plain_instruction_config(cfg, cfg.eval.plain_instruction or PLAIN_INSTRUCTION)


def held_out(cfg, tokenizer, model_cfg) -> tuple:
    """`(ids, mask, texts, rows)` of the first `eval.num_prompts` held-out prompts of `cfg`."""
    e = cfg.eval
    prompts = build_prompts(cfg, tokenizer, model_cfg, path=e.prompts, key="eval.prompts",
                            max_new_tokens=e.max_new_tokens)
    n = min(e.num_prompts, len(prompts))
    rows = None if prompts.rows is None else prompts.rows[:n]
    return prompts.ids[:n], prompts.mask[:n], prompts.texts[:n], rows


def answers(actor: tuple, cfg, prompts: tuple, seed: int, reward_fn) -> tuple[list[str], dict]:
    """The responses of `actor` (graphdef, params, tokenizer, model config) to `prompts`
    (`held_out`) sampled with `seed` and the eval settings of `cfg`, decoded with its
    `data.response_prefix` in front, and the reward function's parts `{name: [n]}`.

    Raises:
      ConfigError: the reward function reports no `accuracy`.
    """
    graphdef, params, tokenizer, model_cfg = actor
    ids, mask, texts, rows = prompts
    e, prefix = cfg.eval, cfg.data.response_prefix or ""

    def decode(r, m):
        return [prefix + tokenizer.decode(a[b > 0].tolist(), skip_special_tokens=True)
                for a, b in zip(r, m)]

    r, m = generate(graphdef, params, ids, mask, jax.random.PRNGKey(seed),
                    max_new_tokens=e.max_new_tokens or cfg.generation.max_new_tokens,
                    temperature=e.temperature, greedy=e.greedy, top_k=cfg.generation.top_k,
                    top_p=cfg.generation.top_p, pad_token_id=pad_token_id(tokenizer),
                    stop_token_ids=stop_token_ids(cfg, tokenizer, model_cfg))
    text, _, parts = score_texts(reward_fn, decode, texts, np.asarray(r), np.asarray(m), rows)
    if "accuracy" not in parts:
        raise ConfigError(f"reward.function={cfg.reward.function!r} reports no accuracy")
    return text, parts


def _mean(values) -> float | None:
    return None if values is None else float(np.mean(values))


def accuracies(source: Path, cfg, seeds, reward_fn) -> tuple[list[dict], list[dict], list[str]]:
    """Load the actor at `source` (an HF or adapter directory, `load_actor`) once; per seed its
    `FIGURES` over the held-out problems (a figure the reward does not report, or the plain
    pass without task prompts, is None) and the responses (`{"tagged": [...], "plain": [...]
    or None}`); the problems' prompts."""
    loaded, tok_dir = load_actor(cfg, source)
    tokenizer, model_cfg = load_tokenizer(tok_dir), loaded.cfg
    actor = (loaded.graphdef, join(loaded.frozen, loaded.params), tokenizer, model_cfg)
    prompts, plain_cfg = held_out(cfg, tokenizer, model_cfg), plain_config(cfg)
    plain = None if plain_cfg is None else held_out(plain_cfg, tokenizer, model_cfg)
    out, responses = [], []
    for seed in seeds:
        text, parts = answers(actor, cfg, prompts, seed, reward_fn)
        fig = {name: _mean(parts.get(name)) for name in FIGURES}
        plain_text = None
        if plain is not None:
            plain_text, plain_parts = answers(actor, plain_cfg, plain, seed, reward_fn)
            fig["accuracy_plain"] = _mean(plain_parts.get("accuracy_format_free"))
        out.append(fig)
        responses.append({"tagged": text, "plain": plain_text})
    return out, responses, prompts[2]


def figure_means(runs: dict[str, list[dict]]) -> dict:
    """Per figure of `FIGURES`, per actor (`runs`: its label -> its per-seed figure dicts) the
    per-seed values and `mean_<label>` over seeds (None when a seed lacks it), and with two
    actors `mean_rise` (the second's mean minus the first's, None when either is)."""
    out = {}
    for name in FIGURES:
        entry = {}
        for label, per_seed in runs.items():
            values = [f[name] for f in per_seed]
            entry[label] = values
            entry[f"mean_{label}"] = None if None in values else float(np.mean(values))
        means = [entry[f"mean_{label}"] for label in runs]
        if len(means) == 2:
            entry["mean_rise"] = None if None in means else means[1] - means[0]
        out[name] = entry
    return out


def figure_table(table: dict, labels: list[str]) -> str:
    """`figure_means`'s means as a text table: one row per figure, one column per actor (and
    the rise with two), "n/a" where a figure is None."""
    cols = labels + (["rise"] if len(labels) == 2 else [])
    keys = [f"mean_{label}" for label in labels] + (["mean_rise"] if len(labels) == 2 else [])
    width = max(len(v) for v in FIGURES.values())
    lines = [f"{'mean over seeds':<{width}}  " + "  ".join(f"{c:>8}" for c in cols)]
    for name, title in FIGURES.items():
        cells = [table[name][k] for k in keys]
        lines.append(f"{title:<{width}}  " + "  ".join(
            "     n/a" if v is None else (f"{v:+8.3f}" if k == "mean_rise" else f"{v:8.3f}")
            for k, v in zip(keys, cells)))
    return "\n".join(lines)


def figures(seeds, before: list[float], after: list[float]) -> dict:
    """Per-seed accuracies and the rise's mean / min / max over seeds."""
    per_seed = [{"seed": s, "before": b, "after": a, "rise": a - b}
                for s, b, a in zip(seeds, before, after)]
    rises = [r["rise"] for r in per_seed]
    return {"per_seed": per_seed, "mean_before": float(np.mean(before)),
            "mean_after": float(np.mean(after)), "mean_rise": float(np.mean(rises)),
            "min_rise": min(rises), "max_rise": max(rises)}


def plain_note(plain: str | None) -> str:
    """The line under the table naming the plain pass's instruction (or its absence)."""
    if plain is None:
        return "(no plain-instruction pass: eval.prompts is not a task's problems)"
    return f"(plain instruction: {plain!r}, no data.response_prefix)"


def base_only(args, result, plain: str | None) -> int:
    """Print (and with --json write) the base's accuracy per seed and its mean, and the
    table of `FIGURES` (`plain`: the plain pass's instruction, or None)."""
    figs, _, texts, base = result
    acc = [f["accuracy"] for f in figs]
    for seed, a in zip(args.seeds, acc):
        print(f"seed {seed}: accuracy {a:.3f}")
    print(f"held-out accuracy of {base} over {len(texts)} problems and {len(args.seeds)} "
          f"seeds: {np.mean(acc):.3f} (min {min(acc):.3f}, max {max(acc):.3f})")
    table = figure_means({"base": figs})
    print(figure_table(table, ["base"]) + "\n" + plain_note(plain))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "base": shown_path(base), "config": args.config, "overrides": args.overrides,
            "num_prompts": len(texts), "seeds": args.seeds, "accuracy": acc,
            "mean": float(np.mean(acc)), "plain_instruction": plain, "figures": table},
            indent=2) + "\n")
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
    parser.add_argument("--show", type=int, default=2, help="print this many problems' answers "
                        "(the first seed's; under the plain instruction too, where it ran)")
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
    plain_cfg = plain_config(cfg)
    plain = None if plain_cfg is None else plain_cfg.data.task.instruction
    if not args.trained:
        return base_only(args, results[0], plain)
    (before, b_text, texts, base), (after, a_text, _, _) = results
    for i in range(min(args.show, len(texts))):
        print(f"problem: {texts[i]}\n  base:    {b_text[0]['tagged'][i]!r}\n"
              f"  trained: {a_text[0]['tagged'][i]!r}")
        if b_text[0]["plain"] is not None:
            print(f"  plain instruction, base:    {b_text[0]['plain'][i]!r}\n"
                  f"  plain instruction, trained: {a_text[0]['plain'][i]!r}")
        print()
    result = figures(args.seeds, [f["accuracy"] for f in before], [f["accuracy"] for f in after])
    table = figure_means({"base": before, "trained": after})
    for r in result["per_seed"]:
        print(f"seed {r['seed']}: accuracy base {r['before']:.3f}, trained {r['after']:.3f}, "
              f"rise {r['rise']:+.3f}")
    print(f"held-out accuracy over {len(texts)} problems and {len(args.seeds)} seeds: base "
          f"{result['mean_before']:.3f}, trained {result['mean_after']:.3f}, rise "
          f"{result['mean_rise']:+.3f} (min {result['min_rise']:+.3f}, max "
          f"{result['max_rise']:+.3f})")
    print(figure_table(table, ["base", "trained"]) + "\n" + plain_note(plain))
    if args.json:
        meta = {"trained": args.trained, "base": shown_path(base), "config": args.config,
                "num_prompts": len(texts), "seeds": args.seeds, "plain_instruction": plain}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({**meta, **result, "figures": table},
                                              indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
