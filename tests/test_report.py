"""Sweeps and pictures (issue #9): multirun summaries, plots, grpo-report and report_to.

Two tiny-model multiruns in a subprocess (module-scoped: each serves several tests), the rest
in-process on synthetic metrics.jsonl files.
"""

from __future__ import annotations

import csv
import gc
import json
import shutil
import sys
import types
import weakref
from pathlib import Path

import pytest
from conftest import ROOT, console_script, run_cli

from grpo_cli import plots, summary
from grpo_cli.cli.sweep import RunFailed, Sweep
from grpo_cli.config import validate

# Console scripts and end-to-end runs: the slow tier (pytest -m "not slow" skips them).
pytestmark = pytest.mark.slow

SMALL = [
    "model=tiny",
    "data.num_examples=32",
    "data.eval_size=4",
    "sampler.num_generations=2",
    "sampler.max_new_tokens=4",
    "trainer.quiet=true",
    "trainer.prompts_per_step=1",
    "trainer.max_steps=2",
    "trainer.save_steps=50",
]
ENV = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "tests")}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MAX_PNG = 100 * 1024


def multirun(tmp: Path, args: list[str]):
    sweep = tmp / "sweep"
    res = run_cli(
        [console_script("grpo-train"), "-m", *SMALL, *args, f"hydra.sweep.dir={sweep}"], cwd=tmp, env=ENV
    )
    return res, sweep


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """A finished 2x2 sweep (4 jobs)."""
    res, folder = multirun(
        tmp_path_factory.mktemp("sweep"),
        [
            "reward=[accuracy,length]",
            "reward.length.unit=chars",
            "reward.length.target=3",
            "loss.beta=0,0.04",
            "loss.epsilon=0.1,0.2",
        ],
    )
    assert res.returncode == 0, res.stdout + res.stderr
    return res, folder


@pytest.fixture(scope="module")
def failing_sweep(tmp_path_factory):
    """2x2 jobs: one trains; one has a reward that raises at run time (UserError); two have a
    value that only validation rejects (a bad config ends a single run with SystemExit)."""
    res, folder = multirun(
        tmp_path_factory.mktemp("failing"),
        [
            "reward=[accuracy]",
            "loss.epsilon=0.2,1.5",
            "+reward.x.fn=reward_fixtures:char_code,reliability_helpers:boom",
        ],
    )
    return res, folder


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and 1000 < len(data) < MAX_PNG, (path, len(data))


# ----------------------------------------------------------------------------- the multiruns


def test_sweep_writes_every_run_a_summary_and_plots(sweep):
    res, folder = sweep
    jobs = sorted(p.name for p in folder.iterdir() if p.is_dir())
    assert jobs == ["0", "1", "2", "3"]
    for job in jobs:
        assert (folder / job / "metrics.jsonl").exists()
        assert summary.read_status(folder / job)["status"] == "completed"
        assert_png(folder / job / "metrics.png")
    assert_png(folder / "summary.png")
    assert_png(folder / plots.TIMELINE_PLOT)  # each run's mean step by phase
    assert all((folder / job / plots.TIMELINE_PLOT).exists() for job in jobs)
    rows = list(csv.DictReader((folder / "summary.csv").open()))
    assert [r["label"] for r in rows] == [
        "loss.beta=0 loss.epsilon=0.1",
        "loss.beta=0 loss.epsilon=0.2",
        "loss.beta=0.04 loss.epsilon=0.1",
        "loss.beta=0.04 loss.epsilon=0.2",
    ]
    assert all(r["status"] == "completed" and r["steps"] == "2" and float(r["wall_time_s"]) > 0 for r in rows)
    assert all(r["eval_accuracy_final"] != "" and r["length_final"] != "" for r in rows)
    data = json.loads((folder / "summary.json").read_text())
    assert data["exit_code"] == 0 and len(data["jobs"]) == 4 and "model=tiny" in data["common_overrides"]
    # The console table wraps with the terminal's width: its content is checked in summary.json.
    assert "summary.csv" in res.stdout and "Traceback" not in res.stdout + res.stderr


