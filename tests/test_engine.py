"""Tier 3: the training engine on the built-in tiny model, on the CPU."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import console_script, run_cli, tiny

from grpo_cli.cli.train import train_config as run

TINY = tiny(
    "data.eval_size=8",
)


def read_metrics(run_dir, training_only=True):
    """metrics.jsonl rows; the step-0 row of trainer.eval_before holds only eval metrics."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "reward" in r] if training_only else rows


def flat_params(model):
    return torch.cat([p.detach().flatten().float() for p in model.parameters()])


def test_console_script_trains_checkpoints_and_resumes(tmp_path):
    from transformers import AutoModelForCausalLM

    from grpo_cli.models import build_tiny

    run_dir = tmp_path / "run"
    common = [
        console_script("grpo-train"),
        "model=tiny",
        "reward=[length]",
        "reward.length.unit=chars",
        "reward.length.target=4",
        "loss.beta=0.04",
        "optimizer.learning_rate=1e-3",
        "data.num_examples=64",
        "data.eval_size=4",
        "sampler.num_generations=4",
        "sampler.max_new_tokens=8",
        "trainer.prompts_per_step=2",
        "trainer.save_steps=2",
        "trainer.seed=1",  # (a seed whose steps all carry signal: every phase runs)
        f"hydra.run.dir={run_dir}",
    ]
    res = run_cli(common + ["trainer.max_steps=3"], cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "self-check ok" in res.stdout
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    before = read_metrics(run_dir, training_only=False)[0]
    assert before["step"] == 0 and "eval/reward" in before  # trainer.eval_before (on by default)
    for row in rows:
        for key, value in row.items():
            if isinstance(value, float):
                assert math.isfinite(value), (key, value)
    for key in (
        "reward",
        "reward_std",
        "rewards/length/mean",
        "frac_reward_zero_std",
        "kl",
        "clip_ratio/low_mean",
        "clip_ratio/high_mean",
        "clip_ratio/region_mean",
        "completions/mean_length",
        "completions/min_length",
        "completions/max_length",
        "completions/clipped_ratio",
        "entropy",
        "grad_norm",
        "learning_rate",
        "loss",
        "step_time",
        "tokens_per_second",
        "pass_rate_hist",
        "time/rollout",
        "time/reward",
        "time/reference",
        "time/policy",
        "time/optimizer",
    ):
        assert key in rows[0], key
    for row in rows:  # the phases are parts of the step, and beta > 0 here: every phase ran
        # (sync: a no-op here; eval: the evaluation after the step, outside step_time)
        phases = [row[k] for k in row if k.startswith("time/") and k not in ("time/sync", "time/eval")]
        assert all(p > 0 for p in phases) and sum(phases) <= row["step_time"], row
    assert "eval/reward" in rows[-1]

    ckpt = run_dir / "checkpoints" / "step-000003"
    trained = AutoModelForCausalLM.from_pretrained(ckpt)
    initial = AutoModelForCausalLM.from_pretrained(build_tiny())
    assert not torch.equal(flat_params(trained), flat_params(initial)), "parameters did not change"
    assert (ckpt / "config.yaml").exists() and (ckpt / "model.safetensors").exists()
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-000002", "step-000003"]

    res = run_cli(common + ["trainer.max_steps=5", "trainer.resume=auto"], cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "at step 3" in res.stdout and "self-check" not in res.stdout
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3, 4, 5]
    assert (run_dir / "checkpoints" / "step-000005").is_dir()


def test_dynamic_sampling_refills_the_step_with_groups_that_carry_signal(compose, tmp_path):
    cfg = compose(
        TINY
        + [
            "reward=[accuracy]",
            "+reward.parity.fn=reward_fixtures:plus_parity",
            "reward.accuracy.weight=0",
            "trainer.dynamic_sampling=true",
            "trainer.max_sampling_tries=8",
            "trainer.prompts_per_step=2",
            "trainer.max_steps=2",
            "data.operations=[+,-]",
            "loss.beta=0",
        ]
    )
    run(cfg, tmp_path)
    rows = read_metrics(tmp_path)
    # Minus prompts always give zero-std groups; the step still trained on whole groups with signal.
    assert any(r["num_groups_sampled"] > 2 for r in rows), rows
    assert all(r["frac_reward_zero_std"] > 0 for r in rows if r["num_groups_sampled"] > 2)
    assert all(r["reward_std"] > 0 for r in rows)


@pytest.mark.parametrize("mask_truncated", [True, False])
def test_truncated_completions_are_masked_when_asked(compose, tmp_path, mask_truncated):
    # sampler.ignore_eos: every completion runs to max_new_tokens and counts as truncated;
    # masking them leaves no token in the loss and no gradient.
    cfg = compose(
        TINY
        + [
            "reward=[]",
            "+reward.code.fn=reward_fixtures:char_code",
            "sampler.max_new_tokens=3",
            "sampler.ignore_eos=true",
            "trainer.max_steps=1",
            "loss.beta=0",
            f"loss.mask_truncated_completions={str(mask_truncated).lower()}",
            "data.eval_size=0",
        ]
    )
    row = run(cfg, tmp_path)
    assert row["completions/clipped_ratio"] == 1.0
    assert row["completions/min_length"] == row["completions/max_length"] == 3.0
    if mask_truncated:
        assert row["grad_norm"] == 0.0
    else:
        assert row["grad_norm"] > 0.0


def test_optimizer_is_fused_adamw_with_the_plain_update():
    """build_optimizer uses the fused AdamW kernel (fast on CPU); its update equals the plain
    single-tensor AdamW's, scheduler included."""
    from grpo_cli.config import OptimizerConfig
    from grpo_cli.optim import build_optimizer

    torch.manual_seed(0)
    models = [torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    start = models[0][0].weight.detach().clone()
    cfg = OptimizerConfig(
        learning_rate=1e-2,
        weight_decay=0.1,
        adam_beta1=0.9,
        adam_beta2=0.99,
        adam_epsilon=1e-8,
        lr_scheduler="linear",
        warmup_steps=1,
    )
    ours, sched = build_optimizer(models[0].parameters(), cfg, total_updates=5)
    assert ours.defaults["fused"]
    plain = torch.optim.AdamW(
        models[1].parameters(), lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, foreach=False
    )
    plain_sched = torch.optim.lr_scheduler.LambdaLR(plain, sched.lr_lambdas[0])
    for _ in range(4):
        x = torch.randn(8, 16)
        for model, opt, sch in ((models[0], ours, sched), (models[1], plain, plain_sched)):
            model(x).pow(2).mean().backward()
            opt.step()
            sch.step()
            opt.zero_grad()
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert (models[0][0].weight - start).abs().max() > 1e-3  # it did train


@pytest.mark.parametrize(
    "value,bad",
    [(float("nan"), True), (float("inf"), True), (-float("inf"), True), (3e38, False), (1.0, False)],
)
def test_nonfinite_params_finds_exactly_the_bad_tensors(value, bad):
    """The cheap sum-based screen never misses a NaN/inf and never blames a tensor of huge but
    finite values (whose sum overflows)."""
    from grpo_cli.guards import nonfinite_params as _nonfinite_params

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    with torch.no_grad():
        model[1].weight.fill_(3e38)  # sum overflows, values finite
        model[0].weight[1, 2] = value
    assert _nonfinite_params(model) == (["0.weight"] if bad else [])


def _plus_only(completions, operation, **kwargs):
    return [1.0 if op == "plus" else 0.0 for op in operation]


def test_evaluation_reports_accuracy_per_operation_and_on_the_wide_set(compose):
    """Held-out accuracy per value of data.eval_group_by, summed across a split into shards the way
    several processes would, and the wide set (operands outside training's) under eval_wide/."""
    from transformers import AutoModelForCausalLM

    from grpo_cli.build import build_data, build_wide_eval, read_data, read_wide_eval
    from grpo_cli.config import to_typed
    from grpo_cli.environments.path import RolloutPath
    from grpo_cli.evaluate import evaluate, group_values
    from grpo_cli.models import build_tiny, load_tokenizer, resolve_source
    from grpo_cli.precision import resolve_precision
    from grpo_cli.rewards import Reward, RewardSpec
    from grpo_cli.samplers import Context, build_sampler

    cfg = to_typed(compose(TINY[:2] + ["data.eval_size=24", "sampler.max_new_tokens=2"]))
    tok = load_tokenizer(resolve_source("builtin:tiny"))
    held_out = build_data(cfg, read_data(cfg), tok).eval
    wide = build_wide_eval(cfg, read_wide_eval(cfg), tok)
    model = AutoModelForCausalLM.from_pretrained(build_tiny())
    rewards = [RewardSpec("accuracy", Reward("accuracy", fn=_plus_only), 1.0, role="correctness")]
    fp32 = resolve_precision("fp32", model.device)
    context = Context(
        model, eos_ids=[tok.eos_token_id], pad_id=tok.pad_token_id, precision=fp32, fast_decode=True
    )
    sampler = RolloutPath(build_sampler(cfg.sampler, context))  # single-turn: no environment's episodes
    kw = dict(group_by="operation")
    groups = group_values(held_out, "operation")
    assert groups == ["minus", "plus", "times"]

    whole = evaluate(sampler, tok, held_out, rewards, groups=groups, **kw)
    share = sum(ex.columns["operation"] == "plus" for ex in held_out) / len(held_out)
    assert whole["eval/accuracy"] == pytest.approx(share) and 0 < share < 1
    assert (whole["eval/accuracy/plus"], whole["eval/accuracy/minus"], whole["eval/accuracy/times"]) == (
        1,
        0,
        0,
    )

    # Two shards, their sums added as Dist.sum adds them over processes: the same numbers.
    halves = [held_out[: len(held_out) // 3], held_out[len(held_out) // 3 :]]
    sums = []

    def collect(values):
        sums.append(values)
        return values

    for half in halves:
        evaluate(sampler, tok, half, rewards, groups=groups, reduce=collect, **kw)
    total = [a + b for a, b in zip(*sums)]
    assert evaluate(sampler, tok, held_out, rewards, groups=groups, reduce=lambda _: total, **kw) == whole

    out = evaluate(
        sampler, tok, wide, rewards, prefix="eval_wide", groups=group_values(wide, "operation"), **kw
    )
    assert set(out) == {
        "eval_wide/reward", "eval_wide/accuracy", "eval_wide/accuracy/minus", "eval_wide/accuracy/plus",
        "eval_wide/accuracy/times",
    }  # fmt: skip
    assert len(wide) == 24
    # No breakdown for a column the rows lack, or one with a value per row.
    from grpo_cli.data import Example

    rows = [Example(prompt="p", prompt_ids=[1], columns={"id": i % n}) for n in (3, 30) for i in range(30)]
    assert group_values(held_out, "level") == [] and group_values(rows[30:], "id") == []
    assert group_values(rows[:30], "id") == ["0", "1", "2"]


@pytest.mark.parametrize(
    "overrides, metric",
    [
        (["loss=cispo"], "cispo_clip_ratio"),
        (["loss=sapo"], "sapo/gate_mean"),
        (["loss.entropy_coef=0.01", "loss.top_entropy_quantile=0.5"], "entropy"),
        (["loss.multi_objective_aggregation=normalize_then_sum", "reward=[format]"], "reward"),
        (["loss.sampler_correction=sequence_mask", "loss.tis_min=0.5"], "sequence_mask/masked"),
        (["loss.off_policy_mask_threshold=0.5"], "off_policy_mask/masked"),
    ],
    ids=["cispo", "sapo", "entropy", "gdpo", "sequence-mask", "off-policy-mask"],
)
def test_each_loss_of_the_menu_trains_the_tiny_model(compose, tmp_path, overrides, metric):
    """Each entry of the loss menu from YAML, two steps on the tiny model: the update moves the
    weights (a gradient), and the entry's metric is in the logged row."""
    cfg = compose(
        TINY
        + [
            "reward=[]",
            "+reward.code.fn=reward_fixtures:char_code",
            "trainer.max_steps=2",
            "data.eval_size=0",
        ]
        + overrides
    )
    if "reward=[format]" in overrides:
        cfg = compose(
            TINY
            + ["+reward.code.fn=reward_fixtures:char_code", "trainer.max_steps=2", "data.eval_size=0"]
            + overrides
        )
    row = run(cfg, tmp_path)
    assert row["grad_norm"] > 0 and metric in row, row


ADAPTIVE_ENTROPY = [
    "reward=[]",
    "+reward.code.fn=reward_fixtures:char_code",
    "data.eval_size=0",
    "trainer.save_steps=2",
    "loss.use_adaptive_entropy=true",
    "loss.entropy_coef_delta=0.05",
]


@pytest.mark.parametrize(
    "target, start, expected",
    [("100", "0", [0.05, 0.10, 0.15, 0.20]), ("1e-9", "0.12", [0.07, 0.02, 0.0, 0.0])],
    ids=["below-target", "above-target"],
)
def test_adaptive_entropy_control_moves_its_coefficient_and_resumes_bit_exact(
    compose, tmp_path, target, start, expected
):
    """TRL's adaptive entropy control from YAML: the logged entropy_coef moves by entropy_coef_delta
    each step toward the target (up when the entropy is below it, down to entropy_coef_min when
    above). The bonus applies from the second step only when the first step's entropy was below
    the target: step 1's loss equals a run without the controller, step 2's differs exactly when it
    applies. Stopped after 2 steps and resumed to 4: the same coefficients, losses and weights as 4
    steps in one go (the controller's state is in the checkpoint)."""
    from safetensors.torch import load_file

    common = TINY + ADAPTIVE_ENTROPY + [f"loss.entropy_target={target}", f"loss.entropy_coef={start}"]
    for d in ("whole", "split", "plain"):
        (tmp_path / d).mkdir()
    run(compose(common + ["trainer.max_steps=4"]), tmp_path / "whole")
    run(compose(common + ["trainer.max_steps=2"]), tmp_path / "split")
    run(compose(common + ["trainer.max_steps=4", "trainer.resume=auto"]), tmp_path / "split")
    plain = TINY + ADAPTIVE_ENTROPY[:4] + ["trainer.max_steps=2"]
    run(compose(plain), tmp_path / "plain")
    whole, split, without = (read_metrics(tmp_path / d) for d in ("whole", "split", "plain"))
    assert [r["entropy_coef"] for r in whole] == pytest.approx(expected, abs=1e-9)
    keep = ("step", "entropy_coef", "entropy", "loss", "grad_norm")
    assert [[r[k] for k in keep] for r in split] == [[r[k] for k in keep] for r in whole]
    w_whole, w_split = (
        load_file(max((tmp_path / d / "checkpoints").iterdir()) / "model.safetensors")
        for d in ("whole", "split")
    )
    assert all(torch.equal(w_whole[k], w_split[k]) for k in w_whole)
    assert whole[0]["loss"] == without[0]["loss"]  # no bonus before a measured entropy
    applied = target == "100"  # (the second step's bonus: 0.05 x its entropy)
    assert (whole[1]["loss"] != without[1]["loss"]) == applied


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["loss.entropy_target=0"], "loss.entropy_target=0"),
        (["loss.entropy_coef_min=0.5", "loss.entropy_coef_max=0.1"], "loss.entropy_coef_min=0.5"),
        (["loss.entropy_coef=2"], "loss.entropy_coef=2"),
        (["loss.entropy_coef_delta=-0.1"], "loss.entropy_coef_delta=-0.1"),
    ],
)
def test_adaptive_entropy_settings_are_checked(compose, overrides, message):
    from grpo_cli.config import validate

    problems = validate(compose(TINY + ["loss.use_adaptive_entropy=true"] + overrides))
    assert len(problems) == 1 and message in problems[0], problems


@pytest.mark.parametrize(
    "rewards", [["reward=[]"], ["reward=[]", "+reward.code.fn=reward_fixtures:char_code"]]
)
def test_on_policy_distillation_trains_with_or_without_rewards(compose, tmp_path, rewards):
    """A teacher (another tiny model of the same tokenizer) scores every sampled token: with no
    reward at all (pure distillation: every group zero-std, none skipped, no error) and beside one,
    each step moves the weights and logs the teacher's KL and log-prob."""
    cfg = compose(
        TINY
        + rewards
        + [
            "teacher.name_or_path=builtin:tiny32",
            "loss.teacher_kl=1.0",
            "trainer.max_steps=2",
            "data.eval_size=0",
        ]
    )
    row = run(cfg, tmp_path)
    assert row["grad_norm"] > 0 and row["teacher/kl"] != 0 and row["teacher/logp"] < 0, row
    assert row["skipped_updates"] == 0 and "time/teacher" in row


def test_a_teacher_of_another_tokenizer_is_refused_before_it_loads(compose, tmp_path):
    from grpo_cli.errors import UserError
    from grpo_cli.models import load_model, load_tokenizer, resolve_source

    src = resolve_source("builtin:tiny")
    tok = load_tokenizer(src)
    tok.add_tokens(["<extra_token>"])
    folder = tmp_path / "other"
    load_model(src, device=torch.device("cpu")).save_pretrained(folder)
    tok.save_pretrained(folder)
    cfg = compose(TINY + [f"teacher.name_or_path={folder}", "loss.teacher_kl=1.0", "trainer.max_steps=1"])
    with pytest.raises(UserError, match="its tokenizer's vocabulary differs from the student's"):
        run(cfg, tmp_path / "run")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["loss.teacher_kl=1.0"], "teacher.name_or_path is not set"),
        (["teacher.name_or_path=builtin:tiny32"], "loss.teacher_kl=0 leaves it out"),
        (["reward=[]"], "no reward is configured"),
    ],
)
def test_teacher_settings_go_together(compose, overrides, message):
    from grpo_cli.config import validate

    problems = validate(compose(TINY + overrides))
    assert any(message in p for p in problems), problems


def test_a_distillation_run_resumes_with_its_teacher(tmp_path):
    """grpo-train with a teacher, stopped at a checkpoint and resumed: the teacher is loaded again
    from teacher.name_or_path, and the resumed steps log its KL."""
    common = [
        console_script("grpo-train"),
        *TINY,
        "teacher.name_or_path=builtin:tiny32",
        "loss.teacher_kl=1.0",
        "trainer.save_steps=2",
        "data.eval_size=0",
        "hydra.run.dir=run",
    ]
    res = run_cli(common + ["trainer.max_steps=2"], cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    res = run_cli(common + ["trainer.max_steps=3", "trainer.resume=auto"], cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    # (k1's mean may take either sign on a step: the reverse KL is its expectation)
    assert [r["step"] for r in steps] == [1, 2, 3] and all(
        math.isfinite(r["teacher/kl"]) and r["teacher/kl"] != 0 for r in steps
    )
