"""The supervised warm-up (sft=demonstrations) and the learnable band (data.pass_rate_band), #60:
their settings' checks, the demonstrations each source writes, the loss against a hand-computed
NLL, one gradient however the step is split, the reference after the warm-up, resume inside and
after the warm-up bit for bit, and the band keeping exactly the prompts inside it."""

from __future__ import annotations

import copy
import json
import shutil
from types import SimpleNamespace

import pytest
import torch
from conftest import composed, tiny, train_here

from grpo_cli.config import to_typed, validate
from grpo_cli.data import Formatting, to_examples
from grpo_cli.errors import UserError
from grpo_cli.sft import Demonstrations, demonstration_batch, keep_passing, nll, read_demonstrations

# ----------------------------------------------------------------------------- settings


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["sft=demonstrations", "sft.steps=3", "sft.epochs=1"], "both set the warm-up's length"),
        (["sft.steps=3"], "sft.steps=3 is ignored with sft=none"),
        (["sft=demonstrations", "sft.reference=bogus"], "sft.reference='bogus'"),
        (["sft=demonstrations", "sft.learning_rate=0"], "sft.learning_rate=0"),
        (["sft=demonstrations", "sft.lr_scheduler=step"], "sft.lr_scheduler='step'"),
        (
            ["sft=demonstrations", "sft.batch_size=1", "trainer.gradient_accumulation_steps=2"],
            "sft.batch_size=1",
        ),
        (["sft=demonstrations", "environment=calculator"], "an environment's episodes"),
        (["sft=demonstrations", "trainer.distributed=fsdp", "trainer.num_processes=2"], "not offered there"),
        (["data.pass_rate_band=[0.9,0.1]"], "data.pass_rate_band=[0.9, 0.1]"),
        (["data.pass_rate_band=[0.2,0.8]", "data.band_samples=1"], "data.band_samples=1"),
        (["data.band_samples=4"], "ignored without data.pass_rate_band"),
        (["data.pass_rate_band=[0.2,0.8]", "reward=[format]"], "needs a correctness reward"),
    ],
)
def test_bad_settings_are_named_before_any_model_loads(overrides, needle):
    problems = validate(composed(overrides))
    assert any(needle in p for p in problems), problems


def test_the_warm_up_and_the_band_compose_cleanly():
    assert validate(composed(["sft=demonstrations", "data.pass_rate_band=[0.2,0.8]"])) == []
    cfg = to_typed(composed(["sft=demonstrations"]))
    assert (cfg.sft.name, cfg.sft.reference, cfg.sft.steps, cfg.sft.epochs) == (
        "demonstrations",
        "warmed",
        None,
        None,
    )


# ----------------------------------------------------------------------------- demonstrations


@pytest.fixture(scope="module")
def tok():
    from grpo_cli.models import load_tokenizer, resolve_source

    return load_tokenizer(resolve_source("builtin:tiny"))


def _examples(rows, tok):
    return to_examples(rows, tok, Formatting(), "test rows")


def test_arithmetic_demonstrates_the_bare_answer_and_eos(tok):
    cfg = to_typed(composed(tiny("sft=demonstrations")))
    train = _examples([{"prompt": "What is 2 minus 15?", "answer": "-13", "kind": "minus_negative"}], tok)
    demos = read_demonstrations(cfg, tok, train, [])
    assert demos.texts == ("-13",)
    assert demos.completions[0][-1] == tok.eos_token_id
    assert tok.decode(demos.completions[0][:-1]) == "-13"
    assert demos.examples[0].prompt_ids == train[0].prompt_ids


def test_sources_declare_their_demonstrations():
    from grpo_cli.data import plugin

    assert plugin("reasoning_gym").facts.demonstration({"answer": "7"}) == "Answer: 7"
    assert plugin("file").facts.demonstration({"completion": "Paris"}) == "Paris"
    assert plugin("file").facts.demonstration({"answer": "Paris"}) is None


