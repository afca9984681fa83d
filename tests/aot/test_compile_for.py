"""`train.py --compile-for`: every program of a run compiled for a TPU slice on this CPU, with
per-chip memory, FLOPs with trip counts, collectives and estimated time (issue 22).

Each run is a subprocess, as a user runs it (libtpu starts once per process)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("libtpu")
ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs/tiny.yaml")
KEYS = {"topology", "chips", "hosts", "chip_kind", "hbm_bytes_per_chip", "fits",
        "libtpu_version", "programs", "step"}
PROGRAM_KEYS = {"argument_bytes", "output_bytes", "temp_bytes", "peak_bytes", "fits",
                "calls_per_step", "flops", "seconds_estimate", "collectives"}


def compile_for(topology: str, tmp_path: Path, *sets: str, config: str = TINY):
    tmp_path.mkdir(parents=True, exist_ok=True)
    out = tmp_path / "report.json"
    cmd = [sys.executable, str(ROOT / "train.py"), "--config", config, "--compile-for", topology,
           "--json", str(out), *sum((["--set", s] for s in sets), [])]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    report = json.loads(out.read_text()) if out.is_file() else None
    return proc, report


@pytest.fixture(scope="module")
def tiny_v5e8(tmp_path_factory):
    """The tiny config on v5e-8 with one row per chip in every micro-batch (mesh data=8), so no
    chip repeats another's matmuls and per-chip FLOPs x 8 is the whole program's."""
    tmp = tmp_path_factory.mktemp("tiny")
    return compile_for("v5e-8", tmp, "mesh.data=8", "ppo.batch_size=8", "ppo.mini_batch_size=8",
                       "ppo.micro_batch_size=8", "eval.every=2")


def test_tiny_config_compiles_for_v5e8_and_fits(tiny_v5e8):
    proc, report = tiny_v5e8
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert KEYS <= set(report) and report["fits"] is True
    assert (report["topology"], report["chips"], report["chip_kind"]) == ("v5e-8", 8, "v5e")
    assert set(report["programs"]) == {"sampler", "experience", "update", "eval_sampler",
                                       "eval_forward"}
    for name, row in report["programs"].items():
        assert PROGRAM_KEYS <= set(row), name
        assert row["fits"] and 0 < row["peak_bytes"] <= report["hbm_bytes_per_chip"]
        assert row["seconds_estimate"] > 0 and row["flops"] > 0
    assert report["programs"]["eval_sampler"]["calls_per_step"] == 0.5  # eval.every=2
    assert {"seconds_estimate", "model_flops", "mfu_estimate"} <= set(report["step"])
    assert f"with libtpu {report['libtpu_version']}, not run" in proc.stdout


def test_update_flops_with_trip_counts_equal_the_model_flop_count(tiny_v5e8):
    """Per-chip matmul FLOPs read from the compiled TPU program, loop trip counts applied, x 8
    chips == the project's jaxpr count of the same update (`aot.flops`), within 5%."""
    _, report = tiny_v5e8
    for name in ("update", "experience"):
        row = report["programs"][name]
        assert row["matmul_flops"] * report["chips"] == pytest.approx(row["model_flops"], rel=0.05)
    # one row per chip: XLA writes the decode step's matrix-vector products as multiply +
    # reduce, counted in `flops` (with the elementwise work), not in `matmul_flops`
    sampler = report["programs"]["sampler"]
    assert 1.0 <= sampler["flops"] * report["chips"] / sampler["model_flops"] < 1.15
    assert 2 in report["programs"]["update"]["loops"]  # the 2 epochs and 2 layers, at least


def test_update_arguments_are_the_train_states_sharded(tiny_v5e8):
    """The update's arguments per chip: actor and critic params with their two Adam moments
    (float32: 4 + 8 bytes a param) split over the 8 chips where the rules shard them, plus the
    experience; the frozen reference is resident but not an argument."""
    _, report = tiny_v5e8
    update = report["programs"]["update"]
    assert update["alias_bytes"] > 0  # the train states are donated
    assert update["resident_bytes"] > 0  # reference params held while the update runs
    assert update["argument_bytes"] > update["resident_bytes"]


