"""Talk to a trained actor: answer prompts with the run's chat template and sampling settings.

Usage:
  python -m ppo_jax.generate runs/tiny/actor_hf --prompt "How was the film?"
  python -m ppo_jax.generate runs/lora/actor_adapter --prompts prompts.jsonl --json
  python -m ppo_jax.generate --run runs/tiny --step 2 --prompt "Hi" --greedy
  python -m ppo_jax.generate --run runs/tiny --prompt "Hi"   # its latest checkpoint
  python -m ppo_jax.generate runs/tiny/actor_hf          # in a terminal: a read-answer loop

The actor is an HF directory (`<run>/actor_hf`), a PEFT adapter directory
(`<run>/actor_adapter`, loaded on the run's `model.actor` or on `--base`), or a checkpoint
step of a run (`--run DIR --step N`; without `--step`, the latest checkpoint; step 0 is the
starting actor).

Settings come from the config the actor trained under: that of `--run DIR`, else of the run
directory the actor directory sits in, else configs/default.yaml. It gives the prompt
template (`data.use_chat_template`, `system_prompt`, `response_prefix`, `max_prompt_length`,
`truncation`), the stop tokens and `generation.*`. Flags override them, and `--set KEY=VALUE`
changes any config key. The weights are sampled in the dtype they were trained in, as the
run's held-out evaluation samples them; `--param-dtype bfloat16` casts them, halving the bytes
read per token.

Prompts come from `--prompt TEXT` (repeatable) or `--prompts FILE` (`.jsonl` / `.json` records
with `data.prompt_field`, `.txt` lines, `.parquet`), answered in batches of `--batch-size`;
with neither, from lines of stdin (a read-answer loop on a terminal). Each prompt is one user
turn, as the run's prompts are. The answer to prompt i is row i of one batch of the static
sampler under `PRNGKey(--seed)`, so a seed gives the same answers whatever the batch size.

Output is `>>> prompt` and the response per prompt; `--json` prints one JSON record per line
(`prompt`, `response`, `response_ids`, `ended`, `logprob`) instead. Bad input (a missing
directory or file, a step with no checkpoint, a flag out of range) prints `error: ...` naming
it and exits 2 before any model loads. A checkpoint that cannot be read prints one line and
exits 2: `error: checkpoint of step N cannot be read: FILE: CAUSE; the step trained under
CONFIG; earlier checkpoints: steps [...] (give one with --step M)`. One that reads but does
not fit the config the step trained under says it `does not fit` that config, exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

import jax
import numpy as np

from ppo_jax.models.functional import Model
from ppo_jax.core import ended_rows
from ppo_jax.rollout.draws import SamplingSettings
from ppo_jax.rollout.static_batch import generate, generate_kwargs
from ppo_jax.rollout.weights import cast_floats
from ppo_jax.fork_imports import import_modules
from ppo_jax.trainer.config import Config, ConfigError, load_config
from ppo_jax.trainer.data.prompts import PromptSet, left_pad, read_prompt_records, tokenize_prompts
from ppo_jax.saved_actor import (
    EXIT_STATUS, actor_dir_kind, adapter_overrides, build_trainer, check_actor_stage, check_step,
    load_actor, read_run_config, restore_step, run_of, step_or_latest, trainer_actor,
)
from ppo_jax.trainer.loading.models import pad_token_id, stop_token_ids
from ppo_jax.trainer.state import full_params


@dataclass
class Session:
    """A loaded actor and what answering needs: its run's config, the `Model`, its
    `ModelConfig`, the tokenizer and the sampling settings with the flags applied."""

    cfg: Config
    actor: Model
    model_cfg: Any
    tokenizer: Any
    settings: SamplingSettings


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ppo_jax.generate",
                                description=__doc__.splitlines()[0], epilog=EXIT_STATUS)
    p.add_argument("actor", nargs="?", help="an HF directory (<run>/actor_hf) or a PEFT adapter "
                   "directory (<run>/actor_adapter)")
    p.add_argument("--run", help="run directory: its config gives the settings; without an actor "
                   "directory its checkpoint of --step is the actor")
    p.add_argument("--step", type=int, help="checkpoint step of --run (default: the latest; 0: "
                   "the starting actor)")
    p.add_argument("--base", help="base model of an adapter (default: the run's model.actor, else "
                   "the adapter's base_model_name_or_path)")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompts", metavar="FILE", help="prompt file (.jsonl, .json, .txt, .parquet)")
    p.add_argument("--max-new-tokens", type=int, help="default: generation.max_new_tokens")
    p.add_argument("--temperature", type=float, help="default: generation.temperature")
    p.add_argument("--top-k", type=int, help="default: generation.top_k (0: off)")
    p.add_argument("--top-p", type=float, help="default: generation.top_p (1: off)")
    p.add_argument("--greedy", action=argparse.BooleanOptionalAction, default=None,
                   help="argmax decoding (default: generation.greedy)")
    p.add_argument("--param-dtype", choices=("float32", "bfloat16", "float16"),
                   help="cast the actor's weights for sampling (default: as trained)")
    p.add_argument("--seed", type=int, default=0, help="PRNG seed of the sampler (default 0)")
    p.add_argument("--batch-size", type=int, default=16, help="prompts per sampler call")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config override, as train.py's (repeatable)")
    p.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                   help="import a module first, as train.py's --import: one that registers what "
                        "the run's config names (a policy loss, a reward function, an "
                        "environment; repeatable)")
    p.add_argument("--json", action="store_true", help="one JSON record per answer")
    args = p.parse_args(argv)
    check_flags(p, args)
    return args


def check_flags(parser: argparse.ArgumentParser, args) -> None:
    """Flag values and combinations; `parser.error` (exit 2, naming the flag) on a bad one."""
    checks = [("--max-new-tokens", args.max_new_tokens, lambda v: v >= 1, ">= 1"),
              ("--temperature", args.temperature, lambda v: 0 < v < float("inf"), "> 0"),
              ("--top-k", args.top_k, lambda v: v >= 0, ">= 0"),
              ("--top-p", args.top_p, lambda v: 0 < v <= 1, "in (0, 1]"),
              ("--batch-size", args.batch_size, lambda v: v >= 1, ">= 1")]
    for flag, value, ok, want in checks:
        if value is not None and not ok(value):
            parser.error(f"{flag} {value} must be {want}")
    if args.step is not None and args.run is None:
        parser.error("--step needs --run DIR")
    if args.step is not None and args.actor:
        parser.error(f"give an actor directory ({args.actor}) or --run/--step, not both")
    if args.run is None and not args.actor:
        parser.error("no actor: give an actor directory or --run DIR [--step N]")
    if args.prompt and args.prompts:
        parser.error("give --prompt or --prompts, not both")
    if args.step is not None and args.step < 0:
        parser.error(f"--step {args.step} must be >= 0")


def run_settings(args) -> Config:
    """The config whose settings apply, with `--base` and `--set` on top: the one `--step` of
    `--run` trained under; for an actor directory, that of its run's last step; else the defaults,
    with an adapter's `model.lora` and base from its adapter_config.json. Reads no model.

    Raises:
      ConfigError: a missing or malformed directory or override, naming it.
    """
    kind = actor_dir_kind(args.actor, "actor") if args.actor else None
    if args.base and kind != "adapter":
        raise ConfigError("--base goes with an adapter directory")
    run = args.run if args.run else (run_of(args.actor) if args.actor else None)
    base = [f"model.actor={args.base}"] if args.base else []
    if run is not None:  # a step's config; an actor directory's: the run's last step's
        return read_run_config(run, base + args.overrides, step=args.step)
    if kind == "adapter":
        return load_config(None, adapter_overrides(args.actor, args.base) + args.overrides)
    return load_config(None, args.overrides)


def read_prompts(args, cfg: Config) -> Optional[list[str]]:
    """The prompts of `--prompt` / `--prompts`, or None when neither is given.

    Raises:
      FileNotFoundError / ValueError: a missing or malformed `--prompts` file, naming it.
    """
    if args.prompt:
        for i, text in enumerate(args.prompt):
            if not text.strip():
                raise ConfigError(f"--prompt number {i + 1} is empty")
        return list(args.prompt)
    if args.prompts:
        return read_prompt_records(args.prompts, cfg.data.prompt_field, "--prompts")[0]
    return None


def sampling_settings(cfg: Config, tokenizer, model_cfg, args) -> SamplingSettings:
    """The run's sampling settings, one sample per prompt and no mesh, with the flags given in
    place of the config's values."""
    from ppo_jax.trainer.stages.ppo.settings import settings_for

    run = settings_for(cfg, stop_token_ids=stop_token_ids(cfg, tokenizer, model_cfg),
                       pad_token_id=pad_token_id(tokenizer)).sampling
    flags = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
             "top_k": args.top_k, "top_p": args.top_p, "greedy": args.greedy}
    return replace(run, samples_per_prompt=1, mesh=None,
                   **{k: v for k, v in flags.items() if v is not None})