def test_sft_path_reads_trls_formats_and_drops_held_out_prompts(tmp_path, tok):
    rows = [
        {"prompt": "What is 1 plus 1?", "completion": "2"},
        {
            "prompt": [{"role": "user", "content": "What is 2 plus 2?"}],
            "completion": [{"role": "assistant", "content": "4"}],
        },
        {"prompt": "What is 9 plus 9?", "completion": "18"},  # held out below
        {"prompt": "What is 3 plus 3?", "completion": ""},  # no completion
    ]
    (tmp_path / "plain.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    held_out = _examples([{"prompt": "What is 9 plus 9?"}], tok)[0].prompt_ids
    cfg = to_typed(composed(tiny("sft=demonstrations", f"sft.path={tmp_path / 'plain.jsonl'}")))
    demos = read_demonstrations(cfg, tok, [], [held_out])
    assert demos.texts == ("2", "4")
    assert demos.dropped == {
        "a row without a prompt and an assistant completion": 1,
        "the prompt is a held-out prompt": 1,
    }

    chats = [
        {
            "messages": [
                {"role": "user", "content": "What is 5 plus 5?"},
                {"role": "assistant", "content": "10"},
            ]
        },
        {"messages": [{"role": "user", "content": "Hi"}]},  # no assistant turn
    ]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chats))
    cfg = to_typed(composed(tiny("sft=demonstrations", f"sft.path={tmp_path / 'chat.jsonl'}")))
    demos = read_demonstrations(cfg, tok, [], [])
    assert demos.texts == ("10",)
    assert demos.examples[0].prompt == [{"role": "user", "content": "What is 5 plus 5?"}]


def test_a_file_without_completions_is_refused_in_one_paragraph(tmp_path, tok):
    (tmp_path / "gsm.jsonl").write_text(json.dumps({"question": "2+2?", "answer": "#### 4"}) + "\n")
    cfg = to_typed(composed(tiny("sft=demonstrations", f"sft.path={tmp_path / 'gsm.jsonl'}")))
    with pytest.raises(UserError, match="TRL's SFT formats") as info:
        read_demonstrations(cfg, tok, [], [])
    assert "answer, question" in str(info.value) and "\n" not in str(info.value)


def test_demonstrations_the_correctness_reward_fails_are_dropped_and_counted(tok):
    from grpo_cli.rewards import build_rewards

    cfg = to_typed(composed(tiny("sft=demonstrations")))
    train = _examples(
        [{"prompt": "What is 2 plus 3?", "answer": "5"}, {"prompt": "What is 2 plus 2?", "answer": "4"}], tok
    )
    eos = tok.eos_token_id
    demos = Demonstrations(
        examples=tuple(train),
        completions=(
            tuple(tok("5", add_special_tokens=False)["input_ids"]) + (eos,),
            tuple(tok("7", add_special_tokens=False)["input_ids"]) + (eos,),
        ),
        texts=("5", "7"),
        where="test",
    )
    kept = keep_passing(demos, build_rewards(cfg.reward), tok)
    assert kept.texts == ("5",)
    assert kept.dropped == {"the run's correctness reward fails it": 1}


# ----------------------------------------------------------------------------- the loss


def _two_demonstrations(tok):
    train = _examples([{"prompt": "What is 12 plus 3?"}, {"prompt": "What is 2 minus 9?"}], tok)
    eos = tok.eos_token_id
    texts = ("15", "-7")
    completions = tuple(tuple(tok(t, add_special_tokens=False)["input_ids"]) + (eos,) for t in texts)
    return Demonstrations(examples=tuple(train), completions=completions, texts=texts, where="test")


