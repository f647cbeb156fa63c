"""Experiment trackers (logging.backend): W&B offline and trackio write, with no network, the rows
metrics.jsonl holds, under the same names and steps; read back from their own files."""

import json
import os
import sqlite3
import struct
import subprocess
import sys

import pytest
from conftest import REPO

from grpo.run.tracking import numeric, run_id, trackio_name

WRITE_ROWS = """
import sys
from pathlib import Path
sys.path.insert(0, {repo!r})
from grpo.config import load_config, to_dict
from grpo.run.tracking import open_tracker
from grpo.sampler.evaluation import append_metrics_row
from grpo.run.metrics_log import MetricsLog

cfg = load_config(None, ["logging.backend={backend}", "logging.tensorboard=false", "run.name=tracked"])
run_dir = Path({run_dir!r})
log = MetricsLog(run_dir, 0, False, open_tracker(cfg.logging, run_dir, cfg.run.name, to_dict(cfg)))
log.write({{"step": 1, "loss": 0.5, "reward": -1.25, "timing/train_s": 2.0, "note": "text", "skipped": False}})
log.write({{"step": 2, "loss": 0.25, "reward": -0.75, "timing/train_s": 1.5}})
# a version already past: W&B's own step grows anyway
log.write_evaluation({{"step": 1, "eval/answer_accuracy": 0.125}})
log.close()
# the sampler's last
append_metrics_row(run_dir, {{"step": 2, "eval/answer_accuracy": 0.25}}, cfg.logging, cfg.run.name)
"""
EXPECTED = [(1, {"loss": 0.5, "reward": -1.25, "timing/train_s": 2.0}),
            (2, {"loss": 0.25, "reward": -0.75, "timing/train_s": 1.5}),
            (1, {"eval/answer_accuracy": 0.125}), (2, {"eval/answer_accuracy": 0.25})]


def write_rows(tmp_path, backend, run="run"):
    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio"), "WANDB_SILENT": "true", "HF_HUB_OFFLINE": "1",
           "http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9"}  # any network use would fail
    code = WRITE_ROWS.format(repo=str(REPO), backend=backend, run_dir=str(tmp_path / run))
    (tmp_path / run).mkdir()
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], without_wall_time(numeric(r))) for r in rows] == EXPECTED
    assert "wall_time" in rows[3]  # the sampler's row has its time; the trainer adds its own rows' before writing
    # one writer: each row counts its tracker's failures
    assert [r.get("tracker/failures") for r in rows] == [0, 0, 0, 0]


def without_wall_time(values: dict) -> dict:
    return {k: v for k, v in values.items() if k not in ("step", "wall_time", "tracker/failures")}


def wandb_records(path):
    """The protobuf records of a .wandb file (LevelDB log format after a 7-byte W&B header)."""
    data, pos, block, pending = path.read_bytes(), 7, 32768, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:
            break
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):  # full, or the last piece
            yield pending


def test_wandb_offline_gets_every_row_against_step(tmp_path):
    from wandb.proto import wandb_internal_pb2

    write_rows(tmp_path, "wandb")
    identity = run_id(tmp_path / "run")

    # one offline run per writer, each with its own id in the run folder's group: syncing one never
    # replaces another's history
    files = [next((tmp_path / "run" / "wandb").glob(f"offline-run-*-{identity}-{writer}/run-*.wandb"))
             for writer in ("trainer", "eval-*")]  # each final evaluation: eval-<its own id>
    logged = []
    for path in files:
        for raw in wandb_records(path):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(raw)
            if record.WhichOneof("record_type") == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                items = {k: v for k, v in items.items() if not k.startswith("_")}  # W&B's own _step, _runtime
                logged.append((items["step"], without_wall_time(items)))
    assert logged == EXPECTED


def test_trackio_gets_every_row_at_its_step(tmp_path):
    write_rows(tmp_path, "trackio")
    db = sqlite3.connect(tmp_path / "trackio" / "grpo-trainer.db")
    name = trackio_name("tracked", tmp_path / "run")
    logged = [(step, without_wall_time(json.loads(metrics))) for step, metrics, run in
              db.execute("select step, metrics, run_name from metrics order by id") if run == name]
    assert logged == EXPECTED


