"""`model.attention` against the run's devices: cuDNN is refused by name, before anything is
loaded, on a mesh without GPUs (this CPU host, a TPU slice compiled for); the other choices
pass (`splash` off TPU runs in Pallas interpret mode, `auto` picks per call)."""

from __future__ import annotations

import pytest

from ppo_jax.models.attention_kernels import ATTENTION_KERNELS
from ppo_jax.trainer.config.schema import ConfigError, MeshConfig
from ppo_jax.trainer.placement import Placement


def _tpu_devices():
    pytest.importorskip("libtpu")
    from ppo_jax.aot.topology import resolve_slice, slice_devices

    return slice_devices(resolve_slice("v5p-8"))


@pytest.mark.parametrize("devices", [None, "v5p-8"])
def test_cudnn_is_refused_without_a_gpu_and_the_rest_pass(devices):
    devs = _tpu_devices() if devices else None
    place = Placement.from_config(MeshConfig(), devs, abstract=devs is not None)
    platform = "tpu" if devices else "cpu"
    with pytest.raises(ConfigError, match=f"model.attention=cudnn needs GPU devices, but this "
                                          f"run's mesh holds {platform} devices"):
        place.check_attention("cudnn")
    for choice in set(ATTENTION_KERNELS) - {"cudnn"}:
        place.check_attention(choice)
