"""The benchmark scripts' own logic: config overrides, FLOPs model and counters, peak table,
report tables.

Models run here only in `test_gpu_sh_dry_run` (`bench/gpu.sh --dry-run`: two tiny workers on
the CPU, about a minute) and in the slow tests (one tiny ppo_jax worker step, the code path of
`bench/ppo_step.py`; `bench/roofline.py --tiny`; `bench/shared_prefill.py --tiny`; the shipped
tokenizer against the converted SmolLM2's).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))  # the benchmark scripts import each other by name


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ppo_step, gpu, report = _load("ppo_step"), _load("gpu"), _load("report")
core_bench, generate, roofline = _load("core"), _load("generate"), _load("roofline")
flops, harness, trl_step = _load("flops"), _load("harness"), _load("ppo_step_trl")
logprob_memory, shared_prefill = _load("logprob_memory"), _load("shared_prefill")


@pytest.mark.parametrize("mode", ["shared", "separate"])
def test_worker_overrides_are_a_valid_config(mode, tmp_path):
    from ppo_jax.trainer.config import load_config

    args = Namespace(batch=8, dtype="float32", remat="none", max_prompt_length=64, new_tokens=48,
                     epochs=4, warmup=1, steps=3, seed=0)
    cfg = load_config(None, ppo_step.jax_overrides(tmp_path, mode, args, str(tmp_path / "out")))
    assert cfg.model.shared_critic == (mode == "shared")
    assert cfg.generation.ignore_eos and cfg.generation.max_new_tokens == 48
    assert cfg.ppo.batch_size == cfg.ppo.mini_batch_size == cfg.ppo.micro_batch_size == 8
    assert cfg.ppo.kl_controller == "fixed" and cfg.ppo.kl_coef == 0.05 and cfg.ppo.vf_coef == 0.1
    assert cfg.optim.max_grad_norm == 1.0 and not cfg.data.shuffle
    assert cfg.data.prompt_buckets == 1  # no new width (a compile) inside a timed step
    assert not cfg.train.tensorboard and not cfg.train.export_hf and not cfg.train.progress


def test_matmul_params_equal_the_model_params():
    """Tied-embedding Llama: every param but the embedding is a matmul weight or a norm, and the
    tied embedding is the LM-head matmul, so N_lm == the model's param count."""
    from ppo_jax.models import count_params, init_model, split_model
    from ppo_jax.models.tiny_random import tiny_config

    cfg = tiny_config(211)
    n = count_params(split_model(init_model(cfg, "causal_lm"))[1])
    mc = {"vocab_size": 211, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
          "num_layers": cfg.num_layers, "num_heads": cfg.num_heads, "num_kv_heads": cfg.num_kv_heads,
          "head_dim": cfg.head_dim}
    n_lm, n_value = gpu.matmul_params(mc)
    assert n_lm == n
    assert n_value == n - 211 * cfg.hidden_size + cfg.hidden_size


