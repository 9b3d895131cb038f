"""Saved rollouts and replay (grpo_cli/replay.py, docs/replay.md): a run saved with
trainer.save_rollouts=true, replayed with trainer.replay=RUN_DIR, ends with the original's weights
bit for bit; another loss config is said and differs; what cannot replay is refused before any model
loads. Both runs of a pair run in this process on one thread, so what is compared is machine
independent (the same machine computes both)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import grpo, tiny

BASE = tiny(
    "trainer.max_steps=3",
    "trainer.precision=fp32",
    "loss.beta=0.04",
    "optimizer.learning_rate=1e-3",
    "trainer.eval_before=false",
    "data.eval_size=4",
    "reward=[]",
    "+reward.code.fn=reward_fixtures:char_code",
    "trainer.save_steps=1",
    "trainer.keep_last=3",
)


def _weights(checkpoint: Path) -> dict:
    from safetensors.torch import load_file

    return {k: v for f in sorted(checkpoint.glob("*.safetensors")) for k, v in load_file(f).items()}


def _train(compose, overrides, run_dir: Path) -> list[dict]:
    from grpo_cli.cli.train import train_config
    from grpo_cli.summary import read_metrics

    run_dir.mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train_config(compose(overrides), run_dir)
    finally:
        torch.set_num_threads(threads)
    return [r for r in read_metrics(run_dir) if r["step"] > 0]


def _saved(compose, tmp_path, *extra) -> Path:
    original = tmp_path / "original"
    _train(compose, [*BASE, *extra, "trainer.save_rollouts=true"], original)
    return original


UPDATE_KEYS = (
    "loss",
    "grad_norm",
    "kl",
    "entropy",
    "num_rows_trained",
    "learning_rate",
    "reward",
    "reward_std",
)


@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["adapter=lora"],  # the adapter's weights (the LoRA init draws from the seeded generator)
        ["trainer.dynamic_sampling=true", "trainer.max_sampling_tries=1"],  # groups dropped
        ["trainer.num_iterations=2", "loss.epsilon=0.1"],  # the policy moves between sampling and update
    ],
    ids=["full", "lora", "dynamic", "iterations"],
)
def test_a_replay_ends_with_the_originals_weights_bit_for_bit(compose, tmp_path, capsys, extra):
    """The same config, read back from the saved rollouts, without sampling or rewards: every
    weight equal, and the update's metrics too (the replay says so itself)."""
    original = _saved(compose, tmp_path, *extra)
    rows = _train(
        compose, [*BASE, *extra, f"trainer.replay={original}", "trainer.quiet=false"], tmp_path / "replay"
    )
    said = capsys.readouterr().out
    assert "replay: 3 saved steps (1-3)" in said and "bit for bit" in said, said
    assert "differs from the original" not in said, said
    theirs, ours = (_weights(run / "checkpoints" / "step-000003") for run in (original, tmp_path / "replay"))
    assert theirs.keys() == ours.keys() and theirs
    assert all(torch.equal(theirs[k], ours[k]) for k in theirs)
    moved = _weights(original / "checkpoints" / "step-000001")
    assert any(not torch.equal(moved[k], theirs[k]) for k in theirs)  # (the steps trained)
    for a, b in zip(_rows(original), rows, strict=True):
        assert {k: a[k] for k in UPDATE_KEYS if k in a} == {k: b[k] for k in UPDATE_KEYS if k in a}
        assert b["time/rollout"] == 0.0 < a["time/rollout"]  # (nothing sampled)


def _rows(run: Path) -> list[dict]:
    from grpo_cli.summary import read_metrics

    return [r for r in read_metrics(run) if r["step"] > 0]


def test_a_replay_under_another_loss_says_so_and_differs(compose, tmp_path, capsys):
    """loss=dr_grpo over the same rollouts: allowed, the difference named, the weights not equal."""
    original = _saved(compose, tmp_path)
    capsys.readouterr()
    _train(
        compose,
        [*BASE, "loss=dr_grpo", f"trainer.replay={original}", "trainer.quiet=false"],
        tmp_path / "replay",
    )
    said = capsys.readouterr().out.replace("\n", " ")
    assert "differs from the original in loss.loss_type: 'grpo' -> 'dr_grpo'" in said, said
    assert "differ from the original's" in said and "bit for bit" not in said
    theirs, ours = (_weights(run / "checkpoints" / "step-000003") for run in (original, tmp_path / "replay"))
    assert any(not torch.equal(theirs[k], ours[k]) for k in theirs)


def test_the_saved_files(compose, tmp_path):
    """One safetensors file a step and a JSON index: each step's rows as the update read them
    (token ids back as int64, the per-reward values as float64), the generator state, the seeds."""
    from safetensors import safe_open

    from grpo_cli import replay

    original = _saved(compose, tmp_path)
    index = json.loads((original / "rollouts" / "index.json").read_text())
    assert index["threads"] == 1 and index["world_size"] == 1 and index["names"] == ["code"]
    assert sorted(index["steps"]) == ["1", "2", "3"] and index["steps"]["1"]["first"]
    assert not index["steps"]["2"]["first"]
    assert (original / "rollouts" / "config.yaml").is_file()
    saved = replay.Saved(original, index)
    torch.manual_seed(12345)  # (any other state: the draw sets the step's)
    sampled = saved.draw(2, "cpu", 0)
    with safe_open(str(original / "rollouts" / "step-000002.safetensors"), framework="pt") as f:
        assert f.get_tensor("completion_ids").dtype == torch.int32  # stored narrow
        assert torch.equal(torch.get_rng_state(), f.get_tensor("rng_state.0"))
        seeds = f.get_tensor("seeds")
    scored = sampled.train
    assert scored.rollout.completion_ids.dtype == torch.int64 and scored.values.dtype == torch.float64
    assert scored.num_generations == 4 and scored.totals.shape == (16,) and seeds.shape == (16,)
    assert index["steps"]["2"]["rows"] == 16 and index["steps"]["2"]["bytes"] > 0


