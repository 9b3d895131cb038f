"""LoRA adapters through PEFT (adapter=lora): the config, the reference model as the adapters-
disabled policy, what trains, every trainer path with adapters, checkpoints, evaluation, export."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import console_script, run_cli, tiny, train_here

from grpo_cli.cli.train import train_config as run

TINY = tiny(
    "data.eval_size=8",
    "trainer.prompts_per_step=2",
    "trainer.precision=fp32",  # (exact comparisons; the bf16 tests say so)
)
# A reward with spread in every group (the tiny model's arithmetic accuracy is 0), a learning rate
# that moves LoRA's weights in a few steps.
SIGNAL = ["reward=[]", "+reward.code.fn=reward_fixtures:char_code", "optimizer.learning_rate=1e-2"]
LORA = ["adapter=lora", "adapter.r=4", "adapter.alpha=8"]
ENV = {"PYTHONPATH": str(Path(__file__).parent)}  # the console scripts import reward_fixtures


def read_metrics(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "reward" in r]


def _parts(compose, tmp_path, overrides):
    from rich.console import Console

    from grpo_cli.build import build_training
    from grpo_cli.config import to_typed

    cfg = to_typed(compose(TINY + overrides))
    return cfg, build_training(cfg, tmp_path, Console(quiet=True))


def _perturb_adapters(model, seed=0):
    """Non-zero B (fresh adapters start with B = 0, i.e. as the base model): the adapted model
    then differs from its base, so the tests below can tell them apart."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))


def _rollout(model, tok, G=3):
    from grpo_cli.samplers.builtin import sample

    prompts = [tok("What is 2 plus 3?")["input_ids"], tok("Hi")["input_ids"]]
    torch.manual_seed(0)
    was_training = model.training
    model.eval()  # as the engine samples (a checkpointed model in train mode drops its KV cache)
    try:
        return sample(
            model,
            prompts,
            num_generations=G,
            max_new_tokens=6,
            temperature=1.0,
            eos_ids=[],
            pad_id=tok.pad_token_id,
        )
    finally:
        model.train(was_training)


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "overrides,fragment",
    [
        (["adapter=lora", "adapter.r=0"], "adapter.r=0 must be a positive integer"),
        (["adapter=lora", "adapter.alpha=0"], "adapter.alpha=0.0 must be > 0"),
        (["adapter=lora", "adapter.dropout=1.5"], "adapter.dropout=1.5 must be in [0, 1)"),
        (["adapter=lora", "adapter.dropout=0.05"], "trainer.self_check=false to train with it"),
        (["adapter=lora", "adapter.init=pissa"], "adapter.init='pissa' is not one of default, gaussian"),
        (["adapter=lora", "adapter.target_modules=[all-linear,q_proj]"], "give [all-linear] alone"),
        (["adapter=lora", "adapter.target_modules=[]"], "must name layers"),
        (["adapter.quantization=4bit"], "adapter.name=none trains every weight; use adapter=qlora"),
        (["adapter.path=somewhere"], "set adapter.name=lora"),
        (["adapter=qlora", "trainer.device=cpu"], "need a CUDA GPU"),
        (["adapter.name=dora"], "adapter.name='dora' is not one of none, lora"),
    ],
)
def test_bad_adapter_settings_are_named_before_any_model_loads(compose, overrides, fragment):
    from grpo_cli.config import validate

    problems = validate(compose(overrides))
    assert any(fragment in p for p in problems), problems


def test_good_adapter_settings_validate(compose):
    from grpo_cli.config import validate

    for overrides in (
        ["adapter=lora"],
        ["adapter=qlora"],
        ["adapter=lora", "adapter.dropout=0.1", "trainer.self_check=false"],
    ):
        assert validate(compose(overrides)) == [], overrides
    cfg = compose(["adapter=qlora"])
    assert (cfg.adapter.name, cfg.adapter.quantization, cfg.adapter.r) == ("lora", "4bit", 16)


@pytest.mark.parametrize("model", ["tiny-llama", "gpt2"])
def test_unknown_target_modules_are_answered_with_the_models_linear_layers(model):
    from transformers import AutoModelForCausalLM, GPT2Config

    from grpo_cli.adapters import add_lora, linear_layer_names
    from grpo_cli.config import AdapterConfig
    from grpo_cli.errors import UserError
    from grpo_cli.models import build_tiny

    if model == "gpt2":
        m = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50))
        expected = ["c_attn", "c_fc", "c_proj"]  # Conv1D layers; the tied lm_head is not adaptable
    else:
        m = AutoModelForCausalLM.from_pretrained(build_tiny())
        expected = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert linear_layer_names(m) == expected
    with pytest.raises(UserError) as err:
        add_lora(
            m, AdapterConfig(r=2, alpha=4, dropout=0.0, target_modules=[expected[0], "query"], init="default")
        )
    assert "'query' is not a linear layer" in str(err.value)
    assert ", ".join(expected) in str(err.value)


