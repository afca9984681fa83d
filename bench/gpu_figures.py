"""What a GPU / TPU benchmark result means: the chips' datasheet peaks, the FLOPs and HBM bytes
of a PPO step, and the markdown bench/report.py puts in results.md for a gpu.json
(bench/gpu.py measures; this module turns its times and token counts into figures).

FLOPs model (Kaplan et al. 2020, "6N"): N = the parameters used in matmuls per token (the
decoder layers, plus vocab x hidden for the LM head; token-embedding lookups are free; a value
model has a 1-wide head instead of the LM head); attention-score FLOPs (which grow with the
sequence length) are not counted, so MFU is a slight under-estimate. Tokens are real tokens
(left padding is wasted work, not credited):
- generation: 2 N_lm x (prompt + response tokens)  (prefill + one decode pass per new token);
- scoring: 2 N_lm x tokens for each of actor and reference, + 2 N_value x tokens for a separate
  critic (shared critic: the values come out of the actor's pass); the scoring phase also holds
  the host-side decode + VADER reward, so its MFU is a lower bound;
- update: ppo_epochs x 6 x (N_lm [+ N_value with a separate critic]) x tokens (forward +
  backward of every trained model).
MFU = FLOPs / wall time / (peak dense bf16 FLOP/s per chip x chips), with the peak taken from
`PEAK_BF16_TFLOPS` keyed on `jax.devices()[0].device_kind`, or from `--peak-tflops` /
`$PPO_BENCH_PEAK_TFLOPS` (per chip) where the chip is not in the table.

Sampler bandwidth: decoding is memory-bound, so the sampler is also rated by the HBM bytes it
must move. Per `generate` call of N new tokens: the prefill and the N - 1 one-token passes each
read every matmul weight once (N x 2 bytes x N_lm in bf16), and each of the N - 1 passes reads
the whole preallocated KV cache (2 x layers x B x S x kv_heads x head_dim x 2 bytes, S = prompt
width + N - 1: the sampler attends over every slot under a mask). Bytes / generation wall time
is the achieved bandwidth; / `HBM_TBS` (datasheet, keyed like the peak; `--peak-hbm-tbs` /
`$PPO_BENCH_PEAK_HBM_TBS`) is its fraction of the chip's. The wall time includes the prefill's
compute, so the fraction is a lower bound.
"""

from __future__ import annotations

from sections import _f, table

# Dense bf16 tensor-core peak per chip (vendor data sheets, without sparsity), TFLOP/s.
# Matched as a case-insensitive substring of device_kind, longest key first.
PEAK_BF16_TFLOPS = {
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "H100": 989.0,  # SXM ("NVIDIA H100 80GB HBM3")
    "H800": 989.0,
    "H200": 989.0,  # also "GH200"
    "B200": 2250.0,
    "B100": 1750.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
    "L4": 121.0,
    "TPU v4": 275.0,
    "TPU v5 lite": 197.0,  # v5e
    "TPU v5e": 197.0,
    "TPU v5p": 459.0,
    "TPU v5": 459.0,
    "TPU v6 lite": 918.0,  # v6e (Trillium)
    "TPU v6e": 918.0,
}

# Memory (HBM / GDDR) bandwidth per chip (vendor data sheets), TB/s; matched like the peak.
HBM_TBS = {
    "H100 PCIe": 2.0,
    "H100 NVL": 3.9,
    "H100": 3.35,
    "H800": 3.35,
    "H200": 4.8,
    "B200": 8.0,
    "B100": 8.0,
    "A100-SXM4-40GB": 1.555,
    "A100-PCIE-40GB": 1.555,
    "A100": 2.039,  # 80GB SXM
    "A800": 2.039,
    "L40S": 0.864,
    "L4": 0.3,
    "TPU v4": 1.2,
    "TPU v5 lite": 0.819,
    "TPU v5e": 0.819,
    "TPU v5p": 2.765,
    "TPU v5": 2.765,
    "TPU v6 lite": 1.64,
    "TPU v6e": 1.64,
}

def _lookup(by_kind: dict, device_kind: str) -> tuple[float | None, str]:
    kind = device_kind.lower()
    for key in sorted(by_kind, key=len, reverse=True):
        if key.lower() in kind:
            return by_kind[key], f"table ({key})"
    return None, "unknown"


def peak_tflops(device_kind: str, override: float | None) -> tuple[float | None, str]:
    """(peak dense bf16 per chip in TFLOP/s, where it came from)."""
    if override:
        return float(override), "override"
    return _lookup(PEAK_BF16_TFLOPS, device_kind)


