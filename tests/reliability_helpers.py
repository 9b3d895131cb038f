"""Helpers for tests/test_reliability.py: reward functions that misbehave, and a grpo-train
entry point that injects faults (a signal after a step, SIGKILL inside a checkpoint write, a
non-finite loss) chosen by the GRPO_TEST_FAULT environment variable, then runs the real
console-script code path.

    python -c "import reliability_helpers as h; h.main()" model=tiny ...   # like grpo-train
"""

from __future__ import annotations

import os
import signal

# ----------------------------------------------------------------------------- rewards


def boom(completions, **kwargs):
    raise ZeroDivisionError("division by zero inside my reward")


def one_short(completions, **kwargs):
    return [1.0] * (len(completions) - 1)


def not_a_number(completions, **kwargs):
    return [float("nan")] * len(completions)


def words(completions, **kwargs):
    return ["high"] * len(completions)


class BrokenEnv:
    """An environment whose step raises (every turn of the random tiny model ends: stop on any character)."""

    stop = [chr(c) for c in range(33, 127)]

    def reset(self, row):
        return None

    def step(self, text):
        raise RuntimeError("the game server is down")


# ----------------------------------------------------------------------------- fault injection


def _kill(sig=signal.SIGKILL):
    os.kill(os.getpid(), sig)


def install(spec: str) -> None:
    """`signal_during_build:SIGNAME`: send the signal while the run is being built (before training).
    `signal_after_step:K:SIGNAME`: send the signal to this process once step K is logged.
    `kill_after_save:K`: SIGKILL right after the step-K checkpoint is in place.
    `kill_before_state:K`: SIGKILL inside the step-K write, before trainer_state.pt is written.
    `kill_before_rename:K`: SIGKILL inside the step-K write, before the temporary folder is renamed.
    `kill_during_rotate:K`: SIGKILL half-way through deleting an old checkpoint after saving step K.
    `nan_loss_from:K`: the loss is NaN from step K on (one loss call per step).
    `no_sampler_sync`: sampler=vllm's engine gets the policy's weights once, at its start, and
    never again (a weight sync that silently does nothing)."""
    import shutil

    import torch

    from grpo_cli import build, checkpoint, metrics
    from grpo_cli import step as train_step

    kind, _, arg = spec.partition(":")
    if kind == "no_sampler_sync":
        from grpo_cli.samplers import vllm

        original_sync, calls = vllm.VLLMSampler.sync, {"n": 0}

        def sync(self, policy):
            calls["n"] += 1
            if calls["n"] == 1:  # the engine's start
                original_sync(self, policy)

        vllm.VLLMSampler.sync = sync
        return
    if kind == "signal_during_build":
        original_load_tokenizer = build.load_tokenizer

        def load_tokenizer(*a, **kw):
            _kill(getattr(signal, arg))
            return original_load_tokenizer(*a, **kw)

        build.load_tokenizer = load_tokenizer
        return
    if kind == "signal_after_step":
        step, _, name = arg.partition(":")
        original_log = metrics.MetricsLogger.log

        def log(self, row):
            original_log(self, row)
            if row.get("step") == int(step):
                _kill(getattr(signal, name))

        metrics.MetricsLogger.log = log
        return
    step = int(arg)
    saving = {"step": None}
    original_save = checkpoint.save_checkpoint

    def save_checkpoint(run_dir, state, **kw):
        saving["step"] = state.step
        path = original_save(run_dir, state, **kw)
        if kind == "kill_after_save" and state.step == step:
            _kill()
        return path

    checkpoint.save_checkpoint = save_checkpoint
    if kind == "kill_before_state":
        original_torch_save = torch.save

        def torch_save(obj, f, *a, **kw):
            if saving["step"] == step and str(f).endswith("trainer_state.pt"):
                _kill()
            return original_torch_save(obj, f, *a, **kw)

        torch.save = torch_save
    elif kind == "kill_before_rename":
        original_replace = os.replace

        def replace(src, dst):
            if saving["step"] == step and os.path.basename(src).startswith(checkpoint.TMP_PREFIX):
                _kill()
            return original_replace(src, dst)

        checkpoint.os.replace = replace  # checkpoint's `os` is the os module: patched for all
    elif kind == "kill_during_rotate":
        original_rmtree = shutil.rmtree

        def rmtree(path, *a, **kw):
            if saving["step"] == step and os.path.basename(str(path)).startswith(checkpoint.TRASH_PREFIX):
                os.remove(os.path.join(path, "model.safetensors"))  # half-deleted...
                _kill()  # ...when the kill lands
            return original_rmtree(path, *a, **kw)

        checkpoint.shutil.rmtree = rmtree
    elif kind == "nan_loss_from":
        original_loss = train_step.grpo_loss
        calls = {"n": 0}

        def grpo_loss(*a, **kw):
            loss, stats = original_loss(*a, **kw)
            calls["n"] += 1
            if calls["n"] >= step:
                loss = loss * float("nan")
            return loss, stats

        train_step.grpo_loss = grpo_loss
    elif kind != "kill_after_save":  # (that one is handled by the save_checkpoint wrapper)
        raise ValueError(f"unknown GRPO_TEST_FAULT {spec!r}")


def main() -> None:
    import sys

    spec = os.environ.get("GRPO_TEST_FAULT")
    if spec:
        install(spec)
    from grpo_cli.cli.train import main as train_main

    sys.argv[0] = "grpo-train"
    train_main()


class Chatty:
    """An environment that answers every turn (each ends at its first character: stop on any), so
    the random tiny model's episodes have several turns."""

    stop = [chr(c) for c in range(33, 127)]

    def reset(self, row):
        return None

    def step(self, text):
        return "ok"