def test_flops_per_phase():
    r = {"model_config": {"vocab_size": 10, "hidden_size": 4, "intermediate_size": 8,
                          "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "head_dim": 2},
         "seq_tokens_mean": 100, "epochs": 4, "mode": "separate"}
    f = gpu.phase_flops(r)
    n_lm, n_v = f["n_lm"], f["n_value"]
    assert f["generation"] == 2 * n_lm * 100
    assert f["scoring"] == 2 * 100 * (2 * n_lm + n_v)
    assert f["update"] == 4 * 6 * 100 * (n_lm + n_v)
    shared = gpu.phase_flops({**r, "mode": "shared"})
    assert shared["update"] == 4 * 6 * 100 * n_lm and shared["scoring"] == 4 * 100 * n_lm


@pytest.mark.parametrize("kind,peak", [("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0),
                                       ("NVIDIA H200", 989.0), ("NVIDIA A100-SXM4-80GB", 312.0),
                                       ("NVIDIA L40S", 362.0), ("TPU v5 lite", 197.0), ("cpu", None)])
def test_peak_table(kind, peak):
    assert gpu.lookup(gpu.PEAK_BF16_TFLOPS, kind, None)[0] == peak
    assert gpu.lookup(gpu.PEAK_BF16_TFLOPS, kind, 123.0) == (123.0, "override")


@pytest.mark.parametrize("kind,tbs", [("NVIDIA H200", 4.8), ("NVIDIA H100 80GB HBM3", 3.35),
                                      ("NVIDIA H100 PCIe", 2.0), ("NVIDIA A100-SXM4-40GB", 1.555),
                                      ("NVIDIA A100-SXM4-80GB", 2.039), ("TPU v5 lite", 0.819),
                                      ("cpu", None)])
def test_hbm_table(kind, tbs):
    assert gpu.lookup(gpu.HBM_TBS, kind, None)[0] == tbs
    assert gpu.lookup(gpu.HBM_TBS, kind, 2.5) == (2.5, "override")


def test_shapes_match_their_models():
    """smollm2 is SmolLM2-135M's shape (~135M params with its vocabulary), llama1b ~1.07B."""
    def n_params(dims):
        mc = {"vocab_size": 49152, "hidden_size": dims["hidden"], "num_layers": dims["layers"],
              "intermediate_size": dims["intermediate"], "num_heads": dims["heads"],
              "num_kv_heads": dims["kv_heads"], "head_dim": dims["head_dim"]}
        return gpu.matmul_params(mc)[0]  # tied: every param is a matmul weight or a norm

    assert n_params(gpu.SHAPES["smollm2"]) == 134_515_008  # SmolLM2-135M's count
    assert 1.0e9 < n_params(gpu.SHAPES["llama1b"]) < 1.1e9


def test_sampler_bytes_and_bandwidth():
    mc = {"vocab_size": 10, "hidden_size": 4, "intermediate_size": 8, "num_layers": 3,
          "num_heads": 2, "num_kv_heads": 1, "head_dim": 2}
    r = {"model_config": mc, "dtype": "bfloat16", "new_tokens": 5, "prompt_width": 7, "batch": 6,
         "stats": {"time/generation": {"median": 2.0}, "tokens_per_s/generation": {"median": 15.0}}}
    b = gpu.sampler_bytes(r)
    n_lm = gpu.matmul_params(mc)[0]
    kv = 2 * 3 * 6 * (7 + 5 - 1) * 1 * 2 * 2  # k and v, layers, rows, slots, kv heads, dim, bf16
    assert b["weight_bytes"] == 2 * n_lm and b["kv_cache_bytes"] == kv
    assert b["bytes"] == 5 * 2 * n_lm + 4 * kv  # prefill + 4 decode passes read the weights
    f = gpu.sampler_figures(r, hbm_tbs=1e-9)  # 1 kB/s
    assert f["tokens_per_s"] == 15.0 and f["gb_per_s"] == pytest.approx(b["bytes"] / 2 / 1e9)
    assert f["hbm_fraction"] == pytest.approx(b["bytes"] / 2 / 1e3)
    assert gpu.sampler_figures(r, None)["hbm_fraction"] is None


def test_configurations_run_every_model_before_the_second_mode():
    assert gpu.configurations(["a", "b"], ["shared", "separate"], [4]) == [
        ("a", "shared", 4), ("b", "shared", 4), ("a", "separate", 4), ("b", "separate", 4)]


def test_shipped_tokenizer_unpacks(tmp_path):
    from ppo_jax.models import load_tokenizer

    tok = load_tokenizer(gpu.unpack_tokenizer(tmp_path / "tok"))
    assert len(tok) == 49152 and tok.eos_token == "<|im_end|>" and tok.pad_token_id == 2
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow
def test_shipped_tokenizer_is_the_converted_smollm2s():
    import hashlib

    from ppo_jax.models.smollm2 import ensure_smollm2

    data = (ensure_smollm2() / "tokenizer.json").read_bytes()
    assert hashlib.sha256(data).hexdigest() == gpu.TOKENIZER_SHA256


@pytest.mark.slow  # about 2 minutes: bench/gpu.sh end to end on the CPU
def test_gpu_sh_dry_run(tmp_path):
    """bench/gpu.sh --dry-run end to end on the CPU (tiny model, both critic layouts), then the
    GPU section bench/report.py makes of its JSON."""
    out = tmp_path / "gpu.json"
    env = {**os.environ, "PPO_BENCH_PYTHON": sys.executable, "JAX_PLATFORMS": "cpu",
           "PPO_JAX_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run(["bash", str(ROOT / "bench/gpu.sh"), "--dry-run", "--json", str(out)],
                          cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
    assert proc.returncode == 0, proc.stdout[-3000:]
    data = json.loads(out.read_text())
    assert data["dry_run"] and data["complete"] and not data["skipped"] and not data["failed"]
    assert [r["mode"] for r in data["results"]] == ["shared", "separate"]
    for r in data["results"]:
        assert r["model"] == "tiny-3M" and r["dtype"] == "bfloat16" and r["gen_tokens"] == 8
        assert r["sampler_bytes"]["bytes"] > 0 and r["flops"]["update"] > 0
    assert "| tiny-3M | separate | 1 |" in proc.stdout and "sampler GB/s" in proc.stdout
    text = gpu.gpu_section(data)
    assert "DRY RUN" in text and "| tiny-3M | shared | 1 |" in text


def test_replace_gpu_section():
    doc = "# R\n\n## A\n\na\n"
    once = gpu.replace_gpu_section(doc, "## PPO step on X\n\nx")
    assert once == "# R\n\n## A\n\na\n\n## PPO step on X\n\nx\n"
    assert gpu.replace_gpu_section(once, "## PPO step on Y\n\ny") == once.replace("X\n\nx", "Y\n\ny")
    middle = gpu.replace_gpu_section(once + "\n## B\n\nb\n", "## PPO step on Z\n\nz")
    assert middle == "# R\n\n## A\n\na\n\n## PPO step on Z\n\nz\n\n## B\n\nb\n"


def _result(config, t_gen, t_score, t_upd, tokens=400):
    st = lambda x: {"median": x, "min": x, "max": x, "n": 3}  # noqa: E731
    t_step = t_gen + t_score + t_upd
    return {"config": config, "label": config, "epochs": 1, "peak_rss_mib": 1000.0,
            "compile_s": None if config == "trl" else 1.0,
            "load_s": 1.0, "first_step_s": 2.0,
            "stats": {"time/generation": st(t_gen), "time/scoring": st(t_score),
                      "time/update": st(t_upd), "time/step": st(t_step),
                      "tokens_per_s/generation": st(384 / t_gen),
                      "tokens_per_s/scoring": st(tokens / t_score),
                      "tokens_per_s/update": st(tokens / t_upd),
                      "tokens_per_s/step": st(tokens / t_step)}}


def test_ppo_step_markdown_ratios():
    data = {"settings": {"model": "m", "dtype": "float32", "batch": 8, "new_tokens": 48,
                         "kl_coef": 0.05, "max_grad_norm": 1.0, "warmup": 1, "steps": 3},
            "results": [_result("jax-shared", 1.0, 1.0, 2.0), _result("trl", 2.0, 3.0, 8.0)]}
    text = ppo_step.markdown(data)
    ratios = text.split("TRL time / ours time")[1]
    # generation x2, scoring x3, update x4, step 13/4
    assert "| jax-shared | ×2.00 | ×3.00 | ×4.00 | ×3.25 |" in ratios
    assert "tok/s" not in text and "tokens/s" not in text  # the time ratios say it
    assert text.index("| trl |") < text.index("| jax-shared |")  # TRL row first


def _spread_result(config, rnd, times, rss=1000.0):
    """A round's result whose measured step times (generation only varies) are `times`."""
    r = _result(config, sorted(times)[len(times) // 2], 1.0, 2.0)
    r["stats"]["time/generation"] = {"median": sorted(times)[len(times) // 2], "min": min(times),
                                     "max": max(times), "n": len(times)}
    return {**r, "round": rnd, "peak_rss_mib": rss, "load_s": 1.0 + rnd, "wall_s": 10.0}


def test_merge_rounds_takes_median_of_round_medians_and_extremes_of_steps():
    rounds = [_spread_result("jax-shared", 0, [1.0, 2.0, 9.0], rss=900.0),
              _spread_result("trl", 0, [4.0, 4.5, 5.0]),
              _spread_result("jax-shared", 1, [3.0, 3.0, 3.5], rss=950.0),
              _spread_result("jax-shared", 2, [0.5, 2.5, 2.6], rss=920.0)]
    merged = {r["config"]: r for r in ppo_step.merge_rounds(rounds)}
    ours = merged["jax-shared"]
    # round medians 2.0, 3.0, 2.5 -> 2.5; extremes over all 9 steps
    assert ours["stats"]["time/generation"] == {"median": 2.5, "min": 0.5, "max": 9.0, "n": 9}
    assert ours["rounds"] == 3 and "round" not in ours
    assert ours["peak_rss_mib"] == 950.0 and ours["load_s"] == 2.0 and ours["wall_s"] == 30.0
    assert ours["compile_s"] == 1.0 and "trl_ratio" not in ours  # TRL ran in one round only
    assert merged["trl"]["rounds"] == 1 and merged["trl"]["compile_s"] is None
    assert merged["trl"]["stats"]["time/generation"]["median"] == 4.5


def test_ppo_step_markdown_reports_per_round_ratio_spread():
    settings = {"model": "m", "dtype": "float32", "batch": 8, "new_tokens": 48, "kl_coef": 0.05,
                "max_grad_norm": 1.0, "warmup": 1, "steps": 3, "rounds": 3}
    rounds = []
    for rnd, (ours, trl) in enumerate([(2.0, 4.0), (4.0, 4.0), (1.0, 3.0)]):  # x2, x1, x3
        rounds += [_spread_result("trl", rnd, [trl]), _spread_result("jax-shared", rnd, [ours])]
    rounds.append(_spread_result("jax-separate", 0, [1.0]))  # one round only: no spread row
    merged = {r["config"]: r for r in ppo_step.merge_rounds(rounds)}
    assert merged["jax-shared"]["trl_ratio"]["time/generation"] == {
        "median": 2.0, "min": 1.0, "max": 3.0, "n": 3}  # x2, x1, x3
    assert "trl_ratio" not in merged["jax-separate"]
    data = {"settings": settings, "results": list(merged.values()), "rounds": rounds}
    text = ppo_step.markdown(data)
    assert "in each of 3 interleaved rounds" in text
    row = next(ln for ln in text.splitlines() if ln.startswith("| jax-shared, per round (3 rounds) |"))
    # generation: x2.00 (x1.00-x3.00); scoring and update equal every round
    assert row.split(" | ")[1:4] == ["×2.00 (×1.00–×3.00)", "×1.00 (×1.00–×1.00)", "×1.00 (×1.00–×1.00)"]
    assert "| jax-separate, per round" not in text
    one = ppo_step.markdown({**data, "settings": {**settings, "rounds": 1},
                             "results": ppo_step.merge_rounds([r for r in rounds if r["round"] == 0])})
    assert "per round" not in one and "median (min–max)." in one


def test_report_renders_missing_sections(tmp_path):
    (tmp_path / "core.json").write_text(json.dumps({  # a file without a commit or a section
        "batch": 4, "load_average": 0.5, "command": ".venv/bin/python bench/core.py"}))
    text = report.render(tmp_path)
    assert "_core.json carries no section" in text
    assert "_not run (no ppo_step.json)_" in text and "_not run (no generate.json)_" in text
    assert "_not run (no decode_floor.json)_" in text and "no commit recorded for core" in text


@pytest.mark.slow
def test_jax_worker_runs_a_tiny_step(tiny_checkpoint):
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench/ppo_step.py"), "--worker", "jax", "--mode", "shared",
         "--model-dir", str(tiny_checkpoint), "--epochs", "1", "--batch", "2", "--new-tokens", "3",
         "--steps", "1", "--warmup", "1", "--max-prompt-length", "16"],
        stdout=subprocess.PIPE, text=True, cwd=ROOT, check=True).stdout
    line = next(ln for ln in out.splitlines() if ln.startswith(harness.JSON_TAG))
    r = json.loads(line[len(harness.JSON_TAG):])
    assert r["gen_tokens"] == 6 and r["measured_steps"] == 1 and r["peak_rss_mib"] > 0
    assert r["compile_s"] == r["first_step_s"] - r["stats"]["time/step"]["median"]


def _count_primitive(jaxpr, name: str) -> int:
    """Occurrences of primitive `name` in a jaxpr and every jaxpr nested in its equations."""
    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive.name == name
        for v in eqn.params.values():
            for sub in v if isinstance(v, (tuple, list)) else (v,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    n += _count_primitive(inner, name)
    return n


@pytest.mark.parametrize("tied", [True, False])
def test_decode_floor_reads_every_weight_once_in_both_layer_forms(tied):
    """bench/decode_floor.py: a step holds the 7 layer matmuls (once in the scan body, once per
    layer unrolled) plus the LM head and nothing else that multiplies matrices; both forms
    compute the same finite numbers; the byte count is the weights of those matmuls."""
    import jax
    import numpy as np

    from ppo_jax.models import flat_params, init_model, split_model
    from ppo_jax.models.tiny_random import tiny_config

    floor = _load("decode_floor")
    cfg = tiny_config(211).replace(tie_word_embeddings=tied)
    params = split_model(init_model(cfg, "causal_lm"))[1]
    flat = flat_params(params)
    head = "backbone/embed_tokens/embedding" if tied else "unembed/kernel"
    expect = sum(int(flat[f"backbone/layers/{m}/kernel"].nbytes) for m in floor.MATMULS)
    outs = []
    for unrolled in (False, True):
        run, h0, nbytes = floor.weight_matmul_steps(params, cfg, batch=3, steps=4,
                                                    unrolled=unrolled)
        assert nbytes == expect + int(flat[head].nbytes) and h0.shape == (3, cfg.hidden_size)
        per_step = 7 * (cfg.num_layers if unrolled else 1) + 1
        assert _count_primitive(jax.make_jaxpr(run)(h0).jaxpr, "dot_general") == per_step
        outs.append(np.asarray(jax.block_until_ready(run(h0))))
    assert np.isfinite(outs[0]).all() and not np.allclose(outs[0], np.asarray(h0))
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- FLOP counting
def test_counted_flops_of_a_matmul_are_2mnk():
    import jax
    import jax.numpy as jnp

    m, k, n = 3, 5, 7
    c = flops.count_flops(jax.jit(lambda x, y: x @ y), jnp.ones((m, k)), jnp.ones((k, n)))
    assert c["flops"] == 2 * m * n * k and c["loops"] == 0
    assert c["xla_flops"] == pytest.approx(2 * m * n * k)


def test_counted_flops_of_a_gradient_are_three_matmuls():
    """d/dx and d/dw of sum(x @ w): forward, g w^T and x^T g, each 2 M N K (the 6N rule)."""
    import jax
    import jax.numpy as jnp

    m, k, n = 4, 6, 3
    grad = jax.jit(jax.grad(lambda x, w: (x @ w).sum(), argnums=(0, 1)))
    assert flops.count_flops(grad, jnp.ones((m, k)), jnp.ones((k, n)))["flops"] == 3 * 2 * m * n * k


def test_scan_bodies_count_per_iteration_but_xla_counts_them_once():
    """Why the benchmarks count from the jaxpr: XLA's cost analysis counts a while body once."""
    import jax
    import jax.numpy as jnp

    layers, b, d = 6, 8, 16

    def stack(x, w):
        return jax.lax.scan(lambda h, wi: (h @ wi, None), x, w)[0]

    c = flops.count_flops(jax.jit(stack), jnp.ones((b, d)), jnp.ones((layers, d, d)))
    assert c["flops"] == layers * 2 * b * d * d
    assert c["xla_flops"] < c["flops"] / 2


def test_batched_dots_and_the_costlier_cond_branch():
    import jax
    import jax.numpy as jnp

    bt, i, j, k = 2, 3, 4, 5

    def f(p, a, b, c):
        ab = jnp.einsum("bij,bjk->bik", a, b)
        return jax.lax.cond(p, lambda: ab, lambda: ab @ c)

    args = (True, jnp.ones((bt, i, j)), jnp.ones((bt, j, k)), jnp.ones((k, k)))
    got = flops.count_flops(jax.jit(f), *args, with_xla=False)
    assert got["flops"] == 2 * bt * i * j * k + 2 * bt * i * k * k and got["xla_flops"] is None


def test_while_loops_are_reported():
    import jax
    import jax.numpy as jnp

    def f(x):
        return jax.lax.while_loop(lambda c: c[1] < 3, lambda c: (c[0] @ c[0], c[1] + 1), (x, 0))[0]

    c = flops.count_flops(jax.jit(f), jnp.ones((4, 4)), with_xla=False)
    assert c == {"flops": 2 * 4 ** 3, "loops": 1, "xla_flops": None}


def test_signature_recorder_counts_each_call_after_the_fact():
    import jax
    import jax.numpy as jnp

    rec = flops.SignatureRecorder(jax.jit(lambda x, y: x @ y))
    a, b = jnp.ones((2, 3)), jnp.ones((3, 4))
    out = rec(a, b)
    rec(jnp.ones((5, 3)), b)
    rec(a, b)
    assert out.shape == (2, 4) and float(out[0, 0]) == 3.0
    assert [c["flops"] for c in rec.per_call(with_xla=False)] == [48, 120, 48]
    assert len(rec.specs) == 2


def test_torch_counter_splits_a_step_at_the_marker():
    """bench/ppo_step_trl.py's counter on a tiny torch model: two nn.Linear phases around a
    marker method (TRL: `compute_advantages`), and the CPU sdpa kernel torch's table lacks."""
    import torch

    m, k, n1, n2 = 3, 5, 7, 2

    class Step:
        def __init__(self):
            self.a, self.b = torch.nn.Linear(k, n1), torch.nn.Linear(n1, n2)

        def marker(self, h):
            return h

        def run(self, x):
            return self.b(self.marker(self.a(x)))

    step, x = Step(), torch.randn(m, k)
    split = trl_step.count_split_flops(step, "marker", lambda: step.run(x))
    assert split == {"before": 2 * m * k * n1, "after": 2 * m * n1 * n2,
                     "total": 2 * m * k * n1 + 2 * m * n1 * n2}
    assert "marker" not in vars(step)  # the method is restored

    bt, h, t, d = 2, 3, 5, 4
    q, kk, v = (torch.randn(bt, h, t, d) for _ in range(3))
    counter = trl_step.flop_counter()
    with counter:
        torch.nn.functional.scaled_dot_product_attention(q, kk, v, is_causal=True)
    assert counter.get_total_flops() == 2 * 2 * bt * h * t * t * d  # q k^T and p v


def test_cpu_info_reads_model_and_instruction_sets():
    x86 = "processor\t: 0\nmodel name\t: Intel Xeon\nflags\t\t: fpu sse avx avx2 fma avx512f\n"
    arm = "processor\t: 0\nFeatures\t: fp asimd sve\n"
    assert harness.cpu_info(x86)["model"] == "Intel Xeon"
    assert harness.cpu_info(x86)["isa"] == ["avx", "avx2", "fma", "avx512f"]
    assert harness.cpu_info(arm)["isa"] == ["asimd", "sve"]
    assert "avx512f" in harness.cpu_line(harness.cpu_info(x86))


def test_matmul_rate_counts_2n3():
    r = roofline.matmul_rate(64, runs=2, warmup=1)
    assert r["flops"] == 2 * 64 ** 3 and r["seconds"]["n"] == 2 and r["gflops_per_s"]["median"] > 0


# --------------------------------------------------------------------------- report sections
ROOFLINE = {
    "bench": "roofline", "tiny": False, "date": "2026-01-01T00:00:00+00:00", "jax": "0.10.2",
    "cpu": {"model": "AMD EPYC 7B13", "cores": 2, "isa": ["avx", "avx2", "fma"]},
    "matmul": {"n": 2048, "flops": 2 * 2048 ** 3,
               "seconds": {"median": 0.05, "min": 0.05, "max": 0.05, "n": 10},
               "gflops_per_s": {"median": 400.0, "min": 390.0, "max": 410.0, "n": 10}},
    "update": {"model": "SmolLM2", "mode": "shared", "epochs": 1, "batch": 8, "new_tokens": 48,
               "flops": 500e9, "xla_flops": 30e9, "flops_6n": 520e9,
               "flops_source": "jaxpr dot_general count (bench/flops.py)",
               "seconds": {"median": 4.0, "min": 4.0, "max": 4.0, "n": 3},
               "gflops_per_s": {"median": 125.0, "min": 120.0, "max": 130.0, "n": 3},
               "scoring_gflops_per_s": {"median": 90.0, "min": 90.0, "max": 90.0, "n": 3}},
    "ratio": 125.0 / 400.0, "target": 0.5, "command": "python bench/roofline.py",
    "load_average": 1.0, "commit": "abc1234", "dirty": False,
}


def test_roofline_section_renders():
    text = roofline.markdown(ROOFLINE)
    assert harness.measured_line(ROOFLINE) == ("Measured 2026-01-01T00:00:00+00:00 on AMD EPYC "
                                               "7B13, 2 logical cores; avx avx2 fma; commit "
                                               "`abc1234`; load average 1.00 at the end.")
    assert "| matmul 2048x2048x2048 (jitted `x @ y`) | 400 (390–410) | 17.2 (2 N^3) |" in text
    assert "| 125 (120–130) | 500 per step (XLA cost analysis 30, 6N model 520) |" in text
    assert "Update / matmul rate: **0.31** (target ≥ 0.50)" in text
    assert "DRY RUN" not in text
    assert "DRY RUN" in roofline.markdown({**ROOFLINE, "tiny": True})


def test_report_has_a_roofline_section(tmp_path):
    assert "_not run (no roofline.json)_" in report.render(tmp_path)
    (tmp_path / "roofline.json").write_text(json.dumps({**ROOFLINE, "markdown": "ROOF TABLE"}))
    text = report.render(tmp_path)
    assert ("## Roofline: the PPO update's FLOP rate vs a large matmul (bench/roofline.py)\n\n"
            "ROOF TABLE\n") in text  # the section the benchmark printed, as it printed it
    assert "python bench/roofline.py" in text and "roofline 1.00" in text


def test_ppo_step_markdown_shows_counted_flops():
    data = {"settings": {"model": "m", "dtype": "float32", "batch": 8, "new_tokens": 48,
                         "kl_coef": 0.05, "max_grad_norm": 1.0, "warmup": 1, "steps": 3},
            "results": [_result("jax-shared", 1.0, 1.0, 2.0), _result("trl", 2.0, 3.0, 8.0)]}
    assert "Model FLOPs per step" not in ppo_step.markdown(data)
    st = lambda x: {"median": x, "min": x, "max": x, "n": 3}  # noqa: E731
    ours, trl = data["results"]
    ours["model_flops"] = {"source": "jaxpr dot_general count (bench/flops.py)",
                           "scoring": {"flops": 20e9, "xla_flops": 1e9, "while_loops": 0},
                           "update": {"flops": 60e9, "xla_flops": 3e9, "while_loops": 0}}
    ours["stats"].update({"gflops_per_s/scoring": st(20.0), "gflops_per_s/update": st(30.0)})
    trl["model_flops"] = {"source": "torch FlopCounterMode, one extra untimed step",
                          "scoring": {"flops": 30e9}, "update": {"flops": 90e9}}
    text = ppo_step.markdown(data)
    assert "| trl | 30 | 90 | n/a | n/a | torch FlopCounterMode |" in text
    assert ("| jax-shared | 20 | 60 | 20.0 | 30.0 | jaxpr dot_general count (bench/flops.py) |"
            in text)


@pytest.mark.slow
def test_roofline_tiny_dry_run(tmp_path):
    out = tmp_path / "roofline.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench/roofline.py"), "--tiny", "--batch", "2",
         "--new-tokens", "3", "--steps", "1", "--warmup", "1", "--max-prompt-length", "16",
         "--matmul", "256", "--matmul-runs", "2", "--json", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:]
    data = json.loads(out.read_text())
    assert data["tiny"] and data["matmul"]["flops"] == 2 * 256 ** 3 and data["ratio"] > 0
    u = data["update"]
    assert u["flops"] > 0 and u["flops"] > u["xla_flops"]  # layers in a scan: XLA counts one
    assert "Update / matmul rate" in proc.stdout


# --------------------------------------------------------------------------- bench/core.py timing
class FakeClock:
    """A clock that advances by `step` seconds per reading; `log` records the calls made."""

    def __init__(self, step: float = 1.0):
        self.t, self.step, self.log = 0.0, step, []

    def __call__(self) -> float:
        self.t += self.step
        return self.t

    def fn(self, name: str):
        return lambda: self.log.append(name)


def test_warm_runs_until_both_the_calls_and_the_seconds_are_reached():
    clock = FakeClock(step=1.0)  # every reading 1 s later: the k-th check sees k seconds passed
    assert harness.warm(clock.fn("f"), min_calls=2, min_s=0.0, clock=clock) == 2
    clock = FakeClock(step=1.0)
    assert harness.warm(clock.fn("f"), min_calls=1, min_s=3.5, clock=clock) == 4
    assert clock.log == ["f"] * 4


def test_interleaved_warms_each_block_right_before_it_and_alternates_sides():
    clock = FakeClock(step=0.5)
    fns = {"ours": clock.fn("ours"), "torch": clock.fn("torch")}
    blocks = harness.interleaved(fns, rounds=2, block={"ours": 3, "torch": 1}, warmup_calls=2,
                                    warmup_s=0.0, clock=clock)
    one_round = ["ours"] * (2 + 3) + ["torch"] * (2 + 1)  # warm-up calls, then the timed block
    assert clock.log == one_round * 2
    assert [len(b) for b in blocks["ours"]] == [3, 3] and [len(b) for b in blocks["torch"]] == [1, 1]
    assert all(t == 0.5 for b in blocks["ours"] for t in b)  # one clock step, in seconds


def test_compare_quotes_ratio_of_minima_and_per_round_ratios():
    torch_blocks = [[10.0, 12.0, 30.0], [20.0, 8.0, 40.0]]  # block medians 12, 20; min 8
    ours_blocks = [[1.0, 2.0, 3.0], [4.0, 5.0, 2.0]]        # block medians 2, 4; min 1
    c = harness.compare(torch_blocks, ours_blocks)
    assert c["ratio_of_minima"] == pytest.approx(8.0)
    assert c["ratio_of_medians"] == pytest.approx(16.0 / 2.5)  # medians of all six calls
    assert c["paired_ratio"] == {"median": 5.5, "min": 5.0, "max": 6.0, "n": 2}  # 12/2, 20/4
    assert core_bench.side_figures(ours_blocks) == {"median_ms": 2500.0, "min_ms": 1000.0,
                                                    "calls": 6}  # seconds in, ms out


CORE = {
    "bench": "core", "batch": 4, "length": 8, "rounds": 2, "torch_block": 3, "jax_block": 3,
    "warmup_calls": 1, "warmup_s": 0.1, "runs": 6, "jax_runs": 6, "default_gae": "scan(unroll=1)",
    "torch": {"median_ms": 16.0, "min_ms": 8.0},
    "jax": {"scan(unroll=1)": {"median_ms": 2.5, "min_ms": 1.0, "compile_s": 0.3,
                               "ratio_of_medians": 6.4, "ratio_of_minima": 8.0,
                               "paired_ratio": {"median": 5.5, "min": 5.0, "max": 6.0, "n": 2}}},
    "gae_alone": {}, "speedup_default": 6.4, "commit": "abc1234", "dirty": False,
    "wall_s": 90.0, "load_average": 0.5, "command": ".venv/bin/python bench/core.py",
}


def test_core_section_shows_minima_and_per_round_ratios_with_their_spread():
    text = core_bench.markdown(CORE)
    assert ("| jax jit, GAE scan(unroll=1) (default) | 2.500 (1.000) | ×6.4 | ×8.0 | "
            "×5.5 (×5.0–×6.0, 2 rounds) | 0.30 |") in text
    assert "2 interleaved rounds" in text and "blocks of 3 (JAX) and 3 (torch)" in text


# --------------------------------------------------------------------------- commits
def _git(repo, *args):
    subprocess.run(["git", "-c", "user.email=b@x", "-c", "user.name=b", *args], cwd=repo,
                   check=True, capture_output=True)


def test_git_state_reads_the_commit_and_whether_tracked_files_changed(tmp_path, monkeypatch):
    _git(tmp_path, "init", "-q")
    (tmp_path / "bench").mkdir()
    for name in ("a.py", "bench/results.md"):
        (tmp_path / name).write_text("x\n")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-q", "-m", "c")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path, text=True,
                          capture_output=True, check=True).stdout.strip()
    assert harness.git_state(tmp_path) == {"commit": head, "dirty": False}
    (tmp_path / "new.py").write_text("untracked\n")  # untracked: not dirty
    (tmp_path / "bench/results.md").write_text("regenerated\n")  # generated: not dirty
    assert harness.git_state(tmp_path)["dirty"] is False
    (tmp_path / "a.py").write_text("changed\n")
    assert harness.git_state(tmp_path) == {"commit": head, "dirty": True}
    monkeypatch.setenv("PPO_BENCH_COMMIT", "feed123")  # a copied tree without .git
    assert harness.git_state(tmp_path / "bench")["commit"] == head  # still inside the checkout
    outside = tmp_path.parent / f"{tmp_path.name}-nogit"
    outside.mkdir()
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    assert harness.git_state(outside) == {"commit": "feed123", "dirty": None}


def test_run_record_carries_commit_dirty_and_wall_time():
    r = harness.run_record()
    assert set(r) == {"date", "commit", "dirty", "cpu", "load_average", "wall_s", "malloc_settings"}
    assert r["cpu"] == harness.cpu_info()
    assert r["wall_s"] is None or r["wall_s"] > 0
    from ppo_jax.trainer.host.memory import MALLOC_SETTINGS

    assert r["malloc_settings"] == all(k in os.environ for k in MALLOC_SETTINGS)


def test_report_says_which_benchmarks_ran_under_the_malloc_settings():
    raws = {"core": {"malloc_settings": True}, "generate": {"malloc_settings": False},
            "roofline": {"commit": "abc"}, "decode_floor": None,
            "ppo_step": {"malloc_settings": False,  # the parent; its workers' flags decide
                         "results": [{"malloc_settings": True}, {"malloc_settings": True}]},
            "update_profile": {"results": [{"malloc_settings": True}, {}]}}
    line = report.malloc_line(raws)
    assert line.endswith("in each benchmark's processes: on: core, ppo_step; off: generate; "
                         "not recorded: roofline, update_profile")


def test_provenance_one_commit_no_warning():
    lines = report.provenance_lines({"core": CORE, "generate": {**CORE, "commit": "abc1234"},
                                     "ppo_step": None})
    assert lines == ["Code: commit `abc1234` (every raw file)."]


def test_provenance_warns_on_dirty_trees_and_missing_commits_and_refuses_unknown_mixes():
    gpu_json = {"commit": "abc1234" + "0" * 33, "dirty": True}  # a full hash is the same commit
    lines = report.provenance_lines({"core": CORE, "ppo_step": {"results": []}, "gpu": gpu_json})
    text = "\n".join(lines)
    assert lines[0].startswith("Code: core `abc1234`, ppo_step not recorded, gpu `abc1234")
    assert "dirty tree" in text and "): gpu;" in text
    assert "no commit recorded for ppo_step" in text
    clean = report.provenance_lines({"core": CORE, "gpu": {"commit": "abc1234"}})
    assert clean == ["Code: commit `abc1234` (every raw file)."]
    with pytest.raises(SystemExit, match="refusing to mix .*`abc1234` vs `def5678`: git cannot tell"):
        report.provenance_lines({"core": CORE, "generate": {**CORE, "commit": "def5678"}})


XEON = {"model": "Intel Xeon", "cores": 2, "isa": ["avx2", "avx512f"]}
EPYC = {"model": "AMD EPYC", "cores": 2, "isa": ["avx2"]}


def test_cpu_lines_name_the_recorded_cpu_not_the_report_machine():
    lines = report.cpu_lines({"core": {"cpu": XEON}, "generate": {"cpu": XEON}, "gpu": None},
                                 here=EPYC)
    assert lines == ["- CPU (recorded by the benchmarks): Intel Xeon, 2 logical cores; avx2 avx512f"]


def test_cpu_lines_warn_on_mixed_and_missing_cpus():
    text = "\n".join(report.cpu_lines({"core": {"cpu": XEON}, "generate": {"cpu": EPYC},
                                           "ppo_step": {"results": []}}, here=XEON))
    assert "core: Intel Xeon" in text and "generate: AMD EPYC" in text
    assert "2 different CPUs" in text and "no CPU recorded for ppo_step" in text
    none = report.cpu_lines({"core": {"commit": "abc"}}, here=EPYC)
    assert none == ["- CPU: not recorded by the raw files; this report was rendered on AMD EPYC, "
                    "2 logical cores; avx2"]


def test_report_header_names_the_commit_and_the_wall_times(tmp_path):
    (tmp_path / "core.json").write_text(json.dumps({**CORE, "dirty": True}))
    text = report.render(tmp_path)
    assert "Code: commit `abc1234` (every raw file)." in text
    assert "**Warning:** measured on a dirty tree" in text and "): core;" in text
    assert "wall time of each benchmark (its whole process): core 1.5 min; 1.5 min in all" in text


def test_report_reproduce_line_names_a_non_default_out(tmp_path):
    (tmp_path / "core.json").write_text(json.dumps(CORE))
    assert f"bench/report.py {tmp_path}\n" in report.render(tmp_path)
    assert f"bench/report.py {tmp_path}\n" in report.render(tmp_path, ROOT / "bench/results.md")
    text = report.render(tmp_path, ROOT / "bench/results_other.md")
    assert f"bench/report.py {tmp_path} --out bench/results_other.md\n" in text


# --------------------------------------------------------------------------- generate / ppo_step
def test_generate_section_shows_every_thread_setting_fastest_first():
    st = lambda x: {"median": x, "min": x, "max": x, "n": 3}  # noqa: E731
    data = {"model": "m", "batch": 8, "prompt_width": 47, "new_tokens": 64, "runs": 3,
            "ppo_jax": {"tokens_per_s": st(140.0), "seconds": st(3.7), "first_call_s": 4.4},
            "transformers": {"tokens_per_s": st(85.0), "seconds": st(6.0), "first_call_s": 6.1,
                             "torch_threads": 2},
            "transformers_by_threads": {
                "1": {"tokens_per_s": st(70.0), "seconds": st(7.3), "first_call_s": 7.5},
                "2": {"tokens_per_s": st(85.0), "seconds": st(6.0), "first_call_s": 6.1}},
            "ratio": 140 / 85, "ratio_by_threads": {"1": 2.0, "2": 140 / 85},
            "paired_ratio": st(1.6), "paired_ratio_by_threads": {"1": st(2.0), "2": st(1.6)},
            "compile_s": 3.2, "identical_rows": 8}
    text = generate.markdown(data)
    fast = ("| transformers `generate` (PyTorch CPU), 2 threads (fastest) | 85.0 | 6.000 | 6.10 | "
            "×1.65 (paired runs ×1.60–×1.60) |")
    slow = "| transformers `generate` (PyTorch CPU), 1 thread | 70.0 | 7.300 | 7.50 | ×2.00 ("
    assert fast in text and slow in text and text.index(fast) < text.index(slow)
    assert "fastest thread setting (2 threads) (medians): ×1.65" in text
    assert "compile: 3.2 s; greedy rows identical token for token: 8/8." in text


def test_ppo_step_section_puts_first_step_beside_the_steady_median_and_counts_columns():
    data = {"settings": {"model": "m", "dtype": "float32", "batch": 8, "new_tokens": 48,
                         "kl_coef": 0.05, "max_grad_norm": 1.0, "warmup": 1, "steps": 3},
            "results": [_result("jax-shared", 1.0, 1.0, 2.0), _result("trl", 2.0, 3.0, 8.0)]}
    ours, trl = data["results"]
    ours.update(seq_tokens_mean=400.0, padded_seq_len_mean=55.0)
    trl.update(seq_tokens_mean=400.0, padded_seq_len_mean=50.0, first_step_s=17.9)
    text = ppo_step.markdown(data)
    # phases, then load, first step, compile, peak RSS
    assert "| trl | 2.00 | 3.00 | 8.00 | 13.0 | 1.00 | 17.9 | none (eager) | 1,000 |" in text
    assert "| jax-shared | 1.00 | 1.00 | 2.00 | 4.00 | 1.00 | 2.00 | 1.00 | 1,000 |" in text
    assert "| jax-shared | 400 | 55.0 | 440 | 10.0% |" in text  # 8 x 55 columns vs 400 tokens
    assert "| trl | 400 | 50.0 | 400 | 0.0% |" in text


# --------------------------------------------------------------------------- shared prefill
def test_shared_prefill_figures_and_section_from_hand_numbers():
    """n = 4 on 2 prompts (batch 8) x 5 new tokens = 40 tokens: 2.0 s repeated, 1.0-1.25 s
    shared -> 20 and 32-40 tokens/s, ratio of medians x1.78 (2 / 1.125), per round x1.6-x2."""
    blocks = {"gen n=4 repeated": [[2.0], [2.0]], "gen n=4 shared": [[1.0], [1.25]],
              "prefill n=4 repeated": [[0.4], [0.4]], "prefill n=4 shared": [[0.1], [0.1]]}
    first = {k: 9.0 for k in blocks}
    info = {"model": "m", "prompt_width": 30, "batch": {"4": 8}}
    by_n = shared_prefill.figures(blocks, first, [4], info, new_tokens=5)
    f = by_n["4"]
    assert f["repeated"]["tokens_per_s"]["median"] == pytest.approx(20.0)
    assert f["shared"]["tokens_per_s"]["median"] == pytest.approx(36.0)  # median of 40, 32
    assert f["ratio"] == pytest.approx(2.0 / 1.125) and f["prefill_ratio"] == pytest.approx(4.0)
    assert (f["paired_ratio"]["min"], f["paired_ratio"]["max"]) == pytest.approx((1.6, 2.0))
    text = shared_prefill.markdown({**info, "by_n": by_n, "tiny": False, "prompts": 2,
                                    "new_tokens": 5, "rounds": 2, "identical": True})
    assert "| 4 | 8 | 20.0 | 36.0 (32.0–40.0) | ×1.78 (×1.60–×2.00) | 400 | 100 | ×4.00 |" in text
    assert "Same tokens on both sides under one key: True." in text and "DRY RUN" not in text


@pytest.mark.slow
def test_shared_prefill_tiny_dry_run(tmp_path):
    out = tmp_path / "shared_prefill.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench/shared_prefill.py"), "--tiny", "--prompts", "2",
         "--samples", "2", "4", "--new-tokens", "3", "--rounds", "1", "--json", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:]
    data = json.loads(out.read_text())
    assert data["tiny"] and data["identical"] and data["batch"] == {"2": 4, "4": 8}
    assert all(data["by_n"][n]["ratio"] > 0 for n in ("2", "4"))
    assert "DRY RUN" in data["markdown"] and "Measured " in proc.stdout


