"""The trainer: the generic loop every stage runs, and one room per concern.

Files here (what every stage shares):
  loop.py         `StageTrainer`: build -> step -> log / save -> export, run-directory guards,
                  `--resume`, the progress line, HF export
  state.py        `TrainState` (trained params + optimiser state of one model), and the
                  one place trained and frozen (LoRA base) params are split and joined
  optim.py        AdamW with warmup / cosine schedules, clipping, backbone learning rates
  accumulate.py   exact gradient accumulation over micro-batches
  placement.py    the device mesh: shardings of states, frozen params and batches
  programs.py     a step's jitted programs with abstract arguments (`--compile-for`)

Rooms:
  config/         the typed config: schema, cross-field checks, `--help-config`
  lifecycle/      the run directory's life: checkpoints, `--resume`, the lock and the config
                  files, preemption (SIGTERM / SIGINT, `train.max_minutes`)
  data/           prompt sets (PPO), reasoning tasks, SFT rows, preference pairs, token rows
  rewards/        reward functions on decoded text (registry) and answer verifiers
  environments/   multi-turn environments (registry): tools (a safe calculator), retries with
                  feedback, tool-call parsing, the fault wall around a step
  loading/        building the models of a run (HF / GGUF / PEFT, LoRA wiring)
  tracking/       metrics.jsonl, TensorBoard, W&B / MLflow, the progress line
  host/           process environment, host memory, multi-host start-up
  stages/         one trainer per RLHF stage: `sft`, `reward_model`, and `ppo/` (the PPO step)

Imports point down: `stages` uses the rooms, the rooms use the files above, and `config` imports
nothing else from the trainer (tests/test_imports.py).
"""