# ----------------------------------------------------------------------------- the model


def test_reference_logprobs_are_the_base_models_exactly(compose, tmp_path):
    """beta > 0 with adapters: the reference is the policy itself with its adapters disabled (no
    second copy of the weights), and its log-probs equal the base model's bit for bit."""
    from grpo_cli.adapters import disabled_adapters
    from grpo_cli.logprobs import token_logprobs
    from grpo_cli.models import ModelSource, build_tiny, load_model

    cfg, parts = _parts(compose, tmp_path, LORA + ["loss.beta=0.04"])
    assert parts.learner.ref is parts.learner.policy  # no second model
    _perturb_adapters(parts.learner.policy)
    base = load_model(
        ModelSource(str(build_tiny()), None, "tiny"), device=torch.device("cpu"), trainable=False
    )
    r = _rollout(base, parts.rollouts.tokenizer)
    with torch.no_grad():
        expected = token_logprobs(base, *r.inputs(), temperature=0.7)
        with disabled_adapters(parts.learner.ref):
            ref = token_logprobs(parts.learner.ref, *r.inputs(), temperature=0.7)
        adapted = token_logprobs(parts.learner.policy, *r.inputs(), temperature=0.7)
    assert torch.equal(ref, expected)
    assert not torch.allclose(adapted, expected, atol=1e-3)  # the adapters are back on afterwards


def test_only_the_adapters_train_and_the_optimizer_holds_only_them(compose, tmp_path):
    from grpo_cli.engine import train
    from grpo_cli.models import build_tiny

    cfg, parts = _parts(compose, tmp_path, LORA + SIGNAL + ["loss.beta=0.04", "trainer.max_steps=3"])
    policy = parts.learner.policy
    adapter_names = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert adapter_names and all("lora_A" in n or "lora_B" in n for n in adapter_names)
    held = {id(p) for group in parts.learner.opt_step.optimizer.param_groups for p in group["params"]}
    assert held == {id(p) for n, p in policy.named_parameters() if n in adapter_names}
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    train(cfg, parts, tmp_path, "{}", on_start=None)
    rows = read_metrics(tmp_path)
    after = dict(policy.named_parameters())
    assert all(torch.equal(before[n], after[n]) for n in before if n not in adapter_names)  # base frozen
    assert any(not torch.equal(before[n], after[n]) for n in adapter_names)  # adapters moved
    assert all(r["grad_norm"] > 0 and r["kl"] >= 0 for r in rows)
    # The frozen base is the model it was loaded from.
    from safetensors.torch import load_file

    base = load_file(build_tiny() / "model.safetensors")
    assert torch.equal(
        after["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"],
        base["model.layers.0.self_attn.q_proj.weight"],
    )


def test_grad_norm_covers_only_the_adapters(compose, tmp_path, monkeypatch):
    """clip_grad_norm_ gets the trainable parameters: a frozen weight given a gradient (it cannot
    get one in training; planted here) does not enter the norm."""
    import grpo_cli.engine as engine
    from grpo_cli.engine import train

    cfg, parts = _parts(compose, tmp_path, LORA + SIGNAL + ["trainer.max_steps=1", "data.eval_size=0"])
    seen = {}
    original = torch.nn.utils.clip_grad_norm_

    def clip(params, max_norm, *a, **kw):
        params = list(params)
        seen["ids"] = {id(p) for p in params}
        return original(params, max_norm, *a, **kw)

    monkeypatch.setattr(engine.torch.nn.utils, "clip_grad_norm_", clip)
    train(cfg, parts, tmp_path, "{}")
    assert seen["ids"] == {id(p) for p in parts.learner.policy.parameters() if p.requires_grad}


