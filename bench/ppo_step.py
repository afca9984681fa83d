"""PPO-step benchmark: ppo_jax's `PPOTrainer.step()` against TRL 0.11's `PPOTrainer`, per phase.

What is measured: the wall time of whole PPO steps (`time.perf_counter()` around each phase) and
the tokens/s they give, split into three phases that add up to the step:

- generation: sampling `--new-tokens` tokens for each of `--batch` prompts (temperature 1, no
  top-k / top-p). Neither side may stop early: ppo_jax runs with `generation.ignore_eos=true`,
  TRL with `min_new_tokens == max_new_tokens` (and it checks every row got all of them).
- scoring: decoding + VADER reward of the responses, then the experience passes over prompt +
  response (actor log-probs, reference log-probs, values; the reward is a function here, so
  there is no reward-model pass), reward shaping (k1 KL penalty, fixed coefficient 0.05) and GAE.
- update: `ppo_epochs` x one minibatch of the whole batch (no gradient accumulation), clipped
  policy + value losses, gradient clipping at 1.0, Adam.

Configurations (each in its own subprocess, so that the peak resident memory,
`getrusage(RUSAGE_SELF).ru_maxrss`, is that configuration's alone), for each `--epochs` value:

- `trl`: TRL 0.11.4 `PPOTrainer` with `AutoModelForCausalLMWithValueHead` (value head on the
  actor's backbone, one joint loss `pg + 0.1 vf`) and a frozen reference; `bench/ppo_step_trl.py`
  in the benchmark-only environment `.venv-bench` (`bench/setup_trl_env.sh`).
- `jax-shared`: ppo_jax with `model.shared_critic=true`, `ppo.vf_coef=0.1`: the same work as TRL
  (two forward passes to score, one forward+backward per epoch to update).
- `jax-separate`: ppo_jax's default DeepSpeed-Chat layout, a separate critic model with its own
  optimiser: one more forward pass to score and one more forward+backward per epoch (more work;
  an extra row, not the like-for-like comparison).

Both sides load the same HF directory (default: SmolLM2-135M-Instruct converted by
`ensure_smollm2()`), compute in float32 on the CPU, and take the same prompts in the same order:
this script tokenises the project's prompt set with ppo_jax's own code (chat template, left
truncation to `--max-prompt-length`) and hands the token ids to the TRL script; ppo_jax reads
them unshuffled (`data.shuffle=false`), so step k of both sides sees rows k*B .. k*B+B-1. (ppo_jax
pads every batch's prompts to the widest prompt of the set (`data.prompt_buckets=1`, so the
warm-up step compiles the one shape the timed steps run; per-batch buckets would compile a new
width inside a timed step), TRL pads to the widest of the batch; token counts below count real
tokens only, so both sides are credited with the same tokens, and `padded_seq_len_mean` gives
the columns each side computed over.)

Tokens/s: generation = B * new_tokens / t; scoring and step = (real prompt + response tokens) /
t; update = epochs * (real prompt + response tokens) / t. With the same tokens on both sides,
ours/TRL tokens/s equals TRL time / ours time.

Model FLOPs per step, counted on both sides (not assumed; `model_flops` in each result): ppo_jax
from the jaxprs of the compiled scoring (`make_experience`) and update (`ppo_update`) functions,
after the timed steps (bench/flops.py: matmuls, scan bodies x trip count; XLA's cost analysis
beside it); TRL from torch's `FlopCounterMode` on one extra untimed step (bench/ppo_step_trl.py).
ppo_jax applies the LM head and log-softmax to response positions only, TRL 0.11 to every
position, so "equal work" is equal PPO work, not equal FLOPs: the table shows both.

Process: both sides' workers start with glibc's `MALLOC_SETTINGS` in their environment, as
`train.py` runs (ppo_jax.trainer.host_memory; `PPO_JAX_MALLOC_TUNING=0` runs both without;
`malloc_settings` in each result says which).

Timing: `--warmup` untimed steps first (for ppo_jax they hold the XLA compilation), then
`--steps` measured steps, in each of `--rounds` interleaved rounds: every configuration runs once
per round in a fresh process (the order reversed every other round), so a machine whose speed
drifts over the run weighs on both sides alike. Each figure is the median of the rounds' medians
with the min and max over every measured step (`merge_rounds`; the rounds' own results are kept
in the JSON's `rounds`), and each phase's ratio to TRL is also given per round (TRL's median /
ours of the same round) with its spread. Compile time = first step minus the median
steady-state step (per phase as well).

Usage:
  python bench/ppo_step.py [--epochs 1 4] [--steps 3] [--warmup 1] [--rounds 3] [--batch 8]
      [--new-tokens 48] [--configs trl,jax-shared,jax-separate] [--json PATH]
One ppo_jax configuration alone (what the orchestrator runs in each subprocess; also used by
`bench/gpu.py`, with `--dtype bfloat16`):
  python bench/ppo_step.py --worker jax --mode shared --epochs 4 [--model-dir DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout, uninstalled
sys.path.insert(0, str(ROOT / "bench"))
from common import cpu_info, cpu_line, run_record, under_malloc_settings, stats, write_json  # noqa: E402

JSON_TAG = "BENCH_JSON "
PROMPTS = ROOT / "configs/prompts/reviews.jsonl"
CONFIGS = ("trl", "jax-shared", "jax-separate")
LABELS = {
    "trl": "TRL 0.11 PPOTrainer (value head on actor)",
    "jax-shared": "ppo_jax, shared critic (equal work)",
    "jax-separate": "ppo_jax, separate critic (DeepSpeed-Chat layout, more work)",
}
KL_COEF, LR, VF_COEF, CLIP, MAX_GRAD_NORM = 0.05, 1e-5, 0.1, 0.2, 1.0


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def resolve_model_dir(model_dir: str | None) -> Path:
    if model_dir:
        return Path(model_dir).resolve()
    from ppo_jax.models.smollm2 import ensure_smollm2

    return ensure_smollm2().resolve()


# --------------------------------------------------------------------------- ppo_jax worker
def jax_overrides(model_dir: Path, mode: str, args, out_dir: str) -> list[str]:
    """Config overrides of one ppo_jax configuration (everything else: the schema defaults)."""
    b, dtype = args.batch, args.dtype
    return [
        f"model.actor={model_dir}", f"model.shared_critic={'true' if mode == 'shared' else 'false'}",
        f"model.param_dtype={dtype}", f"model.dtype={dtype}", f"model.frozen_param_dtype={dtype}",
        f"model.remat={args.remat}",
        f"data.prompts={PROMPTS}", "data.shuffle=false", "data.use_chat_template=true",
        f"data.max_prompt_length={args.max_prompt_length}",
        # one prompt width (the set's widest): with per-batch width buckets a timed step whose
        # width the warm-up step did not have compiles its programs inside the timing
        # (measured on the Intel machine: 8.6 s updates with a compile, 5.0 s without)
        "data.prompt_buckets=1",
        f"generation.max_new_tokens={args.new_tokens}", "generation.ignore_eos=true",
        "generation.temperature=1.0", "generation.top_k=0", "generation.top_p=1.0",
        f"ppo.batch_size={b}", f"ppo.mini_batch_size={b}", f"ppo.micro_batch_size={b}",
        f"ppo.ppo_epochs={args.epochs}", f"ppo.kl_coef={KL_COEF}", "ppo.kl_controller=fixed",
        "ppo.kl_estimator=kl", f"ppo.cliprange={CLIP}", f"ppo.cliprange_value={CLIP}",
        f"ppo.vf_coef={VF_COEF}", "ppo.gamma=1.0", "ppo.lam=0.95",
        f"optim.actor_lr={LR}", f"optim.critic_lr={LR}", f"optim.max_grad_norm={MAX_GRAD_NORM}",
        "reward.kind=function", "reward.function=vader",
        f"train.steps={args.warmup + args.steps}", f"train.seed={args.seed}",
        f"train.output_dir={out_dir}", "train.tensorboard=false", "train.progress=false",
        "train.export_hf=false", "train.save_every=0", "train.sample_every=0",
    ]


def device_peak_bytes() -> int | None:
    """Peak accelerator memory of device 0 (`memory_stats()`), None where not reported (CPU)."""
    import jax

    try:
        ms = jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 - not every backend implements memory_stats
        return None
    return ms.get("peak_bytes_in_use")


def run_jax_worker(args) -> dict:
    """Build `PPOTrainer(load_config(overrides))` and time `warmup + steps` calls of `step()`."""
    import jax
    import numpy as np
    from flops import SignatureRecorder

    from ppo_jax.trainer.config import load_config
    from ppo_jax.trainer.stages.ppo import PPOTrainer

    model_dir = resolve_model_dir(args.model_dir)
    with tempfile.TemporaryDirectory(prefix="ppo_step_bench_") as out_dir:
        cfg = load_config(None, jax_overrides(model_dir, args.mode, args, out_dir))
        t_load = time.perf_counter()
        trainer = PPOTrainer(cfg)
        load_s = time.perf_counter() - t_load
        n_params = int(sum(np.prod(x.shape) for x in jax.tree.leaves(trainer.state["actor"].params)))
        critic = trainer.state["critic"]
        n_critic = 0 if critic is None else int(sum(np.prod(x.shape) for x in jax.tree.leaves(critic.params)))
        mcfg = trainer.models.actor.cfg
        # record the scoring and update calls' shapes; their FLOPs are counted after the steps
        recorders = {"scoring": SignatureRecorder(trainer._experience),
                     "update": SignatureRecorder(trainer._update)}
        trainer._experience, trainer._update = recorders["scoring"], recorders["update"]
        log(f"[ppo_jax {args.mode}] {model_dir.name}: {n_params / 1e6:.1f}M actor params"
            f"{'' if critic is None else f' + {n_critic / 1e6:.1f}M critic'}, batch {args.batch}, "
            f"{args.epochs} epochs, {args.new_tokens} new tokens, {args.dtype}; jax {jax.__version__} "
            f"on {jax.devices()[0].device_kind}; load {load_s:.1f} s")
        records = []
        size, width = len(trainer.prompts), trainer.prompts.ids.shape[1]
        for i in range(args.warmup + args.steps):
            pos = trainer.sampler.position
            rows = [(pos + k) % size for k in range(args.batch)]
            m = trainer.step()
            prompt_tokens = int(trainer.prompts.mask[rows].sum())
            gen_tokens = args.batch * args.new_tokens  # ignore_eos: every row is full length
            seq_tokens = prompt_tokens + gen_tokens
            reported = m["tokens_per_s/step"] * m["time/step"]
            if abs(reported - seq_tokens) > 0.5:
                raise SystemExit(f"token count mismatch: trainer {reported:.1f}, bench {seq_tokens}")
            rec = {k: m[k] for k in ("time/generation", "time/scoring", "time/update", "time/step")}
            rec.update({
                "gen_tokens": gen_tokens, "seq_tokens": seq_tokens, "prompt_tokens": prompt_tokens,
                "padded_seq_len": m["prompt_width"] + m["response_width"],
                "tokens_per_s/generation": gen_tokens / rec["time/generation"],
                "tokens_per_s/scoring": seq_tokens / rec["time/scoring"],
                "tokens_per_s/update": args.epochs * seq_tokens / rec["time/update"],
                "tokens_per_s/step": seq_tokens / rec["time/step"],
            })
            kind = "warm-up" if i < args.warmup else "measured"
            log(f"[ppo_jax {args.mode}] step {i + 1} ({kind}): {rec['time/step']:.2f} s (generation "
                f"{rec['time/generation']:.2f}, scoring {rec['time/scoring']:.2f}, update "
                f"{rec['time/update']:.2f}); score {m['score_mean']:+.3f}, kl {m['kl']:.4f}")
            records.append(rec)
        model_flops = counted_flops(recorders, records, args.warmup)
    warm, measured = records[:args.warmup], records[args.warmup:]
    keys = [k for k in measured[0] if k.startswith(("time/", "tokens_per_s/", "gflops_per_s/"))]
    phase_keys = ("time/generation", "time/scoring", "time/update", "time/step")
    compile_s = None
    if warm:  # first step minus the steady-state median, per phase
        compile_s = {k: warm[0][k] - statistics.median(r[k] for r in measured) for k in phase_keys}
    import flax
    import optax
    import transformers

    return {
        "bench": "ppo_step", "impl": "ppo_jax", "mode": args.mode,
        "config": f"jax-{args.mode}", "label": LABELS[f"jax-{args.mode}"],
        "epochs": args.epochs, "batch": args.batch, "mini_batch": args.batch,
        "micro_batch": args.batch, "new_tokens": args.new_tokens, "dtype": args.dtype,
        "remat": args.remat, "device": jax.devices()[0].platform,
        "device_kind": jax.devices()[0].device_kind, "device_count": jax.device_count(),
        "model": model_dir.name, "n_params": n_params, "n_params_critic": n_critic,
        "model_config": {"vocab_size": mcfg.vocab_size, "hidden_size": mcfg.hidden_size,
                         "intermediate_size": mcfg.intermediate_size, "num_layers": mcfg.num_layers,
                         "num_heads": mcfg.num_heads, "num_kv_heads": mcfg.num_kv_heads,
                         "head_dim": mcfg.head_dim, "tie_word_embeddings": mcfg.tie_word_embeddings},
        "prompt_width": int(width),
        "warmup_steps": len(warm), "measured_steps": len(measured), "load_s": load_s,
        "first_step_s": records[0]["time/step"], "compile_s": compile_s,
        "gen_tokens": measured[0]["gen_tokens"],
        "seq_tokens_mean": statistics.mean(r["seq_tokens"] for r in measured),
        "prompt_tokens_mean": statistics.mean(r["prompt_tokens"] for r in measured),
        "padded_seq_len_mean": statistics.mean(r["padded_seq_len"] for r in measured),
        "stats": {k: stats(r[k] for r in measured) for k in keys},
        "model_flops": model_flops,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "peak_device_bytes": device_peak_bytes(),
        "versions": {"python": platform.python_version(), "jax": jax.__version__,
                     "jaxlib": getattr(jax.lib, "__version__", None) or _pkg_version("jaxlib"),
                     "flax": flax.__version__, "optax": optax.__version__,
                     "transformers": transformers.__version__},
        "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg()[0],
    }


def counted_flops(recorders: dict, records: list[dict], warmup: int) -> dict | None:
    """Per phase, the matmul FLOPs per measured step counted from the compiled functions
    (bench/flops.py: the jaxpr's count, and XLA's cost analysis beside it); adds each measured
    record's `gflops_per_s/<phase>`. None (and a log line) if counting fails."""
    out = {"source": "jaxpr dot_general count (bench/flops.py)"}
    t0 = time.perf_counter()
    try:
        for phase, rec in recorders.items():
            counts = rec.per_call()
            if len(counts) != len(records):
                raise ValueError(f"{len(counts)} {phase} calls for {len(records)} steps")
            for c, r in zip(counts, records):
                r[f"gflops_per_s/{phase}"] = c["flops"] / r[f"time/{phase}"] / 1e9
            measured = counts[warmup:]
            xla = [c["xla_flops"] for c in measured]
            out[phase] = {"flops": statistics.mean(c["flops"] for c in measured),
                          "xla_flops": None if None in xla else statistics.mean(xla),
                          "while_loops": max(c["loops"] for c in measured)}
    except Exception as e:  # noqa: BLE001 - a benchmark still reports its times
        log(f"FLOP count failed: {type(e).__name__}: {e}")
        return None
    log(f"FLOPs per step counted in {time.perf_counter() - t0:.1f} s: "
        + ", ".join(f"{k} {out[k]['flops'] / 1e9:.3g} GFLOP" for k in recorders))
    return out


