"""W&B and Trackio trackers (grpo_cli.trackers): what they log is read back from the files each
library writes (W&B's offline run file, Trackio's local database), without an account or network."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grpo_cli import trackers
from grpo_cli.errors import UserError

ROOT = Path(__file__).resolve().parents[1]

# Rows as the trainer writes them to metrics.jsonl: numbers, a histogram list, an eval key, a flag.
ROWS = [
    {"step": 1, "reward": 0.25, "rewards/accuracy/mean": 0.5, "kl": 0.0, "pass_rate_hist": [1, 2, 0]},
    {"step": 2, "reward": 0.5, "rewards/accuracy/mean": 0.75, "kl": 0.01, "pass_rate_hist": [0, 2, 1]},
    {"step": 3, "reward": 0.75, "kl": 0.02, "eval/accuracy": 0.3, "stopped": True},
]
# Sample records as grpo_cli.samples.step_records makes them: a nested dict of rewards, a chat
# prompt (a list of messages) next to a plain one.
CHAT = [{"role": "user", "content": "2+2?"}]
SAMPLES = [
    {"prompt": CHAT, "completion": "4", "rewards": {"accuracy": 1.0}, "reward": 1.0, "truncated": False},
    {"prompt": "3+5?", "completion": "9", "rewards": {"accuracy": 0.0}, "reward": 0.0, "truncated": True},
]
# ...and as table cells: nested names joined with "/", the messages as JSON text.
SAMPLE_COLUMNS = ["prompt", "completion", "rewards/accuracy", "reward", "truncated"]
SAMPLE_ROWS = [[json.dumps(CHAT), "4", 1.0, 1.0, False], ["3+5?", "9", 0.0, 0.0, True]]
CONFIG = {"seed": 3, "trainer": {"learning_rate": 1e-05, "report_to": ["jsonl", "wandb"]}}


def _expected(rows: list[dict]) -> dict[int, dict]:
    """step -> the values a tracker must log for it: the numbers other than step, not bools."""
    return {
        row["step"]: {
            k: v
            for k, v in row.items()
            if k != "step" and type(v) in (int, float) and not isinstance(v, bool)
        }
        for row in rows
    }


@pytest.fixture
def wandb_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """W&B offline and quiet, its config, cache and data folders in tmp_path (not the home folder)."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var.lower()))
    for var in ("WANDB_PROJECT", "WANDB_RUN_ID", "WANDB_RESUME", "WANDB_DIR"):
        monkeypatch.delenv(var, raising=False)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    return run_dir


def _wandb_records(path: Path) -> list:
    """The protobuf records of a W&B run file. wandb 0.31 no longer ships a Python reader
    (wandb.sdk.internal.datastore went with the Go core), so this reads its LevelDB-style log:
    a 7-byte file header, then 32 KiB blocks of chunks, each with a 7-byte header (crc32, length,
    type: 1 whole record, 2 first, 3 middle, 4 last part)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    records, pending, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:  # zero padding after the last record
            break
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def _finished_wandb_records(path: Path, timeout: float = 60.0) -> list:
    """The run file's records once W&B has written its exit record: wandb.finish() can return
    while its core process is still writing the file (seen on a loaded CI machine)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            records = _wandb_records(path)
        except Exception:  # noqa: BLE001 - a record still being written: read again
            records = []
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.2)


def test_wandb_offline_logs_the_rows_samples_and_config(wandb_offline: Path):
    tracker = trackers.Wandb(wandb_offline, run_name="unit", config=CONFIG)
    for row in ROWS:
        tracker.log(row)
    tracker.log_samples(3, SAMPLES)
    tracker.close()

    run_id = (wandb_offline / "wandb-run-id").read_text().strip()
    (path,) = wandb_offline.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb")
    records = _finished_wandb_records(path)

    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.run_id, run.project, run.display_name) == (run_id, "grpo-cli", "unit")
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["seed"] == 3 and config["trainer"] == CONFIG["trainer"]

    history: dict[int, dict] = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            items = record.history.item
            history[record.history.step.num] = {
                item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items
            }
    assert sorted(history) == [1, 2, 3]
    for step, expected in _expected(ROWS).items():
        logged = {k: v for k, v in history[step].items() if not k.startswith(("_", "completions"))}
        assert logged == expected, f"step {step}"
    assert not any("pass_rate_hist" in row or "stopped" in row for row in history.values())

    # The samples: a table named completions at step 3, its rows as given.
    assert history[3]["completions/_type"] == "table-file"
    (table_file,) = path.parent.glob("files/media/table/completions_3_*.table.json")
    table = json.loads(table_file.read_text())
    assert table["columns"] == SAMPLE_COLUMNS
    assert table["data"] == SAMPLE_ROWS


def test_wandb_resume_reuses_the_run_id_and_a_fresh_start_does_not(wandb_offline: Path):
    first = trackers.Wandb(wandb_offline, run_name="unit", config={})
    first.close()
    id_file = wandb_offline / "wandb-run-id"
    run_id = id_file.read_text().strip()
    assert first.run.id == run_id

    resumed = trackers.Wandb(wandb_offline, run_name="unit", config={}, resume_step=2)
    resumed.close()
    assert resumed.run.id == run_id and id_file.read_text().strip() == run_id

    # A fresh start in the same folder (metrics.jsonl begins again): W&B would ignore its steps
    # 1.. in the old run, which already has them, so it gets a run of its own.
    fresh = trackers.Wandb(wandb_offline, run_name="unit", config={})
    fresh.close()
    assert fresh.run.id != run_id and id_file.read_text().strip() == fresh.run.id


