"""Issue 57, the split placement with staleness 0: the sampler on a rollout group of its own,
the weights sent there after every update, gives the colocated run's steps (8 CPU devices,
4 + 4), with the static sampler and the paged engine, a LoRA actor, a bfloat16 rollout copy and
two processes. One split run on the default test path shares the subprocess of
`test_sharded_step.test_ppo_step_on_2x2x2_mesh_and_on_a_4_plus_4_split_equals_one_device`.
"""

from __future__ import annotations

import pytest

from tests.parallel.sharded_run import run_name
from tests.parallel.test_sharded_step import (
    ENGINE_FIGURES, PAGED, PROCESS_TOL, actor_bytes, assert_same_run, finish, free_port, launch,
    load, without_sync,
)

COLOCATED, SPLIT = (2, 2, 2), (1, 2, 2, 4)  # 8 devices; the trainer's 4 + the rollout group's 4


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.mark.slow  # two runs of 3 steps with evaluations, checkpoints and the HF export
def test_three_split_steps_with_evaluations_equal_the_colocated_run(tmp_path, cache):
    """The acceptance test: 3 steps of `train()` (the held-out evaluation after every step,
    sampled on the rollout group) split 4 + 4 give the metrics and params of the same run
    colocated on all 8 devices."""
    out = tmp_path / "runs"
    finish(launch(out, [COLOCATED, SPLIT], devices=8, steps=3, loop="train", cache=cache))
    want = load(out, COLOCATED)
    got = without_sync(load(out, SPLIT), want[1])
    assert_same_run(got, want, "split 4 + 4, 3 steps")
    assert len(want[0]["metrics"]) == 3
    assert all("eval/reward_mean" in m for m in want[0]["metrics"])  # compared above
    assert (out / f"run_{run_name(SPLIT)}" / "actor_hf").is_dir()


@pytest.mark.slow
def test_the_paged_engine_on_a_rollout_group_equals_colocated(tmp_path, cache):
    """The paged engine's 2 replicas on the rollout group (mesh 2x1x2, KV heads over tensor)
    give the colocated engine's step on 4 replicas."""
    out = tmp_path / "runs"
    finish(launch(out, [COLOCATED, SPLIT], devices=8, steps=2, cache=cache, extra=PAGED))
    want = load(out, COLOCATED)
    assert_same_run(without_sync(load(out, SPLIT), want[1]), want, "split paged engine",
                    skip=ENGINE_FIGURES)
    assert want[0]["metrics"][0]["rollout/prefills"] >= 1


@pytest.mark.slow
def test_a_lora_actor_sends_its_adapters_after_each_update(tmp_path, cache):
    """LoRA: the frozen base goes to the rollout group once, with the first sync; each update
    sends the adapters alone (`weights/sync_bytes` = the trained params' bytes)."""
    out = tmp_path / "runs"
    lora = ["--set", "model.lora.rank=4", "--set", "optim.actor_lr=1e-2"]
    finish(launch(out, [COLOCATED, SPLIT], devices=8, steps=2, cache=cache, extra=lora))
    want = load(out, COLOCATED)
    assert all(k.rsplit("/", 1)[-1] in ("lora_a", "lora_b") for k in want[1]
               if k.startswith("actor/"))  # the saved actor params are the adapters
    assert_same_run(without_sync(load(out, SPLIT), want[1]), want, "split LoRA")


@pytest.mark.slow
def test_a_bfloat16_rollout_copy_moves_half_the_bytes(tmp_path, cache):
    """`generation.param_dtype: bfloat16`: the trainer casts before sending, so half the bytes
    of the float32 params move, and the step equals the colocated one with the same copy."""
    out = tmp_path / "runs"
    bf16 = ["--set", "generation.param_dtype=bfloat16"]
    finish(launch(out, [COLOCATED, SPLIT], devices=8, steps=2, cache=cache, extra=bf16))
    want = load(out, COLOCATED)
    got = without_sync(load(out, SPLIT), want[1], itemsize=2)
    assert_same_run(got, want, "split bfloat16 copy")
    assert actor_bytes(want[1], 2) * 2 == actor_bytes(want[1])


@pytest.mark.slow
def test_two_processes_each_holding_both_groups_equal_one_process(tmp_path, cache):
    """Two processes of 4 devices, each giving 2 to the trainer (mesh 1x2x2: fsdp across the
    processes) and 2 to the rollout group (mesh 2x1x2: a data replica per process): the weight
    sync and the rollout's rows stay inside each process; two steps equal one process on one
    device."""
    multi, single = tmp_path / "multi", tmp_path / "single"
    coordinator = f"localhost:{free_port()}"
    procs = [launch(multi, [SPLIT], devices=4, steps=2, cache=cache,
                    process=(coordinator, 2, i)) for i in range(2)]
    ref = launch(single, [(1, 1, 1)], devices=1, steps=2, cache=cache)
    for p in (*procs, ref):
        finish(p)
    want = load(single, (1, 1, 1))
    got = without_sync(load(multi, SPLIT), want[1])
    assert got[0]["processes"] == 2
    assert_same_run(got, want, "two processes, split", param_atol=PROCESS_TOL)
