"""Memory (XLA's `memory_analysis()`) and time of the update's log-prob + entropy head, full
`[B, T, V]` logits against vocabulary blocks; the whole PPO update's memory of `--update-config`
with either; Llama-3-8B's logits at configs/llama_8b_gpu_tpu.yaml's sizes (arithmetic, labelled).

Usage: python bench/logprob_memory.py [--batch 8] [--length 40] [--hidden 576] [--vocab 49152]
    [--chunk 4096] [--runs 5] [--update-config configs/default.yaml | --no-update] [--json PATH]
"""

from __future__ import annotations

import statistics
import tempfile
from dataclasses import replace
from pathlib import Path

import jax
import jax.numpy as jnp
import yaml

from harness import ROOT, finish, log, options, table, timed, under_malloc_settings
from ppo_jax.core import chunked_logprobs_and_entropy, entropy_from_logits, logprobs_from_logits

MIB = 2 ** 20
LLAMA3_8B = {"hidden": 4096, "vocab": 128256}
MEMORY = ("argument", "output", "alias", "temp")


def loss_grad(chunk: int):
    """jitted `(hidden, kernel, tokens, a, c) -> (loss, (d_hidden, d_kernel))` of the head as full
    `[B, T, V]` logits (`chunk` 0) or in blocks of `chunk` vocabulary columns."""
    def loss(hidden, kernel, tokens, a, c):
        if chunk:
            logprobs, entropy = chunked_logprobs_and_entropy(hidden, kernel, tokens, 1.0, chunk_size=chunk,
                                                             vocab_axis=0)
        else:
            logits = jnp.einsum("btd,vd->btv", hidden, kernel, preferred_element_type=jnp.float32)
            logprobs, entropy = logprobs_from_logits(logits, tokens, 1.0), entropy_from_logits(logits, 1.0)
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
    result = jax.block_until_ready(compiled(*args))  # warm-up
    return {"temp": mem.temp_size_in_bytes, "output": mem.output_size_in_bytes,
            "argument": mem.argument_size_in_bytes, "result": result, "time": statistics.median(
                timed(lambda: jax.block_until_ready(compiled(*args))) for _ in range(runs))}


def llama_8b_arithmetic(chunk: int) -> dict:
    """Bytes of the full float32 logits path vs one block at configs/llama_8b_gpu_tpu.yaml's
    sizes (arithmetic)."""
    cfg = yaml.safe_load((ROOT / "configs/llama_8b_gpu_tpu.yaml").read_text())
    micro, length = cfg["ppo"]["micro_batch_size"], cfg["generation"]["max_new_tokens"]
    vocab, hidden = LLAMA3_8B["vocab"], LLAMA3_8B["hidden"]
    return {"micro_batch": micro, "length": length, "vocab": vocab, "hidden": hidden,
            "chunk": chunk, "logits_bytes": micro * length * vocab * 4,
            "block_bytes": micro * length * min(chunk, vocab) * 4,
            "head_grad_bytes": vocab * hidden * 4}


def update_memory(config: Path, chunk: int) -> dict:
    """XLA's memory account (bytes) of the PPO update program `config` compiles, with
    `model.logprob_chunk_size=chunk`: one `PPOTrainer.step()` records the update's arguments
    (bench/flops.py `SignatureRecorder`), then the same jitted function is compiled for them."""
    from flops import SignatureRecorder

    from ppo_jax.trainer.config import load_config
    from ppo_jax.trainer.stages.ppo.trainer import PPOTrainer

    with tempfile.TemporaryDirectory(prefix="logprob_memory_") as out:
        cfg = load_config(config, [
            f"model.logprob_chunk_size={chunk}", f"train.output_dir={out}", "train.steps=1",
            "eval.every=0", "train.export_hf=false", "train.tensorboard=false",
            "train.progress=false", "train.save_every=0", "train.sample_every=0",
            "ppo.critic_warmup_steps=0"])  # step 1 runs the whole update, not the critic's alone
        trainer = PPOTrainer(cfg)
        recorder = SignatureRecorder(trainer.jit.update)
        trainer.jit = replace(trainer.jit, update=recorder)
        metrics = trainer.step()
        (specs,) = recorder.specs.values()
        mem = recorder.fn.lower(*specs).compile().memory_analysis()
    figures = {k: getattr(mem, f"{k}_size_in_bytes") for k in MEMORY}
    return {"chunk": chunk, **figures, "peak": figures["argument"] + figures["output"]
            - figures["alias"] + figures["temp"],
            "micro_batch": cfg.ppo.micro_batch_size, "mini_batch": cfg.ppo.mini_batch_size,
            "batch": cfg.ppo.batch_size, "epochs": cfg.ppo.ppo_epochs,
            "prompt_width": metrics["prompt_width"], "response_width": metrics["response_width"],
            "shared_critic": cfg.model.shared_critic, "vocab": trainer.models.actor.cfg.vocab_size}


