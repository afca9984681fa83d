"""PPO step, per phase (generation, experience, update), ppo_jax's `PPOTrainer.step()` against TRL
0.11's `PPOTrainer` (bench/ppo_step_trl.py in .venv-bench): same model, prompts, batch and PPO
settings, float32 on the CPU; every configuration a fresh worker process, in interleaved rounds.

Usage: python bench/ppo_step.py [--epochs 1 4] [--steps 3] [--warmup 1] [--rounds 3] [--batch 8]
    [--new-tokens 48] [--configs trl jax-shared jax-separate] [--json PATH]
    On a device machine (bench/gpu.sh): ppo_jax only, random weights of a shape (harness.SHAPES):
    --configs jax-shared jax-separate --random-shape smollm2 --dtype bfloat16
Worker: python bench/ppo_step.py --worker jax --mode shared --epochs 4 --model-dir DIR
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from harness import (ROOT, alternate, emit, finish, fmt, log, options, ppo_step_record, ppo_step_summary,
                     random_model, ratio, run_worker, spread, stats, table, under_malloc_settings)

PROMPTS = ROOT / "configs/prompts/reviews.jsonl"
LABELS = {"trl": "TRL 0.11 PPOTrainer (value head on actor)",
          "jax-shared": "ppo_jax, shared critic (equal work)",
          "jax-separate": "ppo_jax, separate critic (DeepSpeed-Chat layout, more work)"}
CONFIGS = tuple(LABELS)
KL_COEF, LR, VF_COEF, CLIP, MAX_GRAD_NORM, SEED = 0.05, 1e-5, 0.1, 0.2, 1.0, 0
PHASES = ("generation", "experience", "update", "whole step")
TIMES = ("time/generation", "time/experience", "time/update", "time/step")
TRL_PYTHON = ROOT / ".venv-bench/bin/python"  # bench/setup_trl_env.sh


# --------------------------------------------------------------------------- ppo_jax worker
def jax_overrides(model_dir: Path, mode: str, args, out_dir: str) -> list[str]:
    """Config overrides of one ppo_jax configuration (everything else: the schema defaults)."""
    b, dtype = args.batch, args.dtype
    return [
        f"model.actor={model_dir}", f"model.shared_critic={'true' if mode == 'shared' else 'false'}",
        f"model.param_dtype={dtype}", f"model.dtype={dtype}", f"model.frozen_param_dtype={dtype}",
        "model.remat=none", f"data.prompts={PROMPTS}", "data.shuffle=false", "data.use_chat_template=true",
        f"data.max_prompt_length={args.max_prompt_length}",
        # one prompt width (the set's widest): with per-batch width buckets a timed step whose
        # width the warm-up step did not have compiles its programs inside the timing
        "data.prompt_buckets=1", f"generation.max_new_tokens={args.new_tokens}", "generation.ignore_eos=true",
        "generation.temperature=1.0", "generation.top_k=0", "generation.top_p=1.0",
        f"ppo.batch_size={b}", f"ppo.mini_batch_size={b}", f"ppo.micro_batch_size={b}",
        f"ppo.ppo_epochs={args.epochs}", f"ppo.kl_coef={KL_COEF}", "ppo.kl_controller=fixed",
        "ppo.kl_estimator=kl", f"ppo.cliprange={CLIP}", f"ppo.cliprange_value={CLIP}",
        f"ppo.vf_coef={VF_COEF}", "ppo.gamma=1.0", "ppo.lam=0.95",
        f"optim.actor_lr={LR}", f"optim.critic_lr={LR}", f"optim.max_grad_norm={MAX_GRAD_NORM}",
        "reward.kind=function", "reward.function=vader", f"train.steps={args.warmup + args.steps}",
        f"train.seed={SEED}", f"train.output_dir={out_dir}", "train.tensorboard=false", "train.progress=false",
        "train.export_hf=false", "train.save_every=0", "train.sample_every=0",
        "eval.prompts=null",  # no held-out evaluation built at load (TRL's peer has none)
    ]


def step_record(trainer, args, i: int) -> dict:
    """One `trainer.step()`: its phase times, real token counts and tokens/s."""
    pos, size = trainer.prompt_order.position, len(trainer.prompts)
    m = trainer.step()
    rec = ppo_step_record(  # ignore_eos: every row is full length
        {k: m[k] for k in TIMES}, args.batch * args.new_tokens,
        int(trainer.prompts.mask[[(pos + k) % size for k in range(args.batch)]].sum()),
        args.epochs, padded_seq_len=m["prompt_width"] + m["response_width"])
    if abs((reported := m["tokens_per_s/step"] * m["time/step"]) - rec["seq_tokens"]) > 0.5:
        raise SystemExit(f"token count mismatch: trainer {reported:.1f}, bench {rec['seq_tokens']}")
    log(f"[ppo_jax {args.mode}] step {i + 1} ({'warm-up' if i < args.warmup else 'measured'}): "
        + ", ".join(f"{k[5:]} {rec[k]:.2f} s" for k in TIMES)
        + f"; score {m['score_mean']:+.3f}, kl {m['kl']:.4f}")
    return rec


def run_jax_worker(args) -> dict:
    """Time `warmup + steps` calls of `PPOTrainer.step()`."""
    from importlib.metadata import version

    import jax

    from ppo_jax.models import count_params
    from ppo_jax.trainer.config import load_config
    from ppo_jax.trainer.stages.ppo.trainer import PPOTrainer

    model_dir = Path(args.model_dir)
    with tempfile.TemporaryDirectory(prefix="ppo_step_bench_") as out_dir:
        t0 = time.perf_counter()
        trainer = PPOTrainer(load_config(None, jax_overrides(model_dir, args.mode, args, out_dir)))
        load_s = time.perf_counter() - t0
        records = [step_record(trainer, args, i) for i in range(args.warmup + args.steps)]
    n_params = {k: 0 if trainer.state[k] is None else count_params(trainer.state[k].params)
                for k in ("actor", "critic")}
    dev = jax.devices()[0]
    try:
        peak_device = (dev.memory_stats() or {}).get("peak_bytes_in_use")
    except Exception:  # noqa: BLE001 - not every backend implements memory_stats (CPU)
        peak_device = None
    return {
        **ppo_step_summary(records, args.warmup), "epochs": args.epochs, "batch": args.batch,
        "new_tokens": args.new_tokens, "dtype": args.dtype, "device": dev.platform,
        "device_kind": dev.device_kind, "device_count": jax.device_count(), "model": model_dir.name,
        "n_params": n_params["actor"], "n_params_critic": n_params["critic"],
        "prompt_width": int(trainer.prompts.ids.shape[1]), "load_s": load_s, "peak_device_bytes": peak_device,
        "versions": {"python": platform.python_version(), "jax": jax.__version__, "jaxlib": version("jaxlib")},
    }


# --------------------------------------------------------------------------- orchestrator
def write_prompt_ids(model_dir: Path, max_prompt_length: int, path: Path) -> int:
    """Write the prompt set's real token ids, tokenised as `PPOTrainer` does, for the TRL side."""
    from ppo_jax.models import load_tokenizer
    from ppo_jax.trainer.data.prompts import read_prompts, tokenize_prompts
    from ppo_jax.trainer.loading.models import pad_token_id

    tok = load_tokenizer(model_dir)
    prompts = tokenize_prompts(read_prompts(PROMPTS, "prompt"), tok, max_prompt_length=max_prompt_length,
                               truncation="left", use_chat_template=True, system_prompt=None,
                               pad_token_id=pad_token_id(tok))
    rows = [ids[m > 0].tolist() for ids, m in zip(prompts.ids, prompts.mask)]
    path.write_text(json.dumps({"prompt_ids": rows}))
    return len(rows)


