"""trainer.precision=bf16: bf16 weights with fp32 master weights (precision.MasterWeights), and
the precision names. Tiny model, CPU (this CPU's bf16 kernels: oneDNN, emulated where the CPU
has no bf16 units)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny
from safetensors.torch import load_file

from grpo_cli.cli.train import train_config as run
from grpo_cli.errors import UserError
from grpo_cli.precision import MasterWeights, resolve_precision

TINY = tiny(
    "data.eval_size=0",
    "trainer.eval_before=false",
    "trainer.prompts_per_step=2",
    "reward=[]",
    "+reward.code.fn=reward_fixtures:char_code",  # (varied: every group has signal)
)


def _parts(compose, tmp_path, overrides):
    from rich.console import Console

    from grpo_cli.build import build_training
    from grpo_cli.config import to_typed

    cfg = to_typed(compose(TINY + overrides))
    return cfg, build_training(cfg, tmp_path, Console(quiet=True))


class Tied(torch.nn.Module):
    """Embeddings tied to the output head, and a buffer, as in a causal LM."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(8, 4)
        self.head = torch.nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight
        self.norm = torch.nn.Linear(4, 4)
        self.register_buffer("inv_freq", torch.tensor([1.0, 1 / 3, 1 / 7]))

    def forward(self, ids):
        return self.head(self.norm(self.embed(ids)))


@pytest.mark.parametrize(
    "name, device_type, autocast, weights",
    [
        ("fp32", "cpu", None, None),
        ("bf16", "cpu", None, torch.bfloat16),  # bf16 weights (and fp32 masters)
        ("bf16-autocast", "cpu", torch.bfloat16, None),  # fp32 weights, autocast
    ],
)
def test_precision_names_resolve(name, device_type, autocast, weights):
    p = resolve_precision(name, torch.device(device_type))
    assert (p.autocast_dtype, p.weights_dtype, p.use_grad_scaler) == (autocast, weights, False)


@pytest.mark.parametrize(
    "cuda, bf16, want",
    [(True, True, "bf16"), (True, False, "fp16"), (False, True, "bf16"), (False, False, "fp32")],
)
def test_auto_picks_bf16_where_the_device_has_bf16_units_and_says_why(cuda, bf16, want):
    from grpo_cli.precision import pick_precision

    name, why = pick_precision(cuda, bf16)
    assert name == want and why


def test_bf16_with_adapters_keeps_fp32_adapters_under_autocast():
    p = resolve_precision("bf16", torch.device("cpu"), adapted=True)
    assert p.name == "bf16" and p.autocast_dtype == torch.bfloat16 and p.weights_dtype is None


@pytest.mark.parametrize(
    "name, adapted, device_type, units, noted",
    [
        ("bf16", False, "cpu", False, True),  # bf16 weights, emulated
        ("bf16", True, "cpu", False, True),  # LoRA: bf16 base under autocast, emulated
        ("bf16-autocast", False, "cpu", False, True),
        ("bf16", False, "cpu", True, False),  # AVX512-BF16/AMX: native
        ("fp32", False, "cpu", False, False),
        ("bf16", False, "meta", False, False),  # not a CPU: whatever the CPU has
    ],
)
def test_bf16_on_a_cpu_without_bf16_units_is_noted_with_the_faster_choice(
    monkeypatch, name, adapted, device_type, units, noted
):
    """The note that a bf16 run is emulated (50-100x slower matmuls on an AVX2-only EPYC) says
    which setting and which fix, and appears exactly when the CPU lacks the units."""
    import grpo_cli.precision as precision

    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: units)
    p = resolve_precision(name, torch.device("cpu"), adapted=adapted)
    note = precision.emulation_note(p, torch.device(device_type))
    assert (note is not None) == noted
    if noted:
        assert f"trainer.precision={name}" in note and "trainer.precision=auto" in note


@pytest.mark.parametrize("name", ["fp16", "bf17"])
def test_unsupported_precisions_are_refused_with_the_choices(name):
    with pytest.raises(UserError, match="trainer.precision"):
        resolve_precision(name, torch.device("cpu"))


def test_master_weights_are_the_loaded_fp32_tensors_and_the_model_becomes_bf16():
    torch.manual_seed(0)
    model = Tied()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    masters = MasterWeights(model, torch.bfloat16)
    assert len(masters.params) == 3  # the tied weight once: embed (=head), norm.weight, norm.bias
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.inv_freq.dtype == torch.float32  # buffers are not rounded
    assert model.head.weight is model.embed.weight  # still tied
    for (name, _), master in zip(masters.named, masters.params):
        assert master.dtype == torch.float32 and torch.equal(master, before[name]), name
    state = masters.state_dict(model)
    assert set(state) == {"embed.weight", "norm.weight", "norm.bias", "inv_freq"}
    assert all(v.dtype == torch.float32 for v in state.values())