# --------------------------------------------------------------------------- decode floor
def test_floor_figures_from_hand_numbers():
    floor = _load("decode_floor")
    times = {"prefill": [0.1, 0.2, 0.1], "generate": [0.7, 0.8, 0.7], "transformers": [1.5] * 3,
             "scan": [0.4, 0.4, 0.5], "unrolled": [0.3, 0.3, 0.3]}
    f = floor.floor_figures(times, new_tokens=4, weight_bytes=6e9, weight_flops=3e9)
    assert f["decode_step_s"] == pytest.approx(0.2)  # (0.7 - 0.1) / 3
    assert f["floor_form"] == "unrolled" and f["floor_step_s"] == pytest.approx(0.1)
    assert f["forms"]["scan"]["fraction_of_decode_step"] == pytest.approx(0.4 / 3 / 0.2)
    assert f["forms"]["unrolled"]["gb_per_s"] == pytest.approx(60.0)
    assert f["forms"]["unrolled"]["gflops_per_s"] == pytest.approx(30.0)
    assert f["decode_gflops_per_s"] == pytest.approx(15.0)
    assert f["ratio_now"] == pytest.approx(1.5 / 0.7)
    assert f["best_case_ratio"] == pytest.approx(1.5 / (0.1 + 3 * 0.1))
    assert f["step_for_2x_s"] == pytest.approx((0.75 - 0.1) / 3)
    assert f["prefill_s"] == {"median": 0.1, "min": 0.1, "max": 0.2, "n": 3}


