"""Peak memory and time of the PPO update's log-prob + entropy head: full logits vs vocabulary
blocks (`model.logprob_chunk_size`, `core.chunked_logprobs_and_entropy`).

Work measured: from the final hidden states `[B, T, D]` and the tied LM head `[V, D]` (SmolLM2's
layout), the response tokens' log-probs and entropies and the gradient of
`sum(a * logprobs + c * entropy)` (a policy loss with an entropy bonus) w.r.t. the hidden states
and the head, all float32, jitted:

- plain: `logits = hidden @ W^T` (`[B, T, V]` float32), `core.logprobs_from_logits`,
  `core.entropy_from_logits`, autodiff;
- chunked: `core.chunked_logprobs_and_entropy` with `--chunk` columns per block.

Memory is XLA's own account of each compiled program (`compile().memory_analysis()`, which works
on the CPU backend): `temp` is the scratch the program needs beyond its arguments and outputs (the
outputs include the `[V, D]` head gradient in both). Time: median of `--runs` calls after one
warm-up.

The whole PPO update, before / after: with `--update-config` (default `configs/default.yaml`,
`make train`'s run: SmolLM2-135M-Instruct, separate critic, minibatches of 8 rows, 40 new
tokens), one `PPOTrainer.step()` per setting (`model.logprob_chunk_size` 0, then `--chunk`)
records the update program's arguments, and XLA's memory account of that compiled program is
given: arguments, outputs, aliased (donated) bytes, scratch, and their sum less the aliased
bytes, the program's peak footprint on the device. `--no-update` skips it.

Also prints the same arithmetic for Llama-3-8B at `configs/llama_8b_gpu_tpu.yaml`'s sizes
(micro-batch x response length x V=128256). `--json PATH` writes every figure (bench/report.py
puts them in results.md).

Usage: `python bench/logprob_memory.py [--batch 8] [--length 40] [--hidden 576] [--vocab 49152]
[--chunk 4096] [--runs 5] [--update-config configs/default.yaml | --no-update] [--json PATH]`
(SmolLM2-135M's D and V by default; about 3 min on 2 cores with the update, < 1 min without).
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout, uninstalled
sys.path.insert(0, str(ROOT / "bench"))
from common import (cpu_info, cpu_line, machine_load, run_record,  # noqa: E402
                    under_malloc_settings, write_json)
from ppo_jax.core import (  # noqa: E402
    chunked_logprobs_and_entropy,
    entropy_from_logits,
    logprobs_from_logits,
)

MIB = 2 ** 20
LLAMA3_8B = {"hidden": 4096, "vocab": 128256}


def plain_head(hidden, kernel, tokens, temperature):
    logits = jnp.einsum("btd,vd->btv", hidden, kernel, preferred_element_type=jnp.float32)
    return logprobs_from_logits(logits, tokens, temperature), entropy_from_logits(logits, temperature)


def chunked_head(chunk: int):
    def head(hidden, kernel, tokens, temperature):
        return chunked_logprobs_and_entropy(hidden, kernel, tokens, temperature, chunk_size=chunk,
                                            vocab_axis=0)
    return head


def loss_grad(head):
    """jitted `(hidden, kernel, tokens, a, c) -> (loss, (d_hidden, d_kernel))`."""
    def loss(hidden, kernel, tokens, a, c):
        logprobs, entropy = head(hidden, kernel, tokens, 1.0)
        return jnp.sum(a * logprobs + c * entropy)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def inputs(batch: int, length: int, hidden: int, vocab: int):
    k = jax.random.split(jax.random.PRNGKey(0), 5)
    return (jax.random.normal(k[0], (batch, length, hidden)),
            0.1 * jax.random.normal(k[1], (vocab, hidden)),
            jax.random.randint(k[2], (batch, length), 0, vocab),
            jax.random.normal(k[3], (batch, length)), jax.random.normal(k[4], (batch, length)))


def measure(fn, args, runs: int) -> dict:
    """XLA's memory figures (bytes) of the compiled program and the median time (s) of `runs`."""
    compiled = fn.lower(*args).compile()
    mem = compiled.memory_analysis()
    jax.block_until_ready(compiled(*args))  # warm-up
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    return {"temp": mem.temp_size_in_bytes, "output": mem.output_size_in_bytes,
            "argument": mem.argument_size_in_bytes, "time": statistics.median(times),
            "result": compiled(*args)}