def test_a_program_too_large_for_its_chip_exits_3_naming_it(tmp_path):
    """SFT of a 2-layer model with a 16M-token vocabulary on one v5e chip: 4 GiB of embedding,
    12 GiB with its Adam moments, and the update's gradient on top: more than the chip's
    15.75 GiB."""
    shape = tmp_path / "wide-vocab"
    shape.mkdir()
    shape.joinpath("config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 2 ** 24, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
        "eos_token_id": 1, "pad_token_id": 0}))
    proc, report = compile_for("v5e-1", tmp_path, f"model.actor={shape}", "sft.max_length=64",
                               "data.max_prompt_length=32", config=str(ROOT / "configs/sft.yaml"))
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert report["fits"] is False and not report["programs"]["update"]["fits"]
    assert PROGRAM_KEYS <= set(report["programs"]["update"])  # None where the compiler stopped
    assert report["step"]["model_flops"] > 0 and report["step"]["seconds_estimate"] is None
    message = proc.stderr.split("error: ")[-1]
    assert "update needs" in message and "GiB over the 15.75 GiB of a v5e chip" in message
    for key in ("mesh.fsdp", "sft.micro_batch_size", "sft.max_length", "model.remat",
                "model.logprob_chunk_size"):
        assert key in message
    assert "ppo." not in message  # the advice is the stage's own


def test_the_advice_of_a_ppo_run_that_does_not_fit_names_its_memory_keys():
    from ppo_jax.aot.compile_for import over_message

    report = {"hbm_bytes_per_chip": 2 ** 30, "chip_kind": "v5e", "topology": "v5e-8",
              "stage": "ppo", "label": "compiled for v5e-8 with libtpu X, not run",
              "programs": {"update": {"fits": False, "peak_bytes": 3 * 2 ** 30,
                                      "argument_bytes": 2 ** 30, "temp_bytes": 2 ** 30,
                                      "resident_bytes": 2 ** 30}}}
    message = over_message(report)
    assert "update needs 3.00 GiB per chip, 2.00 GiB over the 1.00 GiB of a v5e chip" in message
    for key in ("mesh.fsdp", "ppo.micro_batch_size", "model.remat", "model.frozen_param_dtype",
                "model.offload_frozen", "model.logprob_chunk_size"):
        assert key in message


def test_a_json_path_that_cannot_be_written_is_refused_before_compiling(tmp_path):
    cmd = [sys.executable, str(ROOT / "train.py"), "--config", TINY, "--compile-for", "v5e-8"]
    missing = subprocess.run(cmd + ["--json", str(tmp_path / "no" / "r.json")], cwd=tmp_path,
                             capture_output=True, text=True, timeout=300)
    assert missing.returncode == 2 and "--json" in missing.stderr
    assert "compiling" not in missing.stderr and not (tmp_path / "no").exists()
    alone = subprocess.run([sys.executable, str(ROOT / "train.py"), "--config", TINY, "--json",
                            str(tmp_path / "r.json")], cwd=tmp_path, capture_output=True,
                           text=True, timeout=300)
    assert alone.returncode == 2 and "--json goes with --compile-for" in alone.stderr


def test_an_unknown_topology_exits_2(tmp_path):
    """(test_topology.py checks the names; this is the exit code.)"""
    proc, report = compile_for("v9z-8", tmp_path)
    assert proc.returncode == 2 and report is None
    assert "unknown TPU" in proc.stderr and "v5p-128" in proc.stderr


def test_a_mesh_that_does_not_fit_the_slice_is_a_config_error():
    from ppo_jax.aot.topology import resolve_slice, slice_devices
    from ppo_jax.trainer.config import ConfigError, load_config
    from ppo_jax.trainer.stages.ppo.trainer import PPOTrainer

    devices = slice_devices(resolve_slice("v5e-8"))
    with pytest.raises(ConfigError, match="mesh: .*8"):
        PPOTrainer.abstract(load_config(TINY, ["mesh.data=3"]), devices)
    with pytest.raises(ConfigError, match="ppo.batch_size=4 is not a multiple of the mesh.s batch shards"):
        PPOTrainer.abstract(load_config(TINY, []), devices)


def test_sft_and_reward_model_compile_their_update(tmp_path):
    for stage, config in (("sft", "configs/sft.yaml"),
                          ("reward_model", "configs/reward_model.yaml")):
        proc, report = compile_for("v5e-8", tmp_path, "model.actor=tiny-random",
                                   "model.reward_model=tiny-random", f"{stage}.batch_size=8",
                                   f"{stage}.micro_batch_size=8", f"{stage}.max_length=64",
                                   "data.max_prompt_length=32", config=str(ROOT / config))
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert report["stage"] == stage and set(report["programs"]) == {"update", "eval"}
        assert report["programs"]["update"]["matmul_flops"] > 0
        assert report["programs"]["update"]["collectives"]["all-reduce"]["count"] > 0  # gradients