def test_a_failing_job_does_not_stop_the_sweep(failing_sweep):
    res, folder = failing_sweep
    out = res.stdout + res.stderr
    assert res.returncode == 2, out  # the first failed job's status: bad input
    assert "Traceback" not in out
    jobs = {tuple(j["label"].split()): j for j in json.loads((folder / "summary.json").read_text())["jobs"]}
    good = jobs[("loss.epsilon=0.2", "+reward.x.fn=reward_fixtures\\:char_code")]
    assert good["status"] == "completed" and good["steps"] == 2 and good["reward_final"] is not None
    boom = jobs[("loss.epsilon=0.2", "+reward.x.fn=reliability_helpers\\:boom")]
    assert boom["status"] == "failed" and boom["exit_code"] == 2 and "ZeroDivisionError" in boom["error"]
    for label, job in jobs.items():
        if "loss.epsilon=1.5" in label:
            assert job["status"] == "failed" and "loss.epsilon=1.5 must be in (0, 1)" in job["error"]
    data = json.loads((folder / "summary.json").read_text())
    assert data["exit_code"] == 2 and sum(j["status"] != "completed" for j in data["jobs"]) == 3
    assert out.count("the sweep goes on") == 3
    assert_png(folder / "summary.png")  # the job that trained


def test_grpo_report_rerenders_a_finished_sweep(sweep, tmp_path, capsys):
    from grpo_cli.cli import report

    console_script("grpo-report")  # installed; run in-process here (same code, no new interpreter)
    copy = tmp_path / "copy"
    shutil.copytree(sweep[1], copy, ignore=shutil.ignore_patterns("checkpoints"))
    made = [copy / "summary.csv", copy / "summary.json", copy / "summary.png", copy / "0" / "metrics.png"]
    for path in made:
        path.unlink()
    report.main([str(copy)])
    out = capsys.readouterr().out
    assert all(path.exists() for path in made)
    assert (
        json.loads((copy / "summary.json").read_text())["jobs"][3]["label"]
        == "loss.beta=0.04 loss.epsilon=0.2"
    )
    # The printed table wraps with the terminal's width; its rows are checked in summary.json.
    assert "summary.csv" in out and "summary.png" in out


# ----------------------------------------------------------------------------- synthetic runs


def fake_run(
    folder: Path,
    *,
    steps: int = 6,
    reward_slope: float = 0.1,
    overrides: list[str] | None = None,
    partial_line: bool = False,
) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"step": 0, "eval/accuracy": 0.1, "eval/reward": 0.2}]
    for s in range(1, steps + 1):
        rows.append(
            {
                "step": s,
                "reward": reward_slope * s,
                "rewards/accuracy/mean": 0.05 * s,
                "kl": 0.01 * s,
                "completions/mean_length": 20.0 - s,
                "clip_ratio/low_mean": 0.0,
                "clip_ratio/high_mean": 0.01,
                "clip_ratio/region_mean": 0.01,
                "frac_reward_zero_std": 0.5,
                "pass_rate_hist": [1, 2, 1],
            }
        )
    rows.append({"step": steps, "eval/accuracy": reward_slope * 3})
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if partial_line:
        text += '{"step": 99, "reward": 0.'  # a line the run is still writing
    (folder / "metrics.jsonl").write_text(text)
    (folder / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides or []))
    return folder


