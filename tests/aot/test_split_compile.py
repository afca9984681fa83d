"""`--compile-for` with `generation.placement: split` (issue 57): the sampler's programs on the
rollout group's chips, the trainer's on the others, and the weight sync as a transfer row whose
bytes are the actor's params in the rollout dtype, estimated over the chip's ICI bandwidth."""

from __future__ import annotations

import math
from pathlib import Path

import jax
import pytest

pytest.importorskip("libtpu")

from ppo_jax.aot.compile_for import devices_of, step_figures, transfer_rows  # noqa: E402
from ppo_jax.aot.topology import resolve_slice, slice_devices  # noqa: E402
from ppo_jax.trainer.config import load_config  # noqa: E402
from ppo_jax.trainer.stages.ppo.trainer import PPOTrainer  # noqa: E402
from tests.aot.test_compile_for import compile_for  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SPLIT = ["generation.placement=split", "generation.rollout_devices=2",
         "generation.param_dtype=bfloat16", "ppo.batch_size=4", "eval.every=2"]


def abstract(tmp_path, *sets):
    cfg = load_config(ROOT / "configs/tiny.yaml", [f"train.output_dir={tmp_path / 'run'}",
                                                   *SPLIT, *sets])
    return PPOTrainer.abstract(cfg, slice_devices(resolve_slice("v5p-8")))


def param_bytes(tree, itemsize: int) -> int:
    return sum(math.prod(x.shape) * itemsize for x in jax.tree.leaves(tree))


def test_programs_compile_on_their_own_group_and_the_sync_moves_the_bf16_actor(tmp_path):
    """v5p-8 (4 chips) split 2 + 2: the sampler's programs take the rollout chips only, the
    trainer's the others; the sync row moves the actor's params once in bfloat16."""
    trainer = abstract(tmp_path, "mesh.data=2")
    groups = {p.name: {d.id for d in devices_of(p.args)} for p in trainer.programs()}
    rollout = {d.id for d in trainer.rollout_place.mesh.devices.flat}
    assert len(rollout) == 2 and groups["sampler"] == groups["eval_sampler"] == rollout
    for name in ("rollout_copy", "experience", "update", "eval_forward"):
        assert groups[name] and not groups[name] & rollout, name
    (sync,) = trainer.transfers()
    actor = param_bytes(trainer.state["actor"].params, 2)
    assert sync["name"] == "weight_sync" and sync["bytes"] == actor == sync["receiver_bytes"]
    s = resolve_slice("v5p-8")
    row = transfer_rows([sync], s)["weight_sync"]
    assert row["seconds_estimate"] == actor / s.chip.ici_bandwidth and "estimate" in row["label"]
    programs = {"update": {"calls_per_step": 1.0, "seconds_estimate": 2.0, "flops": 0.0}}
    assert step_figures(programs, {}, s, {"weight_sync": row})["seconds_estimate"] == \
        2.0 + row["seconds_estimate"]


def test_a_tensor_split_copy_sends_each_rollout_chip_its_half(tmp_path):
    """mesh.tensor=2: the rollout mesh is 1x1x2; each rollout chip receives the weights split
    over tensor (the split matrices halved, norms whole), and the LoRA base's row is a
    one-time transfer."""
    trainer = abstract(tmp_path, "mesh.data=1", "mesh.tensor=2", "ppo.batch_size=4",
                       "model.lora.rank=4")
    assert dict(trainer.rollout_place.mesh.shape) == {"data": 1, "fsdp": 1, "tensor": 2}
    rows = {t["name"]: t for t in trainer.transfers()}
    assert rows["weight_sync"]["per_step"] == 1.0 and rows["weight_sync_base"]["per_step"] == 0.0
    assert rows["weight_sync"]["bytes"] == param_bytes(trainer.state["actor"].params, 2)
    base = rows["weight_sync_base"]
    assert base["bytes"] == param_bytes(trainer.frozen["actor"], 2)
    assert base["bytes"] / 2 < base["receiver_bytes"] < base["bytes"]


@pytest.mark.slow  # a libtpu compile of the tiny run's programs (about a minute on 2 cores)
def test_the_report_has_the_transfer_row_and_counts_it_in_the_step(tmp_path):
    proc, report = compile_for("v5p-8", tmp_path, *SPLIT, "mesh.data=2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert report["mesh"]["data"] == 2 and report["rollout_mesh"]["data"] == 2
    sync = report["transfers"]["weight_sync"]
    trainer = abstract(tmp_path, "mesh.data=2")
    assert sync["bytes"] == param_bytes(trainer.state["actor"].params, 2)
    programs = report["programs"]
    seconds = sum(r["calls_per_step"] * r["seconds_estimate"] for r in programs.values())
    assert report["step"]["seconds_estimate"] == pytest.approx(seconds + sync["seconds_estimate"])
    # the sampler's chips hold the rollout copy, not the train states the update's chips hold
    assert programs["sampler"]["chips"] == programs["update"]["chips"] == 2
    assert programs["sampler"]["resident_bytes"] < programs["experience"]["resident_bytes"]
    assert "weight_sync" in proc.stdout and "estimate" in proc.stdout


def test_a_multi_host_slice_gives_each_host_chips_of_both_groups(tmp_path):
    """v5p-64 (32 chips, 8 hosts of 4), 16 rollout chips: every host gives 2 chips to each
    group; the trainer's mesh 4x2x2 and the rollout mesh 8x1x2 lay out their own chips (jax
    builds no torus mesh for part of a slice: `parallel.make_mesh` keeps the given order), and
    each host's rows and weight shards are its own in both (checked at build)."""
    cfg = load_config(ROOT / "configs/tiny.yaml", [
        f"train.output_dir={tmp_path / 'run'}", "generation.placement=split",
        "generation.rollout_devices=16", "mesh.data=4", "mesh.fsdp=2", "mesh.tensor=2",
        "ppo.batch_size=16", "ppo.mini_batch_size=8", "ppo.micro_batch_size=2"])
    trainer = PPOTrainer.abstract(cfg, slice_devices(resolve_slice("v5p-64")))
    for place in (trainer.place, trainer.rollout_place):
        hosts = [d.process_index for d in place.mesh.devices.flat]
        assert sorted(hosts) == sorted(list(range(8)) * 2), hosts
    assert dict(trainer.rollout_place.mesh.shape) == {"data": 8, "fsdp": 1, "tensor": 2}
    assert not ({d.id for d in trainer.place.mesh.devices.flat}
                & {d.id for d in trainer.rollout_place.mesh.devices.flat})