def test_the_loss_is_the_mean_nll_of_the_completion_tokens_alone(tiny_model):
    from grpo_cli.logprobs import ScoringOptions, score_tokens

    model, tok = tiny_model
    demos = _two_demonstrations(tok)
    batch = demonstration_batch(demos, [0, 1], tok.pad_token_id, "cpu")
    # The trained tokens are the completion and its EOS: no prompt position is a target.
    assert batch.loss_mask.sum(-1).tolist() == [len(c) for c in demos.completions]
    scores = score_tokens(
        model, *batch.rollout.inputs(), ScoringOptions(1.0, top_k=1, shared_prompt=False), 1
    )
    tokens = int(batch.loss_mask.sum())
    loss = nll(scores.logps.float(), batch.loss_mask, tokens)

    # By hand: each demonstration alone, unpadded, through the model's own logits.
    completion_only, every_position = 0.0, 0.0
    with torch.no_grad():
        for ex, completion in zip(demos.examples, demos.completions):
            ids = torch.tensor([ex.prompt_ids + list(completion)])
            logp = torch.log_softmax(model(ids).logits[0, :-1].double(), -1)  # [T-1, V]
            per_token = -logp.gather(-1, ids[0, 1:, None])[:, 0]  # [T-1]: the NLL of token t+1
            P = len(ex.prompt_ids)
            completion_only += float(per_token[P - 1 :].sum())
            every_position += float(per_token.sum())
    assert float(loss) == pytest.approx(completion_only / tokens, rel=1e-5)
    # A prompt position's target would change the loss: counting them gives another number.
    assert every_position / tokens > completion_only / tokens + 0.5


def _learner(model, accumulation: int):
    from grpo_cli.distributed import Dist
    from grpo_cli.logprobs import TokenLogprobs
    from grpo_cli.packing import ScoringPlan
    from grpo_cli.precision import resolve_precision

    cfg = to_typed(
        composed(tiny("sft=demonstrations", f"trainer.gradient_accumulation_steps={accumulation}"))
    )
    return SimpleNamespace(
        cfg=cfg,
        dist=Dist(),
        scorer=TokenLogprobs(model, temperature=cfg.sampler.temperature, shared_prompt=True),
        plan=ScoringPlan(),
        precision=resolve_precision("fp32", torch.device("cpu")),
        device=torch.device("cpu"),
        policy=model,
    )


def test_one_or_four_micro_batches_make_one_update(tiny_model):
    """The NLL is normalised by the step's tokens, not the micro-batch's: SGD's update (the
    gradient itself) is the same for one micro-batch and four of unequal token counts."""
    from grpo_cli.distributed import Dist
    from grpo_cli.optim import OptimizerStep
    from grpo_cli.sft import train_step

    base, tok = tiny_model
    rows = [
        {"prompt": f"What is {a} plus {b}?"}
        for a, b in [(1, 2), (13, 4), (5, 16), (7, 7), (20, 1), (3, 9), (11, 11), (2, 18)]
    ]
    train = _examples(rows, tok)
    texts = [str(a) for a in (3, 17, 21, 14, 21, 12, 22, 20)]
    completions = tuple(
        tuple(tok(t, add_special_tokens=False)["input_ids"]) + (tok.eos_token_id,) for t in texts
    )
    demos = Demonstrations(tuple(train), completions, tuple(texts), "test")
    batch = demonstration_batch(demos, list(range(8)), tok.pad_token_id, "cpu")
    deltas, losses = [], []
    for accumulation in (1, 4):
        model = copy.deepcopy(base).train()
        learner = _learner(model, accumulation)
        sgd = torch.optim.SGD(model.parameters(), lr=1.0)
        opt = OptimizerStep(
            sgd,
            torch.optim.lr_scheduler.LambdaLR(sgd, lambda _: 1.0),
            policy=model,
            masters=None,
            grad_scaler=None,
            max_grad_norm=1e9,
            dist=Dist(),
        )
        torch.manual_seed(0)
        step = train_step(batch, learner, opt, learner.plan.options(1.0, top_k=1))
        losses.append(step.loss)
        deltas.append(torch.cat([(p - q).flatten() for p, q in zip(model.parameters(), base.parameters())]))
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    assert deltas[0].abs().max() > 0
    assert torch.allclose(deltas[0], deltas[1], atol=1e-6, rtol=0)


# ----------------------------------------------------------------------------- runs