def test_summary_rows_final_best_common_and_winner(tmp_path):
    fake_run(tmp_path / "0", reward_slope=0.1, overrides=["model=tiny", "loss.beta=0"])
    fake_run(tmp_path / "1", reward_slope=0.2, overrides=["model=tiny", "loss.beta=0.04"])
    c = fake_run(tmp_path / "2", reward_slope=0.3, overrides=["model=tiny", "loss.beta=0.1"])
    (c / "metrics.jsonl").write_text((c / "metrics.jsonl").read_text().replace('"kl": 0.06', '"kl": NaN'))
    s = summary.summarise_sweep(
        tmp_path,
        statuses={c: {"job": 2, "status": "failed", "exit_code": 3, "error": "training stopped: NaN"}},
    )
    assert s.common == ["model=tiny"] and [r["label"] for r in s.rows] == [
        "loss.beta=0",
        "loss.beta=0.04",
        "loss.beta=0.1",
    ]
    row = s.rows[0]
    assert row["status"] == "unfinished" and row["steps"] == 6
    assert row["reward_final"] == pytest.approx(0.6) and row["reward_best"] == pytest.approx(0.6)
    assert row["eval_accuracy_final"] == pytest.approx(0.3) and row["eval_accuracy_best"] == pytest.approx(
        0.3
    )
    assert row["length_final"] == 14 and row["length_max"] == 19
    assert s.rows[2]["kl_final"] is None and s.rows[2]["kl_max"] == pytest.approx(0.05)  # NaN is not a value
    assert s.best == 1  # the best of the runs that did not fail
    assert s.exit_code == 3
    paths = summary.write_summary(s, tmp_path)
    assert [p.name for p in paths] == ["summary.csv", "summary.json"]
    data = json.loads((tmp_path / "summary.json").read_text())  # strict JSON: no NaN
    assert data["best_job"] == 1 and data["jobs"][2]["error"] == "training stopped: NaN"
    assert len(list(csv.DictReader((tmp_path / "summary.csv").open()))) == 3
    lines = summary.notes(s)
    assert any("best: job 1 (loss.beta=0.04)" in line for line in lines)
    assert any("job 2 failed: training stopped: NaN" in line for line in lines)


def test_a_tie_names_no_best_run(tmp_path):
    for name in ("0", "1"):
        fake_run(tmp_path / name, overrides=[f"loss.epsilon=0.{name}"])
    s = summary.summarise_sweep(tmp_path)
    assert s.best is None and s.tie
    assert "no single best run" in " ".join(summary.notes(s))


def test_run_and_sweep_plots_are_small_pngs(tmp_path):
    a = fake_run(tmp_path / "a")
    b = fake_run(tmp_path / "b", reward_slope=0.2)
    assert_png(plots.draw_run(a))
    fig = plots.run_figure(summary.read_metrics(a), "a")
    titles = [ax.get_title() for ax in fig.axes if ax.get_visible()]
    assert titles == [
        "reward",
        "held-out accuracy (greedy)",
        "kl",
        "completion length (tokens)",
        "clip ratio",
        "fraction of zero-std groups",
    ]
    clip = fig.axes[titles.index("clip ratio")]
    assert sorted(line.get_label() for line in clip.lines) == ["high_mean", "low_mean", "region_mean"]
    assert_png(plots.draw_sweep(tmp_path, [("loss.beta=0", a), ("loss.beta=0.04", b)]))
    empty = tmp_path / "empty"
    empty.mkdir()
    assert plots.draw_run(empty) is None  # no metrics yet: no plot, no error


def test_a_plot_failure_is_one_warning_line(tmp_path, monkeypatch, capsys):
    run = fake_run(tmp_path / "run")

    def broken(*args, **kwargs):
        raise RuntimeError("no fonts\nsecond line")

    monkeypatch.setattr(plots, "run_figure", broken)
    assert plots.draw_safely(plots.draw_run, run, prog="grpo-train") is None
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "could not draw the plots" in err and "RuntimeError: no fonts" in err


def test_grpo_report_skips_a_partial_last_line(tmp_path, capsys):
    from grpo_cli.cli import report

    run = fake_run(tmp_path / "run", partial_line=True, overrides=["loss.beta=0"])
    report.main([str(run)])
    out = capsys.readouterr().out
    assert_png(run / "metrics.png")
    assert [r["step"] for r in summary.read_metrics(run)][-1] == 6
    assert "loss.beta=0" in out and "0.6/0.6" in out


def test_grpo_report_rejects_a_folder_that_is_no_run(tmp_path, capsys):
    from grpo_cli.cli import report

    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as info:
        report.main([str(tmp_path / "empty"), str(tmp_path / "missing")])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert (
        "empty is neither a run folder" in err
        and "missing does not exist" in err
        and "grpo-train wrote" in err
    )