def test_decode_floor_section_renders(tmp_path):
    floor = _load("decode_floor")
    times = {"prefill": [0.1] * 3, "generate": [1.3] * 3, "transformers": [1.5] * 3,
             "scan": [0.9] * 3, "unrolled": [0.6] * 3}  # steps: ours 0.4 s, floor 0.2 s
    fig = floor.floor_figures(times, new_tokens=4, weight_bytes=538e6, weight_flops=2.2e9)
    data = {"bench": "decode_floor", "model": "m", "dtype": "float32", "batch": 8,
            "prompt_width": 47, "new_tokens": 4, "runs": 3, "weight_bytes": 538e6,
            "weight_flops_per_step": 2.2e9, "torch_threads": 2, **fig, "commit": "abc1234",
            "dirty": False, "command": ".venv/bin/python bench/decode_floor.py --json x"}
    text = floor.markdown(data)
    assert "538 MB read per step, 2.20 GFLOP" in text
    assert "| ppo_jax decode step | — | 400 | — | 5.5 | 100% |" in text
    assert "| weight matmuls alone, layers unrolled (floor) | 600 | 200 | 2.7 | 11.0 | 50% |" in text
    assert "**×2.14**" in text  # 1.5 / (0.1 + 3 x 0.2)
    (tmp_path / "decode_floor.json").write_text(json.dumps({**data, "markdown": text}))
    full = report.render(tmp_path)
    assert "## Decode floor: the sampler's decode step vs its weight matmuls alone" in full
    assert ".venv/bin/python bench/decode_floor.py --json x" in full and text in full