def test_decode_fast_path_and_shared_prompt_forward_match_the_plain_paths_with_adapters(compose, tmp_path):
    """The CPU decode's W @ x^T layers reach the plain nn.Linear layers inside PEFT's LoRA layers
    (base_layer, lora_A, lora_B): greedy tokens and log-probs as without them; the shared-prompt
    training forward equals the plain one."""
    from grpo_cli.logprobs import token_logprobs
    from grpo_cli.samplers.builtin import sample

    cfg, parts = _parts(compose, tmp_path, LORA)
    model, tok = parts.learner.policy, parts.rollouts.tokenizer
    _perturb_adapters(model)
    prompts = [tok("What is 2 plus 3?")["input_ids"], tok("Hi")["input_ids"]]
    kw = dict(
        num_generations=2, max_new_tokens=8, temperature=1.0, eos_ids=[], pad_id=tok.pad_token_id, greedy=True
    )
    fast, plain = (
        sample(model, prompts, fast_decode=True, **kw),
        sample(model, prompts, fast_decode=False, **kw),
    )
    assert torch.equal(fast.completion_ids, plain.completion_ids)
    torch.testing.assert_close(fast.sampler_logps, plain.sampler_logps, atol=1e-5, rtol=0)
    from grpo_cli.samplers.builtin import _patch_counts

    assert not any(True for _ in _patch_counts.keys())  # every layer unpatched afterwards
    r = _rollout(model, tok)
    shared = token_logprobs(model, *r.inputs(), temperature=1.0, num_generations=r.num_generations)
    full = token_logprobs(model, *r.inputs(), temperature=1.0)  # one row per group: no prompt shared
    torch.testing.assert_close(shared, full, atol=1e-5, rtol=0)
    torch.testing.assert_close(full * r.trained_mask, r.sampler_logps, atol=1e-5, rtol=0)


def test_gradient_checkpointing_gives_the_same_adapter_gradients(compose, tmp_path):
    from grpo_cli.logprobs import checkpointing, token_logprobs

    grads = []
    for gc in (False, True):
        cfg, parts = _parts(compose, tmp_path / str(gc), LORA + [f"trainer.gradient_checkpointing={gc}"])
        assert checkpointing(parts.learner.policy) is gc
        _perturb_adapters(parts.learner.policy)
        r = _rollout(parts.learner.policy, parts.rollouts.tokenizer)
        token_logprobs(parts.learner.policy, *r.inputs(), temperature=1.0).sum().backward()
        grads.append(
            {n: p.grad.clone() for n, p in parts.learner.policy.named_parameters() if p.requires_grad}
        )
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-5, rtol=1e-4)
    assert any(g.abs().sum() > 0 for g in grads[0].values())


def test_lora_on_a_bf16_base_keeps_fp32_adapters_and_trains(compose, tmp_path):
    cfg, parts = _parts(compose, tmp_path, LORA + SIGNAL + ["trainer.precision=bf16", "trainer.max_steps=2"])
    dtypes = {p.dtype for p in parts.learner.policy.parameters() if not p.requires_grad}
    assert dtypes == {torch.bfloat16}
    assert {p.dtype for p in parts.learner.policy.parameters() if p.requires_grad} == {torch.float32}
    from grpo_cli.engine import train

    last = train(cfg, parts, tmp_path, "{}")
    assert all(isinstance(v, (int, float)) and v == v for v in last.values() if isinstance(v, float))


@pytest.mark.parametrize("extra", [["trainer.dynamic_sampling=true"], ["trainer.num_iterations=2"]])
def test_training_with_adapters_runs_the_self_check_and_moves_the_adapters(compose, tmp_path, extra, capsys):
    cfg = compose(
        TINY + LORA + SIGNAL + ["loss.beta=0.04", "trainer.max_steps=2", "trainer.quiet=false"] + extra
    )
    last = run(cfg, tmp_path)
    out = capsys.readouterr().out
    assert "self-check ok" in out and "adapter: LoRA r=4" in out
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(v == v for r in rows for v in r.values() if isinstance(v, float))  # finite, no NaN
    assert last["kl"] > 0  # the adapters moved the policy away from the reference


