"""Mesh sizes and the named partition rules, without devices (an AbstractMesh has only sizes)."""

from __future__ import annotations

import pytest
from jax.sharding import AbstractMesh, PartitionSpec as P

from ppo_jax.parallel import AXES, param_spec, resolve_axis_sizes


def mesh(data, fsdp, tensor):
    return AbstractMesh((data, fsdp, tensor), AXES)


def test_minus_one_takes_the_remaining_devices():
    assert resolve_axis_sizes(-1, 2, 2, 8) == (2, 2, 2)
    assert resolve_axis_sizes(1, -1, 4, 32) == (1, 8, 4)
    assert resolve_axis_sizes(8, 1, 1, 8) == (8, 1, 1)


@pytest.mark.parametrize("sizes, devices, match", [
    ((-1, -1, 1), 8, "at most one"),
    ((3, -1, 1), 8, "do not divide"),
    ((2, 2, 1), 8, "has 4 devices but there are 8"),
    ((0, 1, 1), 8, "positive or -1"),
])
def test_bad_mesh_sizes_name_the_sizes(sizes, devices, match):
    with pytest.raises(ValueError, match=match) as err:
        resolve_axis_sizes(*sizes, devices)
    assert f"data={sizes[0]}" in str(err.value)


def test_column_and_row_parallel_specs_skip_the_layer_axis():
    m = mesh(1, 2, 4)
    # [layers, D, H*hd]: layer axis never sharded; D over fsdp, heads over tensor
    assert param_spec("backbone/layers/attn/q_proj/kernel", (30, 64, 64), m) == P(None, "fsdp", "tensor")
    assert param_spec("backbone/layers/attn/o_proj/kernel", (30, 64, 64), m) == P(None, "tensor", "fsdp")
    assert param_spec("backbone/layers/mlp/down_proj/kernel", (30, 128, 64), m) == P(None, "tensor", "fsdp")
    assert param_spec("backbone/embed_tokens/embedding", (208, 64), m) == P("tensor", "fsdp")
    assert param_spec("backbone/layers/attn/q_proj/bias", (30, 64), m) == P(None, "tensor")


def test_dims_the_axis_does_not_divide_and_unknown_params_are_replicated():
    m = mesh(1, 2, 4)
    # 2 KV heads x 32 = 66 columns: not divisible by 4 -> only fsdp applies
    assert param_spec("backbone/layers/attn/k_proj/kernel", (30, 64, 66), m) == P(None, "fsdp")
    assert param_spec("backbone/layers/input_norm/scale", (30, 64), m) == P()
    assert param_spec("value_head/kernel", (64, 1), m) == P()
    assert param_spec("opt_state/0/count", (), m) == P()  # scalar step counts
    # a size-1 axis is never named in a spec
    assert param_spec("backbone/layers/attn/q_proj/kernel", (30, 64, 64), mesh(8, 1, 1)) == P()


def test_optimizer_moments_follow_their_params():
    m = mesh(1, 2, 2)
    assert (param_spec("opt_state/1/0/mu/backbone/layers/mlp/up_proj/kernel", (2, 64, 128), m)
            == param_spec("params/backbone/layers/mlp/up_proj/kernel", (2, 64, 128), m)
            == P(None, "fsdp", "tensor"))
