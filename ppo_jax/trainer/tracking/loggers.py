"""Experiment trackers beside `metrics.jsonl` and TensorBoard: Weights & Biases and MLflow, each
off unless named in `train.loggers` (docs/training.md, "Tracking").

A tracker gets the run's config once when it opens, then every metrics record and every table
of decoded samples that `MetricsWriter` writes. Only process 0 opens any. A tracker whose open
or log raises is warned about once on stderr (naming it and the error) and dropped; training
goes on, and `metrics.jsonl` still has every record. No tracker waits long on a server: one that
does not answer within 3 s at start is not used (MLflow: dropped; W&B: its own offline mode,
files under `<dir>/wandb/offline-run-*` uploaded later by `wandb sync`, with one line on stderr
saying why), and MLflow's own HTTP timeout and retries are cut short unless set (`MLFLOW_BOUNDS`).
The clients are imported only when a tracker opens.
"""

from __future__ import annotations

import json
import netrc
import os
import re
import secrets
import shutil
import ssl
import sys
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

DEFAULT_PROJECT = "ppo_jax"  # W&B project / MLflow experiment when neither config nor env names one
WANDB_HOST = "https://api.wandb.ai"
# seconds wandb.init waits for its server to start the run unless WANDB_INIT_TIMEOUT is set
# (W&B's default: 90; it adds ~10 s of its own)
WANDB_INIT_TIMEOUT = 20.0
# MLflow's HTTP settings when unset (its defaults: 120 s a request, 7 retries, backoff 2): a
# silent server costs a call at most ~3 * 5 s + 2 s of backoff, once, before the tracker drops
MLFLOW_BOUNDS = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "5", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
                 "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1"}
# URI schemes of MLflow's database stores (`postgresql+psycopg2://` too), and the modules they
# need, which the full `mlflow` package brings and mlflow-skinny does not
DATABASE_STORES = ("sqlite", "postgresql", "mysql", "mssql")
DATABASE_MODULES = ("sqlalchemy", "alembic")


def warn_dropped(name: str, what: str, error: BaseException) -> None:
    """The one warning about a tracker that failed: on stderr, naming it, the call and the error."""
    print(f"warning: logger {name!r} dropped: {what} raised {type(error).__name__}: "
          f"{str(error)[:500]}; training continues (metrics.jsonl has every record)",
          file=sys.stderr, flush=True)