def test_ppo_step_record_counts_real_tokens_alike_on_both_sides():
    """bench/harness.py `ppo_step_record`, shared by ppo_step.py and ppo_step_trl.py: 8 rows x 4
    new tokens, 100 real prompt tokens, 2 epochs; tokens/s of each phase by hand."""
    times = {"time/generation": 2.0, "time/scoring": 3.3, "time/update": 6.6, "time/step": 11.0}
    r = harness.ppo_step_record(times, 32, 100, 2, padded_seq_len=20)
    assert (r["seq_tokens"], r["prompt_tokens"], r["padded_seq_len"]) == (132, 100, 20)
    assert r["tokens_per_s/generation"] == 16.0 and r["tokens_per_s/step"] == 12.0
    assert r["tokens_per_s/scoring"] == pytest.approx(40.0)
    assert r["tokens_per_s/update"] == pytest.approx(40.0)  # 2 epochs x 132 tokens / 6.6 s
    s = harness.ppo_step_summary([r, {**r, "time/step": 13.0, "seq_tokens": 134}])
    assert s["seq_tokens_mean"] == 133 and s["stats"]["time/step"]["median"] == 12.0


def test_finish_prints_the_table_under_the_cpu_and_commit_and_writes_it(tmp_path, capsys):
    data = harness.finish({"x": 2.0}, lambda d: f"| x | {d['x']} |", tmp_path / "b.json")
    written = json.loads((tmp_path / "b.json").read_text())
    assert written["markdown"] == data["markdown"] == capsys.readouterr().out.strip()
    first, table_ = data["markdown"].split("\n\n")
    assert first.startswith(f"Measured {data['date']} on {harness.cpu_line(harness.cpu_info())}")
    assert f"commit `{data['commit']}`" in first and table_ == "| x | 2.0 |"


