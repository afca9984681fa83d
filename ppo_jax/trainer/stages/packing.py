"""Packing checks and layout shared by the stages that pack (`sft.packing`,
`reward_model.packing`, `ppo.packing`; docs/packing.md)."""

from __future__ import annotations

from ppo_jax.trainer.config.schema import ConfigError


def packing_shards(micro: int, batch_shards: int) -> int:
    """The shards a micro-batch of `micro` rows is packed over: the mesh's batch shards (data x
    fsdp) when they split it evenly, each device packing its own rows; else 1."""
    return batch_shards if micro % batch_shards == 0 else 1


def check_packing(name: str, sec, sequences_per_row: int, batch_shards: int) -> None:
    """Refuse `<name>.packing` (`sec` its section) where each device would pack one sequence a
    micro-batch, alone in its row: the padded pass's compute, nothing saved. Called at build,
    before any compile (the mesh decides it; `config.no_effect` refuses a micro_batch_size of
    1 at load).

    Raises:
      ConfigError: naming the key, micro_batch_size and the mesh's batch shards.
    """
    sequences = sec.micro_batch_size * sequences_per_row  # of a micro-batch
    if getattr(sec, "micro_batch_tokens", None) is not None:
        return  # the update's micro-batches hold as many sequences as fit: it packs
    if sec.packing and sequences == packing_shards(sec.micro_batch_size, batch_shards):
        raise ConfigError(
            f"{name}.packing=true has no effect: {name}.micro_batch_size={sec.micro_batch_size} "
            f"over the mesh's {batch_shards} batch shard(s) (data x fsdp) leaves each device "
            f"one sequence a micro-batch, alone in its row; drop it or raise "
            f"{name}.micro_batch_size")