@pytest.mark.parametrize(
    "values, weights, totals",
    [
        ([[1.0, 0.5]], [1.0, 1.0], [1.5]),
        ([[1.0, 0.5]], [2.0, 0.5], [2.25]),
        ([[math.nan, 0.5]], [2.0, 1.0], [0.5]),  # a reward that gave no value is left out
        ([[0.1, 0.2], [0.3, math.nan]], [1.0, 1.0], [0.1 + 0.2, 0.3]),  # Python's float sum, bit for bit
    ],
)
def test_totals_recomputed_under_new_weights(values, weights, totals):  # (weighted_totals alone)
    from grpo_cli.replay import weighted_totals

    got = weighted_totals(torch.tensor(values, dtype=torch.float64), weights).tolist()
    assert got == totals


def test_new_weights_keep_a_failed_row_out_and_pass_by_the_new_totals(compose, tmp_path):
    """Reweighed totals: each row's values under the new weights, but a row whose scoring failed
    (its saved total NaN: its group left out of the loss) stays NaN; without a correctness reward
    the pass rule (total > 0) follows the new totals."""
    from grpo_cli import replay

    original = _saved(compose, tmp_path)
    index = json.loads((original / "rollouts" / "index.json").read_text())
    tensors, metadata = replay._load(original / "rollouts" / "step-000001.safetensors")
    tensors["totals"][0] = math.nan
    scored = replay._scored(tensors, metadata, index, (-2.0,), judge=None)
    values = tensors["values"][:, 0]
    assert math.isnan(scored.totals[0]) and torch.equal(scored.totals[1:], -2.0 * values[1:])
    assert torch.equal(scored.passed, scored.totals > 0) and not torch.equal(scored.passed, tensors["passed"])


@pytest.mark.parametrize(
    "edit, overrides, message",
    [
        (None, ["trainer.replay={tmp}/nowhere"], "no saved rollouts there"),
        ({"threads": 7}, [], "start the replay with OMP_NUM_THREADS=7"),
        ({"world_size": 2}, [], "set trainer.num_processes=2"),
        ({"device": "cuda:0"}, [], "replay is offered on the CPU only"),
        (None, ["hydra.run.dir={original}"], "give the replay a folder of its own"),
        (None, ["reward=[format]"], "configure the original's rewards"),
        (None, ["data.pass_rate_band=[0.1,0.9]"], "remove it from the replay's command"),
        (None, ["model.revision=v2"], "the model differs from the original's"),
    ],
    ids=["missing", "threads", "world-size", "device", "same-folder", "rewards", "band", "model"],
)
def test_what_cannot_replay_is_refused_before_a_model_loads(
    compose, tmp_path, monkeypatch, edit, overrides, message
):
    from grpo_cli import build
    from grpo_cli.errors import UserError

    original = _saved(compose, tmp_path)
    if edit:  # (the run's facts are the index's and each step's)
        path = original / "rollouts" / "index.json"
        index = json.loads(path.read_text()) | edit
        index["steps"] = {k: v | edit for k, v in index["steps"].items()}
        path.write_text(json.dumps(index))

    def no_model(*args, **kwargs):
        raise AssertionError("a model loaded")

    monkeypatch.setattr(build, "load_policy", no_model)
    given = [o.replace("{tmp}", str(tmp_path)).replace("{original}", str(original)) for o in overrides]
    replay = [] if any(o.startswith("trainer.replay") for o in given) else [f"trainer.replay={original}"]
    into = original if "hydra.run.dir" in " ".join(given) else tmp_path / "replay"
    given = [o for o in given if not o.startswith("hydra.")]
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _train(compose, [*BASE, *given, *replay], into)


def test_replay_from_the_command_line(tmp_path):
    """grpo-train twice, as a user types it: the run saved, then replayed with its own command plus
    trainer.replay; the replay exits 0 and says its weights equal the original's."""
    args = [*BASE, "trainer.save_rollouts=true", f"hydra.run.dir={tmp_path / 'original'}"]
    first = grpo(args, tmp_path)
    assert first.returncode == 0, first.stderr
    again = grpo(
        [
            *BASE,
            "trainer.save_rollouts=true",  # (the original's own command: a replay reads rollouts, writes none)
            f"trainer.replay={tmp_path / 'original'}",
            "trainer.quiet=false",
            f"hydra.run.dir={tmp_path / 'replay'}",
        ],
        tmp_path,
    )
    assert again.returncode == 0, again.stderr
    assert "weights equal the original's" in again.stdout.replace("\n", " "), again.stdout
    assert not (tmp_path / "replay" / "rollouts").exists()  # a replay reads rollouts, it writes none
