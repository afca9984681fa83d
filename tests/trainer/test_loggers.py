"""Experiment trackers (W&B offline, MLflow on a file store) and the plain progress lines of a run
whose output is not a terminal: a tiny run through a pipe writes the metrics of metrics.jsonl,
its config and its sample tables to both, read back with each tracker's own formats; a tracker
that raises is dropped with one warning and the run goes on; a tracker server that refuses or
never answers costs seconds, not minutes (MLflow dropped, W&B offline, each said once); bad
`train.loggers`, a database MLflow store without SQL support and W&B's online mode without a key
exit 2 before anything loads."""

from __future__ import annotations

import json
import math
import os
import re
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from ppo_jax.trainer.tracking import loggers
from ppo_jax.trainer.config import ConfigError, load_config
from ppo_jax.trainer.tracking.metrics import MetricsWriter, read_metrics
from ppo_jax.trainer.tracking.progress import PlainProgress, progress_line

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import train  # noqa: E402

STEPS = 2
QUIET = {"WANDB_ERROR_REPORTING": "false", "MLFLOW_DISABLE_TELEMETRY": "true",
         "DO_NOT_TRACK": "true"}  # no network at test time


def tiny_args(out: Path, *extra: str) -> list[str]:
    return ["--config", str(ROOT / "configs/tiny.yaml"), "--set", f"train.output_dir={out}",
            "--set", f"data.prompts={ROOT / 'configs/prompts/reviews.jsonl'}",
            "--set", f"eval.prompts={ROOT / 'configs/prompts/quotes_eval.jsonl'}",
            "--set", f"train.steps={STEPS}", "--set", "train.export_hf=false",
            "--set", "train.save_every=0", *extra]


def tracker_env(tmp: Path) -> dict:
    """No W&B API key (none in the environment, a netrc file that does not exist), so the W&B
    tracker chooses offline mode itself; W&B's files under `tmp`; MLflow's variables unset."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("WANDB_", "MLFLOW_")) and k != "NETRC"}
    return {**env, **QUIET, "WANDB_DIR": str(tmp), "NETRC": str(tmp / "no-netrc"),
            "PPO_JAX_CACHE": str(tmp / "cache")}


def isolate_env(monkeypatch, tmp: Path, **extra: str) -> None:
    """`tracker_env(tmp)` and `extra` for this test; what the trackers set for good (with
    setdefault) is undone after it."""
    for key in [k for k in os.environ if k.startswith(("WANDB_", "MLFLOW_"))] + [
            "MLFLOW_ALLOW_FILE_STORE", *loggers.MLFLOW_BOUNDS]:
        monkeypatch.setenv(key, "")  # recorded, so restored (or removed) after the test
        monkeypatch.delenv(key)
    for key, value in {**tracker_env(tmp), **extra}.items():
        monkeypatch.setenv(key, value)


@pytest.fixture
def silent_server():
    """http://127.0.0.1:PORT of a listening socket that never accepts or answers: the kernel
    completes each TCP handshake, then nothing comes back."""
    with socket.create_server(("127.0.0.1", 0), backlog=16) as server:
        yield f"http://127.0.0.1:{server.getsockname()[1]}"


def closed_port() -> str:
    """http://127.0.0.1:PORT where nothing listens (connection refused)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        return f"http://127.0.0.1:{server.getsockname()[1]}"


@pytest.fixture(scope="module")
def piped_run(tmp_path_factory):
    """A tiny run with train.loggers=[wandb, mlflow] and train.progress=true, its stdout and
    stderr one pipe: (run dir, tracker dir, mlflow uri, output text)."""
    tmp = tmp_path_factory.mktemp("trackers")
    out, uri = tmp / "run", (tmp / "mlruns").as_uri()
    cmd = [sys.executable, str(ROOT / "train.py"), *tiny_args(
        out, "--set", "train.loggers=[wandb,mlflow]", "--set", "train.progress=true",
        "--set", f"train.mlflow_tracking_uri={uri}", "--set", "train.run_name=tiny-trackers")]
    done = subprocess.run(cmd, cwd=ROOT, env=tracker_env(tmp), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:]
    return out, tmp, uri, done.stdout