WARM = tiny(
    "sft=demonstrations",
    "sft.steps=4",
    "sft.batch_size=4",
    "sft.learning_rate=1e-3",
    "trainer.save_steps=2",
    "trainer.max_steps=2",
    "trainer.keep_last=5",
    "trainer.eval_before=false",
    "data.eval_size=8",
    "loss.beta=0.04",
)


@pytest.fixture(scope="module")
def warmed_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("warm") / "run"
    train_here(WARM, run)
    return run


def _weights(checkpoint):
    from safetensors.torch import load_file

    return load_file(str(checkpoint / "model.safetensors"))


def test_a_warm_up_run_writes_its_checkpoints_rows_and_warmed_reference(warmed_run):
    names = sorted(p.name for p in (warmed_run / "checkpoints").iterdir())
    assert names == ["sft-000002", "sft-end", "step-000002"]
    rows = [json.loads(line) for line in (warmed_run / "metrics.jsonl").read_text().splitlines()]
    sft_rows = [r for r in rows if r.get("phase") == "sft"]
    assert [r["sft/step"] for r in sft_rows] == [1, 2, 3, 4]
    assert all(
        r["sft/loss"] > 0 and 0 <= r["sft/token_accuracy"] <= 1 and r["time/sft"] > 0 for r in sft_rows
    )
    # The warm-up moved the weights, and GRPO's reference is the warmed policy: at step 1 the
    # policy equals it, so the KL is 0 exactly.
    from grpo_cli.models import load_model, resolve_source

    base = load_model(resolve_source("builtin:tiny"), device=torch.device("cpu")).state_dict()
    warmed = _weights(warmed_run / "checkpoints" / "sft-end")
    assert any(not torch.equal(warmed[k], base[k]) for k in warmed)
    step1 = next(r for r in rows if r.get("step") == 1)
    assert step1["kl"] == 0.0


def test_the_base_reference_is_kept_on_request(tmp_path):
    last = train_here([*WARM, "sft.reference=base", "trainer.max_steps=1"], tmp_path / "run")
    assert last["kl"] > 0  # the policy has moved away from the base model in the warm-up


def test_lora_keeps_the_warmed_adapter_as_its_reference(tmp_path):
    lora = [*WARM, "adapter=lora", "adapter.r=4", "trainer.max_steps=1"]
    assert train_here(lora, tmp_path / "warmed")["kl"] == 0.0
    assert train_here([*lora, "sft.reference=base"], tmp_path / "base")["kl"] > 0


@pytest.mark.parametrize("cut", ["sft-000002", "sft-end"])
def test_a_run_stopped_inside_or_after_the_warm_up_resumes_bit_exact(warmed_run, tmp_path, cut):
    """The run resumed from a warm-up checkpoint (the later ones deleted: where a stop would
    have left it) ends with the uninterrupted run's weights, bit for bit, and its rows."""
    run = tmp_path / "run"
    shutil.copytree(warmed_run, run)
    order = ["sft-000002", "sft-end", "step-000002"]
    for later in order[order.index(cut) + 1 :]:
        shutil.rmtree(run / "checkpoints" / later)
    train_here([*WARM, "trainer.resume=auto"], run)
    final, expected = (
        _weights(run / "checkpoints" / "step-000002"),
        _weights(warmed_run / "checkpoints" / "step-000002"),
    )
    assert all(torch.equal(final[k], expected[k]) for k in expected)

    def rows(folder):
        out = []
        for line in (folder / "metrics.jsonl").read_text().splitlines():
            row = json.loads(line)
            out.append(
                {k: v for k, v in row.items() if not k.startswith(("time/", "memory/")) and k != "step_time"}
            )
        return out

    assert [r.get("sft/loss") for r in rows(run)] == [r.get("sft/loss") for r in rows(warmed_run)]


# ----------------------------------------------------------------------------- the band