def markdown(d: dict) -> str:
    """The head's memory and time, full logits vs blocks; the whole update's; Llama-3-8B's."""
    h, upd, ll = d["head"], d["update"], d["llama_8b"]
    out = [f"XLA's memory account of each compiled program (`memory_analysis()`), jax {d['jax']}, float32. "
           f"**The head alone**: hidden `[{h['batch']}, {h['length']}, {h['hidden']}]` and a tied head "
           f"`[{h['vocab']}, {h['hidden']}]`, the taken tokens' log-probs and entropies and the gradient of "
           f"`sum(a * logprobs + c * entropy)` w.r.t. both; time: median of {d['runs']} calls.", "",
           table(["path", "scratch MiB", "outputs MiB", "arguments MiB", "s per call"],
                 [[name, *(f"{m[k] / MIB:.1f}" for k in ("temp", "output", "argument")),
                   f"{m['time']:.3f}"] for name, m in (("full `[B, T, V]` logits", h["plain"]),
                                                       (f"blocks of {h['chunk']} columns", h["chunked"]))]),
           "", f"Scratch full / blocks: ×{h['plain']['temp'] / max(h['chunked']['temp'], 1):.1f}; "
           f"time blocks / full: ×{h['chunked']['time'] / h['plain']['time']:.2f}; max |blocks - "
           f"full| of (loss, d_hidden, d_head): {h['max_abs_diff']}."]
    if upd["settings"]:
        u0 = upd["settings"][0]
        out += ["", f"**The whole PPO update** of `{upd['config']}` (one compiled program: "
                f"{u0['epochs']} epochs over the batch of {u0['batch']} rows in minibatches of "
                f"{u0['mini_batch']}, micro-batches of {u0['micro_batch']}, prompt width "
                f"{u0['prompt_width']:.0f} + response width {u0['response_width']:.0f}, "
                f"V = {u0['vocab']:,}, {'shared' if u0['shared_critic'] else 'separate'} critic, "
                "forward, backward and AdamW); peak = arguments + outputs - aliased (donated) + "
                "scratch:", "",
                table(["`model.logprob_chunk_size`", "arguments MiB", "outputs MiB", "aliased MiB", "scratch MiB",
                       "peak MiB"], [[f"{u['chunk']} ({'blocks' if u['chunk'] else 'full logits'})",
                                      *(f"{u[k] / MIB:,.1f}" for k in (*MEMORY, "peak"))]
                                     for u in upd["settings"]])]
    out += ["", f"**Llama-3-8B at `configs/llama_8b_gpu_tpu.yaml`'s sizes** (arithmetic, not "
            f"measured): micro-batch {ll['micro_batch']} x {ll['length']} response tokens x V = "
            f"{ll['vocab']:,}: the full float32 logits are {ll['logits_bytes'] / MIB:,.0f} MiB "
            f"({3 * ll['logits_bytes'] / MIB:,.0f} MiB with their log-softmax and gradient) "
            f"against {ll['block_bytes'] / MIB:,.0f} MiB per block of {ll['chunk']} columns; the "
            f"`[V, D]` head gradient ({ll['head_grad_bytes'] / MIB:,.0f} MiB) is held either way."]
    return "\n".join(out)


def main(argv=None) -> None:
    args = options(__doc__, argv, batch=8, length=40, hidden=576, vocab=49152, chunk=4096,
                   runs=5, update_config=ROOT / "configs/default.yaml", no_update=False, json=None)
    data = inputs(args.batch, args.length, args.hidden, args.vocab)
    plain, chunked = (measure(loss_grad(c), data, args.runs) for c in (0, args.chunk))
    diff = ", ".join(f"{float(jnp.max(jnp.abs(u - v))):.2e}" for u, v in
                     zip(jax.tree.leaves(plain.pop("result")), jax.tree.leaves(chunked.pop("result"))))
    updates = [] if args.no_update else [update_memory(args.update_config, c) for c in (0, args.chunk)]
    config = args.update_config.resolve()
    log(f"head and {len(updates)} update setting(s) measured")
    finish({"bench": "logprob_memory", "jax": jax.__version__, "runs": args.runs,
            "head": {"batch": args.batch, "length": args.length, "hidden": args.hidden,
                     "vocab": args.vocab, "chunk": args.chunk, "plain": plain, "chunked": chunked,
                     "max_abs_diff": diff},
            "llama_8b": llama_8b_arithmetic(args.chunk),
            "update": {"config": str(config.relative_to(ROOT) if config.is_relative_to(ROOT)
                                     else args.update_config), "settings": updates}},
           markdown, args.json)


if __name__ == "__main__":
    under_malloc_settings()
    main()
