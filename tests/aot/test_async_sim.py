"""The async-RL simulator (`aot.async_sim`, issue 57) on cases small enough to follow by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ppo_jax.aot.async_sim import (
    SYNCHRONOUS, BatchShape, FlopModel, RolloutCost, Schedule, TrainerCost, simulate,
)
from ppo_jax.aot.response_lengths import (
    fixed_lengths, lognormal_lengths, step_mixture_lengths, truncated_exponential_rate,
)


def _two_slots(prefill=0.5, chunk=1.0):
    """2 slots, one sample per group, 1 token per chunk."""
    return RolloutCost(chips=1, slots=2, decode_chunk=1, decode_seconds=((1.0, chunk),),
                       prefill_seconds_per_group=prefill)


def test_synchronous_step_is_prefill_decode_then_train():
    # a batch = 2 groups of 1 sample, every response 3 tokens: prefill 2 x 0.5 (the first
    # token), 2 chunks of 1 s for the other two, then experience 1 + update 2 + weights 0.5
    shape = BatchShape(groups=2, group_size=1, prompt_width=1, max_new_tokens=3,
                       response_buckets=1)
    trainer = TrainerCost(chips=1, experience_seconds=1.0, update_seconds=2.0,
                          weight_sync_seconds=0.5)
    out = simulate(_two_slots(), trainer, SYNCHRONOUS, shape, fixed_lengths([3]), updates=6,
                   warmup=1)
    assert out.update_ends == pytest.approx([6.0, 12.5, 19.0, 25.5, 32.0, 38.5])
    assert out.step_seconds == pytest.approx(6.5)
    assert out.staleness == {0: 1.0}
    assert out.tokens_per_step == 6 and out.tokens_per_s_per_chip == pytest.approx(6 / 6.5)
    assert out.rollout_busy == pytest.approx(1 - 0.5 / 6.5)  # idle only for the weights


def test_staleness_one_overlaps_sampling_with_the_update():
    # the same costs on two chips, one per side: the rollout samples batch u + 1 (3 s) while
    # the trainer runs update u (3 s + 0.5 s of weights), so the trainer sets the pace: an
    # update every 3.5 s, each on groups one version behind
    shape = BatchShape(groups=2, group_size=1, prompt_width=1, max_new_tokens=3,
                       response_buckets=1)
    trainer = TrainerCost(chips=1, experience_seconds=1.0, update_seconds=2.0,
                          weight_sync_seconds=0.5)
    for partial in (False, True):
        out = simulate(_two_slots(), trainer, Schedule(1, partial), shape, fixed_lengths([3]),
                       updates=6, warmup=1)
        assert out.update_ends == pytest.approx([6.0, 9.5, 13.0, 16.5, 20.0, 23.5])
        assert out.step_seconds == pytest.approx(3.5)
        assert out.staleness == {1: 1.0} and out.refused_fraction == 0
        assert out.tokens_per_s_per_chip == pytest.approx(6 / 3.5 / 2)
        assert out.rollout_busy == pytest.approx(3 / 3.5)
        assert out.trainer_busy == pytest.approx(3 / 3.5)


def _long_short(schedule, recompute=0.0):
    # 2 slots, one-sample groups, one group per update; lengths 4, 2, 4, 2, ...; chunk 1 s,
    # free prefill, update 1 s, weights at once
    shape = BatchShape(groups=1, group_size=1, prompt_width=1, max_new_tokens=4,
                       response_buckets=1)
    trainer = TrainerCost(chips=1, experience_seconds=0.0, update_seconds=1.0,
                          weight_sync_seconds=0.0)
    rollout = RolloutCost(chips=1, slots=2, decode_chunk=1, decode_seconds=((1.0, 1.0),),
                          prefill_seconds_per_group=0.0, recompute_seconds_per_token=recompute)
    return simulate(rollout, trainer, schedule, shape, fixed_lengths([4, 2]), updates=6,
                    warmup=2)


def test_partial_rollouts_take_weights_at_the_next_chunk():
    # t=0 g0 (4) and g1 (2) start under v0; g1 ends at 1 -> update 0 [1, 2]; at 2 the engine
    # takes v1 with g0 in flight and starts g2 (4, v1); g0 ends at 3 -> update 1 [3, 4]; v2 at
    # 4 starts g3 (2); g2 and g3 end at 5 -> update 2 [5, 6] on g2 (oldest first), update 3
    # [6, 7] on g3; g4 (4, v3) and g5 (2, v4) start at 6 and 7, g5 ends at 8 -> update 4
    # [8, 9]; g4 ends at 9, 5 - 3 = 2 versions behind update 5: refused; g7 (v5) -> [10, 11]
    out = _long_short(Schedule(1, partial_rollouts=True))
    assert out.update_ends == pytest.approx([2.0, 4.0, 6.0, 7.0, 9.0, 11.0])
    assert out.max_span == 1  # g2: started under v1, ended under v2
    assert out.refused_fraction > 0


def test_recomputing_the_kv_at_a_swap_costs_the_in_flight_context():
    # as above, but a swap re-prefills each in-flight sequence (prompt 1 + 3 tokens at 0.5 s):
    # v1 at 2 finds g0 in flight -> 2 s, g2 starts at 4, g0 ends at 5 -> update 1 [5, 6]; v2
    # at 6 finds g2 with 3 tokens -> 2 s, g3 starts at 8, both end at 9 -> updates [9, 10],
    # [10, 11]
    out = _long_short(Schedule(1, partial_rollouts=True), recompute=0.5)
    assert out.update_ends[:4] == pytest.approx([2.0, 6.0, 10.0, 11.0])


def test_without_partial_rollouts_the_engine_drains_before_new_weights():
    # as above until 2: v1 is published with g0 in flight, so nothing is admitted until g0
    # ends at 3; the engine then takes v1, starts g2 (4); v2 (at 4) waits for g2 to end at 6,
    # update 2 [6, 7] on it; v2 starts g3 (2) -> update 3 [7, 8]; g4 (4, v3) drains to 10
    out = _long_short(Schedule(1, partial_rollouts=False))
    assert out.update_ends == pytest.approx([2.0, 4.0, 7.0, 8.0, 11.0, 12.0])
    assert out.max_span == 0 and out.refused_fraction == 0
    assert out.staleness == {1: 1.0}


def test_synchronous_at_the_upper_bound_is_the_compiled_step():
    # every response max_new_tokens long: the compiled step of `--compile-for` (prefill of
    # all groups, ceil((N - 1) / k) chunks at full slots, experience, update, rollout copy),
    # and its MFU: the programs' model FLOPs over chips x peak x that step
    shape = BatchShape(groups=64, group_size=8, prompt_width=256, max_new_tokens=4096)
    rollout = RolloutCost(chips=32, slots=512, decode_chunk=8,
                          decode_seconds=((0.25, 0.05), (1.0, 0.087)),
                          prefill_seconds_per_group=0.4 / 64)
    trainer = TrainerCost(chips=32, experience_seconds=14.0, update_seconds=21.0,
                          weight_sync_seconds=0.3)
    flops = FlopModel(decode_per_token=1.7e10, prefill_per_sample=5e12,
                      experience_per_row=2e14, update_per_row=6e14, peak_flops_per_chip=459e12)
    out = simulate(rollout, trainer, SYNCHRONOUS, shape, fixed_lengths([4096]), updates=4,
                   warmup=1, flops=flops)
    step = 0.4 + math.ceil(4095 / 8) * 0.087 + 14.0 + 21.0 + 0.3
    assert out.step_seconds == pytest.approx(step)
    model = 512 * (1.7e10 * 4095 + 5e12 + 2e14 + 6e14)
    assert out.mfu == pytest.approx(model / (32 * 459e12 * step))


def test_decode_chunk_costs_its_live_slot_bucket():
    cost = RolloutCost(chips=8, slots=512, decode_chunk=8,
                       decode_seconds=((0.25, 0.2), (1.0, 0.5)), prefill_seconds_per_group=0.0)
    assert cost.chunk_seconds(1) == pytest.approx(0.2)  # bucket 128 of 512
    assert cost.chunk_seconds(128) == pytest.approx(0.2)
    assert cost.chunk_seconds(129) == pytest.approx(0.3)  # bucket 256: a third of the way
    assert cost.chunk_seconds(512) == pytest.approx(0.5)


def test_a_narrow_batch_trains_on_its_response_bucket():
    # longest response 1 of 4 tokens -> width 1 of buckets 1, 2, 3, 4: (2 + 1) / (2 + 4) of the
    # full-width experience + update; the step is prefill 0.5 + that 3 s
    shape = BatchShape(groups=1, group_size=1, prompt_width=2, max_new_tokens=4,
                       response_buckets=4)
    assert [shape.width(n) for n in (1, 2, 3, 4)] == [1, 2, 3, 4]
    trainer = TrainerCost(chips=1, experience_seconds=2.0, update_seconds=4.0,
                          weight_sync_seconds=0.0)
    out = simulate(_two_slots(), trainer, SYNCHRONOUS, shape, fixed_lengths([1]), updates=3,
                   warmup=1)
    assert out.step_seconds == pytest.approx(0.5 + 6.0 * 3 / 6)


def test_bad_schedules_are_refused():
    shape = BatchShape(groups=1, group_size=4, prompt_width=1, max_new_tokens=4)
    trainer = TrainerCost(chips=1, experience_seconds=1.0, update_seconds=1.0,
                          weight_sync_seconds=0.0)
    with pytest.raises(ValueError, match="colocated"):
        simulate(_two_slots(), trainer, Schedule(1, colocated=True), shape, fixed_lengths([2]))
    with pytest.raises(ValueError, match="slots=2"):
        simulate(_two_slots(), trainer, Schedule(1), shape, fixed_lengths([2]))
    with pytest.raises(ValueError, match="warmup"):
        simulate(_two_slots(), trainer, SYNCHRONOUS, shape, fixed_lengths([2]), warmup=0)


@pytest.mark.parametrize("mean", [0.05, 0.3, 0.5, 0.8])
def test_truncated_exponential_has_the_mean_asked_for(mean):
    a = truncated_exponential_rate(mean)
    x = np.linspace(0.0, 1.0, 200_001)
    density = np.exp(a * (x - 1.0))  # scaled by e^-a: same normalised density, no overflow
    assert np.trapezoid(x * density, x) / np.trapezoid(density, x) == pytest.approx(mean,
                                                                                 abs=1e-6)
    with pytest.raises(ValueError, match="mean=1"):
        truncated_exponential_rate(1.0)


def test_step_mixture_keeps_each_steps_cut_fraction_and_mean():
    # one logged step: responses that ended averaged 1/4 of the budget, 10% were cut at it
    draw = step_mixture_lengths([(0.25, 0.1)], max_new_tokens=1000)
    x = draw(np.random.default_rng(0), 40_000)
    assert x.min() >= 1 and x.max() == 1000
    assert np.mean(x == 1000) == pytest.approx(0.1, abs=0.005)
    # the ended ones: ceil(1000 u) with u of mean 1/4
    assert np.mean(x) == pytest.approx(0.9 * 250.5 + 0.1 * 1000, rel=0.02)


def test_lognormal_lengths_are_cut_at_the_budget():
    x = lognormal_lengths(1024, 0.8, 4096)(np.random.default_rng(0), 50_000)
    assert np.median(x) == pytest.approx(1024, rel=0.03)
    # P(z > ln 4 / 0.8) = 4.2%
    assert np.mean(x == 4096) == pytest.approx(0.0415, abs=0.004)
