"""What a run reports while it trains.

  metrics.py      metrics.jsonl, TensorBoard events, samples.jsonl
  loggers.py      experiment trackers (`train.loggers`): Weights & Biases, MLflow
  progress.py     a tqdm bar on a terminal, plain lines in a log file
"""
