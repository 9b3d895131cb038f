"""Behaviour that matters most on a GPU, run on the device under test: GRPO_TEST_DEVICE (cuda in
`scripts/device_check.sh` on a GPU machine; cpu everywhere else, where each test exercises the
same code path with the CPU's own version of the event). Marked `gpu`: `pytest -m gpu`."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from conftest import tiny
from safetensors.torch import load_file

from grpo_cli.cli.train import train_config as run

DEVICE = os.environ.get("GRPO_TEST_DEVICE", "cpu")
CUDA = DEVICE.startswith("cuda")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(CUDA and not torch.cuda.is_available(), reason="GRPO_TEST_DEVICE=cuda, no GPU here"),
]

TINY = tiny(
    "data.eval_size=0",
    "trainer.eval_before=false",
    "trainer.prompts_per_step=2",
    "reward=[]",
    "+reward.code.fn=reward_fixtures:char_code",
    f"trainer.device={DEVICE}",
)


def rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_auto_precision_on_the_device():
    from grpo_cli.precision import cpu_has_bf16, resolve_precision

    p = resolve_precision("auto", torch.device(DEVICE))
    if CUDA:
        assert p.name == ("bf16" if torch.cuda.is_bf16_supported() else "fp16")
    else:
        assert p.name == ("bf16" if cpu_has_bf16() else "fp32")
    assert (p.weights_dtype == torch.bfloat16) is (p.name == "bf16")


def test_bf16_weights_with_fp32_masters_train_on_the_device(compose, tmp_path):
    """Two steps in bf16: the step-0 self-check passes, metrics are finite, and the checkpoint
    (the fp32 masters) moved away from the base weights."""
    from grpo_cli.models import build_tiny

    cfg = compose(
        TINY + ["trainer.precision=bf16", "loss.beta=0.04", "trainer.max_steps=2", "trainer.save_steps=2"]
    )
    run(cfg, tmp_path)
    for row in rows(tmp_path):
        assert all(math.isfinite(v) for v in row.values() if isinstance(v, float)), row
    saved = load_file(tmp_path / "checkpoints" / "step-000002" / "model.safetensors")
    base = load_file(build_tiny() / "model.safetensors")
    assert {v.dtype for v in saved.values()} == {torch.float32}
    assert any(not torch.equal(saved[k], base[k]) for k in saved)


def test_fp16_grad_scaler_skips_an_overflowing_step_logs_it_and_keeps_training(
    compose, tmp_path, monkeypatch, capsys
):
    """A grad scaler whose scale overflows the gradients (init_scale 1e38): the update is skipped
    (weights unchanged), the scaler lowers its scale, the warning says so, and the skip does not
    count toward trainer.max_bad_steps (the run ends normally). On the CPU, which has no fp16
    autocast, the same scaler path runs under bf16 autocast."""
    from grpo_cli import build
    from grpo_cli.models import build_tiny
    from grpo_cli.precision import Precision

    real = torch.amp.GradScaler.__init__
    monkeypatch.setattr(
        torch.amp.GradScaler, "__init__", lambda self, *a, **kw: real(self, *a, **{**kw, "init_scale": 1e38})
    )
    if not CUDA:
        monkeypatch.setattr(
            build, "resolve_precision", lambda *a, **kw: Precision("fp16", torch.bfloat16, True)
        )
    cfg = compose(
        TINY
        + ["trainer.precision=fp16", "trainer.max_steps=2", "trainer.save_steps=2", "trainer.max_bad_steps=1"]
    )
    run(cfg, tmp_path)
    got = rows(tmp_path)
    assert [
        (r["skipped_updates"], r["skipped_updates/grad_scaler"], r["skipped_updates/nonfinite"]) for r in got
    ] == [
        (1, 1, 0),
        (1, 1, 0),
    ]
    saved = load_file(tmp_path / "checkpoints" / "step-000002" / "model.safetensors")
    base = load_file(build_tiny() / "model.safetensors")
    assert all(torch.equal(saved[k], base[k].to(saved[k].dtype)) for k in saved)
    err = capsys.readouterr().err
    assert "grad scaler lowers its scale to 5e+37" in err, err


def test_running_out_of_memory_says_how_to_make_a_step_fit(compose, tmp_path, monkeypatch):
    """An allocation failure in the middle of a step (on a GPU a real one, 35 TB): one paragraph
    with the settings that shrink a step, exit status 2, no traceback."""
    from grpo_cli.cli.sweep import RunFailed
    from grpo_cli.cli.train import _run_here
    from grpo_cli.distributed import Dist
    from grpo_cli.samplers import builtin

    def sample(*args, **kwargs):
        if CUDA:  # a real one: 35 TB
            return torch.empty(2**45, dtype=torch.uint8, device=DEVICE)
        # (the CPU allocator's own words: a real 35 TB request may succeed under memory overcommit)
        raise RuntimeError(
            "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: "
            "you tried to allocate 35184372088832 bytes. Error code 12 (Cannot allocate memory)"
        )

    monkeypatch.setattr(builtin, "sample", sample)
    cfg = compose(TINY + ["trainer.max_steps=1", "trainer.gradient_accumulation_steps=2"])
    with pytest.raises(RunFailed) as info:
        _run_here(cfg, tmp_path, [], in_sweep=True, d=Dist())
    message = info.value.message()
    assert info.value.code == 2
    assert "ran out of memory" in message and "trainer.gradient_accumulation_steps (now 2)" in message
    assert "grpo-check-env" in message


def test_a_sweep_job_hands_its_cached_gpu_memory_back(monkeypatch):
    """Between sweep jobs the CUDA caching allocator's free blocks are released, so the next job
    starts with the whole GPU (a CPU machine: torch.cuda is stood in for)."""
    from grpo_cli.cli import sweep

    calls = []
    if not CUDA:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    real = torch.cuda.empty_cache
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(1) or (real() if CUDA else None))
    sweep.release_memory()
    assert calls == [1]