@pytest.mark.slow
def test_core_and_decode_floor_write_json_report_reads(tmp_path, tiny_checkpoint):
    """bench/core.py (tiny sizes) and bench/decode_floor.py (tiny model) end to end: their JSON
    carries the commit and the figures, and bench/report.py turns both into sections."""
    runs = [[str(ROOT / "bench/core.py"), "--batch", "4", "--length", "16", "--rounds", "2",
             "--torch-block", "1", "--jax-block", "2", "--warmup-s", "0", "--json",
             str(tmp_path / "core.json")],
            [str(ROOT / "bench/decode_floor.py"), "--model-dir", str(tiny_checkpoint), "--batch",
             "2", "--new-tokens", "3", "--runs", "3", "--json", str(tmp_path / "decode_floor.json")]]
    for cmd in runs:
        proc = subprocess.run([sys.executable, *cmd], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
        assert proc.returncode == 0, proc.stdout[-3000:]
    core = json.loads((tmp_path / "core.json").read_text())
    assert core["commit"] and core["jax"][core["default_gae"]]["paired_ratio"]["n"] == 2
    floor = json.loads((tmp_path / "decode_floor.json").read_text())
    assert floor["commit"] == core["commit"] and floor["floor_form"] in ("scan", "unrolled")
    text = report.render(tmp_path)
    assert f"`{core['commit']}`" in text and "per-round ratios" in text
    assert "| ppo_jax decode step |" in text


def test_ceiling_puts_counted_flops_at_the_best_matmul_rate_and_generation_at_the_floor():
    st = lambda x: {"median": x, "min": x, "max": x, "n": 3}  # noqa: E731
    ours = {"config": "jax-shared", "epochs": 1,
            "stats": {"time/step": st(12.0), "time/generation": st(4.0)},
            "model_flops": {"scoring": {"flops": 300e9}, "update": {"flops": 500e9}}}
    trl = {"config": "trl", "epochs": 1, "stats": {"time/step": st(10.0)}}
    roof = {"matmul": {"n": 2048, "gflops_per_s": {"median": 150.0, "min": 100.0, "max": 200.0}}}
    floor = {"floor_step_s": 0.05, "decode_step_s": 0.08}
    text = report.ceiling_markdown({"results": [trl, ours]}, roof, floor)
    # generation 4.0 x 0.05 / 0.08 = 2.5 s; 800 GFLOP at 200 GFLOP/s = 4.0 s; best 6.5 s
    assert "| 1 | 12.0 | 2.50 | 4.00 | 6.50 | 10.0 | ×0.83 | **×1.54** |" in text
    text = report.ceiling_markdown({"results": [trl, ours]}, roof, None)
    assert "| 1 | 12.0 | 4.00 | 4.00 | 8.00 | 10.0 | ×0.83 | **×1.25** |" in text
    assert "_needs" in report.ceiling_markdown({"results": [ours]}, roof, floor)


# --------------------------------------------------------------------------- bench/update_profile.py
update_profile = _load("update_profile")


@pytest.mark.parametrize("name,kind", [
    ("ynn_fusion.27", "matmul"), ("xnn_fusion", "matmul"), ("dot.134", "matmul"),
    ("copy_bitcast_fusion.4", "layout copies"), ("transpose_copy_fusion", "layout copies"),
    ("copy", "layout copies"), ("wrapped_broadcast.12", "layer-scan stacking"),
    ("bitcast_dynamic-update-slice_fusion.10", "layer-scan stacking"),
    ("subtract_dynamic-slice_fusion", "layer-scan stacking"), ("add_divide_fusion", "other"),
    ("ThunkExecutor::Execute", None), ("$api.py:2479 block_until_ready", None),
    ("end: ynn_fusion", None), ("PjitFunction(loss)", None)])
def test_xla_trace_events_are_sorted_by_kind(name, kind):
    assert update_profile.xla_op_kind(name) == kind


def test_torch_ops_are_sorted_by_kind():
    kinds = [update_profile.torch_op_kind(n) for n in ("aten::mm", "aten::bmm", "aten::copy_",
                                                       "aten::fill_", "aten::mul")]
    assert kinds == ["matmul", "matmul", "layout copies", "layout copies", "other"]


def test_op_profile_gives_per_call_time_shares_and_the_largest_ops():
    events = [("dot.1", "matmul", 40.0), ("dot.2", "matmul", 20.0), ("copy", "layout copies", 30.0),
              ("add", "other", 10.0), ("ThunkExecutor", None, 99.0)]
    t = update_profile.op_profile(events, calls=2)
    assert t["total_ms_per_call"] == 50.0
    assert t["kinds"]["matmul"] == {"ms_per_call": 30.0, "share": 0.6}
    assert t["kinds"]["layer-scan stacking"] == {"ms_per_call": 0.0, "share": 0.0}
    assert t["top_ops"][:2] == [["dot.1", 20.0], ["copy", 15.0]]


@pytest.mark.parametrize("side", ["jax", "torch"])
def test_update_profile_workers_time_and_trace_a_tiny_model(side, tiny_checkpoint):
    """Each worker in-process on the tiny model: counted FLOPs, timed calls, and a parsed trace
    whose op time is mostly ops of a known kind (the profiler formats are what we read)."""
    pytest.importorskip("torch") if side == "torch" else None
    worker = update_profile.jax_worker if side == "jax" else update_profile.torch_worker
    args = Namespace(model_dir=str(tiny_checkpoint), batch=2, prompt=5, response=4, calls=2,
                     trace=False)
    timed = worker(args)
    assert timed["flops"] > 0 and len(timed["seconds"]) == 2
    traced = worker(Namespace(**{**vars(args), "trace": True}))
    assert traced["total_ms_per_call"] > 0
    assert traced["kinds"]["matmul"]["ms_per_call"] > 0
    assert abs(sum(k["share"] for k in traced["kinds"].values()) - 1) < 1e-9
    if side == "jax":  # the layers are a lax.scan: its stacking shows up
        assert traced["kinds"]["layer-scan stacking"]["ms_per_call"] > 0


UPDATE_PROFILE = {
    "bench": "update_profile", "tiny": False, "date": "2026-01-01T00:00:00+00:00",
    "cpu": {"model": "Test CPU", "cores": 2, "isa": ["avx2"]}, "model": "m", "batch": 8,
    "prompt": 46, "response": 48, "rounds": 3, "calls": 3, "profile_calls": 2,
    "flags_ab": {"flops": {"jax": 5.6e11, "torch": 6.2e11}, "rows": [
        {"name": "default", "xla_flags": "", "side": "jax",
         "seconds": {"median": 4.0, "min": 3.8, "max": 4.4, "n": 3},
         "first_call_s": {"median": 8.0, "min": 8.0, "max": 8.0, "n": 3},
         "ratio_to_default": {"median": 1.0, "min": 1.0, "max": 1.0, "n": 3}, "gflops_per_s": 140.0},
        {"name": "xnnpack off", "xla_flags": "--xla_cpu_use_xnnpack=false", "side": "jax",
         "seconds": {"median": 4.2, "min": 4.0, "max": 4.5, "n": 3},
         "first_call_s": {"median": 8.0, "min": 8.0, "max": 8.0, "n": 3},
         "ratio_to_default": {"median": 1.05, "min": 0.98, "max": 1.1, "n": 3}, "gflops_per_s": 133.3},
        {"name": "torch", "xla_flags": None, "side": "torch",
         "seconds": {"median": 3.7, "min": 3.5, "max": 3.9, "n": 3},
         "first_call_s": {"median": 4.0, "min": 4.0, "max": 4.0, "n": 3},
         "ratio_to_default": {"median": 0.93, "min": 0.9, "max": 0.95, "n": 3}, "gflops_per_s": 167.6}]},
    "profiles": {s: {"kinds": {k: {"ms_per_call": v, "share": v / 100} for k, v in kinds.items()},
                     "total_ms_per_call": 100.0, "top_ops": [["op", 10.0]]}
                 for s, kinds in (("jax", {"matmul": 58, "layout copies": 16, "layer-scan stacking": 17,
                                           "other": 9}),
                                  ("torch", {"matmul": 75, "layout copies": 5, "layer-scan stacking": 0,
                                             "other": 20}))},
}


def test_update_profile_section_renders():
    text = update_profile.markdown(UPDATE_PROFILE)
    assert "| xnnpack off | `--xla_cpu_use_xnnpack=false` | 4.20 (4.00–4.50) | 1.05 (0.98–1.10) | 133 | 8.0 |" in text
    assert "| torch | PyTorch peer (transformers, eager) | 3.70 (3.50–3.90) | 0.93 (0.90–0.95)" in text
    assert "| layout copies | 16.0 ms (16%) | 5.0 ms (5%) |" in text
    assert "jax 560 GFLOP" in text and "torch 620 GFLOP" in text
    assert "DRY RUN" not in text and "DRY RUN" in update_profile.markdown({**UPDATE_PROFILE, "tiny": True})


@pytest.mark.slow
def test_update_profile_tiny_dry_run(tmp_path):
    out = tmp_path / "update_profile.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench/update_profile.py"), "--tiny", "--batch", "2",
         "--prompt", "5", "--response", "4", "--rounds", "2", "--calls", "1", "--profile-calls", "1",
         "--flags", "default=", "xnnpack off=--xla_cpu_use_xnnpack=false", "--json", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:]
    data = json.loads(out.read_text())
    names = [r["name"] for r in data["flags_ab"]["rows"]]
    assert names == ["default", "xnnpack off", "torch"]
    assert data["flags_ab"]["rows"][0]["ratio_to_default"]["median"] == 1.0
    assert set(data["profiles"]) == {"jax", "torch"} and "Op time per call by kind" in proc.stdout