def max_abs_diffs(x, y) -> str:
    return ", ".join(f"{float(jnp.max(jnp.abs(u - v))):.2e}"
                     for u, v in zip(jax.tree.leaves(x), jax.tree.leaves(y)))


def llama_8b_arithmetic(chunk: int) -> dict:
    """Bytes of the full float32 logits path vs one block at configs/llama_8b_gpu_tpu.yaml's
    sizes (printed, and returned)."""
    cfg = yaml.safe_load((ROOT / "configs/llama_8b_gpu_tpu.yaml").read_text())
    micro, length = cfg["ppo"]["micro_batch_size"], cfg["generation"]["max_new_tokens"]
    vocab = LLAMA3_8B["vocab"]
    logits = micro * length * vocab * 4
    block = micro * length * min(chunk, vocab) * 4
    print(f"\nLlama-3-8B at configs/llama_8b_gpu_tpu.yaml: micro_batch_size={micro}, "
          f"response length (max_new_tokens)={length}, V={vocab}, D={LLAMA3_8B['hidden']}")
    print(f"  full float32 logits [{micro}, {length}, {vocab}]: {micro} * {length} * {vocab} * 4 B "
          f"= {logits / MIB:,.0f} MiB; with its log-softmax and its gradient (3 such arrays): "
          f"{3 * logits / MIB:,.0f} MiB per micro-batch (per device holding the whole vocabulary)")
    print(f"  one block [{micro}, {length}, {chunk}]: {block / MIB:,.0f} MiB; 3 such: "
          f"{3 * block / MIB:,.0f} MiB  (ratio {logits / block:.1f}x)")
    print(f"  both paths also hold the [V, D] head gradient: {vocab * LLAMA3_8B['hidden'] * 4 / MIB:,.0f}"
          " MiB float32 (a parameter gradient, not an activation)")
    return {"micro_batch": micro, "length": length, "vocab": vocab, "hidden": LLAMA3_8B["hidden"],
            "chunk": chunk, "logits_bytes": logits, "block_bytes": block,
            "head_grad_bytes": vocab * LLAMA3_8B["hidden"] * 4}