def merge_rounds(results: list[dict]) -> list[dict]:
    """One result per (epochs, config): per phase the median of the round medians, min and max
    over every step; peak RSS the largest; load, first step, compile the round medians; with two
    rounds or more against TRL, `trl_ratio`: per phase the stats of TRL's / ours per round."""
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault((r["epochs"], r["config"]), []).append(r)
    at = lambda r: (r["epochs"], r.get("round"))  # noqa: E731
    trl = {at(r): r for r in results if r["config"] == "trl"}
    merged = []
    for rs in groups.values():
        m = {**rs[0], "rounds": len(rs), "peak_rss_mib": max(r["peak_rss_mib"] for r in rs),
             "wall_s": sum(r.get("wall_s") or 0.0 for r in rs)}
        m.pop("round", None)
        m["stats"] = {k: {"median": statistics.median(r["stats"][k]["median"] for r in rs),
                          "min": min(r["stats"][k]["min"] for r in rs),
                          "max": max(r["stats"][k]["max"] for r in rs),
                          "n": sum(r["stats"][k].get("n", 1) for r in rs)}
                      for k in rs[0]["stats"] if all(k in r["stats"] for r in rs)}
        for key in ("load_s", "first_step_s", "compile_s"):
            vals = [r[key] for r in rs if r.get(key) is not None]
            m[key] = statistics.median(vals) if vals else None
        pairs = [(trl[at(r)], r) for r in rs if r["config"] != "trl" and at(r) in trl]
        if len(pairs) >= 2:
            m["trl_ratio"] = {k: stats(t["stats"][k]["median"] / r["stats"][k]["median"] for t, r in pairs)
                              for k in TIMES}
        merged.append(m)
    return merged


