"""The memory levers of issue #62 (docs/precision.md, "Memory levers"): AdamW with 8-bit state
(optimizer.name=adamw_8bit, bitsandbytes), bf16 weights stepped with stochastic rounding and no
fp32 master copy (optimizer.name=adamw_bf16_sr, torchao), and frozen models kept in bf16 while the
policy trains in fp32 (trainer.frozen_precision=bf16). Tiny model, CPU. The optimizers' tests skip
where their library (the memory-levers extra) is not installed."""

from __future__ import annotations

import gc
import importlib.util

import pytest
import torch
from conftest import tiny
from safetensors.torch import load_file

from grpo_cli.cli.train import train_config as run
from grpo_cli.config.validation import validate
from grpo_cli.models import build_tiny

TINY = tiny(
    "data.eval_size=0",
    "trainer.eval_before=false",
    "trainer.prompts_per_step=2",
    "trainer.precision=fp32",
    "optimizer.learning_rate=1e-2",
    "reward=[]",
    "+reward.code.fn=reward_fixtures:char_code",  # (varied: every group has signal)
)

needs_bnb = pytest.mark.skipif(
    importlib.util.find_spec("bitsandbytes") is None,
    reason="bitsandbytes is not installed (pip install -e '.[memory-levers]')",
)
needs_torchao = pytest.mark.skipif(
    importlib.util.find_spec("torchao") is None,
    reason="torchao is not installed (pip install -e '.[memory-levers]')",
)


def _parts(compose, tmp_path, overrides):
    from rich.console import Console

    from grpo_cli.build import build_training
    from grpo_cli.config import to_typed

    cfg = compose(TINY + overrides)
    assert validate(cfg) == []
    return build_training(to_typed(cfg), tmp_path, Console(quiet=True))


def _moved(folder) -> float:
    """The largest change of any weight from the tiny model's, in the last checkpoint of `folder`."""
    last = max((folder / "checkpoints").iterdir())
    got, base = load_file(last / "model.safetensors"), load_file(build_tiny() / "model.safetensors")
    return max(float((got[k].float() - base[k].float()).abs().max()) for k in base)


@pytest.fixture
def eager_compile():
    """torch.compile off (torchao compiles its update per parameter shape; eager is the same
    arithmetic, without tens of seconds of compiling on a cold cache)."""
    with torch.compiler.set_stance("force_eager"):
        yield


# ----------------------------------------------------------------------------- 8-bit AdamW


@needs_bnb
def test_adamw_8bit_trains_with_8bit_state_and_fp32_for_small_tensors(compose, tmp_path):
    parts = _parts(compose, tmp_path, ["optimizer=adamw_8bit"])
    opt = parts.learner.opt_step.optimizer
    assert type(opt).__name__ == "AdamW8bit" and type(opt).__module__.startswith("bitsandbytes")
    policy = parts.learner.policy
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    for p in policy.parameters():
        p.grad = torch.randn_like(p)
    parts.learner.opt_step.step(1.0, has_signal=True)
    assert all(not torch.equal(p, before[n]) for n, p in policy.named_parameters())
    kinds = set()
    for p in policy.parameters():
        state = opt.state[p]
        if p.numel() >= 4096:  # (bitsandbytes' min_8bit_size)
            assert state["state1"].dtype == state["state2"].dtype == torch.uint8
            assert state["state1"].shape == p.shape
            kinds.add("8-bit")
        else:
            assert state["state1"].dtype == state["state2"].dtype == torch.float32
            kinds.add("fp32")
    assert kinds == {"8-bit", "fp32"}  # (the tiny model has both: k/v projections, norms)


