"""Ahead-of-time compiles for hardware this host does not have (`train.py --compile-for`):
TPU slices by name (`topology`), the per-chip costs of a compiled program with loop trip
counts (`hlo`, `hlo_cost`), the project's jaxpr FLOP count (`flops`) and the report
(`compile_for`). Imports jax only; the trainer to compile is passed in."""