def command_line() -> str:
    """This process's command line, the interpreter relative to the checkout when inside it."""
    exe = Path(sys.executable)
    if exe.is_relative_to(ROOT):
        exe = exe.relative_to(ROOT)
    else:
        exe = Path(exe.name)
    return " ".join([str(exe), *sys.argv])


def _pkg_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


# --------------------------------------------------------------------------- orchestrator
def write_prompt_ids(model_dir: Path, max_prompt_length: int, path: Path) -> int:
    """Tokenise the prompt set exactly as `PPOTrainer` does (ppo_jax.trainer.data) and write the
    real (unpadded) token ids of every prompt, in order, for the TRL side. Returns the count."""
    from ppo_jax.models import load_tokenizer
    from ppo_jax.trainer.data import read_prompts, tokenize_prompts
    from ppo_jax.trainer.setup import pad_token_id

    tok = load_tokenizer(model_dir)
    prompts = tokenize_prompts(read_prompts(PROMPTS, "prompt"), tok,
                               max_prompt_length=max_prompt_length, truncation="left",
                               use_chat_template=True, system_prompt=None,
                               pad_token_id=pad_token_id(tok))
    rows = [ids[m > 0].tolist() for ids, m in zip(prompts.ids, prompts.mask)]
    path.write_text(json.dumps({"prompt_ids": rows}))
    return len(rows)


