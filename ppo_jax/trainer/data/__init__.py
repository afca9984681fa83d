"""Data of the three stages: read, check, tokenise, order.

  prompts.py      PPO prompt sets: read, template, tokenise, left-pad (one call that does it
                  all for a run: `trainer.loading.models.build_prompts`)
  order.py        `DataOrder`: the resumable, seeded order a run reads any data set in
  tasks.py        reasoning-gym's procedural tasks as prompt sets (`data.prompts: task`)
  arithmetic.py   synthetic multiplication problems, train / held-out disjoint by construction
  records.py      reading row files (.jsonl / .json / .txt / .parquet), shared field checks
  sft.py          stage 1's demonstrations (TRL `SFTTrainer` formats)
  preference.py   stage 2's preference pairs (TRL `RewardTrainer` formats)
  token_rows.py   stages 1 and 2: prompt + response rows, truncated and right-padded
  text.py         stages 1 and 2: rows read, checked, tokenised and right-padded in one call
"""