# ----------------------------------------------------------------------------- files


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A short LoRA run (in this process: its files are grpo-train's); its final checkpoint."""
    run_dir = tmp_path_factory.mktemp("lora") / "run"
    train_here(
        [*TINY, *LORA, *SIGNAL, "loss.beta=0.04", "trainer.max_steps=3", "trainer.save_steps=3"], run_dir
    )
    return run_dir, run_dir / "checkpoints" / "step-000003"


def test_checkpoint_holds_the_adapter_in_peft_format(lora_run):
    from peft import PeftConfig

    run_dir, ckpt = lora_run
    names = {p.name for p in ckpt.iterdir()}
    assert {
        "adapter_config.json",
        "adapter_model.safetensors",
        "optimizer.pt",
        "scheduler.pt",
        "config.yaml",
        "trainer_state.pt",
        "tokenizer.json",
    } <= names
    assert "model.safetensors" not in names  # the frozen base is not copied into every checkpoint
    config = PeftConfig.from_pretrained(str(ckpt))
    assert (config.r, config.lora_alpha, config.peft_type.value) == (4, 8, "LORA")


def test_grpo_eval_checkpoint_evaluates_base_plus_adapter(lora_run, tmp_path, monkeypatch):
    """grpo-eval --checkpoint of a LoRA run loads its adapter onto the base model: its greedy
    reward on the held-out prompts is the training run's final evaluation. (grpo-eval's main in
    this process: tests/test_offline_eval.py runs the console script.)"""
    from grpo_cli.cli.eval import main as grpo_eval

    run_dir, ckpt = lora_run
    out = tmp_path / "eval.json"
    monkeypatch.chdir(tmp_path)
    assert grpo_eval(["--checkpoint", str(ckpt), "--samples", "0", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert "LoRA adapter" in result["model"]
    final = read_metrics(run_dir)[-1]
    assert result["greedy_reward"] == pytest.approx(final["eval/reward"], abs=1e-6)


def test_export_writes_a_merged_model_that_from_pretrained_loads(lora_run, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from grpo_cli.cli.export import main as grpo_export
    from grpo_cli.models import build_tiny

    run_dir, ckpt = lora_run
    out = tmp_path / "merged"
    # grpo-export's main in this process (the refusal below runs the console script).
    assert grpo_export([str(ckpt), "--output", str(out)]) == 0
    assert not (out / "adapter_config.json").exists() and (out / "model.safetensors").is_file()
    merged = AutoModelForCausalLM.from_pretrained(out)
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(build_tiny()), str(ckpt))
    base = AutoModelForCausalLM.from_pretrained(build_tiny())
    x = torch.randint(0, 100, (2, 9))
    with torch.no_grad():
        want, got, plain = adapted(input_ids=x).logits, merged(input_ids=x).logits, base(input_ids=x).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(plain, want, atol=1e-4)  # the adapters did change the model
    again = run_cli([console_script("grpo-export"), str(ckpt), "--output", str(out)], cwd=tmp_path, env=ENV)
    assert again.returncode == 2 and "never overwrites" in again.stderr


def test_resume_refuses_another_adapter_shape(lora_run, tmp_path):
    """A UserError, which grpo-train reports with exit status 2 (catalogue case Z6 of
    tests/test_reliability.py runs a refused resume through the console script)."""
    from grpo_cli.errors import UserError

    run_dir, ckpt = lora_run
    args = [
        *TINY,
        "adapter=lora",
        "adapter.r=8",
        "adapter.alpha=8",
        *SIGNAL,
        "loss.beta=0.04",
        "trainer.max_steps=4",
        f"trainer.resume={ckpt}",
    ]
    with pytest.raises(UserError) as refused:
        train_here(args, tmp_path / "r")
    assert "adapter.r=4" in str(refused.value) and "adapter.r=8" in str(refused.value)


def test_qlora_on_a_cpu_is_one_paragraph_before_anything_loads(tmp_path):
    res = run_cli(
        [
            console_script("grpo-train"),
            "adapter=qlora",
            "trainer.device=auto",
            f"hydra.run.dir={tmp_path / 'q'}",
        ],
        cwd=tmp_path,
        env={"CUDA_VISIBLE_DEVICES": ""},
    )
    assert res.returncode == 2, res.stdout + res.stderr
    assert "QLoRA" in res.stderr and "CUDA GPU" in res.stderr and "adapter=lora" in res.stderr
    assert "Traceback" not in res.stderr
    assert "model:" not in res.stdout  # nothing was loaded (the tokenizer and model load after the banner)
    assert not (tmp_path / "q").exists()


def test_a_sweep_over_full_and_lora_training(tmp_path):
    sweep = tmp_path / "sweep"
    args = [
        console_script("grpo-train"),
        "-m",
        *TINY,
        *SIGNAL,
        "adapter=none,lora",
        "adapter.r=4",
        "trainer.max_steps=1",
        "data.eval_size=0",
        f"hydra.sweep.dir={sweep}",
    ]
    res = run_cli(args, cwd=tmp_path, env=ENV)
    assert res.returncode == 0, res.stdout + res.stderr
    # adapter.r, given for both jobs, does not apply to full training: a note there, not an error.
    assert res.stderr.count("note: adapter.r=4 is ignored with adapter.name=none") == 1, res.stderr
    full, lora = sweep / "0", sweep / "1"
    assert (full / "checkpoints" / "step-000001" / "model.safetensors").is_file()
    assert (lora / "checkpoints" / "step-000001" / "adapter_model.safetensors").is_file()
    assert len(read_metrics(full)) == len(read_metrics(lora)) == 1
