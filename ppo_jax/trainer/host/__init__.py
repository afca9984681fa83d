"""The host process of a run.

  env.py          environment set before jax starts (libtpu's probe kept quiet on CPU hosts)
  memory.py       freed host memory given back between the phases of a step (glibc malloc)
  distributed.py  multi-host start-up (`jax.distributed.initialize`)
"""
