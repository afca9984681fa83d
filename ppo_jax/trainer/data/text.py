"""Text data of stage 1 (SFT) and stage 2 (reward model): read rows, check them, tokenise,
right-pad.

Row formats follow TRL: SFT rows are `{"prompt", "response"}` or `{"messages"}` (the last
message is the assistant response; `SFTTrainer`'s completion-only loss), preference rows are
`{"prompt", "chosen", "rejected"}` or the implicit-prompt form where `chosen` / `rejected` are
whole conversations (`RewardTrainer`). A prompt is tokenised exactly as PPO's prompts are
(`encode_prompt`, which `data.prompts.apply_template` calls), a response is its tokens plus the
stop token the sampler ends on; each row is prompt + response, right-padded (DeepSpeed-Chat steps 1 and 2).

The names are defined in four modules and all importable from here:
  `data.records`     reading `.jsonl` / `.json` / `.parquet` rows; the field checks both formats share
  `data.token_rows`  encoding, truncation and right-padding into `SequenceBatch` / `PairBatch`;
                     `split_holdout`, `take`
  `data.sft`         `SFTExample`, `sft_examples`, `tokenize_sft`
  `data.preference`  `PreferencePair`, `preference_pairs`, `tokenize_pairs`
"""

from __future__ import annotations

from ppo_jax.trainer.data.preference import PreferencePair, preference_pairs, tokenize_pairs
from ppo_jax.trainer.data.sft import SFTExample, sft_examples, tokenize_sft
from ppo_jax.trainer.data.token_rows import (
    PairBatch, Row, SequenceBatch, encode_prompt, encode_response, pad_rows, padded_rows,
    split_holdout, take, truncate_rows,
)
from ppo_jax.trainer.data.records import (
    ROLES, ROW_SUFFIXES, Messages, read_records, read_rows, require_file,
)

__all__ = [
    "ROLES", "ROW_SUFFIXES", "Messages", "PairBatch", "PreferencePair", "Row", "SFTExample",
    "SequenceBatch", "encode_prompt", "encode_response", "pad_rows", "padded_rows",
    "preference_pairs",
    "read_records", "read_rows", "require_file", "sft_examples", "split_holdout", "take",
    "tokenize_pairs", "tokenize_sft", "truncate_rows",
]
