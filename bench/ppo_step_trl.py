"""One PPO-step benchmark configuration of TRL 0.11's `PPOTrainer` (runs in .venv-bench).

The comparison point for `bench/ppo_step.py`: the same model (an HF directory, e.g. the converted
SmolLM2-135M-Instruct), the same prompts (token ids handed over by `ppo_step.py`, so both sides
see identical rows in the same order), the same batch, exactly `--new-tokens` sampled tokens per
response (`min_new_tokens == max_new_tokens`, so EOS can never end a row early), the same VADER
reward on the decoded response, the same PPO settings (1 minibatch of the whole batch, no
gradient accumulation, gradient clipping at 1.0, KL coefficient 0.05 fixed), float32 on CPU.

Model: `AutoModelForCausalLMWithValueHead` (TRL's shared critic: the value head sits on the
actor's backbone; one joint loss `pg + vf_coef * vf`) and a frozen reference copy, as in TRL's
own examples. Per step, timed with `time.perf_counter()`:

- generation: `ppo_trainer.generate(queries, batch_size=B, return_prompt=False, ...)` (HF
  `generate`, sampling with temperature 1, top_k 0, top_p 1);
- reward: `batch_decode` + VADER compound score of each response;
- `ppo_trainer.step(queries, responses, scores)`, whose own `time/ppo/*` entries split it into
  forward_pass (actor+values and reference log-probs), compute_rewards, compute_advantages,
  optimize_step (epochs x minibatches of forward+backward+Adam) and calc_stats.

Phases reported (they add up to the step): generation; scoring = reward + forward_pass +
compute_rewards + compute_advantages; update = the rest of `step()` (optimize_step + calc_stats +
KL-controller update + overhead); step = generation + reward + `step()`.
Tokens/s use the same counts as ppo_jax: generation = B * new_tokens / t; scoring and step = real
(unpadded) prompt + response tokens / t; update = epochs * those tokens / t.

FLOPs: after the measured steps, one more untimed step on the rows of the first measured step
runs `step()` under `torch.utils.flop_counter.FlopCounterMode` (plus the CPU flash-attention
kernels its table lacks), split at `compute_advantages` into scoring and update FLOPs
(`model_flops` in the JSON, `gflops_per_s/*` = those FLOPs / each measured step's phase time).

Prints one line `BENCH_JSON {...}` (median, min, max of each figure over the measured steps after
`--warmup` untimed steps; the first step's time; peak RSS of this process, from
`getrusage(RUSAGE_SELF).ru_maxrss`). Run one configuration per process so that
peak RSS is per configuration.

Usage (normally called by ppo_step.py):
  .venv-bench/bin/python bench/ppo_step_trl.py --model-dir DIR [--prompt-ids FILE.json]
      [--epochs 4] [--batch 8] [--new-tokens 48] [--steps 3] [--warmup 1]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import stats  # noqa: E402

JSON_TAG = "BENCH_JSON "


def log(msg: str) -> None:
    print(f"[trl] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- loading
def load_tokenizer(model_dir: Path):
    """The checkpoint's fast tokenizer, read straight from tokenizer.json.

    Directories written by transformers 5 name `tokenizer_class: TokenizersBackend`, which
    transformers 4.x cannot resolve, and keep the chat template in `chat_template.jinja`; both
    are read here by hand. Left padding, as TRL generates with.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        tok = AutoTokenizer.from_pretrained(model_dir)
    except (ValueError, OSError, KeyError):
        cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
        special = {k: cfg[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token")
                   if isinstance(cfg.get(k), str)}
        tok = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"), **special)
    template = model_dir / "chat_template.jinja"
    if getattr(tok, "chat_template", None) is None and template.is_file():
        tok.chat_template = template.read_text()
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def load_config(model_dir: Path):
    """The HF config; a transformers-5 `rope_parameters` dict is mapped back to `rope_theta` /
    `rope_scaling`, which transformers 4.x reads (else it would silently use rope_theta=1e4)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    raw = json.loads((model_dir / "config.json").read_text())
    rope = raw.get("rope_parameters")
    if isinstance(rope, dict):
        if "rope_theta" in rope:
            cfg.rope_theta = float(rope["rope_theta"])
        if rope.get("rope_type", "default") != "default":
            cfg.rope_scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    return cfg


def read_prompt_ids(path: Path | None, tok, max_prompt_length: int) -> list[list[int]]:
    """Prompt token ids: from ppo_step.py's JSON file, else the project's review prompts through
    the chat template (left-truncated to `max_prompt_length`)."""
    if path is not None:
        return [list(map(int, row)) for row in json.loads(path.read_text())["prompt_ids"]]
    root = Path(__file__).resolve().parents[1]
    rows = [json.loads(line)["prompt"] for line in
            (root / "configs/prompts/reviews.jsonl").read_text().splitlines() if line.strip()]
    out = []
    for text in rows:
        if tok.chat_template:
            text = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                           add_generation_prompt=True)
        out.append(tok(text, add_special_tokens=False)["input_ids"][-max_prompt_length:])
    return out


# --------------------------------------------------------------------------- FLOP count
def flop_counter():
    """A `torch.utils.flop_counter.FlopCounterMode` (no display) that also counts the CPU
    flash-attention kernels its table leaves out (`aten._scaled_dot_product_flash_attention_for_cpu`
    and its backward: transformers' default `sdpa` attention on the CPU), with torch's own sdpa
    formulas; None where this torch has no flop counter."""
    try:
        import torch
        from torch.utils import flop_counter as fc
    except ImportError:
        return None
    extra, known = {}, getattr(fc, "flop_registry", {})
    try:
        fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    except (AttributeError, RuntimeError):
        fwd = bwd = None
    if fwd is not None and fwd not in known:
        extra[fwd] = lambda q, k, v, *_, out_shape=None, **__: fc.sdpa_flop_count(q, k, v)
    if bwd is not None and bwd not in known:
        extra[bwd] = (lambda g, q, k, v, *_, out_shape=None, **__:
                      fc.sdpa_backward_flop_count(g, q, k, v))
    return fc.FlopCounterMode(display=False, custom_mapping=extra)


def count_split_flops(obj, marker: str, run) -> dict | None:
    """Run `run()` once under `flop_counter()`; split its FLOPs where the method `obj.<marker>`
    returns (its first call): `{"before", "after", "total"}`, None without a flop counter.

    For TRL's `PPOTrainer.step`, marker `compute_advantages` splits the scoring passes (actor +
    value and reference forward, reward shaping, GAE) from the update (epochs x minibatches)."""
    counter = flop_counter()
    if counter is None:
        return None
    marks, method = [], getattr(obj, marker)

    def marked(*args, **kwargs):
        out = method(*args, **kwargs)
        marks.append(counter.get_total_flops())
        return out

    setattr(obj, marker, marked)
    try:
        with counter:
            run()
    finally:
        delattr(obj, marker)
    if not marks:
        raise RuntimeError(f"{marker} was never called")
    total = counter.get_total_flops()
    return {"before": marks[0], "after": total - marks[0], "total": total}


def count_step_flops(ppo_trainer, queries, responses, scores, records: list[dict]) -> dict | None:
    """`model_flops` of one `ppo_trainer.step(queries, responses, scores)` run under the counter
    (scoring / update split at `compute_advantages`); adds `gflops_per_s/<phase>` to each timed
    record. None (and a log line) without a counter or when counting fails."""
    try:
        split = count_split_flops(ppo_trainer, "compute_advantages",
                                  lambda: ppo_trainer.step(queries, responses, scores))
    except Exception as e:  # noqa: BLE001 - the timings still stand
        log(f"FLOP count failed: {type(e).__name__}: {e}")
        return None
    if split is None:
        log("no torch.utils.flop_counter: FLOPs not counted")
        return None
    out = {"source": "torch FlopCounterMode, one extra untimed step on the rows of the first "
                     "measured step",
           "scoring": {"flops": split["before"]}, "update": {"flops": split["after"]}}
    log(f"FLOPs per step (counted): scoring {split['before'] / 1e9:.3g} GFLOP, update "
        f"{split['after'] / 1e9:.3g} GFLOP")
    for r in records:
        for phase in ("scoring", "update"):
            r[f"gflops_per_s/{phase}"] = out[phase]["flops"] / r[f"time/{phase}"] / 1e9
    return out


# --------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", required=True, type=Path, help="HF checkpoint directory")
    parser.add_argument("--prompt-ids", type=Path, default=None,
                        help='JSON {"prompt_ids": [[ids...], ...]} (real tokens, no padding)')
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--mini-batch", type=int, default=None, help="default: --batch")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--steps", type=int, default=3, help="measured steps")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--max-prompt-length", type=int, default=64)
    parser.add_argument("--kl-coef", type=float, default=0.05)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    mini = args.mini_batch or args.batch

    warnings.filterwarnings("ignore")
    import numpy as np
    import torch
    import transformers
    import trl
    from transformers import AutoModelForCausalLM
    from trl import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

    transformers.logging.set_verbosity_error()
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)

    t_load = time.perf_counter()
    tok = load_tokenizer(args.model_dir)
    hf_cfg = load_config(args.model_dir)

    def value_head_model():
        base = AutoModelForCausalLM.from_pretrained(args.model_dir, config=hf_cfg,
                                                    torch_dtype=torch.float32)
        # dropout off everywhere, as in ppo_jax; TRL's value head defaults to dropout 0.1.
        return AutoModelForCausalLMWithValueHead.from_pretrained(base, summary_dropout_prob=0.0)

    model, ref_model = value_head_model(), value_head_model()
    config = PPOConfig(
        model_name=str(args.model_dir), batch_size=args.batch, mini_batch_size=mini,
        gradient_accumulation_steps=1, ppo_epochs=args.epochs, learning_rate=args.lr,
        init_kl_coef=args.kl_coef, adap_kl_ctrl=False, kl_penalty="kl", cliprange=0.2,
        cliprange_value=0.2, vf_coef=0.1, gamma=1.0, lam=0.95, max_grad_norm=1.0,
        seed=args.seed, log_with=None)
    ppo_trainer = PPOTrainer(config=config, model=model, ref_model=ref_model, tokenizer=tok)
    load_s = time.perf_counter() - t_load

    prompts = read_prompt_ids(args.prompt_ids, tok, args.max_prompt_length)
    analyzer = SentimentIntensityAnalyzer()
    gen_kwargs = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                      do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"{args.model_dir.name}: {n_params / 1e6:.1f}M params (actor + value head), "
        f"{len(prompts)} prompts, batch {args.batch}, mini-batch {mini}, {args.epochs} epochs, "
        f"{args.new_tokens} new tokens; torch {torch.__version__} ({torch.get_num_threads()} "
        f"threads), transformers {transformers.__version__}, trl {trl.__version__}")

    def batch_rows(i: int) -> list[list[int]]:
        start = (i * args.batch) % len(prompts)
        return [prompts[(start + k) % len(prompts)] for k in range(args.batch)]

    def reward(responses) -> list:
        texts = tok.batch_decode(responses, skip_special_tokens=True)
        return [torch.tensor(analyzer.polarity_scores(t)["compound"], dtype=torch.float32)
                for t in texts]

    records, first_step_s = [], None
    for i in range(args.warmup + args.steps):
        rows = batch_rows(i)
        queries = [torch.tensor(r, dtype=torch.long) for r in rows]

        t0 = time.perf_counter()
        responses = ppo_trainer.generate(queries, batch_size=args.batch, return_prompt=False,
                                         **gen_kwargs)
        t1 = time.perf_counter()
        scores = reward(responses)
        t2 = time.perf_counter()
        out = ppo_trainer.step(queries, responses, scores)
        t3 = time.perf_counter()

        lengths = [int(r.shape[0]) for r in responses]
        if any(n != args.new_tokens for n in lengths):
            raise SystemExit(f"TRL generated {lengths} tokens, expected {args.new_tokens} each")
        gen_tokens = sum(lengths)
        seq_tokens = sum(len(r) for r in rows) + gen_tokens
        timing = {k: float(v) for k, v in out.items() if k.startswith("time/ppo/")}
        scoring_in_step = sum(timing[f"time/ppo/{k}"] for k in
                              ("forward_pass", "compute_rewards", "compute_advantages"))
        rec = {
            "time/generation": t1 - t0,
            "time/reward": t2 - t1,
            "time/scoring": (t2 - t1) + scoring_in_step,
            "time/update": (t3 - t2) - scoring_in_step,
            "time/step_call": t3 - t2,
            "time/step": t3 - t0,
            **timing,
            "gen_tokens": gen_tokens, "seq_tokens": seq_tokens,
            "prompt_tokens": seq_tokens - gen_tokens, "max_prompt_len": max(len(r) for r in rows),
        }
        rec["tokens_per_s/generation"] = gen_tokens / rec["time/generation"]
        rec["tokens_per_s/scoring"] = seq_tokens / rec["time/scoring"]
        rec["tokens_per_s/update"] = args.epochs * seq_tokens / rec["time/update"]
        rec["tokens_per_s/step"] = seq_tokens / rec["time/step"]
        kind = "warm-up" if i < args.warmup else "measured"
        log(f"step {i + 1} ({kind}): {rec['time/step']:.2f} s (generation "
            f"{rec['time/generation']:.2f}, scoring {rec['time/scoring']:.2f}, update "
            f"{rec['time/update']:.2f}); score {float(np.mean([float(x) for x in scores])):+.3f}, "
            f"kl {float(out['objective/kl']):.4f}")
        if first_step_s is None:
            first_step_s = rec["time/step"]
        if i >= args.warmup:
            records.append(rec)

    peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # the timed steps'
    # one more, untimed step on the rows of the first measured step, its `step()` under torch's
    # flop counter: the scoring and update FLOPs TRL executes (after the timings, never in them)
    queries = [torch.tensor(r, dtype=torch.long) for r in batch_rows(args.warmup)]
    responses = ppo_trainer.generate(queries, batch_size=args.batch, return_prompt=False,
                                     **gen_kwargs)
    scores = reward(responses)
    model_flops = count_step_flops(ppo_trainer, queries, responses, scores, records)

    keys = [k for k in records[0] if k.startswith(("time/", "tokens_per_s/", "gflops_per_s/"))]
    result = {
        "bench": "ppo_step", "impl": "trl", "mode": "shared", "config": "trl",
        "label": "TRL 0.11 PPOTrainer (value head on actor)",
        "epochs": args.epochs, "batch": args.batch, "mini_batch": mini, "micro_batch": mini,
        "new_tokens": args.new_tokens, "dtype": "float32", "device": "cpu",
        "model": args.model_dir.name, "n_params": n_params,
        "warmup_steps": args.warmup, "measured_steps": len(records),
        "load_s": load_s, "first_step_s": first_step_s, "compile_s": None,
        "gen_tokens": records[0]["gen_tokens"],
        "seq_tokens_mean": statistics.mean(r["seq_tokens"] for r in records),
        "prompt_tokens_mean": statistics.mean(r["prompt_tokens"] for r in records),
        "padded_seq_len_mean": statistics.mean(r["max_prompt_len"] + args.new_tokens for r in records),
        "stats": {k: stats(r[k] for r in records) for k in keys},
        "model_flops": model_flops,
        "peak_rss_mib": peak_rss_mib,
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__, "trl": trl.__version__,
                     "torch_threads": torch.get_num_threads()},
        "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg()[0],
    }
    print(JSON_TAG + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