@needs_bnb
def test_adamw_8bit_trains_from_yaml_and_a_resume_restores_its_8bit_state(compose, tmp_path):
    """grpo-train optimizer=adamw_8bit: the weights move; the checkpoint's optimizer.pt holds the
    uint8 state and loads with weights_only=True, back into uint8 state (torch's load_state_dict
    would cast a state tensor to its parameter's dtype; bitsandbytes' keeps its own); 2 steps
    straight equal 1 + resume 1 bit for bit."""
    args = TINY + ["optimizer=adamw_8bit", "trainer.save_steps=1", "trainer.keep_last=3"]
    for folder in ("straight", "split"):
        (tmp_path / folder).mkdir()
    row = run(compose(args + ["trainer.max_steps=2"]), tmp_path / "straight")
    assert row["step"] == 2
    assert _moved(tmp_path / "straight") > 1e-3
    saved = torch.load(
        tmp_path / "straight" / "checkpoints" / "step-000001" / "optimizer.pt", weights_only=True
    )
    # (bitsandbytes' state_dict nests each parameter's tensors under one key)
    quantised = [s["__bnb_optimizer_quant_state__"] for s in saved["state"].values()]
    assert {q["state1"].dtype for q in quantised} == {torch.uint8, torch.float32}

    run(compose(args + ["trainer.max_steps=1"]), tmp_path / "split")
    resumed = ["optimizer=adamw_8bit", "trainer.max_steps=2", "trainer.resume=auto"]
    parts = _parts(compose, tmp_path / "split", resumed)
    assert parts.state.step == 1
    opt, embed = parts.learner.opt_step.optimizer, parts.learner.policy.get_input_embeddings().weight
    assert opt.state[embed]["state1"].dtype == torch.uint8 and int(opt.state[embed]["step"]) == 1
    del parts, opt, embed
    run(compose(args + ["trainer.max_steps=2", "trainer.resume=auto"]), tmp_path / "split")
    want = load_file(tmp_path / "straight" / "checkpoints" / "step-000002" / "model.safetensors")
    got = load_file(tmp_path / "split" / "checkpoints" / "step-000002" / "model.safetensors")
    assert all(torch.equal(want[k], got[k]) for k in want)


# ----------------------------------------------------------------------------- bf16, stochastic rounding


@needs_torchao
def test_bf16_stochastic_rounding_keeps_no_fp32_master_copy(compose, tmp_path, eager_compile):
    parts = _parts(compose, tmp_path, ["optimizer.name=adamw_bf16_sr", "trainer.precision=bf16"])
    step, policy = parts.learner.opt_step, parts.learner.policy
    assert step.masters is None
    stepped = [p for group in step.optimizer.param_groups for p in group["params"]]
    assert [id(p) for p in stepped] == [id(p) for p in policy.parameters()]
    assert {p.dtype for p in stepped} == {torch.bfloat16}
    before = [p.detach().clone() for p in stepped]
    for p in stepped:
        p.grad = torch.randn_like(p)
    step.step(1.0, has_signal=True)
    assert all(not torch.equal(p, b) for p, b in zip(stepped, before))
    for p in stepped:  # the moments are the weights' dtype too
        state = step.optimizer.state[p]
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
    # The fp32 copies MasterWeights made at load are gone: no fp32 tensor of a weight's shape is alive.
    del parts, step, stepped, before
    gc.collect()
    shapes = {tuple(p.shape) for p in policy.parameters() if p.numel() >= 4096}
    alive = [
        o
        for o in gc.get_objects()
        if type(o) in (torch.Tensor, torch.nn.Parameter)
        and o.dtype == torch.float32
        and tuple(o.shape) in shapes
    ]
    assert alive == []


@needs_torchao
def test_bf16_stochastic_rounding_trains_from_yaml_and_resumes_bit_exact(compose, tmp_path, eager_compile):
    """The weights move and are checkpointed in bf16 (no fp32 copy to write); 2 steps straight
    equal 1 + resume 1 bit for bit (the moments in optimizer.pt, the rounding's random draws from
    the RNG state the checkpoint restores)."""
    args = TINY + ["optimizer.name=adamw_bf16_sr", "trainer.precision=bf16", "trainer.save_steps=1"]
    for folder in ("straight", "split"):
        (tmp_path / folder).mkdir()
    row = run(compose(args + ["trainer.max_steps=2"]), tmp_path / "straight")
    assert row["step"] == 2 and isinstance(row["learning_rate"], float)
    want = load_file(tmp_path / "straight" / "checkpoints" / "step-000002" / "model.safetensors")
    assert {v.dtype for v in want.values()} == {torch.bfloat16}
    assert _moved(tmp_path / "straight") > 1e-3
    run(compose(args + ["trainer.max_steps=1"]), tmp_path / "split")
    run(compose(args + ["trainer.max_steps=2", "trainer.resume=auto"]), tmp_path / "split")
    got = load_file(tmp_path / "split" / "checkpoints" / "step-000002" / "model.safetensors")
    assert all(torch.equal(want[k], got[k]) for k in want)