def load_session(args, cfg: Config) -> Session:
    """Load the actor of `args` under `cfg`, cast to `--param-dtype` when given, and its
    tokenizer.

    Raises:
      ConfigError / FileNotFoundError / ValueError: as `ppo_jax.saved_actor`.
    """
    from ppo_jax.models import load_tokenizer

    if args.step is not None:
        step = check_step(args.run, args.step)
        trainer = build_trainer(cfg)
        restore_step(trainer, args.run, step)
        actor, tokenizer = trainer_actor(trainer), trainer.tokenizer
        model_cfg = trainer.models.actor.cfg if cfg.stage == "ppo" else trainer.model.cfg
    else:
        loaded, tok_dir = load_actor(cfg, args.actor)  # an adapter's base is `frozen`
        actor, model_cfg = Model(loaded.graphdef, full_params(loaded.frozen, loaded.params)), loaded.cfg
        tokenizer = load_tokenizer(tok_dir)
    if args.param_dtype is not None:
        actor = Model(actor.graphdef, cast_floats(actor.params, args.param_dtype))
    return Session(cfg, actor, model_cfg, tokenizer,
                   sampling_settings(cfg, tokenizer, model_cfg, args))


def encode(session: Session, texts: list[str], width: Optional[int] = None) -> PromptSet:
    """The prompts templated and tokenised as the run's prompts are, left-padded to the
    longest or to `width`.

    Raises:
      ConfigError: prompt width + max_new_tokens over the model's context, naming the flag.
    """
    d = session.cfg.data
    pad = pad_token_id(session.tokenizer)
    prompts = tokenize_prompts(texts, session.tokenizer, max_prompt_length=d.max_prompt_length,
                               truncation=d.truncation, use_chat_template=d.use_chat_template,
                               system_prompt=d.system_prompt, pad_token_id=pad,
                               response_prefix=d.response_prefix)
    if width is not None and width > prompts.ids.shape[1]:
        lists = [row[m > 0].tolist() for row, m in zip(prompts.ids, prompts.mask)]
        prompts.ids, prompts.mask = left_pad(lists, width, pad)
    new, context = session.settings.max_new_tokens, session.model_cfg.max_position_embeddings
    if prompts.ids.shape[1] + new > context:
        raise ConfigError(f"--max-new-tokens / generation.max_new_tokens={new}: with prompts of "
                          f"{prompts.ids.shape[1]} tokens it exceeds the model context {context}")
    return prompts


