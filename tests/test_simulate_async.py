"""scripts/simulate_async.py: the simulator's cost model read from `--compile-for` reports."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from ppo_jax.aot.async_sim import BatchShape

ROOT = Path(__file__).resolve().parents[1]
SHAPE = BatchShape(groups=64, group_size=8, prompt_width=256, max_new_tokens=4096)


def _script():
    spec = importlib.util.spec_from_file_location("simulate_async",
                                                  ROOT / "scripts/simulate_async.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _report(chips, decode, prefill, experience, update, copy=0.2):
    def prog(seconds, flops=1e15, out=2 * 2 ** 30):
        return {"seconds_estimate": seconds, "model_flops": flops, "output_bytes": out}

    return {"chips": chips, "mesh": {"data": 1, "fsdp": chips // 8, "tensor": 8},
            "chip_kind": "v5p", "peak_bf16_flops": 459e12,
            "programs": {"engine_decode": prog(decode), "engine_prefill": prog(prefill),
                         "experience": prog(experience), "update": prog(update),
                         "rollout_copy": prog(copy)}}


REPORTS = {32: _report(32, 0.1, 0.4, 10.0, 20.0), 16: _report(16, 0.2, 0.8, 20.0, 40.0),
           8: _report(8, 0.4, 1.6, 40.0, 80.0)}


def test_a_rollout_group_reads_the_report_with_as_many_slots_per_replica():
    s = _script()
    # 16 chips: 2 replicas of 256 slots, the 16-chip report's own figures; prefill per group:
    # one call admits 512 / 8 = 64 groups
    cost = s.rollout_cost(REPORTS, SHAPE, 16, decode_fixed=1.0, k=8)
    assert (cost.slots, cost.decode_seconds[-1][1]) == (512, 0.2)
    assert cost.prefill_seconds_per_group == pytest.approx(0.8 / 64)
    # 24 chips: 3 replicas of 168 slots (21 groups), between the 128 (32-chip report) and 256
    # (16-chip report) slots a replica: 0.1 + (168 - 128) / 128 x 0.1
    cost = s.rollout_cost(REPORTS, SHAPE, 24, decode_fixed=0.6, k=8)
    assert cost.slots == 504
    assert cost.decode_seconds == ((0.0, pytest.approx(0.6 * 0.13125)),
                                   (1.0, pytest.approx(0.13125)))


def test_a_trainer_group_between_two_reports_interpolates_the_chips_rates():
    s = _script()
    # 24 chips between 16 (t = 20 s) and 32 (10 s): rate (1/20 + 1/10) / 2 -> 13.33 s
    cost = s.trainer_cost(REPORTS, 24, rollout_chips=8)
    assert cost.experience_seconds == pytest.approx(1 / ((1 / 20 + 1 / 10) / 2))
    assert s.trainer_cost(REPORTS, 16, 16).update_seconds == 40.0
    # weights: the rollout copy (0.2 s at 16 and 32 chips) plus 2 GiB a rollout chip received
    # at 600 GB/s, 1 replica's 16 GiB over 24 sending chips being less per chip
    assert cost.weight_sync_seconds == pytest.approx(0.2 + 2 * 2 ** 30 / 600e9)
    assert s.trainer_cost(REPORTS, 32, 0).weight_sync_seconds == 0.2  # colocated: the copy


def test_rlvr_steps_split_the_mean_into_ended_and_cut(tmp_path):
    s = _script()
    rows = [{"step": 0, "eval/response_length": 9.0},
            {"step": 1, "response_length": 10.0, "ended_fraction": 0.75},  # 25% cut at 16
            {"step": 2, "response_length": 16.0, "ended_fraction": 0.0}]
    path = tmp_path / "m.metrics.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    steps = s.rlvr_steps([path], budget=16)
    # ended ones: (10 - 0.25 x 16) / 0.75 = 8 tokens, half the budget
    assert steps[0] == (pytest.approx(0.5), 0.25)
    assert steps[1][1] == 1.0 and len(steps) == 2