def test_an_8_gpu_node_compiles_without_a_gpu(tmp_path):
    """The CUDA PJRT plugin compiles for an H100 target config on this CPU host (the gpu-aot
    extra; skipped without it). Memory analysis comes from the compiler; FLOPs, bytes and
    collectives from the HLO walk, as on TPU."""
    pytest.importorskip("jax_plugins.xla_cuda12")
    proc, report = compile_for("h100-8", tmp_path, "mesh.data=8", "ppo.batch_size=8",
                               "ppo.mini_batch_size=8", "ppo.micro_batch_size=8")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (report["chip_kind"], report["chips"], report["hosts"]) == ("h100", 8, 1)
    assert report["hbm_bytes_per_chip"] == pytest.approx(0.75 * 84978434048)
    update = report["programs"]["update"]
    assert update["matmul_flops"] * 8 == pytest.approx(update["model_flops"], rel=0.05)
    assert "jax-cuda12-pjrt" in report["label"] and report["libtpu_version"] is None


def test_sizes_print_without_an_exponent():
    from ppo_jax.aot.compile_for import _size

    assert [_size(x) for x in (None, 512, 1536, 1010 * 2 ** 10, 38.2 * 2 ** 20, 5.83 * 2 ** 30)] == \
        ["-", "512", "1.5K", "1010K", "38.2M", "5.83G"]


def test_the_paged_engine_compiles_for_a_slice_and_decodes_without_gathering_weights(tmp_path):
    """generation.engine=paged on v5e-8 (2 replicas x fsdp 4): the rollout copy, the engine's
    prefill and decode chunk compile and fit; the copy is the sampling's only weight gather
    (one copy per step), the decode chunk gathers nothing; the chunk's calls per step are the
    upper bound (every response max_new_tokens long)."""
    proc, report = compile_for("v5e-8", tmp_path, "mesh.data=2", "mesh.fsdp=4",
                               "ppo.batch_size=8", "ppo.mini_batch_size=8",
                               "ppo.micro_batch_size=8", "eval.every=0",
                               "generation.engine=paged", "generation.page_size=8",
                               "generation.decode_chunk=4")
    assert proc.returncode == 0, proc.stderr[-2000:]
    programs = report["programs"]
    assert {"rollout_copy", "engine_prefill", "engine_decode"} <= set(programs)
    assert "sampler" not in programs and all(p["fits"] for p in programs.values())
    assert programs["rollout_copy"]["collectives"]["all-gather"]["bytes"] > 0
    assert programs["engine_decode"]["collectives"]["all-gather"]["bytes"] == 0
    assert programs["engine_decode"]["calls_per_step"] == 2  # ceil((8 - 1) / 4), one round


@pytest.mark.slow  # two compiles of the tiny run (~1 min each on 2 cores)
def test_packed_programs_compile_with_fewer_flops_than_padded(tmp_path):
    """`ppo.packing` under --compile-for: the experience pass and the update compile over the
    packed rows of a heavy-tailed batch (`stages.ppo.packing.abstract_plans`, responses of mean
    / max 0.5), each micro-batch of 16 on 2 batch shards of 8 rows; both programs count fewer
    FLOPs than the padded ones, the sampler the same."""
    sets = ("generation.max_new_tokens=128", "data.max_prompt_length=16", "ppo.batch_size=16",
            "ppo.mini_batch_size=16", "ppo.micro_batch_size=16", "mesh.data=2", "mesh.tensor=4",
            "eval.every=0")
    (p0, padded), (p1, packed) = (compile_for("v5e-8", tmp_path / name, f"ppo.packing={on}", *sets)
                                  for name, on in (("padded", "false"), ("packed", "true")))
    assert p0.returncode == 0 and p1.returncode == 0, (p0.stderr + p1.stderr)[-2000:]
    flops = {name: {k: r["programs"][k]["flops"] for k in ("sampler", "experience", "update")}
             for name, r in (("padded", padded), ("packed", packed))}
    assert flops["packed"]["sampler"] == flops["padded"]["sampler"]
    for k in ("experience", "update"):
        assert flops["packed"][k] < 0.9 * flops["padded"][k], (k, flops)