# ----------------------------------------------------------------------------- sweep jobs in-process


def test_sweep_job_records_each_kind_of_failure_and_releases_memory(tmp_path, capsys):
    from grpo_cli.errors import Interrupted

    class Model:  # stands for the job's model: referenced from the failing frame's locals
        pass

    refs = []

    def diverges():
        model = Model()
        refs.append(weakref.ref(model))
        raise RunFailed(
            "grpo-train: training stopped", ["3 steps in a row had a non-finite loss\nDiagnosis: ..."], code=3
        )

    def bug():
        raise KeyError("oops")

    def bad_config_exit():
        sys.exit(2)

    sweep = Sweep()
    for num, task in enumerate([diverges, bug, bad_config_exit, lambda: None]):
        sweep.run_job(task, sweep_dir=tmp_path, run_dir=tmp_path / str(num), overrides=[f"x={num}"], num=num)
    assert refs[0]() is None, "the failed job's objects are still alive"
    status = [summary.read_status(tmp_path / str(n)) for n in range(4)]
    assert [s["status"] for s in status] == ["failed", "failed", "failed", "completed"]
    assert [s["exit_code"] for s in status] == [3, 1, 2, 0]
    assert status[0]["error"] == "training stopped: 3 steps in a row had a non-finite loss"
    assert status[1]["error"] == "KeyError: 'oops'"
    err = capsys.readouterr().err
    assert "Traceback" in err and "KeyError" in err  # a bug keeps its traceback
    assert sweep.exit_code == 3
    assert sweep.finish() == 3 and sweep.finish() == 0  # once per sweep
    assert json.loads((tmp_path / "summary.json").read_text())["exit_code"] == 3

    def interrupted():
        raise Interrupted("SIGTERM", 143)

    with pytest.raises(Interrupted):
        sweep.run_job(interrupted, sweep_dir=tmp_path, run_dir=tmp_path / "4", overrides=[], num=4)
    assert summary.read_status(tmp_path / "4")["status"] == "interrupted"