def epoch_tables(rs: list[dict], batch: int) -> list[str]:
    """One `ppo_epochs` value: phase times, ratios to TRL, columns."""
    out = ["Wall time per step, seconds; load, first step and compile (first step minus the median; "
           "TRL runs eagerly) apart:", "", table(
               ["configuration"] + [f"{n} s" for n in PHASES] + ["load s", "first step s", "compile s",
                                                                 "peak RSS MiB"],
               [[r["label"]] + [spread(r["stats"].get(k)) for k in TIMES]
                + [fmt(r.get("load_s")), fmt(r.get("first_step_s")),
                   "none (eager)" if r.get("compile_s") is None else fmt(r["compile_s"]),
                   fmt(r["peak_rss_mib"], 0)] for r in rs])]
    if (trl := rs[0])["config"] == "trl" and len(rs) > 1:
        med = lambda r, k: r["stats"][k]["median"]  # noqa: E731
        rows = [[r["label"]] + [ratio(med(trl, k) / med(r, k)) for k in TIMES] for r in rs[1:]]
        per_round = [[f"{r['label']}, per round ({v[TIMES[0]]['n']} rounds)"]
                     + [ratio(v[k]["median"], 2, v[k]) for k in TIMES] for r in rs if (v := r.get("trl_ratio"))]
        out += ["", "TRL time / ours time (above 1: ppo_jax is faster), of the medians"
                + (" and per round (median (min–max) over the rounds)" if per_round else "") + ":", "",
                table(["comparison"] + list(PHASES), rows + per_round)]
    if cols := [[r["label"], fmt(r.get("seq_tokens_mean"), 1), fmt(r["padded_seq_len_mean"], 1),
                 fmt(batch * r["padded_seq_len_mean"], 0),
                 f"{batch * r['padded_seq_len_mean'] / r['seq_tokens_mean'] - 1:.1%}" if r.get("seq_tokens_mean")
                 else "n/a"] for r in rs if r.get("padded_seq_len_mean")]:
        out += ["", "Columns per step (means): real tokens against the padded prompt + response width each "
                "side computes over:", "", table(["configuration", "real tokens / step",
                                                  "padded width (prompt + response)", "padded tokens / step",
                                                  "padding overhead"], cols)]
    return out