# --- reading the trackers' own files back ----------------------------------------------------
def wandb_records(path: Path) -> list:
    """The protobuf records of a W&B transaction log (`run-*.wandb`): a 7-byte header, then
    LevelDB-log blocks of 32 KiB holding records of 7-byte headers (crc, length, type:
    1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, chunks, records = path.read_bytes(), 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or (kind == 0 and length == 0):  # block padding
            pos += left
            continue
        chunks, pos = chunks + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(chunks)
            records.append(record)
            chunks = b""
    return records


def wandb_history(records) -> dict[int, dict]:
    """step -> {key: value} of the history records (tables as their nested fields)."""
    rows = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            row = rows.setdefault(r.history.step.num, {})
            for item in r.history.item:
                row[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return rows


def same_metrics(record: dict, logged: dict) -> None:
    for key, value in record.items():
        if key != "step" and isinstance(value, (int, float)):
            assert logged[key] == pytest.approx(value, rel=1e-12, nan_ok=True), key


def test_wandb_offline_run_holds_the_metrics_config_and_samples(piped_run):
    out, tmp, _, _ = piped_run
    (run_dir,) = (tmp / "wandb").glob("offline-run-*")
    records = wandb_records(next(run_dir.glob("run-*.wandb")))
    history = wandb_history(records)
    metrics = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in metrics] == [0, 1, 2] and sorted(history) == [0, 1, 2]
    for record in metrics:
        same_metrics(record, history[record["step"]])
    assert metrics[1]["score_mean"] == history[1]["score_mean"]  # the same number, not a copy
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.display_name == "tiny-trackers" and run.project == "ppo_jax"
    config = {i.key: json.loads(i.value_json) for i in run.config.update}
    assert config["train"]["steps"] == STEPS
    assert config["ppo"]["batch_size"] == 4
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    table = json.loads((run_dir / "files" / history[1]["samples/path"]).read_text())
    first = [s for s in samples if s["step"] == 1 and not s.get("eval")]
    assert table["columns"][:3] == ["prompt", "response", "score"]
    assert [row[:3] for row in table["data"]] == [[s["prompt"], s["response"], s["score"]]
                                                  for s in first]


def test_mlflow_run_holds_the_metrics_config_and_samples(piped_run, monkeypatch):
    out, _, uri, _ = piped_run
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("ppo_jax").experiment_id])
    assert (run.info.status, run.info.run_name) == ("FINISHED", "tiny-trackers")
    metrics = read_metrics(out / "metrics.jsonl")
    for key in ("score_mean", "pg_loss", "kl", "eval/reward_mean", "time/step"):
        want = [(r["step"], r[key]) for r in metrics if key in r]
        have = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
        assert sorted(have) == want and want, key  # the same floats, written and read back
    assert run.data.params["train.steps"] == str(STEPS)
    assert run.data.params["model.actor"] == "tiny-random"
    local = Path(client.download_artifacts(run.info.run_id, "", str(out.parent / "mlflow_dl")))
    assert json.loads((local / "config.json").read_text()) == json.loads(
        (out / "config.json").read_text())
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    table = json.loads((local / "samples" / "step_000001.json").read_text())
    first = [s for s in samples if s["step"] == 1 and not s.get("eval")]
    assert [dict(zip(table["columns"], row)) for row in table["data"]] == [
        {k: v for k, v in s.items() if k != "step"} for s in first]


def test_progress_in_a_pipe_is_one_plain_line_per_step(piped_run):
    text = piped_run[3]
    assert "\r" not in text
    lines = [line for line in text.splitlines() if line.startswith("ppo step ")]
    assert [re.match(r"ppo step (\d+)/2 \(\d+%\)", line).group(1) for line in lines] == ["1", "2"]
    assert all(" s/step | eta " in line and " reward=" in line and " kl=" in line
               for line in lines)


def test_a_logger_that_raises_is_dropped_once_and_training_goes_on(tmp_path, monkeypatch, capsys):
    isolate_env(monkeypatch, tmp_path)
    calls = []

    def boom(self, step, scalars):
        calls.append(step)
        raise RuntimeError("tracker server gone")

    monkeypatch.setattr(loggers.WandbTracker, "log_metrics", boom)
    out, uri = tmp_path / "run", (tmp_path / "mlruns").as_uri()
    assert train.main(tiny_args(out, "--set", "train.loggers=[wandb,mlflow]",
                                "--set", f"train.mlflow_tracking_uri={uri}",
                                "--set", "train.progress=false")) == 0
    err = capsys.readouterr().err
    assert calls == [0]  # dropped at its first failure, never called again
    assert err.count("warning: logger 'wandb' dropped") == 1
    assert "log_metrics raised RuntimeError: tracker server gone" in err
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1, 2]
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("ppo_jax").experiment_id])
    assert [m.step for m in client.get_metric_history(run.info.run_id, "kl")] == [1, 2]


# --- no training -------------------------------------------------------------------------------
class Recorder:
    name = "recorder"

    def __init__(self, fail_on=()):
        self.calls, self.fail_on = [], fail_on

    def _call(self, method, *args):
        self.calls.append((method, *args))
        if method in self.fail_on:
            raise OSError(f"{method} failed")

    def log_metrics(self, step, scalars):
        self._call("log_metrics", step, scalars)

    def log_table(self, step, tag, rows):
        self._call("log_table", step, tag, rows)

    def close(self, failed=False):
        self._call("close", failed)


def test_metrics_writer_sends_the_records_to_the_trackers(tmp_path, capsys):
    good, bad = Recorder(), Recorder(fail_on=("log_table",))
    w = MetricsWriter(tmp_path, tensorboard=False, trackers=loggers.Trackers([good, bad]))
    w.write(1, {"kl": 0.5, "loss": float("nan"), "tag": "text", "n": 3})
    w.write_samples(1, [{"prompt": "a", "response": "b", "score": 0.25}, {"prompt": "c", "x": 1}])
    w.write(2, {"kl": 0.25})
    w.close()
    method, step, scalars = good.calls[0]
    assert (method, step, scalars["kl"], scalars["n"]) == ("log_metrics", 1, 0.5, 3.0)
    assert math.isnan(scalars["loss"]) and "tag" not in scalars
    assert good.calls[1] == ("log_table", 1, "samples", [{"prompt": "a", "response": "b",
                                                          "score": 0.25}, {"prompt": "c", "x": 1}])
    assert good.calls[2:] == [("log_metrics", 2, {"kl": 0.25}), ("close", False)]
    assert [c[0] for c in bad.calls] == ["log_metrics", "log_table", "close"]  # dropped, closed
    assert bad.calls[-1] == ("close", True)
    assert capsys.readouterr().err.count("logger 'recorder' dropped: log_table raised OSError") == 1
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]


def test_a_tracker_that_cannot_open_is_dropped(tmp_path, monkeypatch, capsys):
    def refuse(train, config, out):
        raise ConnectionError("no route to host")

    monkeypatch.setitem(loggers.TRACKERS, "wandb", refuse)
    cfg = load_config(ROOT / "configs/tiny.yaml", ["train.loggers=[wandb]"])
    assert loggers.Trackers.open(cfg.train, {}, tmp_path).live == []
    assert "logger 'wandb' dropped: opening it raised ConnectionError: no route to host" in \
        capsys.readouterr().err


def test_mlflow_tracker_renames_what_mlflow_refuses(tmp_path, monkeypatch):
    for key, value in {**QUIET, "MLFLOW_ALLOW_FILE_STORE": "true"}.items():
        monkeypatch.setenv(key, value)
    from mlflow import MlflowClient

    uri = (tmp_path / "mlruns").as_uri()
    train_cfg = SimpleNamespace(project="p", run_name="r", mlflow_tracking_uri=uri)
    tracker = loggers.MlflowTracker(train_cfg, {"ppo": {"kl_coef": 0.05, "name": "x"}}, tmp_path)
    tracker.log_metrics(3, {"eval/pass@4": 0.5, "time/step": 1.25})
    tracker.close(failed=True)
    run = MlflowClient(tracking_uri=uri).get_run(tracker.run_id)
    assert run.data.metrics == {"eval/pass_at_4": 0.5, "time/step": 1.25}
    assert run.data.params == {"ppo.kl_coef": "0.05", "ppo.name": "x"}
    assert (run.info.status, run.info.run_name) == ("FAILED", "r")


def test_wandb_goes_offline_without_a_key_or_a_server(tmp_path):
    netrc = tmp_path / "netrc"
    assert loggers.wandb_mode({"NETRC": str(netrc)}) == (
        "offline", "no W&B API key (WANDB_API_KEY, or `wandb login`)")
    assert loggers.wandb_mode({"WANDB_MODE": "disabled"}) == ("disabled", None)  # W&B's own wins
    closed = closed_port()
    mode, why = loggers.wandb_mode({"WANDB_API_KEY": "k" * 40, "WANDB_BASE_URL": closed})
    assert mode == "offline" and why.startswith(f"no W&B server: {closed}: ") and "refused" in why
    netrc.write_text("machine 127.0.0.1 login user password " + "k" * 40 + "\n")
    assert loggers.has_wandb_key({"NETRC": str(netrc)}, closed)
    assert not loggers.has_wandb_key({"NETRC": str(netrc)})  # a key for another host only


@pytest.mark.parametrize("server", ["refused", "silent"])
def test_an_mlflow_server_that_does_not_answer_is_dropped_in_seconds(
        server, silent_server, tmp_path, monkeypatch, capsys):
    url = closed_port() if server == "refused" else silent_server
    isolate_env(monkeypatch, tmp_path, MLFLOW_HTTP_REQUEST_MAX_RETRIES="4")
    train_cfg = SimpleNamespace(loggers=["mlflow"], project="p", run_name="r",
                                mlflow_tracking_uri=url)
    start = time.monotonic()
    assert loggers.Trackers.open(train_cfg, {"a": 1}, tmp_path).live == []
    assert time.monotonic() - start < 10  # MLflow's own waits: minutes (retries), or never
    err = capsys.readouterr().err
    assert err.count("warning: logger 'mlflow' dropped") == 1, err
    assert f"no MLflow server: {url}" in err
    assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "5"  # bounded for the run's later calls
    assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "4"  # the user's own setting kept


def test_a_wandb_server_that_never_answers_costs_seconds_and_is_said(
        silent_server, tmp_path, monkeypatch, capsys):
    isolate_env(monkeypatch, tmp_path, WANDB_API_KEY="k" * 40, WANDB_BASE_URL=silent_server)
    start = time.monotonic()
    trackers = loggers.Trackers.open(SimpleNamespace(project="p", run_name="r", loggers=["wandb"]),
                                     {"a": 1}, tmp_path)
    assert time.monotonic() - start < 15  # W&B's own wait: ~90 s, then offline silently
    assert [t.name for t in trackers.live] == ["wandb"]
    trackers.call("log_metrics", 1, {"x": 1.0})
    trackers.call("close", False)
    err = capsys.readouterr().err
    assert err.count("warning: logger 'wandb' runs offline") == 1, err
    assert f"no W&B server: {silent_server} did not answer within 3 s" in err
    (run_dir,) = (tmp_path / "wandb").glob("*run-*")  # no half-made online run beside it
    assert run_dir.name.startswith("offline-run-") and str(run_dir) in err


def test_tracker_settings_they_would_refuse_are_refused_at_load_time(monkeypatch, tmp_path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",  # mlflow-skinny alone: no SQL stores
                        lambda name, *a: None if name == "sqlalchemy" else real(name, *a))
    for key in ("MLFLOW_TRACKING_URI", "WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    sqlite = ["train.loggers=[mlflow]", "train.mlflow_tracking_uri=sqlite:///runs.db"]
    with pytest.raises(ConfigError, match=re.escape(
            "train.mlflow_tracking_uri='sqlite:///runs.db': a database store")) as e:
        load_config(ROOT / "configs/tiny.yaml", sqlite)
    assert "pip install mlflow (the full package)" in str(e.value)
    load_config(ROOT / "configs/tiny.yaml", sqlite[1:])  # no mlflow tracker: nothing to refuse
    monkeypatch.setenv("WANDB_MODE", "online")
    with pytest.raises(ConfigError, match="WANDB_MODE=online: W&B has no API key"):
        load_config(ROOT / "configs/tiny.yaml", ["train.loggers=[wandb]"])
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    load_config(ROOT / "configs/tiny.yaml", ["train.loggers=[wandb]"])


@pytest.mark.parametrize("value, says", [
    ("[tensorboard]", "'tensorboard' is not one of ['wandb', 'mlflow']"),
    ("[wandb,wandb]", "a name given twice"),
])
def test_bad_logger_names_are_refused_at_load_time(value, says):
    with pytest.raises(ConfigError, match=re.escape(says)) as e:
        load_config(ROOT / "configs/tiny.yaml", [f"train.loggers={value}"])
    assert "train.loggers=" in str(e.value)


def test_a_logger_without_its_package_exits_2_before_loading(tmp_path, monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "mlflow" else real(name, *a))
    out = tmp_path / "run"
    assert train.main(tiny_args(out, "--set", "train.loggers=[wandb,mlflow]")) == 2
    err = capsys.readouterr().err
    assert "train.loggers=['wandb', 'mlflow']" in err and "pip install mlflow" in err
    assert not out.exists()  # nothing written, no model loaded


def test_plain_progress_prints_every_n_steps_without_carriage_returns(capsys):
    bar = PlainProgress(total=5, initial=1, desc="sft", every=2)
    for step in range(2, 6):
        bar.set_postfix(loss=f"{step / 10:.4f}")
        bar.update(1)
    bar.close()
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = err.splitlines()
    assert [line.split(" | ")[0] for line in lines] == ["sft step 2/5 (40%)", "sft step 4/5 (80%)",
                                                        "sft step 5/5 (100%)"]
    assert lines[1].endswith("loss=0.4000")
    assert progress_line("ppo", 3, 40, 37.0, 3, {"kl": "0.1"}) == (
        "ppo step 3/40 (8%) | elapsed 0:37 | 12.33 s/step | eta 7:36 | kl=0.1")