def test_a_failed_sweep_job_leaves_no_model_alive(compose, tmp_path, monkeypatch, capsys):
    """The real engine: the reward raises at step 1, with the policy and reference models built."""
    import torch

    from grpo_cli.cli import train

    monkeypatch.syspath_prepend(str(ROOT / "tests"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = compose(
            [*SMALL, "loss.beta=0.04", "trainer.eval_before=false", "+reward.x.fn=reliability_helpers:boom"]
        )
        sweep = Sweep()
        sweep.run_job(
            lambda: train.run_one(cfg, tmp_path / "0", [], in_sweep=True),
            sweep_dir=tmp_path,
            run_dir=tmp_path / "0",
            overrides=[],
            num=0,
        )
    finally:
        torch.set_num_threads(threads)
    assert sweep.jobs[tmp_path / "0"]["status"] == "failed"
    alive = [
        o
        for o in gc.get_objects()
        if type(o).__name__.endswith("ForCausalLM") and isinstance(o, torch.nn.Module)
    ]
    assert not alive, f"{len(alive)} models outlived their job"


def test_a_run_that_trained_draws_its_plot_even_on_error_and_bad_input_draws_none(
    compose, tmp_path, monkeypatch, capsys
):
    from grpo_cli.cli import train
    from grpo_cli.errors import UserError

    def run(cfg, run_dir, on_start=None, d=None):
        on_start()
        fake_run(run_dir, steps=3)
        raise UserError("could not write checkpoint: disk full")

    real_figure = plots.run_figure
    monkeypatch.setattr(train, "train_config", run)
    with pytest.raises(RunFailed, match="disk full"):
        train.run_one(compose(["model=tiny"]), tmp_path / "run", [], in_sweep=False)
    assert_png(tmp_path / "run" / "metrics.png")

    def no_figure(*args, **kwargs):
        raise MemoryError("figure")

    monkeypatch.setattr(plots, "run_figure", no_figure)
    shutil.rmtree(tmp_path / "run")
    with pytest.raises(RunFailed, match="disk full"):  # the error is not hidden by the plot's
        train.run_one(compose(["model=tiny"]), tmp_path / "run", [], in_sweep=False)
    assert "could not draw the plots" in capsys.readouterr().err

    def bad_resume(
        cfg, run_dir, on_start=None, d=None
    ):  # bad input found before training: the folder is left as it was
        raise UserError("trainer.resume=auto found no checkpoint")

    monkeypatch.setattr(train, "train_config", bad_resume)
    monkeypatch.setattr(plots, "run_figure", real_figure)
    shutil.rmtree(tmp_path / "run")
    fake_run(tmp_path / "run")  # an earlier run's folder, resumed with bad input
    with pytest.raises(RunFailed):
        train.run_one(compose(["model=tiny"]), tmp_path / "run", [], in_sweep=False)
    assert not (tmp_path / "run" / "metrics.png").exists()


# ----------------------------------------------------------------------------- report_to


def test_report_to_validation(compose, monkeypatch):

    assert validate(compose(["model=tiny"])) == []
    assert compose([]).trainer.report_to == ["jsonl"]
    problems = validate(compose(["trainer.report_to=[jsonl,mlflow]"]))
    assert problems == [
        "trainer.report_to=[jsonl,mlflow]: unknown name mlflow; the valid names are jsonl, tensorboard, "
        "trackio, wandb (e.g. trainer.report_to=[jsonl,tensorboard]), or the import path of a tracker of "
        "yours (a module declaring PLUGIN)."
    ]
    import grpo_cli.trackers as trackers

    monkeypatch.setattr(trackers, "find_spec", lambda name: None if name == "tensorboard" else object())
    problems = validate(compose(["trainer.report_to=[tensorboard]"]))
    assert any("must include jsonl" in p for p in problems)
    assert any(
        "tensorboard package is not installed" in p
        and "pip install -e '.[tensorboard]' in grpo-cli's folder" in p
        for p in problems
    )


ROWS = [
    {"step": 0, "eval/accuracy": 0.25},
    {"step": 1, "reward": 0.5, "kl": 0.0, "clip_ratio/low_mean": 0.0, "pass_rate_hist": [1, 1]},
]


def test_tensorboard_gets_the_metrics_jsonl_names(tmp_path, monkeypatch):
    from grpo_cli.metrics import MetricsLogger

    calls = []

    class FakeWriter:
        def __init__(self, log_dir, purge_step=None):
            calls.append(("init", log_dir, purge_step))

        def add_scalar(self, tag, value, global_step):
            calls.append((tag, value, global_step))

        def flush(self):
            pass

        def close(self):
            calls.append(("close",))

    monkeypatch.setitem(
        sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=FakeWriter)
    )
    with MetricsLogger(tmp_path, total_steps=1, quiet=True, report_to=("jsonl", "tensorboard")) as log:
        for row in ROWS:
            log.log(row)
    assert calls == [
        ("init", str(tmp_path / "tensorboard"), None),
        ("eval/accuracy", 0.25, 0),
        ("reward", 0.5, 1),
        ("kl", 0.0, 1),
        ("clip_ratio/low_mean", 0.0, 1),
        ("close",),
    ]
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [
        0,
        1,
    ]


def test_tensorboard_event_files_hold_the_metrics(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from grpo_cli.metrics import MetricsLogger

    with MetricsLogger(tmp_path, total_steps=1, quiet=True, report_to=("jsonl", "tensorboard")) as log:
        for row in ROWS:
            log.log(row)
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["clip_ratio/low_mean", "eval/accuracy", "kl", "reward"]
    assert [(e.step, e.value) for e in events.Scalars("reward")] == [(1, 0.5)]


# ----------------------------------------------------------------------------- the timeline


def test_the_timeline_stacks_each_steps_phases_and_marks_its_events():
    rows = [
        {"step": 0, "eval/accuracy": 0.1},  # (before GRPO: no phases)
        {"step": 1, "time/rollout": 2.0, "time/policy": 1.0, "time/reward": 0.0, "frac_reward_zero_std": 0.5},
        {"step": 2, "time/rollout": 3.0, "time/policy": 1.5, "time/eval": 4.0, "frac_reward_zero_std": 1.0},
    ]
    events = [
        {"step": 2, "kind": "checkpoint", "text": "ckpt", "seconds": 0.5},
        {"step": 2, "kind": "health", "text": "no learning signal"},
        {"step": 3, "kind": "skipped", "text": "no group"},
    ]
    steps, phases = plots.step_phases(rows, events)
    assert steps == [1, 2]
    assert phases == {
        "rollout": [2.0, 3.0],
        "policy": [1.0, 1.5],
        "eval": [0.0, 4.0],
        "checkpoint": [0.0, 0.5],
    }
    assert list(phases) == [p for p in plots.PHASES if p in phases]  # in the order a step runs them
    assert plots.step_marks(rows, events) == {"skipped": [3], "zero_std": [2], "health": [2]}
    fig = plots.timeline_figure(rows, events, "run")
    ax = fig.axes[0]
    assert len(ax.patches) == 2 * 4  # a bar a step and phase
    assert max(p.get_y() + p.get_height() for p in ax.patches) == pytest.approx(9.0)  # step 2 stacked
    labels = {c.get_label() for c in ax.collections}
    assert labels == {plots.MARKERS[k][2] for k in ("skipped", "zero_std", "health")}


def test_a_run_logs_its_events_and_draws_its_timeline(compose, tmp_path):
    """A tiny run whose rewards are all alike: every step zero-std (marked), the health warning an
    event, each checkpoint an event with its seconds, the held-out evaluation's seconds in its row;
    timeline.png drawn from the run's files alone."""
    from conftest import tiny

    from grpo_cli.cli.train import train_config

    cfg = compose(
        tiny(
            "reward=[]",
            "+reward.same.fn=reward_fixtures:constant",
            "trainer.max_steps=5",  # (no learning signal: said after 5 zero-std steps)
            "trainer.save_steps=2",
            "data.eval_size=4",
            "trainer.precision=fp32",
        )
    )
    train_config(cfg, tmp_path)
    events = summary.read_events(tmp_path)
    assert [e["step"] for e in events if e["kind"] == "checkpoint"] == [2, 4, 5]
    assert all(e["seconds"] > 0 for e in events if e["kind"] == "checkpoint")
    health = [e for e in events if e["kind"] == "health"]
    assert any("no learning signal" in h["text"] for h in health), health
    rows = summary.read_metrics(tmp_path)
    assert rows[-1]["time/eval"] > 0
    marks = plots.step_marks(rows, events)
    assert marks["zero_std"] == [1, 2, 3, 4, 5] and marks["health"] == sorted({h["step"] for h in health})
    assert_png(plots.draw_run(tmp_path))
    assert_png(tmp_path / plots.TIMELINE_PLOT)


def test_grpo_report_gives_held_out_accuracy_at_the_best_step_and_at_the_end(tmp_path, capsys):
    """A run with checkpoints/best (chosen on the validation set): grpo-report says its step and
    metric, and the held-out accuracy there beside the last evaluation's."""
    from grpo_cli.cli import report

    run = tmp_path / "run"
    best = run / "checkpoints" / "best"
    best.mkdir(parents=True)
    rows = [
        {"step": 0, "eval/accuracy": 0.25},
        {"step": 8, "reward": 0.5, "eval/accuracy": 0.5, "val/accuracy": 0.7},
        {"step": 16, "reward": 0.6, "eval/accuracy": 0.45, "val/accuracy": 0.6},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (best / "best.json").write_text(json.dumps({"metric": "val/accuracy", "value": 0.7, "step": 8}))
    report.main([str(run)])
    out = " ".join(capsys.readouterr().out.split())
    assert (
        "best step 8 (val/accuracy 0.700); held-out accuracy there 0.500, at the end (step 16) 0.450" in out
    ), out
    (best / "best.json").unlink()
    report.main([str(run)])
    assert "best step" not in capsys.readouterr().out