def test_two_run_folders_with_one_name_are_two_trackio_runs(tmp_path):
    """trackio continues a run by its name: the default run.name in two folders was one run."""
    write_rows(tmp_path, "trackio", "a")
    write_rows(tmp_path, "trackio", "b")
    db = sqlite3.connect(tmp_path / "trackio" / "grpo-trainer.db")
    for folder in ("a", "b"):
        name = trackio_name("tracked", tmp_path / folder)
        logged = [(step, without_wall_time(json.loads(metrics))) for step, metrics, run in
                  db.execute("select step, metrics, run_name from metrics order by id") if run == name]
        assert logged == EXPECTED, folder


def test_a_raising_tracker_is_counted_and_never_stops_the_caller(caplog):
    from grpo.run.tracking import Guarded

    class Broken:
        def log(self, row):
            raise ConnectionError("the tracker's server went away")

        def finish(self):
            raise RuntimeError("no")

    tracker = Guarded(Broken())
    for step in range(5):
        tracker.log({"step": step})
    tracker.finish()
    assert tracker.failures == 6
    # said, not spammed
    assert sum("the tracker's log failed (ConnectionError" in r.message for r in caplog.records) == 3


def test_an_unknown_backend_is_a_config_error():
    from grpo.config import load_config
    from grpo.settings.tree import ConfigError

    with pytest.raises(ConfigError, match="logging.backend must be one of none, wandb, trackio; got 'mlflow'"):
        load_config(None, ["logging.backend=mlflow"])


WRITE_TABLE = """
import sys
from pathlib import Path
sys.path.insert(0, {repo!r})
from grpo.config import load_config, to_dict
from grpo.run.tracking import open_tracker
from grpo.run.metrics_log import MetricsLog

cfg = load_config(None, ["logging.backend={backend}", "logging.tensorboard=false", "run.name=tracked"])
run_dir = Path({run_dir!r})
log = MetricsLog(run_dir, 0, False, open_tracker(cfg.logging, run_dir, cfg.run.name, to_dict(cfg)))
log.write({{"step": 1, "loss": 0.5}})
log.write_completions(1, 0, {records!r})
log.close()
assert log.tracker.failures == 0
"""
SHOWN = [{"sample_id": "train-3", "prompt": [{"role": "user", "content": "What is 2 + 2?"}], "completion": "<answer>4",
          "rewards": {"gsm8k_answer": 1.0}, "reward": 1.0, "advantage": 0.5}]
TABLE_ROW = [1, 0, "train-3", '[{"role": "user", "content": "What is 2 + 2?"}]', "<answer>4", '{"gsm8k_answer": 1.0}',
             1.0, 0.5]


@pytest.mark.parametrize("backend", ["wandb", "trackio"])
def test_the_shown_completions_are_a_table_in_each_tracker(tmp_path, backend):
    """logging.completions_per_step: the tracker gets a 'completions' table at the step they trained
    (a chat or the rewards by name as their JSON text), beside completions.jsonl."""
    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio"), "WANDB_SILENT": "true", "HF_HUB_OFFLINE": "1",
           "http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9"}
    (tmp_path / "run").mkdir()
    code = WRITE_TABLE.format(repo=str(REPO), backend=backend, run_dir=str(tmp_path / "run"), records=SHOWN)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    columns = ["step", "sampler", "sample_id", "prompt", "completion", "rewards", "reward", "advantage"]
    if backend == "wandb":
        table = json.loads(next((tmp_path / "run" / "wandb").glob("offline-run-*/files/media/table/completions_*.json"))
                           .read_text())
        assert (table["columns"], table["data"]) == (columns, [TABLE_ROW])
    else:
        db = sqlite3.connect(tmp_path / "trackio" / "grpo-trainer.db")
        rows = [(step, json.loads(metrics)) for step, metrics in
                db.execute("select step, metrics from metrics order by id")]
        tables = [(step, metrics["completions"]) for step, metrics in rows if "completions" in metrics]
        assert tables == [(1, {"_type": "trackio.table", "_value": [dict(zip(columns, TABLE_ROW))]})]
    shown = json.loads((tmp_path / "run" / "completions.jsonl").read_text())
    assert shown == {"step": 1, "sampler": 0, **SHOWN[0]}