def test_master_weights_keep_updates_that_bf16_would_round_away():
    """1000 SGD steps of lr 1e-6 on a weight of 0.05: bf16's spacing there is 2.4e-4, so stepping
    the bf16 weight directly never moves it; the fp32 master moves exactly as an fp32 weight does,
    and the model's bf16 copy follows it to the nearest bf16 value."""

    def linear(dtype):
        layer = torch.nn.Linear(1, 1, bias=False).to(dtype)
        with torch.no_grad():
            layer.weight.fill_(0.05)
        return layer

    model, plain, fp32 = linear(torch.float32), linear(torch.bfloat16), linear(torch.float32)
    masters = MasterWeights(model, torch.bfloat16)
    optimizers = [
        torch.optim.SGD(p, lr=1e-6) for p in (masters.params, plain.parameters(), fp32.parameters())
    ]
    for _ in range(1000):
        model(torch.ones(1, 1, dtype=torch.bfloat16)).sum().backward()  # d/dw = 1
        masters.take_grads()
        assert model.weight.grad is None and masters.params[0].grad.dtype == torch.float32
        plain(torch.ones(1, 1, dtype=torch.bfloat16)).sum().backward()
        fp32(torch.ones(1, 1)).sum().backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
        masters.put_weights()
    with torch.no_grad():
        assert float(plain.weight) == float(torch.tensor(0.05, dtype=torch.bfloat16))  # stuck
        assert torch.equal(masters.params[0], fp32.weight) and float(fp32.weight) == pytest.approx(
            0.049, rel=1e-4
        )
        assert torch.equal(model.weight, fp32.weight.to(torch.bfloat16))


def test_master_weights_sum_micro_batch_gradients_in_fp32():
    """Two micro-batches' bf16 gradients, taken after each backward: their sum is formed in fp32
    (a bf16 .grad would round the sum once more)."""
    model = torch.nn.Linear(4, 1, bias=False)
    masters = MasterWeights(model, torch.bfloat16)
    grads = []
    for x in (torch.tensor([[1.0, 3.0, 5.0, 7.0]]), torch.tensor([[1e-3, 1e-3, 1e-3, 1e-3]])):
        model(x.to(torch.bfloat16)).sum().backward()
        grads.append(model.weight.grad.float().clone())
        masters.take_grads()
    assert torch.equal(masters.params[0].grad, grads[0] + grads[1])
    assert not torch.equal(masters.params[0].grad, (grads[0] + grads[1]).to(torch.bfloat16).float())


def test_bf16_run_samples_and_trains_on_bf16_weights_while_the_optimizer_steps_fp32(compose, tmp_path):
    cfg, parts = _parts(compose, tmp_path, ["trainer.precision=bf16", "loss.beta=0.04"])
    policy, ref, masters = parts.learner.policy, parts.learner.ref, parts.learner.opt_step.masters
    assert {p.dtype for p in policy.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in ref.parameters()} == {torch.bfloat16}
    stepped = [p for group in parts.learner.opt_step.optimizer.param_groups for p in group["params"]]
    assert [id(p) for p in stepped] == [id(p) for p in masters.params]
    assert all(p.dtype == torch.float32 for p in stepped)
    # The reference starts equal to the policy (the same rounding of the same fp32 weights).
    for (name, p), q in zip(policy.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), name


def test_bf16_checkpoints_hold_the_fp32_masters_and_resume_bit_exact(compose, tmp_path):
    """4 steps straight vs 2 + resume 2: the same fp32 weights bit for bit (the checkpoint holds
    the masters, not their bf16 rounding), written as fp32 with config.json saying so."""
    args = TINY + [
        "trainer.precision=bf16",
        "loss.beta=0.04",
        "optimizer.learning_rate=1e-2",
        "trainer.save_steps=2",
        "trainer.keep_last=3",
    ]
    for folder in ("straight", "split"):
        (tmp_path / folder).mkdir()
    run(compose(args + ["trainer.max_steps=4"]), tmp_path / "straight")
    run(compose(args + ["trainer.max_steps=2"]), tmp_path / "split")
    run(compose(args + ["trainer.max_steps=4", "trainer.resume=auto"]), tmp_path / "split")
    step2 = tmp_path / "straight" / "checkpoints" / "step-000002"
    a = load_file(step2 / "model.safetensors")
    assert {v.dtype for v in a.values()} == {torch.float32}
    assert json.loads((step2 / "config.json").read_text()).get("dtype", "float32") == "float32"
    # fp32 values that bf16 cannot hold: the masters, not the model's rounded copy.
    assert any(not torch.equal(v, v.to(torch.bfloat16).float()) for v in a.values())
    want = load_file(tmp_path / "straight" / "checkpoints" / "step-000004" / "model.safetensors")
    got = load_file(tmp_path / "split" / "checkpoints" / "step-000004" / "model.safetensors")
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_bf16_and_fp32_runs_take_the_same_first_step_closely(compose, tmp_path):
    """The same rollout (the first step's samples at this seed do not change with the rounding
    of a tiny model), the same update up to bf16's rounding of the forward and backward."""
    rows = {}
    for precision in ("fp32", "bf16"):
        cfg = compose(
            TINY + [f"trainer.precision={precision}", "trainer.max_steps=1", "trainer.save_steps=1"]
        )
        (tmp_path / precision).mkdir()
        rows[precision] = run(cfg, tmp_path / precision)
    a = load_file(tmp_path / "fp32" / "checkpoints" / "step-000001" / "model.safetensors")
    b = load_file(tmp_path / "bf16" / "checkpoints" / "step-000001" / "model.safetensors")
    from grpo_cli.models import build_tiny

    base = load_file(build_tiny() / "model.safetensors")
    da = torch.cat([(a[k] - base[k]).flatten() for k in sorted(a)])
    db = torch.cat([(b[k] - base[k]).flatten() for k in sorted(a)])
    assert da.abs().max() > 1e-7
    cos = float(torch.nn.functional.cosine_similarity(da, db, dim=0))
    assert cos > 0.9, cos  # the same direction (Adam's first step is ~lr * sign(grad))
    assert rows["bf16"]["sampler/logp_diff_max"] < 1.0