def answer(session: Session, prompts: PromptSet, key, *, first_row: int = 0,
           batch_size: int = 16) -> list[dict]:
    """Sample a response to every prompt of `prompts` (`[N, P]`, left-padded), `batch_size`
    rows per call. The last call is padded with copies of its first row so that there is one
    compile; row i is keyed as row `first_row + i` of one batch.

    Returns:
      N dicts with `prompt`; `response` (`data.response_prefix` + the decoded text);
      `response_ids` (up to and including the stop token); `ended` (a stop token came); and
      `logprob`, the response's log-probability at the sampling temperature, before top_k /
      top_p filtering.
    """
    s, n = session.settings, len(prompts)
    size = min(batch_size, n)
    kwargs = generate_kwargs(s)
    out = []
    for lo in range(0, n, size):
        take = np.arange(lo, lo + size)
        take = np.where(take < n, take, lo)
        ids, mask, logp = generate(session.actor.graphdef, session.actor.params,
                                   prompts.ids[take], prompts.mask[take], key,
                                   first_row=first_row + lo, return_logprobs=True, **kwargs)
        ended = np.asarray(ended_rows(ids, mask, s.stop_token_ids))
        ids, mask, logp = np.asarray(ids), np.asarray(mask), np.asarray(logp)
        for i in range(min(size, n - lo)):
            out.append({"prompt": prompts.texts[lo + i],
                        "response": decode(session, ids[i], mask[i]),
                        "response_ids": ids[i][mask[i] > 0].tolist(), "ended": bool(ended[i]),
                        "logprob": float(logp[i][mask[i] > 0].sum())})
    return out