def test_the_band_keeps_exactly_the_prompts_inside_it(tmp_path):
    """A reward that passes every completion of an even answer and none of an odd one: the
    band [0.5, 1] keeps exactly the even answers' prompts, stores them, and trains on them alone."""
    from grpo_cli.data.arithmetic import rows as arithmetic_rows

    run = tmp_path / "run"
    overrides = tiny(
        "reward=[]",
        "+reward.even.fn=band_rewards:even_answer",
        "+reward.even.role=correctness",
        "data.pass_rate_band=[0.5,1.0]",
        "data.band_samples=2",
        "trainer.max_steps=3",
        "trainer.save_steps=2",
        "trainer.eval_before=false",
        "data.eval_size=8",
    )
    train_here(overrides, run)
    cfg = to_typed(composed(overrides))
    train, _ = arithmetic_rows(cfg.data, cfg.trainer.seed)
    band = json.loads((run / "band.json").read_text())
    assert band["kept"] == [i for i, row in enumerate(train) if int(row["answer"]) % 2 == 0]
    assert band["pass_rates"] == [1.0 if int(row["answer"]) % 2 == 0 else 0.0 for row in train]
    assert band["completions"] == 2 * len(train)
    trained = [json.loads(line)["prompt"] for line in (run / "completions.jsonl").read_text().splitlines()]
    kept_prompts = {train[i]["prompt"] for i in band["kept"]}
    assert trained and set(trained) <= kept_prompts
    state = torch.load(run / "checkpoints" / "step-000003" / "trainer_state.pt", weights_only=True)
    assert state["band"] == band["kept"]

    # Resumed from step 2: the stored band is reused (no second probe), and the run ends as it did.
    resumed = tmp_path / "resumed"
    shutil.copytree(run, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-000003")
    (resumed / "band.json").unlink()
    train_here([*overrides, "trainer.resume=auto"], resumed)
    assert not (resumed / "band.json").exists()
    rows = [json.loads(line) for line in (resumed / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("phase") for r in rows].count("band") == 1  # (the first run's row, kept)
    final, expected = (
        _weights(resumed / "checkpoints" / "step-000003"),
        _weights(run / "checkpoints" / "step-000003"),
    )
    assert all(torch.equal(final[k], expected[k]) for k in expected)


def test_pass_rates_count_samples_and_the_band_ends_are_inclusive():
    from grpo_cli.band import in_band

    assert in_band([0.0, 0.2, 0.5, 0.8, 0.81, 1.0, None], [0.2, 0.8]) == [1, 2, 3]
    assert in_band([0.0, 1.0], [0.0, 1.0]) == [0, 1]


def test_a_band_that_keeps_too_few_prompts_is_refused_before_grpo(tmp_path):
    overrides = tiny(
        "reward=[]",
        "+reward.even.fn=band_rewards:even_answer",
        "+reward.even.role=correctness",
        "data.pass_rate_band=[0.2,0.8]",  # every rate is 0 or 1: none inside
        "data.band_samples=2",
        "trainer.eval_before=false",
    )
    with pytest.raises(UserError, match=r"keeps 0 of 64 training prompts.*widen the band"):
        train_here(overrides, tmp_path / "run")


def test_grpo_eval_counts_the_prompts_inside_a_band(tmp_path):
    """grpo-eval --band: how many held-out prompts the band would keep, per group, from the same
    pass rates (band.rates_of) the training band reads."""
    from grpo_cli.cli.eval import main
    from grpo_cli.data.arithmetic import rows as arithmetic_rows

    overrides = tiny(
        "reward=[]",
        "+reward.even.fn=band_rewards:even_answer",
        "+reward.even.role=correctness",
        "data.eval_size=12",
        "data.wide_eval_max_operand=0",
    )
    out = tmp_path / "eval.json"
    assert main([*overrides, "--samples=2", "--band", "0.5", "1", f"--output={out}"]) == 0
    result = json.loads(out.read_text())
    cfg = to_typed(composed(overrides))
    _, held_out = arithmetic_rows(cfg.data, cfg.trainer.seed)
    even = [row for row in held_out if int(row["answer"]) % 2 == 0]
    assert (result["in_band"], result["in_band_of"]) == (len(even), len(held_out))
    for kind in {row["kind"] for row in held_out}:
        kept = sum(row["kind"] == kind for row in even)
        assert result[f"in_band/{kind}"] == f"{kept}/{sum(row['kind'] == kind for row in held_out)}"


@pytest.mark.parametrize(
    "extra",
    [
        ["trainer.precision=bf16", "trainer.gradient_checkpointing=true"],  # bf16 weights, fp32 masters
        ["trainer.micro_batch_tokens=64"],  # token-budget micro-batches, rows in length buckets
        ["adapter=lora", "adapter.r=4", "trainer.gradient_accumulation_steps=2"],
    ],
    ids=["bf16-checkpointed", "token-budget", "lora-accumulation"],
)
def test_the_warm_up_trains_through_grpos_forward_paths(tmp_path, extra):
    """The warm-up runs where GRPO's training forward runs: its loss falls over a few steps on
    the same demonstrations (sft.batch_size = every one) and the trained weights move."""
    run = tmp_path / "run"
    overrides = tiny(
        "sft=demonstrations",
        "sft.steps=4",
        "sft.batch_size=8",
        "sft.learning_rate=3e-3",
        "data.num_examples=8",
        "data.eval_size=0",
        "data.wide_eval_max_operand=0",
        "trainer.max_steps=1",
        *extra,
    )
    train_here(overrides, run)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["sft/loss"] for r in rows if r.get("phase") == "sft"]
    assert len(losses) == 4 and losses[-1] < losses[0], losses
    end = run / "checkpoints" / "sft-end"
    assert (end / ("adapter_model.safetensors" if "adapter=lora" in extra else "model.safetensors")).is_file()


def test_an_sft_file_with_gold_answers_is_judged_and_one_without_is_kept(tmp_path, tok):
    """sft.path's other columns reach the correctness reward (a wrong demonstration is dropped);
    a file without the gold answer column is kept whole rather than refused."""
    from grpo_cli.rewards import build_rewards

    rows = [
        {"prompt": "What is 1 plus 1?", "completion": "2", "answer": "2"},
        {"prompt": "What is 2 plus 2?", "completion": "5", "answer": "4"},
    ]
    (tmp_path / "gold.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = to_typed(composed(tiny("sft=demonstrations", f"sft.path={tmp_path / 'gold.jsonl'}")))
    rewards = build_rewards(cfg.reward)
    kept = keep_passing(read_demonstrations(cfg, tok, [], []), rewards, tok)
    assert kept.texts == ("2",) and kept.dropped == {"the run's correctness reward fails it": 1}
    (tmp_path / "plain.jsonl").write_text(
        "".join(json.dumps({k: r[k] for k in ("prompt", "completion")}) + "\n" for r in rows)
    )
    cfg = to_typed(composed(tiny("sft=demonstrations", f"sft.path={tmp_path / 'plain.jsonl'}")))
    assert keep_passing(read_demonstrations(cfg, tok, [], []), rewards, tok).texts == ("2", "5")


def test_lora_stays_in_training_mode_beside_its_reference_adapter(tiny_model):
    """PEFT's load_adapter puts the model in eval mode; the policy must train on (gradient
    checkpointing acts in training mode only)."""
    from grpo_cli.adapters import REFERENCE_ADAPTER, add_lora, load_reference_adapter, reference_weights
    from grpo_cli.config import AdapterConfig

    model, _ = tiny_model
    policy = add_lora(copy.deepcopy(model), AdapterConfig(name="lora", r=4)).train()
    saved = None
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        policy.save_pretrained(folder)
        load_reference_adapter(policy, folder)
        saved = policy.training
    assert saved is True
    assert REFERENCE_ADAPTER in policy.peft_config
    trained = [n for n, p in policy.named_parameters() if p.requires_grad]
    with reference_weights(policy):
        pass
    assert [n for n, p in policy.named_parameters() if p.requires_grad] == trained
    assert trained and all(REFERENCE_ADAPTER not in n for n in trained)
