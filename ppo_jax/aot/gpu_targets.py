"""XLA GPU target configs (`stream_executor::GpuTargetConfigProto` text) for compiling without
a GPU: the CUDA PJRT plugin builds a compile-only topology from one of these
(`topology.slice_devices`). H100: the values XLA ships as its H100-SXM spec; H200: the same
GH100 die (132 SMs at 1.98 GHz, 50 MiB L2) with the H200's memory (141 GB HBM3e, 143,771 MiB
as the driver reports it, at 4.8 TB/s; NVIDIA H200 datasheet).
"""

from __future__ import annotations

_GH100 = """gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {bandwidth}
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: {memory}
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {{
    major: 9
  }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{
  major: 9
  minor: 3
}}
device_description_str: "{name}"
"""

H100_MEMORY = 84978434048  # bytes the driver reports for an H100 80GB
H200_MEMORY = 143771 * 2 ** 20
H100 = _GH100.format(bandwidth=3352320000000, memory=H100_MEMORY, name="NVIDIA H100 80GB HBM3")
H200 = _GH100.format(bandwidth=4800000000000, memory=H200_MEMORY, name="NVIDIA H200")