def markdown(d: dict) -> str:
    s, order = d["settings"], {c: i for i, c in enumerate(CONFIGS)}
    out = [f"Model `{s['model']}`, {s['dtype']}, batch {s['batch']} (one minibatch), {s['new_tokens']} new "
           f"tokens per response (no early stop), KL coef {s['kl_coef']} fixed, grad clip {s['max_grad_norm']}; "
           f"{s['warmup']} warm-up + {s['steps']} measured steps per configuration"
           + (f" in each of {s['rounds']} interleaved rounds (fresh processes, the order reversed every other "
              "round); median of the round medians (min–max over every measured step)."
              if s.get("rounds", 1) > 1 else "; median (min–max).")]
    for epochs in sorted({r["epochs"] for r in d["results"]}):
        rs = sorted((r for r in d["results"] if r["epochs"] == epochs), key=lambda r: order.get(r["config"], 9))
        out += ["", f"#### ppo_epochs = {epochs}", "", *epoch_tables(rs, s["batch"])]
    return "\n".join(out)


def main() -> None:
    args = options(__doc__, model_dir=None, epochs=[1, 4], batch=8, new_tokens=48, steps=3, warmup=1,
                   rounds=3, max_prompt_length=64, configs=list(CONFIGS), random_shape="", json=None,
                   worker="", mode="shared", dtype="float32")
    if args.worker == "jax":
        (args.epochs,) = args.epochs  # one value
        return emit(run_jax_worker(args))
    from ppo_jax.models.packaged import ensure_packaged
    from ppo_jax.trainer.host.memory import malloc_env, malloc_settings_active

    # random weights of a shape (harness.SHAPES), else --model-dir, else the converted SmolLM2-135M-Instruct
    model_dir = random_model(args.random_shape) if args.random_shape else Path(args.model_dir or ensure_packaged("smollm2"))
    model_dir, configs = model_dir.resolve(), args.configs
    if "trl" in configs and not TRL_PYTHON.is_file():
        log(f"TRL environment not found ({TRL_PYTHON}); run bench/setup_trl_env.sh. Skipping the TRL rows.")
        configs.remove("trl")
    env = malloc_env() or dict(os.environ)  # both sides under the malloc settings train.py uses
    results = []
    with tempfile.TemporaryDirectory(prefix="ppo_step_prompts_") as tmp:
        prompt_file = Path(tmp) / "prompt_ids.json"
        log(f"{write_prompt_ids(model_dir, args.max_prompt_length, prompt_file)} prompts from "
            f"{PROMPTS.relative_to(ROOT)}; model {model_dir}")
        shared = [f"--model-dir={model_dir}", *(f"--{k.replace('_', '-')}={getattr(args, k)}"
                                                for k in ("batch", "new_tokens", "steps", "warmup"))]
        for epochs in args.epochs:
            for rnd in range(args.rounds):
                for name in alternate(configs, rnd):
                    cmd = ([str(TRL_PYTHON), str(ROOT / "bench/ppo_step_trl.py"), f"--prompt-ids={prompt_file}",
                            f"--kl-coef={KL_COEF}", f"--lr={LR}", f"--seed={SEED}"] if name == "trl" else
                           [sys.executable, str(Path(__file__).resolve()), "--worker=jax",
                            f"--mode={name.split('-')[1]}", f"--max-prompt-length={args.max_prompt_length}",
                            f"--dtype={args.dtype}"])
                    cmd += [*shared, f"--epochs={epochs}"]
                    if res := run_worker(cmd, env, f"{name}, {epochs} epoch(s), round {rnd + 1}/{args.rounds}"):
                        results.append({**res, "config": name, "label": LABELS[name], "round": rnd,
                                        "command": " ".join(cmd), "malloc_settings": malloc_settings_active(env)})
    finish({"bench": "ppo_step", "settings": {
        "model": model_dir.name, "batch": args.batch, "new_tokens": args.new_tokens, "epochs": args.epochs,
        "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds,
        "max_prompt_length": args.max_prompt_length, "dtype": args.dtype, "kl_coef": KL_COEF, "vf_coef": VF_COEF,
        "max_grad_norm": MAX_GRAD_NORM, "configs": configs},
        "results": merge_rounds(results), "rounds": results}, markdown, args.json)
    if len(results) < len(configs) * len(args.epochs) * args.rounds:
        raise SystemExit("some configurations failed (see above)")


if __name__ == "__main__":
    under_malloc_settings()  # as train.py runs (ppo_jax.trainer.host.memory)
    main()