def update_memory(config: Path, chunk: int) -> dict:
    """XLA's memory account (bytes) of the PPO update program `config` compiles, with
    `model.logprob_chunk_size=chunk`: one `PPOTrainer.step()` records the update's arguments
    (bench/flops.py `SignatureRecorder`), then the same jitted function is compiled for them."""
    from flops import SignatureRecorder

    from ppo_jax.trainer.config import load_config
    from ppo_jax.trainer.stages.ppo import PPOTrainer

    with tempfile.TemporaryDirectory(prefix="logprob_memory_") as out:
        cfg = load_config(config, [
            f"model.logprob_chunk_size={chunk}", f"train.output_dir={out}", "train.steps=1",
            "eval.every=0", "train.export_hf=false", "train.tensorboard=false",
            "train.progress=false", "train.save_every=0", "train.sample_every=0",
            "ppo.critic_warmup_steps=0"])  # step 1 runs the whole update, not the critic's alone
        trainer = PPOTrainer(cfg)
        recorder = SignatureRecorder(trainer._update)
        trainer._update = recorder
        metrics = trainer.step()
        (specs,) = recorder.specs.values()
        mem = recorder.fn.lower(*specs).compile().memory_analysis()
    figures = {"argument": mem.argument_size_in_bytes, "output": mem.output_size_in_bytes,
               "alias": mem.alias_size_in_bytes, "temp": mem.temp_size_in_bytes}
    figures["peak"] = figures["argument"] + figures["output"] - figures["alias"] + figures["temp"]
    return {"chunk": chunk, **figures,
            "micro_batch": cfg.ppo.micro_batch_size, "mini_batch": cfg.ppo.mini_batch_size,
            "batch": cfg.ppo.batch_size, "epochs": cfg.ppo.ppo_epochs,
            "prompt_width": metrics["prompt_width"], "response_width": metrics["response_width"],
            "shared_critic": cfg.model.shared_critic, "vocab": trainer.models.actor.cfg.vocab_size}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=40, help="response tokens per row (T)")
    parser.add_argument("--hidden", type=int, default=576, help="D (SmolLM2-135M: 576)")
    parser.add_argument("--vocab", type=int, default=49152, help="V (SmolLM2: 49152)")
    parser.add_argument("--chunk", type=int, default=4096, help="vocabulary columns per block")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--update-config", type=Path, default=ROOT / "configs/default.yaml",
                        help="config whose PPO update's memory is measured before / after")
    parser.add_argument("--no-update", action="store_true", help="skip the whole-update figures")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.chunk <= 0:
        parser.error(f"--chunk must be > 0 (vocabulary columns per block), got {args.chunk}")
    b, t, d, v = args.batch, args.length, args.hidden, args.vocab
    print(f"CPU: {cpu_line(cpu_info())}; jax {jax.__version__}, backend {jax.default_backend()}")
    print(f"head: hidden [{b}, {t}, {d}] float32, tied kernel [{v}, {d}] float32, "
          f"loss sum(a * logprobs + c * entropy), grad w.r.t. hidden and kernel; chunk {args.chunk}")
    data = inputs(b, t, d, v)
    plain = measure(loss_grad(plain_head), data, args.runs)
    chunked = measure(loss_grad(chunked_head(args.chunk)), data, args.runs)
    print(f"{'':10}{'temp MiB':>10}{'output MiB':>12}{'arg MiB':>10}{'median s':>10}")
    for name, m in (("plain", plain), ("chunked", chunked)):
        print(f"{name:10}{m['temp'] / MIB:10.1f}{m['output'] / MIB:12.1f}{m['argument'] / MIB:10.1f}"
              f"{m['time']:10.3f}")
    print(f"temp ratio plain / chunked: {plain['temp'] / max(chunked['temp'], 1):.1f}x; "
          f"time ratio chunked / plain: {chunked['time'] / plain['time']:.2f}")
    print(f"one [B, T, V] float32 array: {b * t * v * 4 / MIB:.1f} MiB; one block: "
          f"{b * t * min(args.chunk, v) * 4 / MIB:.1f} MiB")
    print(f"max |chunked - plain| of (loss {float(plain['result'][0]):.1f}, d_hidden, d_kernel): "
          f"{max_abs_diffs(plain['result'], chunked['result'])}")
    llama = llama_8b_arithmetic(args.chunk)
    updates = []
    if not args.no_update:
        for chunk in (0, args.chunk):
            updates.append(update_memory(args.update_config, chunk))
        print(f"\nPPO update of {args.update_config.name} (XLA memory_analysis, MiB): "
              f"{'arguments':>10}{'outputs':>9}{'aliased':>9}{'scratch':>9}{'peak':>8}")
        for u in updates:
            name = "full logits" if u["chunk"] == 0 else f"blocks of {u['chunk']}"
            print(f"  {name:16}" + "".join(f"{u[k] / MIB:9.1f}" for k in
                                           ("argument", "output", "alias", "temp", "peak")))
    if args.json:
        head = {name: {k: m[k] for k in ("temp", "output", "argument", "time")}
                for name, m in (("plain", plain), ("chunked", chunked))}
        write_json(args.json, {
            "benchmark": "logprob_memory", **run_record(), **machine_load(),
            "command": ".venv/bin/python bench/logprob_memory.py " + shlex.join(sys.argv[1:]),
            "jax": jax.__version__, "runs": args.runs,
            "head": {"batch": b, "length": t, "hidden": d, "vocab": v, "chunk": args.chunk,
                     **head, "max_abs_diff": max_abs_diffs(plain["result"], chunked["result"])},
            "llama_8b": llama,
            "update": {"config": str(args.update_config.resolve().relative_to(ROOT))
                       if args.update_config.resolve().is_relative_to(ROOT)
                       else str(args.update_config), "settings": updates}})


if __name__ == "__main__":
    under_malloc_settings()
    main()