def test_mixed_commits_with_the_same_measured_code_get_a_note_not_a_warning(tmp_path):
    """Two commits that differ only in a benchmark script measured the same ppo_jax code: a
    note naming the script; a third that changes ppo_jax is the warning."""
    def commit(path, text):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
        _git(tmp_path, "add", ".")
        _git(tmp_path, "commit", "-q", "-m", path)
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path, text=True,
                              capture_output=True, check=True).stdout.strip()

    _git(tmp_path, "init", "-q")
    a = commit("ppo_jax/core.py", "x = 1\n")
    commit("bench/results.md", "a report, not a script\n")
    b = commit("bench/train_run.py", "new benchmark\n")
    c = commit("bench/report.py", "rendering only\n")
    d = commit("ppo_jax/core.py", "x = 2\n")
    raws = {"core": {**CORE, "commit": a}, "train_run": {**CORE, "commit": b}}
    lines = report.provenance_lines(raws, root=tmp_path)
    assert lines[0] == f"Code: core `{a}`, train_run `{b}`."
    assert lines[1].startswith(f"> **Note:** the raw files come from 2 commits (`{a}`, `{b}`) "
                               "that hold the same measured code")
    assert lines[1].endswith("the benchmark scripts that differ: bench/train_run.py.")
    assert "Warning" not in "\n".join(lines)
    only_rendering = report.provenance_lines(
        {"core": {**CORE, "commit": b}, "x": {**CORE, "commit": c}}, root=tmp_path)
    assert only_rendering[1].endswith("the benchmark scripts are the same too.")
    with pytest.raises(SystemExit, match=f"`{a}` vs `{d}`: ppo_jax/core.py"):
        report.provenance_lines({**raws, "gpu": {"commit": d}}, root=tmp_path)  # code changed
    assert report.code_changes(a, d, tmp_path) == (["ppo_jax/core.py"], ["bench/train_run.py"])
    assert report.code_changes(a, "feedbee", tmp_path) is None  # unknown commit


