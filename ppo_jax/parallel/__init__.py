"""Device meshes, partition rules and multi-host data movement (below `rollout`, above
`models`: imports jax and `ppo_jax.models` only)."""

from ppo_jax.parallel.mesh import (
    AXES,
    BATCH_AXES,
    batch_shards,
    batch_sharding,
    make_mesh,
    replicated,
    resolve_axis_sizes,
    rows_spec,
    shard_rows,
    shard_rows_tree,
)
from ppo_jax.parallel.rules import (
    ROLLOUT_RULES,
    RULES,
    describe,
    param_spec,
    shard_like_params,
    tree_shardings,
    vocab_shards,
)