def run_subprocess(cmd: list[str], name: str) -> dict | None:
    """Run one configuration; its stderr streams through; parse its `BENCH_JSON` line."""
    from ppo_jax.trainer.host_memory import malloc_env, malloc_settings_active

    log(f"--- {name}: {' '.join(cmd)}")
    t0 = time.perf_counter()
    env = malloc_env() or dict(os.environ)  # both sides under the malloc settings train.py uses
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, cwd=str(ROOT), env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(JSON_TAG)]
    if proc.returncode != 0 or not lines:
        log(f"--- {name}: FAILED (exit {proc.returncode}); stdout tail:\n{proc.stdout[-2000:]}")
        return None
    result = json.loads(lines[-1][len(JSON_TAG):])
    result["wall_s"] = time.perf_counter() - t0
    result["malloc_settings"] = malloc_settings_active(env)
    result["command"] = " ".join(cmd)
    return result


def merge_rounds(results: list[dict]) -> list[dict]:
    """One result per (epochs, config) from the rounds' results: each phase's stats become the
    median of the rounds' medians with the min and max over every measured step (`n`: all of
    them); peak RSS the largest, load / first step / compile the rounds' medians, `wall_s` the
    sum; everything else from the first round. `rounds` says how many were merged."""
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault((r["epochs"], r["config"]), []).append(r)
    merged = []
    for rs in groups.values():
        m = {**rs[0], "rounds": len(rs)}
        m.pop("round", None)
        m["stats"] = {k: {"median": statistics.median(r["stats"][k]["median"] for r in rs),
                          "min": min(r["stats"][k]["min"] for r in rs),
                          "max": max(r["stats"][k]["max"] for r in rs),
                          "n": sum(r["stats"][k].get("n", 1) for r in rs)}
                      for k in rs[0]["stats"] if all(k in r["stats"] for r in rs)}
        m["peak_rss_mib"] = max(r["peak_rss_mib"] for r in rs)
        for key in ("load_s", "first_step_s"):
            vals = [r[key] for r in rs if r.get(key) is not None]
            m[key] = statistics.median(vals) if vals else None
        if rs[0].get("compile_s") is not None:
            m["compile_s"] = {k: statistics.median(r["compile_s"][k] for r in rs)
                              for k in rs[0]["compile_s"]}
        m["wall_s"] = sum(r.get("wall_s") or 0.0 for r in rs)
        merged.append(m)
    return merged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default=None, help="HF directory (default: ensure_smollm2())")
    parser.add_argument("--epochs", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--steps", type=int, default=3, help="measured steps per configuration")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first (compile)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="interleaved rounds: every configuration runs once per round")
    parser.add_argument("--max-prompt-length", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help=f"comma-separated subset of {','.join(CONFIGS)}")
    parser.add_argument("--trl-python", default=str(ROOT / ".venv-bench/bin/python"),
                        help="interpreter of the TRL environment (bench/setup_trl_env.sh)")
    parser.add_argument("--json", type=Path, default=None, help="write all results here")
    # worker mode (one configuration in this process)
    parser.add_argument("--worker", choices=("jax",), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=("shared", "separate"), default="shared")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--remat", default="none")
    args = parser.parse_args()

    if args.worker == "jax":
        if len(args.epochs) != 1:
            parser.error("--worker takes one --epochs value")
        args.epochs = args.epochs[0]
        print(JSON_TAG + json.dumps(run_jax_worker(args)), flush=True)
        return
    log(f"CPU: {cpu_line(cpu_info())}")

    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = set(configs) - set(CONFIGS)
    if unknown:
        parser.error(f"unknown --configs {sorted(unknown)}; known: {CONFIGS}")
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    model_dir = resolve_model_dir(args.model_dir)
    trl_python = Path(args.trl_python)
    if "trl" in configs and not trl_python.is_file():
        log(f"TRL environment not found ({trl_python}); run bench/setup_trl_env.sh. "
            "Skipping the TRL rows.")
        configs.remove("trl")

    results = []
    with tempfile.TemporaryDirectory(prefix="ppo_step_prompts_") as tmp:
        prompt_file = Path(tmp) / "prompt_ids.json"
        n_prompts = write_prompt_ids(model_dir, args.max_prompt_length, prompt_file)
        log(f"{n_prompts} prompts from {PROMPTS.relative_to(ROOT)}; model {model_dir}")
        common = ["--batch", str(args.batch), "--new-tokens", str(args.new_tokens),
                  "--steps", str(args.steps), "--warmup", str(args.warmup),
                  "--max-prompt-length", str(args.max_prompt_length), "--seed", str(args.seed)]
        for epochs in args.epochs:
            for rnd in range(args.rounds):
                for name in (configs if rnd % 2 == 0 else configs[::-1]):
                    if name == "trl":
                        cmd = [str(trl_python), str(ROOT / "bench/ppo_step_trl.py"),
                               "--model-dir", str(model_dir), "--prompt-ids", str(prompt_file),
                               "--epochs", str(epochs), "--kl-coef", str(KL_COEF), "--lr", str(LR),
                               *common]
                    else:
                        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "jax",
                               "--mode", name.split("-")[1], "--model-dir", str(model_dir),
                               "--epochs", str(epochs), *common]
                    res = run_subprocess(cmd, f"{name}, {epochs} epoch(s), round {rnd + 1}/{args.rounds}")
                    if res is not None:
                        res["config"], res["round"] = name, rnd
                        results.append(res)

    from sections import ppo_step_markdown

    data = {
        "bench": "ppo_step",
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "settings": {"model": model_dir.name, "batch": args.batch, "new_tokens": args.new_tokens,
                     "epochs": args.epochs, "steps": args.steps, "warmup": args.warmup,
                     "rounds": args.rounds,
                     "max_prompt_length": args.max_prompt_length, "dtype": "float32",
                     "kl_coef": KL_COEF, "vf_coef": VF_COEF, "max_grad_norm": MAX_GRAD_NORM,
                     "configs": configs},
        "results": merge_rounds(results),
        "rounds": results,
        "command": command_line(),
        "load_average": os.getloadavg()[0], **run_record(),
    }
    print(ppo_step_markdown(data))
    if args.json:
        write_json(args.json, data)
    if len(results) < len(configs) * len(args.epochs) * args.rounds:
        raise SystemExit("some configurations failed (see above)")


if __name__ == "__main__":
    under_malloc_settings()  # as train.py runs (ppo_jax.trainer.host_memory)
    main()