def has_wandb_key(environ, host: str = WANDB_HOST) -> bool:
    """Whether W&B can find an API key: `WANDB_API_KEY`, or an entry for `host` in the netrc
    file (`NETRC`, else ~/.netrc), where `wandb login` writes it."""
    if environ.get("WANDB_API_KEY"):
        return True
    path = Path(environ.get("NETRC") or Path.home() / ".netrc")
    try:
        return netrc.netrc(str(path)).authenticators(urlparse(host).hostname or host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def unanswered(url: str, timeout: float = 3.0) -> str | None:
    """Why the server at `url` (http or https) gives no answer to a GET within `timeout` seconds:
    the connection is refused or does not open, or it opens and nothing comes back. None when
    anything comes back (any status; a TLS or protocol error is left to the client to judge)."""
    try:
        urllib.request.urlopen(url, timeout=timeout).close()
    except Exception as e:
        reason = getattr(e, "reason", e)  # urllib wraps connection errors in URLError
        if isinstance(reason, TimeoutError):
            return f"{url} did not answer within {timeout:g} s"
        if isinstance(reason, OSError) and not isinstance(reason, ssl.SSLError):
            return f"{url}: {reason}"
    return None


def database_uri(uri: str) -> bool:
    """Whether an MLflow tracking URI names a database store (`sqlite:///runs.db`, ...)."""
    return urlparse(uri).scheme.split("+")[0] in DATABASE_STORES


def wandb_mode(environ) -> tuple[str, str | None]:
    """W&B's mode for this run and, when it is offline by this choice, why: `WANDB_MODE` when
    set (W&B's own variable), else offline without an API key or when `WANDB_BASE_URL` (default
    api.wandb.ai) does not answer within 3 s, else online."""
    if environ.get("WANDB_MODE"):
        return environ["WANDB_MODE"], None
    host = environ.get("WANDB_BASE_URL") or WANDB_HOST
    if not has_wandb_key(environ, host):
        return "offline", "no W&B API key (WANDB_API_KEY, or `wandb login`)"
    why = unanswered(host)
    return ("offline", f"no W&B server: {why}") if why else ("online", None)


def _table(samples: list[dict]) -> tuple[list[str], list[list]]:
    """Column names (every key, in first-seen order) and rows (None where a sample lacks one)."""
    columns = list(dict.fromkeys(k for s in samples for k in s))
    return columns, [[s.get(c) for c in columns] for s in samples]


def mlflow_name(key: str) -> str:
    """A metric or param name MLflow accepts (alphanumerics, `_ - . /` and spaces): `eval/pass@4` ->
    `eval/pass_at_4`; any other character becomes `_`."""
    return re.sub(r"[^/\w.\- ]", "_", key.replace("@", "_at_"))


def _flat(tree: dict, prefix: str = "") -> dict:
    """`{"a": {"b": 1}}` -> `{"a.b": 1}`."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


class WandbTracker:
    """One W&B run (offline without a key or network: `wandb_mode`, said once on stderr)."""

    name = "wandb"

    def __init__(self, train, config: dict, out: Path):
        import wandb

        self._wandb, (mode, why) = wandb, wandb_mode(os.environ)
        kwargs = dict(project=train.project or os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT,
                      name=train.run_name or out.resolve().name, config=config,
                      dir=os.environ.get("WANDB_DIR") or str(out),
                      id=os.environ.get("WANDB_RUN_ID") or secrets.token_hex(4))
        if not os.environ.get("WANDB_INIT_TIMEOUT"):
            kwargs["settings"] = wandb.Settings(init_timeout=WANDB_INIT_TIMEOUT)
        try:
            self.run = wandb.init(mode=mode, **kwargs)
        except Exception as e:
            if mode != "online":
                raise
            why = self._offline_after(e, kwargs)
        if why:
            print(f"warning: logger 'wandb' runs offline: {why}; its files: {self.run.sync_dir} "
                  "(`wandb sync DIR` uploads them later)", file=sys.stderr, flush=True)

    def _offline_after(self, error: Exception, kwargs: dict) -> str:
        """Start the run offline after the online start raised (its server refused or timed
        out), without the failed start's half-made files; returns why, in one line."""
        self._wandb.teardown()  # ends the failed run's service, which would write its files on
        for half_made in (Path(kwargs["dir"]) / "wandb").glob(f"run-*-{kwargs['id']}"):
            shutil.rmtree(half_made, ignore_errors=True)
        self.run = self._wandb.init(mode="offline", **kwargs)
        first_line = (str(error).strip().splitlines() or [""])[0][:300]
        return f"its online start failed: {type(error).__name__}: {first_line}"

    def log_metrics(self, step: int, scalars: dict) -> None:
        self.run.log(scalars, step=step)

    def log_table(self, step: int, tag: str, samples: list[dict]) -> None:
        columns, rows = _table(samples)
        table = self._wandb.Table(columns=columns, data=rows, allow_mixed_types=True)
        self.run.log({tag: table}, step=step)

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class MlflowTracker:
    """One MLflow run, written through `MlflowClient` (no global active run)."""

    name = "mlflow"

    def __init__(self, train, config: dict, out: Path):
        from mlflow import MlflowClient
        from mlflow.entities import Param

        uri = (train.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
               or (out / "mlruns").resolve().as_uri())
        if uri.startswith("file:") or "://" not in uri:  # a file store (or path) named here
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        for key, value in MLFLOW_BOUNDS.items():  # read by MLflow at each request
            os.environ.setdefault(key, value)
        if urlparse(uri).scheme in ("http", "https") and (why := unanswered(uri)):
            raise ConnectionError(f"no MLflow server: {why}")
        self.client = client = MlflowClient(tracking_uri=uri)
        name = train.project or os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_PROJECT
        experiment = client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else client.create_experiment(name)
        run = client.create_run(experiment_id, run_name=train.run_name or out.resolve().name)
        self.run_id = run.info.run_id
        client.log_dict(self.run_id, config, "config.json")
        params = [Param(mlflow_name(k), (v if isinstance(v, str) else json.dumps(v))[:500])
                  for k, v in _flat(config).items()]  # MLflow's length limit; config.json has all
        for i in range(0, len(params), 100):  # MLflow's batch limit
            client.log_batch(self.run_id, params=params[i:i + 100])

    def log_metrics(self, step: int, scalars: dict) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(mlflow_name(k), float(v), now, step)
                                                    for k, v in scalars.items()])

    def log_table(self, step: int, tag: str, samples: list[dict]) -> None:
        columns, rows = _table(samples)
        self.client.log_dict(self.run_id, {"columns": columns, "data": rows},
                             f"{tag}/step_{step:06d}.json")

    def close(self, failed: bool = False) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


TRACKERS = {"wandb": WandbTracker, "mlflow": MlflowTracker}


class Trackers:
    """The trackers that opened; each call goes to every one, and one that raises is warned
    about once and dropped (closed quietly), so a tracker never stops a run."""

    def __init__(self, trackers=()):
        self.live = list(trackers)

    @classmethod
    def open(cls, train, config: dict, out: Path) -> "Trackers":
        """Open the trackers `train.loggers` names (`train`: the config's `TrainConfig`) with
        the whole `config` (a plain dict) logged once; `out` is the run's directory."""
        opened = []
        for name in train.loggers:
            try:
                opened.append(TRACKERS[name](train, config, Path(out)))
            except Exception as e:
                warn_dropped(name, "opening it", e)
        return cls(opened)

    def call(self, method: str, *args) -> None:
        """`tracker.method(*args)` on each live tracker; one that raises is dropped."""
        for tracker in list(self.live):
            try:
                getattr(tracker, method)(*args)
            except Exception as e:
                self.live.remove(tracker)
                warn_dropped(tracker.name, method, e)
                if method != "close":
                    try:
                        tracker.close(True)
                    except Exception:
                        pass