def peak_hbm_tbs(device_kind: str, override: float | None) -> tuple[float | None, str]:
    """(memory bandwidth per chip in TB/s, where it came from)."""
    if override:
        return float(override), "override"
    return _lookup(HBM_TBS, device_kind)


def matmul_params(mc: dict) -> tuple[int, int]:
    """(N_lm, N_value): params used in matmuls per token by a causal LM and by a value model of
    the config `mc` (see the module docstring). Llama family: q/k/v/o, gate/up/down, norms."""
    h, layers, inter = mc["hidden_size"], mc["num_layers"], mc["intermediate_size"]
    q, kv = mc["num_heads"] * mc["head_dim"], mc["num_kv_heads"] * mc["head_dim"]
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * inter + 2 * h
    body = layers * per_layer + h
    return body + mc["vocab_size"] * h, body + h


def phase_flops(r: dict) -> dict:
    """FLOPs of each phase of one PPO step of the worker result `r` (per step, real tokens)."""
    n_lm, n_value = matmul_params(r["model_config"])
    tokens, epochs = r["seq_tokens_mean"], r["epochs"]
    separate = r["mode"] == "separate"
    gen = 2 * n_lm * tokens
    scoring = 2 * tokens * (2 * n_lm + (n_value if separate else 0))
    update = epochs * 6 * tokens * (n_lm + (n_value if separate else 0))
    return {"generation": gen, "scoring": scoring, "update": update,
            "step": gen + scoring + update, "n_lm": n_lm, "n_value": n_value}


def sampler_bytes(r: dict) -> dict:
    """HBM bytes one `generate` call of the worker result `r` must move (module docstring):
    every matmul weight once per forward pass (prefill + N - 1 decode passes) and the whole KV
    cache once per decode pass."""
    mc = r["model_config"]
    item = 2 if r["dtype"] in ("bfloat16", "float16") else 4
    n_lm, _ = matmul_params(mc)
    n = r["new_tokens"]
    slots = r["prompt_width"] + n - 1
    weights = n_lm * item
    kv = 2 * mc["num_layers"] * r["batch"] * slots * mc["num_kv_heads"] * mc["head_dim"] * item
    return {"weight_bytes": weights, "kv_cache_bytes": kv, "cache_slots": slots,
            "bytes": n * weights + (n - 1) * kv}


def sampler_figures(r: dict, hbm_tbs: float | None) -> dict:
    """Sampler tokens/s, achieved bandwidth (GB/s) and its fraction of `hbm_tbs`."""
    t = r["stats"]["time/generation"]["median"]
    b = (r.get("sampler_bytes") or sampler_bytes(r))["bytes"]
    gbs = b / t / 1e9
    return {"tokens_per_s": r["stats"]["tokens_per_s/generation"]["median"], "gb_per_s": gbs,
            "hbm_fraction": None if not hbm_tbs else gbs / (hbm_tbs * 1e3)}


def _gib(x) -> str:
    return "n/a" if x is None else f"{x / 2**30:.1f}"