@needs_torchao
def test_stochastic_rounding_lands_updates_that_rounding_to_nearest_loses(eager_compile):
    """Weights of 1.0 moved down by lr 1e-3 (Adam's first step is lr * sign(grad)); below 1.0
    bf16's step is 2**-8 (0.0039): rounding to nearest leaves them all at 1.0, stochastic rounding
    moves 1e-3 / 2**-8 = 26% of them one step down, so their mean lands near 1 - 1e-3."""
    from grpo_cli.config.schema import OptimizerConfig
    from grpo_cli.optim import build_optimizer

    cfg = OptimizerConfig(name="adamw_bf16_sr", learning_rate=1e-3)
    p = torch.nn.Parameter(torch.ones(256, 64, dtype=torch.bfloat16))
    opt, _ = build_optimizer([p], cfg, total_updates=1)
    torch.manual_seed(0)
    p.grad = torch.ones_like(p)
    opt.step()
    moved = float((p != 1).float().mean())
    assert 0.2 < moved < 0.31, moved
    assert float(p.detach().float().mean()) == pytest.approx(1 - 1e-3, abs=3e-4)
    q = torch.nn.Parameter(torch.ones(256, 64, dtype=torch.bfloat16))
    plain = torch.optim.AdamW([q], lr=1e-3, weight_decay=0.0)
    q.grad = torch.ones_like(q)
    plain.step()
    assert bool((q == 1).all())


@pytest.mark.slow  # (torch.compile: inductor may load its compiled kernel in a subprocess)
@needs_torchao
def test_bf16_stochastic_rounding_compiles_and_steps_on_this_device():
    """torchao's own path: the update compiled by torch.compile (one parameter shape: seconds)."""
    from grpo_cli.config.schema import OptimizerConfig
    from grpo_cli.optim import build_optimizer

    p = torch.nn.Parameter(torch.ones(64, 64, dtype=torch.bfloat16))
    opt, _ = build_optimizer([p], OptimizerConfig(name="adamw_bf16_sr", learning_rate=1e-3), total_updates=1)
    p.grad = torch.ones_like(p)
    opt.step()
    assert 0 < float((p != 1).float().mean()) < 0.3


# ----------------------------------------------------------------------------- frozen models in bf16


def test_a_bf16_reference_beside_an_fp32_policy_and_its_measured_kl(compose, tmp_path):
    """trainer.frozen_precision=bf16: the reference is stored in bf16 while the policy trains in
    fp32, and its log-probs come back in fp32. At step 1 the policy equals the reference, so the KL
    is exactly 0 with an fp32 reference and, with a bf16 one, bf16's rounding alone: 2.4e-7 measured
    on the tiny model (bounded here by 1e-5), not 0."""
    parts = _parts(compose, tmp_path / "parts", ["loss.beta=0.04", "trainer.frozen_precision=bf16"])
    assert {p.dtype for p in parts.learner.ref.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in parts.learner.policy.parameters()} == {torch.float32}
    del parts
    rows = {}
    for frozen in ("same", "bf16"):
        (tmp_path / frozen).mkdir()
        args = TINY + ["loss.beta=0.04", f"trainer.frozen_precision={frozen}", "trainer.max_steps=1"]
        rows[frozen] = run(compose(args), tmp_path / frozen)
    assert rows["same"]["kl"] == 0.0
    assert 0 < rows["bf16"]["kl"] < 1e-5, rows["bf16"]["kl"]
    assert rows["bf16"]["loss"] == pytest.approx(rows["same"]["loss"], abs=1e-3)


def test_reference_logprobs_of_a_bf16_reference_are_fp32_and_close(compose, tmp_path):
    """The reference pass itself (step.reference_logprobs' scorer) on the same tokens: a bf16 copy
    of the tiny model against its fp32 self, returned in fp32 and within bf16's rounding."""
    from grpo_cli.logprobs import ScoringOptions, score_tokens
    from grpo_cli.models import load_model, resolve_source
    from grpo_cli.precision import to_weights_dtype

    src = resolve_source("builtin:tiny")
    fp32 = load_model(src, device=torch.device("cpu"), trainable=False)
    bf16 = load_model(src, device=torch.device("cpu"), trainable=False)
    to_weights_dtype(bf16, torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 60, (4, 6), generator=gen)
    completion = torch.randint(3, 60, (4, 10), generator=gen)
    ones = torch.ones_like
    options = ScoringOptions(temperature=1.0)
    with torch.inference_mode():
        a = score_tokens(fp32, prompt, ones(prompt), completion, ones(completion), options).logps
        b = score_tokens(bf16, prompt, ones(prompt), completion, ones(completion), options).logps
    assert a.dtype == b.dtype == torch.float32
    diff = float((a - b).abs().max())
    assert 0 < diff < 0.02, diff  # measured 0.0018 (mean 0.0006) where |log p| is up to 4.9