def test_wandb_init_failure_is_a_user_error(wandb_offline: Path, monkeypatch: pytest.MonkeyPatch):
    import wandb

    def no_api_key(**kwargs):
        raise wandb.errors.UsageError("No API key configured. Use `wandb login` to log in.")

    monkeypatch.setattr(wandb, "init", no_api_key)
    with pytest.raises(UserError, match="WANDB_MODE=offline") as info:
        trackers.Wandb(wandb_offline, run_name="unit", config={})
    assert "UsageError: No API key configured" in str(info.value)


# Runs in a subprocess: trackio reads TRACKIO_DIR once, when it is imported, into constants that
# several of its modules copy, so setting it in this process after an import would not move it.
TRACKIO_SCRIPT = """
import json, sys
from pathlib import Path
from trackio.sqlite_storage import SQLiteStorage
from grpo_cli.trackers import Trackio

rows, samples, config = json.loads(sys.argv[1])
run_dir = Path(sys.argv[2])
first = Trackio(run_dir, run_name="unit", config=config)
for row in rows:
    first.log(row)
first.log_samples(3, samples)
first.close()
resumed = Trackio(run_dir, run_name="unit", config=config, resume_step=3)
resumed.log({"step": 4, "reward": 1.0})
resumed.close()
fresh = Trackio(run_dir, run_name="unit", config=config)
fresh.close()
result = {
    "ids": [first.run.id, resumed.run.id, fresh.run.id],
    "logs": SQLiteStorage.get_logs("grpo-cli", run_id=first.run.id),
    "config": SQLiteStorage.get_run_config("grpo-cli", run_id=first.run.id),
}
print("RESULT " + json.dumps(result, default=str))
"""


def test_trackio_logs_the_rows_and_samples_locally(tmp_path: Path):
    pytest.importorskip("trackio")
    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio"), "HF_HUB_OFFLINE": "1"}
    for var in ("TRACKIO_PROJECT", "TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL", "TRACKIO_BUCKET_ID"):
        env.pop(var, None)
    args = [sys.executable, "-c", TRACKIO_SCRIPT, json.dumps([ROWS, SAMPLES, CONFIG]), str(tmp_path)]
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    result = json.loads(line.removeprefix("RESULT "))
    assert (tmp_path / "trackio" / "grpo-cli.db").exists()

    first, resumed, fresh = result["ids"]
    assert resumed == first and fresh != first  # resume continues the run; a fresh start does not
    assert result["config"]["seed"] == 3 and result["config"]["trainer"] == CONFIG["trainer"]

    metrics: dict[int, dict] = {}
    samples = None
    for entry in result["logs"]:
        values = {k: v for k, v in entry.items() if k not in ("step", "timestamp")}
        if "completions" in values:
            assert entry["step"] == 3
            samples = values.pop("completions")
        metrics.setdefault(entry["step"], {}).update(values)
    assert metrics == {**_expected(ROWS), 4: {"reward": 1.0}}
    assert samples == {
        "_type": "trackio.table",
        "_value": [dict(zip(SAMPLE_COLUMNS, row)) for row in SAMPLE_ROWS],
    }


@pytest.mark.parametrize("name", ["wandb", "trackio", "tensorboard"])
def test_missing_package_names_the_extra(name: str, monkeypatch: pytest.MonkeyPatch):
    looked_up = []
    monkeypatch.setattr(trackers, "find_spec", lambda module: looked_up.append(module))
    problem = trackers.missing_package(name)
    assert looked_up == [name]
    assert problem is not None and f"pip install -e '.[{name}]' in grpo-cli's folder" in problem
    assert "trainer.report_to" in problem


def test_missing_package_is_none_when_installed():
    pytest.importorskip("wandb")
    assert trackers.missing_package("wandb") is None


@pytest.mark.parametrize("cls, name", [(trackers.Wandb, "wandb"), (trackers.Trackio, "trackio")])
def test_tracker_without_its_package_is_a_user_error(cls, name, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, name, None)  # makes `import name` raise ImportError
    with pytest.raises(UserError, match=rf"pip install -e '\.\[{name}\]' in grpo-cli's folder"):
        cls(tmp_path, run_name="unit", config={})


def test_a_training_run_sends_metrics_jsonl_rows_and_its_config_to_wandb(wandb_offline: Path, compose):
    """grpo-train with trainer.report_to=[jsonl,wandb]: W&B's history holds the numbers of
    metrics.jsonl under the same names at the same steps, the run's resolved config, and the
    completions table of a logged step."""
    from grpo_cli.cli.train import train_config

    cfg = compose(
        [
            "model=tiny",
            "data.num_examples=32",
            "data.eval_size=0",
            "sampler.num_generations=2",
            "sampler.max_new_tokens=3",
            "trainer.max_steps=2",
            "trainer.prompts_per_step=2",
            "trainer.quiet=true",
            "trainer.report_to=[jsonl,wandb]",
        ]
    )
    train_config(cfg, wandb_offline)
    run_id = (wandb_offline / "wandb-run-id").read_text().strip()
    (path,) = wandb_offline.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb")
    records = _finished_wandb_records(path)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["trainer"]["report_to"] == ["jsonl", "wandb"] and config["model"]["name_or_path"]
    history = {
        r.history.step.num: {
            i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item
        }
        for r in records
        if r.WhichOneof("record_type") == "history"
    }
    rows = [json.loads(line) for line in (wandb_offline / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        for key, value in _expected([row])[row["step"]].items():
            assert history[row["step"]][key] == pytest.approx(value, nan_ok=True), key
    assert history[2]["completions/_type"] == "table-file"
