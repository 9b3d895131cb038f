"""trainer.micro_batch_tokens=auto (grpo_cli/fit.py): the planner's contract on tables of probes,
the peak meter on real allocations, the settings' checks, and tiny-model runs: auto equals the run
with its budget pinned bit for bit, a resume reuses the plan without probing, and a group that
cannot fit is refused in one paragraph before step 1."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from conftest import tiny

from grpo_cli import fit
from grpo_cli.errors import UserError
from grpo_cli.packing import GroupShape, micro_batch_cost

MIB = 2**20
GIB = 2**30


def _cost(prompt: int, completion: int, G: int):
    shape = GroupShape(prompt, completion, True, (completion,) * G)
    return lambda k: micro_batch_cost([shape] * k, G, prompt_once=True)


# (probes, before, optimizer, limit, groups) -> what the plan must satisfy
PLANS = [
    # two probes on a line: 1 MiB a token above 1 GiB; a limit of 4 GiB
    ([(520, 1024 * MIB + 260 * MIB), (1040, 1024 * MIB + 520 * MIB)], 900 * MIB, 0, 4096 * MIB, 64),
    # the optimizer's state takes a GiB of the room
    ([(520, 1300 * MIB), (1040, 1560 * MIB)], 900 * MIB, 1024 * MIB, 4096 * MIB, 64),
    # a limit the whole step fits under: the budget is the step's tokens, rounded up to the grid
    ([(520, 1300 * MIB), (1040, 1560 * MIB)], 900 * MIB, 0, 64 * 1024 * MIB, 4),
    # one probe (a group of one row): the line through the resident bytes before it
    ([(300, 1200 * MIB)], 1000 * MIB, 0, 2048 * MIB, 16),
    # noisy probes (the larger read less): the conservative line through `before`
    ([(520, 1600 * MIB), (1040, 1560 * MIB)], 900 * MIB, 0, 3000 * MIB, 64),
    # room for one group and a half only: under the grid, the room itself
    ([(520, 1300 * MIB), (1040, 1560 * MIB)], 900 * MIB, 0, 1820 * MIB, 64),
]


@pytest.mark.parametrize("probes,before,optimizer,limit,groups", PLANS)
def test_the_plan_is_the_largest_budget_on_the_grid_whose_prediction_fits(
    probes, before, optimizer, limit, groups
):
    cost = _cost(16, 63, 16)  # a group: 16 + 16 x 63 = 1024 tokens
    p = fit.plan_budget(
        probes,
        before_bytes=before,
        optimizer_bytes=optimizer,
        limit_bytes=limit,
        groups=groups,
        cost_of_groups=cost,
    )
    assert isinstance(p, fit.FitPlan)
    fixed, per_token = fit._line(probes, before)
    predicted = lambda t: max(max(x for _, x in probes) + optimizer, fixed + per_token * t + optimizer)  # noqa: E731
    assert predicted(p.budget) <= limit  # a budget the probe rejects is never used
    step = cost(groups)
    if p.budget < fit.GRID:  # under the grid only where its first point is over the limit
        assert predicted(fit.GRID) > limit and predicted(p.budget + 1) > limit and p.budget >= cost(1)
    elif p.budget < step:  # on the grid, and the next point would be over the limit
        assert p.budget % fit.GRID == 0 and predicted(p.budget + fit.GRID) > limit
    else:
        assert p.budget == -(-step // fit.GRID) * fit.GRID and p.micro_batches == 1
    together = max(k for k in range(1, groups + 1) if k == 1 or cost(k) <= p.budget)
    assert p.micro_batches == -(-groups // together)
    assert p.predicted_peak_bytes <= limit
    assert p.probes == tuple(probes) and fit.FitPlan.from_dict(json.loads(json.dumps(p.as_dict()))) == p
    assert f"trainer.micro_batch_tokens={p.budget}" in p.line()


def test_a_line_through_two_probes_is_their_line():
    fixed, per_token = fit._line([(100, 2000), (300, 2600)], before_bytes=10)
    assert per_token == 3.0 and fixed == 1700


def test_a_group_over_the_limit_has_no_budget():
    p = fit.plan_budget(
        [(520, 1300 * MIB), (1040, 1560 * MIB)],
        before_bytes=900 * MIB,
        optimizer_bytes=512 * MIB,
        limit_bytes=2000 * MIB,
        groups=4,
        cost_of_groups=_cost(16, 63, 16),
    )
    assert isinstance(p, fit.Unfit) and p.over_bytes == (1560 + 512 - 2000) * MIB


def test_the_peak_meter_sees_an_allocation_inside_it(monkeypatch):
    """The CPU's peak: the resident set's high-water mark reset at entry; where /proc/self/clear_refs
    cannot be written, a sampling thread. A 256 MiB tensor written inside the block (then freed)
    is in the peak; the peak of an empty block is near the resident set."""
    cpu = torch.device("cpu")
    for path in ("clear_refs", "thread"):
        if path == "thread":
            monkeypatch.setattr(
                fit.Path, "write_text", lambda *a, **k: (_ for _ in ()).throw(OSError("read-only"))
            )
        with fit.PeakMeter(cpu) as quiet:
            pass
        with fit.PeakMeter(cpu) as meter:
            x = torch.ones(64 * MIB)  # 256 MiB, every page written
            float(x.sum())
            del x
        assert meter.peak - quiet.peak > 200 * MIB, (path, quiet.peak, meter.peak)
        assert quiet.peak < fit.resident_bytes() + 64 * MIB, path


AUTO_CASES = [
    (["trainer.micro_batch_tokens=auto"], None),
    (["trainer.micro_batch_tokens=auto", "trainer.memory_limit_gib=16"], None),
    (["trainer.micro_batch_tokens=autox"], "trainer.micro_batch_tokens=autox must be a positive number"),
    (["trainer.memory_limit_gib=16"], "is the limit trainer.micro_batch_tokens=auto plans for"),
    (
        ["trainer.micro_batch_tokens=auto", "trainer.memory_limit_gib=-1"],
        "trainer.memory_limit_gib=-1 must be",
    ),
]


@pytest.mark.parametrize("overrides,message", AUTO_CASES, ids=[" ".join(c[0]) for c in AUTO_CASES])
def test_auto_settings_are_checked(compose, overrides, message):
    from grpo_cli.config.validation import validate

    problems = validate(compose(["model=tiny", *overrides]))
    if message is None:
        assert problems == []
    else:
        assert len(problems) == 1 and message in problems[0], problems


def _weights(run_dir):
    from safetensors.torch import load_file

    return load_file(max((run_dir / "checkpoints").iterdir()) / "model.safetensors")


def test_auto_equals_its_budget_pinned_and_a_resume_reuses_the_plan(compose, tmp_path, monkeypatch):
    """A tiny run with auto, its probes' peaks made a known line (1 GiB + 1 MiB a token: the real
    probe still runs, and must leave no trace) and a limit of 7.5 groups' tokens above it: the plan
    is budget 1024 for 6 groups a micro-batch, 2 micro-batches for the step's 8; the run's weights
    after 3 steps equal those of the run with trainer.micro_batch_tokens=1024 pinned, bit for bit
    (the probe changes no weight, no RNG); a run of 2 steps resumed to 3 reuses the saved plan
    (no probe runs). (That a resume with a pinned budget is bit for bit: test_packing.)"""
    from grpo_cli.checkpoint import TrainerState
    from grpo_cli.cli.train import train_config

    real = fit.probe_peak
    probed = []

    def known_line(policy, scorer, opt_step, precision, rollout, device):
        real(policy, scorer, opt_step, precision, rollout, device)
        tokens = rollout.prompt_ids.shape[1] + rollout.completion_ids.numel()  # (its prompt once)
        probed.append(tokens)
        return 2**30 + tokens * MIB

    monkeypatch.setattr(fit, "probe_peak", known_line)
    common = tiny(
        "data.eval_size=0", "trainer.save_steps=2", "sampler.max_new_tokens=24", "trainer.prompts_per_step=8"
    )
    for d in ("probe", "auto", "pinned", "split"):
        (tmp_path / d).mkdir()
    auto = [*common, "trainer.micro_batch_tokens=auto"]
    train_config(compose([*auto, "trainer.max_steps=1"]), tmp_path / "probe")
    group = json.loads((tmp_path / "probe" / "memory_plan.json").read_text())["group_tokens"]
    assert probed == [group - 2 * 24, group]  # (half the rows, then the whole group)
    limit = (2**30 + 7.5 * group * MIB) / 2**30
    auto.append(f"trainer.memory_limit_gib={limit!r}")

    train_config(compose([*auto, "trainer.max_steps=3"]), tmp_path / "auto")
    plan = fit.FitPlan.from_dict(json.loads((tmp_path / "auto" / "memory_plan.json").read_text()))
    assert (plan.budget, plan.micro_batches, plan.bytes_per_token) == (1024, 2, MIB), plan
    assert plan.predicted_peak_bytes == 2**30 + 6 * group * MIB + plan.optimizer_bytes
    train_config(
        compose([*common, "trainer.micro_batch_tokens=1024", "trainer.max_steps=3"]), tmp_path / "pinned"
    )
    a, b = _weights(tmp_path / "auto"), _weights(tmp_path / "pinned")
    assert all(torch.equal(a[k], b[k]) for k in a)

    train_config(compose([*auto, "trainer.max_steps=2"]), tmp_path / "split")
    saved = fit.FitPlan.from_dict(json.loads((tmp_path / "split" / "memory_plan.json").read_text()))
    (tmp_path / "split" / "memory_plan.json").unlink()
    probed.clear()
    train_config(compose([*auto, "trainer.max_steps=3", "trainer.resume=auto"]), tmp_path / "split")
    assert probed == [] and not (tmp_path / "split" / "memory_plan.json").exists()  # (kept, not probed)
    last = max((tmp_path / "split" / "checkpoints").iterdir())
    state = TrainerState.from_dict(torch.load(last / "trainer_state.pt", weights_only=True))
    assert fit.FitPlan.from_dict(state.fit) == saved == plan and state.step == 3
    c = _weights(tmp_path / "split")
    assert all(torch.equal(a[k], c[k]) for k in a)


def test_a_group_that_cannot_fit_is_refused_before_step_1(compose, tmp_path):
    """A limit under what one group measures: one paragraph naming the limit, the overshoot and the
    levers (with the longest completion that would fit), and no step trained."""
    from grpo_cli.cli.train import train_config

    cfg = compose(
        tiny("data.eval_size=0", "trainer.micro_batch_tokens=auto", "trainer.memory_limit_gib=0.05")
    )
    with pytest.raises(UserError) as err:
        train_config(cfg, tmp_path)
    text = str(err.value)
    assert "one group cannot fit in 0.05 GiB (trainer.memory_limit_gib=0.05)" in text, text
    assert "over the limit" in text and "Nothing was trained" in text and "\n" not in text
    assert "trainer.gradient_checkpointing=true" in text and "optimizer=adamw_8bit" in text
    assert not (tmp_path / "metrics.jsonl").exists() or not (tmp_path / "metrics.jsonl").read_text().strip()


def test_each_step_logs_its_peak_and_a_step_over_the_plan_is_said_once(
    compose, tmp_path, monkeypatch, capsys
):
    """memory/peak_gib on every row (the process's peak resident set: a tiny run holds more than
    50 MiB); with auto's probe made to read almost nothing, the real steps go over its prediction:
    one warning naming the step, the prediction and a smaller budget to pin, said once."""
    from grpo_cli.cli.train import train_config
    from grpo_cli.summary import read_metrics

    real = fit.probe_peak

    def nearly_nothing(policy, scorer, opt_step, precision, rollout, device):
        real(policy, scorer, opt_step, precision, rollout, device)
        return 1000 + rollout.completion_ids.numel()

    monkeypatch.setattr(fit, "probe_peak", nearly_nothing)
    cfg = compose(tiny("data.eval_size=0", "trainer.max_steps=2", "trainer.micro_batch_tokens=auto"))
    train_config(cfg, tmp_path)
    rows = [r for r in read_metrics(tmp_path) if "reward" in r]
    assert len(rows) == 2 and all(r["memory/peak_gib"] > 50 / 1024 for r in rows), rows
    err = capsys.readouterr().err
    assert err.count("memory: step") == 1 and "memory: step 1 peaked at" in err, err
    assert "over the 0.00 GiB that trainer.micro_batch_tokens=auto predicted" in err


def test_the_probe_holds_a_later_micro_batchs_gradients_and_leaves_no_trace(tiny_model):
    """probe_peak on the tiny model: the forward runs with every optimized parameter's gradient
    already allocated (as in a step's second micro-batch: they accumulate), and afterwards every
    gradient is None, every weight is bit for bit as before and the global RNG has not moved."""
    from types import SimpleNamespace

    from grpo_cli.logprobs import TokenLogprobs
    from grpo_cli.precision import resolve_precision

    cpu = torch.device("cpu")
    model, _ = tiny_model
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    opt_step = SimpleNamespace(params=params, masters=None, optimizer=torch.optim.SGD(params, lr=1.0))
    real = TokenLogprobs(model, temperature=0.7, shared_prompt=True)
    held = []

    def scorer(*inputs, num_generations):
        held.append(all(p.grad is not None for p in params))
        return real(*inputs, num_generations=num_generations)

    rollout = fit._probe_rollout(12, 20, 4, model.get_input_embeddings().weight.shape[0], cpu)
    rng = torch.random.get_rng_state()
    peak = fit.probe_peak(model, scorer, opt_step, resolve_precision("fp32", cpu), rollout, cpu)
    assert held == [True] and peak > 0
    assert all(p.grad is None for p in params)
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    assert torch.equal(torch.random.get_rng_state(), rng)


# ----------------------------------------------------------------------------- grpo-check-env --fit


@pytest.mark.parametrize(
    "fixed, per_token, optimizer, limit, expected",
    [
        (1000, 10.0, 0, 2000, 100),  # cost(n) = n: 1000 + 10 n <= 2000
        (1000, 10.0, 500, 2000, 50),  # the optimizer's state takes half the room
        (1000, 10.0, 0, 1005, 0),  # not even one
        (1000, 0.0, 0, 2000, 1 << 20),  # flat: the cap
    ],
)
def test_largest_is_the_last_n_within_the_limit(fixed, per_token, optimizer, limit, expected):
    assert fit._largest(fixed, per_token, optimizer, limit, lambda n: n) == expected


def test_a_levers_row_is_solved_on_the_line_through_its_probes():
    """Probes on a known line (1 GiB + 1 MiB a token): the longest completion and the largest group
    are the last that fit under the limit on that line, the next ones are over it."""
    prompt, completion, G = 20, 100, 8
    cost = lambda p, c, g: p + c * g  # noqa: E731 (the prompt once, G completions)
    probes = tuple((cost(prompt, completion, g), GIB + MIB * cost(prompt, completion, g)) for g in (4, 8))
    probed = fit.Probed(
        (prompt, completion, G), probes, GIB, 512 * MIB, 3 * GIB, "trainer.memory_limit_gib=3"
    )
    row = fit.solve_fit("as configured", (), probed, cost)
    assert row.fits and row.group_peak_bytes == probes[-1][1] + 512 * MIB
    room = 3 * GIB - GIB - 512 * MIB  # bytes left for the tokens: 1 MiB each
    assert (
        cost(prompt, row.longest_completion, G) * MIB
        <= room
        < cost(prompt, row.longest_completion + 1, G) * MIB
    )
    assert cost(prompt, completion, row.largest_group) * MIB <= room
    assert cost(prompt, completion, row.largest_group + 1) * MIB > room
    tight = fit.solve_fit("as configured", (), dataclasses.replace(probed, limit_bytes=GIB), cost)
    assert not tight.fits and tight.longest_completion == 0 and tight.largest_group == 0


@pytest.mark.parametrize(
    "overrides, precision, available, expected",
    [
        ([], "fp32", set(), ["as configured", "gradient checkpointing", "LoRA"]),
        (
            ["loss.beta=0.04"],
            "fp32",
            {"bitsandbytes", "torchao"},
            ["as configured", "gradient checkpointing", "8-bit AdamW state", "LoRA", "frozen models in bf16"],
        ),
        (
            ["loss.beta=0.04", "trainer.gradient_checkpointing=true", "adapter=lora"],
            "bf16",
            {"bitsandbytes", "torchao"},
            ["as configured", "8-bit AdamW state", "bf16 without fp32 masters"],
        ),
        (
            ["optimizer=adamw_8bit"],  # (8-bit state: neither the 8-bit nor the bf16 SR lever applies)
            "bf16",
            {"bitsandbytes", "torchao"},
            ["as configured", "gradient checkpointing", "LoRA"],
        ),
    ],
)
def test_fit_measures_the_levers_that_apply(compose, overrides, precision, available, expected):
    from grpo_cli.config import to_typed

    cfg = to_typed(compose(["model=tiny", *overrides]))
    assert [name for name, _ in fit.levers(cfg, precision, available)] == expected


@pytest.mark.slow  # (each lever runs in a process of its own: multiprocessing, which the guard does not see)
def test_check_env_fit_measures_each_lever_on_the_real_model(capsys):
    """grpo-check-env --model tiny --fit: every lever that applies is built and probed on this device;
    its peaks are measured, its optimizer state counted (8 bytes a trained weight for AdamW, less
    for 8-bit state and for LoRA's adapters), and with room to spare the configured group fits and
    the solved lengths reach past it. Under the resident set nothing fits."""
    from grpo_cli.cli import check_env

    overrides = [
        "loss.beta=0.04",
        "trainer.precision=fp32",
        "sampler.max_new_tokens=8",
        "sampler.num_generations=4",
    ]
    assert check_env.main(["--model", "tiny", "--fit", "--memory-gib", "64", "--json", *overrides]) == 0
    report = json.loads(capsys.readouterr().out)["fit"]
    rows = {r["lever"]: r for r in report["levers"]}
    assert {"as configured", "gradient checkpointing", "LoRA", "frozen models in bf16"} <= set(rows)
    base = rows["as configured"]
    from grpo_cli.models import load_model, resolve_source

    params = sum(
        p.numel() for p in load_model(resolve_source("builtin:tiny"), device=torch.device("cpu")).parameters()
    )
    assert base["optimizer_bytes"] == 8 * params
    assert 0 < rows["LoRA"]["optimizer_bytes"] < base["optimizer_bytes"] / 2  # (r=16 on a 0.08M model)
    if "8-bit AdamW state" in rows:
        assert 0 < rows["8-bit AdamW state"]["optimizer_bytes"] < base["optimizer_bytes"]
    for r in rows.values():
        assert r["lengths"][1:] == [8, 4] and len(r["probes"]) == 2
        assert all(peak > 0 for _, peak in r["probes"])
        assert r["group_peak_bytes"] == max(peak for _, peak in r["probes"]) + r["optimizer_bytes"]
        assert r["fits"] and r["longest_completion"] >= 8 and r["largest_group"] >= 4
    fewer = ["trainer.gradient_checkpointing=true", "adapter=lora", "loss.beta=0"]  # (fewer levers apply)
    assert check_env.main(["--model", "tiny", "--fit", "--memory-gib", "0.01", *overrides, *fewer]) == 0
    out = capsys.readouterr().out
    table = out[out.index("fit: tiny") :]
    assert "limit 0.01 GiB (trainer.memory_limit_gib=0.01)" in table
    lines = [line.split() for line in table.splitlines()[2:] if line.startswith("  as configured")]
    assert lines and lines[0][-3:] == ["no", "0", "0"], table


def test_check_env_fit_needs_a_model(capsys):
    from grpo_cli.cli import check_env

    with pytest.raises(SystemExit):
        check_env.main(["--fit"])
    assert "--fit measures a model" in capsys.readouterr().err
