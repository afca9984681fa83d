"""The life of a run's directory: what is saved, how a start continues it, and how it stops.

  checkpoint.py   orbax checkpoints (train states, KL controller, RNG, data position), and the
                  errors that name a step whose write or read failed
  resume.py       `--resume [auto|STEP]`: which checkpoint a start continues from, under which
                  config, and which config changes it refuses
  run_dir.py      the run directory: who may write it (the lock), the config files of each
                  start, and the logs and checkpoints a resume moves aside
  preemption.py   SIGTERM / SIGINT and `train.max_minutes`: stop at the next step boundary,
                  saved, on every process

The shared loop (`trainer.loop.StageTrainer`) calls these; they import the config and nothing
else of the trainer.
"""