def test_logprob_memory_head_json_and_section(tmp_path):
    """bench/logprob_memory.py on a small head (no whole update, in this process): its JSON and
    results.md section."""
    out = tmp_path / "lm.json"
    logprob_memory.main(["--batch", "2", "--length", "4", "--hidden", "16", "--vocab", "100",
                         "--chunk", "32", "--runs", "1", "--no-update", "--json", str(out)])
    data = json.loads(out.read_text())
    h = data["head"]
    assert (h["batch"], h["length"], h["vocab"], h["chunk"]) == (2, 4, 100, 32)
    # outputs: the loss, d_hidden [2, 4, 16] and d_head [100, 16] float32, plus XLA's tuple tables
    assert h["plain"]["output"] == h["chunked"]["output"]
    assert 0 <= h["plain"]["output"] - (4 + (2 * 4 * 16 + 100 * 16) * 4) <= 64
    assert max(float(x) for x in h["max_abs_diff"].split(", ")) < 1e-5
    ll = data["llama_8b"]
    assert ll["logits_bytes"] == 8 * 256 * 128256 * 4 and ll["block_bytes"] == 8 * 256 * 32 * 4
    assert data["update"]["settings"] == [] and data["cpu"]["model"]
    text = logprob_memory.markdown(data)
    assert "blocks of 32 columns" in text and "1,002 MiB" in text
    assert "The whole PPO update" not in text


def test_logprob_memory_update_section_by_hand():
    mib = 2 ** 20
    data = {"jax": "0.10.2", "runs": 5, "head": {
        "batch": 8, "length": 40, "hidden": 576, "vocab": 49152, "chunk": 4096,
        "plain": {"temp": 240 * mib, "output": 108 * mib, "argument": 109 * mib, "time": 0.85},
        "chunked": {"temp": 33 * mib, "output": 108 * mib, "argument": 109 * mib, "time": 1.02},
        "max_abs_diff": "1e-06"},
        "update": {"config": "configs/default.yaml", "settings": [
            {"chunk": c, "argument": 2000 * mib, "output": 1900 * mib, "alias": 1800 * mib,
             "temp": t * mib, "peak": (2100 + t) * mib, "micro_batch": 8, "mini_batch": 8,
             "batch": 16, "epochs": 2,
             "prompt_width": 52.0, "response_width": 40.0, "shared_critic": False,
             "vocab": 49152} for c, t in ((0, 900), (4096, 400))]},
        "llama_8b": logprob_memory.llama_8b_arithmetic(4096)}
    text = logprob_memory.markdown(data)
    assert "Scratch full / blocks: ×7.3; time blocks / full: ×1.20" in text
    assert "| 0 (full logits) | 2,000.0 | 1,900.0 | 1,800.0 | 900.0 | 3,000.0 |" in text
    assert "| 4096 (blocks) | 2,000.0 | 1,900.0 | 1,800.0 | 400.0 | 2,500.0 |" in text
    assert "2 epochs over the batch of 16 rows in minibatches of 8, micro-batches of 8" in text


@pytest.mark.slow
def test_logprob_memory_whole_update_tiny(tmp_path):
    """The whole-update figures on the tiny config: both settings compiled, same arguments."""
    out = tmp_path / "lm.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench/logprob_memory.py"), "--batch", "2", "--length", "4",
         "--hidden", "16", "--vocab", "100", "--chunk", "32", "--runs", "1",
         "--update-config", "configs/tiny.yaml", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    full, blocks = json.loads(out.read_text())["update"]["settings"]
    assert (full["chunk"], blocks["chunk"]) == (0, 32)
    assert full["argument"] == blocks["argument"] > 0 and full["temp"] > 0
    for u in (full, blocks):
        assert u["peak"] == u["argument"] + u["output"] - u["alias"] + u["temp"]


# --------------------------------------------------------------------------- bench/lora_update.py
lora_update = _load("lora_update")


def test_lora_update_worker_trains_only_adapters_and_its_section_renders(tiny_checkpoint):
    """The worker in-process on the tiny model, full and LoRA: the adapters are the trained
    params, LoRA counts fewer matmul FLOPs (no weight gradients of the base), and the section
    prints both rows and the ratio per round."""
    args = Namespace(model_dir=str(tiny_checkpoint), batch=2, prompt=5, response=4, calls=2,
                     rank=4, layers=0, trace=False, lora=False)
    full, lora = lora_update.jax_worker(args), lora_update.jax_worker(Namespace(**{**vars(args), "lora": True}))
    assert full["variant"] == "full" and lora["variant"] == "lora"
    assert len(full["seconds"]) == 2 and len(lora["forward_s"]) == 2
    assert 0 < lora["trained_params"] < full["trained_params"] / 2
    assert 0 < lora["flops"] < full["flops"]
    prof = {"kinds": {k: {"ms_per_call": 10.0, "share": 0.25} for k in update_profile.KINDS}}
    st = lambda x: {"median": x, "min": x, "max": x, "n": 1}  # noqa: E731
    model = {"model": "m", "layers": 4, "ratio": st(0.8),
             **{v: {"seconds": st(s), "forward_s": st(s / 3), "flops": 1e9 * s,
                    "trained_params": n, "profile": prof}
                for v, s, n in (("full", 2.0, 1e8), ("lora", 1.6, 4e6))}}
    text = lora_update.markdown({"tiny": False, "rank": 16, "batch": 8, "prompt": 46, "response": 48,
                                 "rounds": 3, "calls": 3, "profile_calls": 2, "models": [model]})
    assert "| m (4 layers) | lora | 4.00M | 1.60 | 0.53 | 1.6 | 10.0 | 30.0 |" in text
    assert "| m (4 layers) | 0.80 | 0.80 | 1.00 |" in text


@pytest.mark.slow
def test_engine_bench_runs_on_the_tiny_model(tmp_path):
    """bench/engine.py --tiny: both sides draw the same tokens (the script checks it) and the
    table holds each workload's ratio."""
    out = tmp_path / "engine.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench/engine.py"), "--tiny", "--rounds", "1",
                           "--responses", "16", "--rows", "4", "--slots", "4", "8", "--new-tokens", "24",
                           "--workload", "heavy", "default", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PPO_JAX_MALLOC_TUNING": "0"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    heavy = data["workloads"]["heavy"]
    assert heavy["batch"] == 16 and heavy["useful_tokens"] > 0
    assert {e["slots"] for e in heavy["engines"].values()} == {4, 8}
    assert heavy["engines"]["paged 4"]["steps"] >= heavy["useful_tokens"] // 4 / 2
    assert "paged / static" in data["markdown"]
