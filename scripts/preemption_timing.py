#!/usr/bin/env python
"""Time from a stop signal to the exit of `train.py` (docs/reliability.md "Preemption").

Starts `train.py --config CONFIG` into a fresh `--out` directory, waits for the metrics row of
step `--after-step`, waits `--delay` seconds more (the signal then lands inside the next step),
sends `--signal` and prints one JSON line: the step the run stopped at, the time from the signal
to the end of that step (its metrics row; 0 when the row came first), from there to the
"preempted at step N" line (samples, save, flush), from that to the exit, and in all.

    python scripts/preemption_timing.py --config configs/tiny.yaml --out runs/preempt_tiny \
        --set train.steps=5 --after-step 2 --delay 0.3
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def logged(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    text = path.read_text() if path.is_file() else ""
    return [json.loads(line)["step"] for line in text.splitlines() if line.endswith("}")]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", required=True, help="a new train.output_dir")
    parser.add_argument("--after-step", type=int, default=1)
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--signal", default="SIGTERM", choices=("SIGTERM", "SIGINT"))
    args = parser.parse_args(argv)
    out = Path(args.out)
    if out.exists():
        print(f"error: --out {out} exists; give a new directory", file=sys.stderr)
        return 2
    sets = [f"train.output_dir={out}", "train.progress=false", *args.set]
    cmd = [sys.executable, str(ROOT / "train.py"), "--config", args.config]
    cmd += [x for s in sets for x in ("--set", s)]
    out.mkdir(parents=True)
    with open(out.parent / f"{out.name}.stderr", "w") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, stderr=err, stdout=subprocess.DEVNULL)
        while args.after_step not in logged(out):
            if proc.poll() is not None:
                print(f"error: train.py exited {proc.returncode} first", file=sys.stderr)
                return 1
            time.sleep(0.05)
        time.sleep(args.delay)
        sent, step_end, said = time.perf_counter(), None, None
        proc.send_signal(getattr(signal, args.signal))
        while proc.poll() is None:
            if step_end is None and args.after_step + 1 in logged(out):
                step_end = time.perf_counter()
            if said is None and "preempted at" in Path(err.name).read_text():
                said = time.perf_counter()
            time.sleep(0.01)
        done = time.perf_counter()
    stopped = re.findall(r"preempted at step (\d+)", (out.parent / f"{out.name}.stderr").read_text())
    step_end, said = step_end or sent, said or done
    print(json.dumps({"config": args.config, "signal": args.signal, "rc": proc.returncode,
                      "preempted_at": int(stopped[0]) if stopped else None,
                      "signal_to_step_end_s": round(step_end - sent, 2),
                      "step_end_to_saved_s": round(said - step_end, 2),
                      "saved_to_exit_s": round(done - said, 2),
                      "signal_to_exit_s": round(done - sent, 2)}))
    return 0 if proc.returncode == 0 and stopped else 1


if __name__ == "__main__":
    sys.exit(main())