def test_a_teacher_is_kept_in_bf16_too(compose, tmp_path):
    parts = _parts(
        compose,
        tmp_path,
        ["trainer.frozen_precision=bf16", "teacher.name_or_path=builtin:tiny", "loss.teacher_kl=0.1"],
    )
    assert {p.dtype for p in parts.learner.teacher.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in parts.learner.policy.parameters()} == {torch.float32}


# ----------------------------------------------------------------------------- refusals


def _problems(compose, overrides, word):
    return [p for p in validate(compose(TINY + overrides)) if word in p]


@pytest.mark.parametrize(
    "overrides, says",
    [
        (["trainer.precision=fp32"], "trainer.precision=fp32 keeps the weights in fp32"),
        (["trainer.precision=auto"], "may resolve to fp32"),
        (["trainer.precision=bf16", "adapter=lora"], "trains fp32 adapters"),
        (
            ["trainer.precision=bf16", "trainer.num_processes=2", "trainer.distributed=fsdp"],
            "FSDP2 keeps fp32 shards",
        ),
    ],
    ids=["fp32", "auto", "lora", "fsdp"],
)
def test_bf16_stochastic_rounding_is_refused_where_there_are_no_bf16_weights(
    compose, monkeypatch, overrides, says
):
    import grpo_cli.optim as optim

    monkeypatch.setattr(optim, "_version", lambda package: "99.0")  # (installed or not)
    problems = _problems(compose, ["optimizer.name=adamw_bf16_sr", *overrides], "adamw_bf16_sr")
    assert len(problems) == 1, problems
    assert says in problems[0] and "\n" not in problems[0], problems[0]


def test_adamw_8bit_is_refused_under_fsdp(compose, monkeypatch):
    import grpo_cli.optim as optim

    monkeypatch.setattr(optim, "_version", lambda package: "99.0")
    overrides = ["optimizer=adamw_8bit", "trainer.num_processes=2", "trainer.distributed=fsdp"]
    problems = _problems(compose, overrides, "adamw_8bit")
    assert len(problems) == 1 and "not offered" in problems[0], problems


@pytest.mark.parametrize(
    "name, package, precision",
    [("adamw_8bit", "bitsandbytes", "fp32"), ("adamw_bf16_sr", "torchao", "bf16")],
)
def test_a_missing_library_is_one_paragraph_with_the_extra_before_any_model_loads(
    compose, monkeypatch, tmp_path, name, package, precision
):
    import grpo_cli.models
    import grpo_cli.optim as optim
    from grpo_cli.cli.sweep import RunFailed
    from grpo_cli.cli.train import run_one

    monkeypatch.setattr(optim, "_version", lambda p: None if p == package else "99.0")
    monkeypatch.setattr(grpo_cli.models, "load_model", lambda *a, **k: pytest.fail("a model loaded"))
    overrides = [f"optimizer.name={name}", f"trainer.precision={precision}"]
    with pytest.raises(RunFailed) as failed:
        run_one(compose(TINY + overrides), tmp_path / "run", TINY + overrides)
    (problem,) = failed.value.problems
    assert f"{package}, which is not installed" in problem and "\n" not in problem
    assert "pip install -e '.[memory-levers]'" in problem and "optimizer.name=adamw" in problem


def test_an_old_bitsandbytes_is_refused_with_the_upgrade(compose, monkeypatch):
    import grpo_cli.optim as optim

    monkeypatch.setattr(optim, "_version", lambda package: "0.45.5")
    (problem,) = _problems(compose, ["optimizer=adamw_8bit"], "adamw_8bit")
    assert "bitsandbytes >= 0.50.2" in problem and "0.45.5 is installed" in problem
    assert "pip install -U 'bitsandbytes>=0.50.2'" in problem


@pytest.mark.parametrize(
    "overrides, says",
    [
        ([], "loss.beta=0 (no reference) and no teacher"),
        (["loss.beta=0.04", "adapter=lora"], "the reference is the policy itself"),
        (["loss.beta=0.04", "trainer.precision=bf16"], "stored in bf16 already"),
    ],
    ids=["no-frozen-model", "lora-reference", "bf16-policy"],
)
def test_frozen_precision_bf16_where_it_changes_nothing_is_said(compose, overrides, says):
    problems = _problems(compose, ["trainer.frozen_precision=bf16", *overrides], "frozen_precision")
    assert len(problems) == 1 and says in problems[0], problems


def test_frozen_precision_bf16_under_fp16_is_refused(compose):
    overrides = ["trainer.frozen_precision=bf16", "loss.beta=0.04", "trainer.precision=fp16"]
    problems = _problems(compose, overrides, "frozen_precision")
    assert len(problems) == 1 and "fp16 is for GPUs without bf16" in problems[0], problems