def decode(session: Session, ids: np.ndarray, mask: np.ndarray) -> str:
    """One response as text with `data.response_prefix` in front, as the trainer decodes it."""
    prefix = session.cfg.data.response_prefix or ""
    return prefix + session.tokenizer.decode(ids[mask > 0].tolist(), skip_special_tokens=True)


def show(record: dict, as_json: bool, write: Callable[[str], None]) -> None:
    """Write one answer: a JSON line, or the prompt after `>>> ` and the response."""
    write(json.dumps(record) if as_json else f">>> {record['prompt']}\n{record['response']}\n")


def chat(session: Session, key, *, read: Optional[Callable[[str], str]] = None,
         write: Callable[[str], None] = print, as_json: bool = False) -> int:
    """The read-answer loop: each non-blank line read is a prompt, answered as row `turn` of one
    batch under `key`. Prompts are padded to `data.max_prompt_length` so every line reuses one
    compile. A line that cannot be encoded is reported on stderr and skipped. Ends at end of
    input, Ctrl-C or a line `/quit`. Returns the number of answers."""
    read = input if read is None else read
    turn = 0
    while True:
        try:
            line = read("> ")
        except (EOFError, KeyboardInterrupt):
            break
        if line.strip() == "/quit":
            break
        if not line.strip():
            continue
        try:
            prompts = encode(session, [line], width=session.cfg.data.max_prompt_length)
        except ValueError as e:  # e.g. a line that tokenises to nothing: say so, read on
            print(f"error: {e}", file=sys.stderr)
            continue
        record = answer(session, prompts, key, first_row=turn)[0]
        write(json.dumps(record) if as_json else record["response"] + "\n")
        turn += 1
    return turn


def main(argv=None, stdin=None) -> int:
    args = parse_args(argv)
    if not import_modules(args.imports):
        return 2
    stdin = sys.stdin if stdin is None else stdin
    try:
        if args.run is not None and not args.actor:  # a checkpoint: --step, else the latest
            args.step = step_or_latest(args.run, args.step)
        cfg = run_settings(args)
        if args.step is not None:
            check_actor_stage(cfg, args.run)
        texts = read_prompts(args, cfg)
        session = load_session(args, cfg)
        key = jax.random.PRNGKey(args.seed)
        if texts is None and stdin.isatty():
            print(f"answering with {args.actor or f'{args.run} step {args.step}'}; a prompt per "
                  "line, /quit or Ctrl-D to end", file=sys.stderr)
            chat(session, key, as_json=args.json)
            return 0
        if texts is None:  # piped: every non-blank line of stdin is a prompt
            texts = [line.rstrip("\n") for line in stdin if line.strip()]
            if not texts:
                raise ConfigError("no prompts: give --prompt, --prompts or lines on stdin")
        for record in answer(session, encode(session, texts), key, batch_size=args.batch_size):
            show(record, args.json, print)
    except (ConfigError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    from ppo_jax.trainer.host.env import quiet_tpu_probe

    quiet_tpu_probe()  # no libtpu start-up errors on a host without TPU chips
    sys.exit(main())