def markdown(results: list[dict], peak: float | None, peak_src: str, chips: int,
             hbm: float | None = None, hbm_src: str = "unknown") -> str:
    """Summary (the figures to quote), then per-phase tokens/s and TFLOP/s (MFU) tables."""
    summary, rows, mfu_rows = [], [], []
    for r in results:
        st = r["stats"]
        fl = r["flops"]

        def tflops(k):
            return fl[k] / st[f"time/{k}"]["median"] / 1e12

        def mfu(k):
            return "" if not peak else f" ({100 * tflops(k) / (peak * chips):.1f}%)"

        smp = sampler_figures(r, hbm)
        frac = "" if smp["hbm_fraction"] is None else f" ({100 * smp['hbm_fraction']:.1f}%)"
        summary.append([r["model"], r["mode"], r["epochs"], _f(st["time/step"]["median"], 3),
                        _f(st["tokens_per_s/step"]["median"], 1),
                        f"{_f(tflops('update'))}{mfu('update')}",
                        _f(smp["tokens_per_s"], 1), f"{_f(smp['gb_per_s'])}{frac}",
                        _gib(r.get("peak_device_bytes"))])
        comp = (r.get("compile_s") or {}).get("time/step")
        rows.append([r["model"], r["mode"], r["epochs"]]
                    + [_f(st[f"tokens_per_s/{k}"]["median"], 1)
                       for k in ("generation", "scoring", "update", "step")]
                    + [_f(st[f"time/{k}"]["median"], 3)
                       for k in ("generation", "scoring", "update", "step")]
                    + [_f(comp)])
        mfu_rows.append([r["model"], f"{fl['n_lm'] / 1e6:.0f}M", r["mode"], r["epochs"]]
                        + [f"{tflops(k):.2f}{mfu(k)}"
                           for k in ("generation", "scoring", "update", "step")])
    peak_txt = (f"peak {peak:g} TFLOP/s per chip x {chips} chip(s), {peak_src}" if peak
                else "peak unknown for this device: set PPO_BENCH_PEAK_TFLOPS for MFU")
    hbm_txt = (f"{hbm:g} TB/s per chip, {hbm_src}" if hbm
               else "bandwidth unknown for this device: set PPO_BENCH_PEAK_HBM_TBS")
    return "\n".join([
        f"Summary (medians; MFU: {peak_txt}; HBM: {hbm_txt}):", "",
        table(["model", "critic", "epochs", "step s", "step tok/s", "update TFLOP/s (MFU)",
               "sampler tok/s", "sampler GB/s (of HBM)", "peak device GiB"], summary), "",
        "Per phase (tokens/s: generation = new tokens; scoring, step = real prompt + response "
        "tokens; update = epochs x those; compile = first step minus the median step):", "",
        table(["model", "critic", "epochs", "generation tok/s", "scoring tok/s", "update tok/s",
               "step tok/s", "generation s", "scoring s", "update s", "step s", "compile s"],
              rows), "",
        f"Achieved TFLOP/s (MFU; {peak_txt}; 6N train / 2N inference FLOPs per real token):", "",
        table(["model", "N (matmul)", "critic", "epochs", "generation", "scoring", "update", "step"],
              mfu_rows)])


def gpu_section(gpu: dict) -> str:
    """The GPU section of results.md from a gpu.json (bench/gpu.sh --json)."""
    st = gpu["settings"]
    dry = ", DRY RUN on a tiny model" if gpu.get("dry_run") else ""
    out = [f"## PPO step on {gpu['devices']} x {gpu['device_kind']} (bench/gpu.sh{dry})", "",
           f"ppo_jax only, random weights, {st['dtype']}, batch {st['batch']} (one minibatch), "
           f"{st['new_tokens']} new tokens per response (no early stop), prompts up to "
           f"{st['max_prompt_length']} tokens, {st['warmup']} warm-up + {st['steps']} measured "
           f"steps per configuration (medians). Measured {gpu['date']}"
           + (f" with jax {gpu['jax']}" if gpu.get("jax") else "")
           + (f", code at commit `{gpu['commit']}`" if gpu.get("commit") else "")
           + (f"; command `{gpu['command']}`" if gpu.get("command") else "") + ".", ""]
    shapes = gpu.get("shapes") or {}
    if shapes:
        out += ["Shapes: " + "; ".join(
            f"{m}: hidden {d['hidden']}, {d['layers']} layers, intermediate {d['intermediate']}, "
            f"{d['heads']} heads / {d['kv_heads']} KV heads of {d['head_dim']}"
            for m, d in shapes.items()) + "; SmolLM2's 49152-token vocabulary, tied embeddings.",
            ""]
    out.append(markdown(gpu["results"], gpu["peak_tflops"], gpu["peak_source"],
                            gpu["devices"], gpu.get("peak_hbm_tbs"),
                            gpu.get("peak_hbm_source", "unknown")))
    for key, what in (("skipped", "skipped (time budget)"), ("failed", "FAILED")):
        if gpu.get(key):
            out += ["", f"{what}: " + ", ".join(f"{x['model']} / {x['mode']} critic / "
                                                 f"{x['epochs']} epochs" for x in gpu[key])]
    return "\n".join(out)


GPU_HEADING = "## PPO step on "


def replace_gpu_section(text: str, section: str) -> str:
    """`text` (a results.md) with its GPU section (from `GPU_HEADING` to the next `## ` heading
    or the end) replaced by `section`, or `section` appended where there is none."""
    start = text.find("\n" + GPU_HEADING)
    if start < 0:
        return text.rstrip("\n") + "\n\n" + section.strip("\n") + "\n"
    end = text.find("\n## ", start + 1)
    rest = "" if end < 0 else "\n" + text[end:].lstrip("\n")
    return text[:start].rstrip("\n") + "\n\n" + section.strip("\n") + "\n" + rest
