"""grpo-chat in subprocesses, as a user runs it: a one-shot prompt on a tiny full checkpoint and on a
tiny LoRA checkpoint (its adapter on the base, nothing merged), a run folder, a session on stdin, and
a bad target. The reply is checked against transformers (and PEFT) loading the checkpoint on their own."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import console_script, run_cli

PROMPT = "What is 3 plus 4?"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """A one-step tiny run, full and LoRA (a checkpoint each)."""
    root = tmp_path_factory.mktemp("chat")
    out = {}
    for name, extra in (("full", []), ("lora", ["adapter=lora"])):
        run_dir = root / name
        res = run_cli(
            [
                console_script("grpo-train"),
                "model=tiny",
                "trainer=smoke",
                "trainer.max_steps=1",
                "trainer.precision=fp32",
                "data.num_examples=16",
                "data.eval_size=0",
                "sampler.num_generations=2",
                "sampler.max_new_tokens=4",
                "trainer.quiet=true",
                f"hydra.run.dir={run_dir}",
                *extra,
            ],
            cwd=root,
        )
        assert res.returncode == 0, res.stderr
        out[name] = run_dir
    return out


SEED, TOKENS = 3, 12


def _expected(model, tokenizer, ckpt: Path) -> str:
    """The reply transformers (and PEFT) generate on their own: the checkpoint's chat template and its
    saved sampler settings (temperature, top_p, top_k), sampled with the seed grpo-chat is given,
    ending at the tokenizer's or the generation config's end of sequence."""
    from grpo_cli.cli.common import typed_config

    s = typed_config([], checkpoint=str(ckpt)).sampler
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], tokenize=False, add_generation_prompt=True
    )
    enc = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    extra = model.generation_config.eos_token_id
    eos = sorted({tokenizer.eos_token_id, *(extra if isinstance(extra, list) else [extra])} - {None})
    torch.manual_seed(SEED)
    with torch.no_grad():
        ids = model.generate(
            **enc,
            max_new_tokens=TOKENS,
            do_sample=True,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k or None,
            eos_token_id=eos,
            pad_token_id=tokenizer.pad_token_id,
        )
    return tokenizer.decode(ids[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)


def _chat(target: Path | str, cwd: Path, *args: str, stdin: str | None = None):
    import subprocess

    from conftest import grpo_env

    return subprocess.run(
        [console_script("grpo-chat"), str(target), *args],
        cwd=cwd,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
        env=grpo_env(),
    )


ONE_SHOT = ("-p", PROMPT, "--seed", str(SEED), "--max-new-tokens", str(TOKENS))


def test_chat_answers_a_one_shot_prompt_on_a_checkpoint(runs, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpt = runs["full"] / "checkpoints" / "step-000001"
    res = _chat(ckpt, tmp_path, *ONE_SHOT)
    assert res.returncode == 0, res.stderr
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    expected = _expected(model, AutoTokenizer.from_pretrained(ckpt), ckpt)
    assert expected.strip() and res.stdout.rstrip("\n") == expected, (res.stdout, expected)
    assert "grpo-chat device=cpu" in res.stderr
    # the run folder: its last checkpoint
    again = _chat(runs["full"], tmp_path, *ONE_SHOT)
    assert again.returncode == 0 and again.stdout == res.stdout


def test_chat_answers_on_a_lora_checkpoint_without_merging(runs, tmp_path):
    from peft import PeftModel
    from transformers import AutoTokenizer

    from grpo_cli.models import load_model, resolve_source

    ckpt = runs["lora"] / "checkpoints" / "step-000001"
    assert (ckpt / "adapter_model.safetensors").exists() and not (ckpt / "model.safetensors").exists()
    res = _chat(ckpt, tmp_path, *ONE_SHOT)
    assert res.returncode == 0, res.stderr
    base = load_model(resolve_source("builtin:tiny"), device=torch.device("cpu"))
    model = PeftModel.from_pretrained(base, ckpt).eval()
    expected = _expected(model, AutoTokenizer.from_pretrained(ckpt), ckpt)
    assert expected.strip() and res.stdout.rstrip("\n") == expected, (res.stdout, expected)


def test_a_chat_session_reads_messages_until_exit(runs, tmp_path):
    ckpt = runs["full"] / "checkpoints" / "step-000001"
    one = _chat(ckpt, tmp_path, *ONE_SHOT).stdout.rstrip("\n")
    args = ("--seed", str(SEED), "--max-new-tokens", str(TOKENS))
    res = _chat(ckpt, tmp_path, *args, stdin=f"{PROMPT}\n/reset\n{PROMPT}\n/exit\n")
    assert res.returncode == 0, res.stderr
    assert one.strip() and one in res.stdout, (res.stdout, one)  # the first reply: the one-shot's draw
    assert res.stdout.startswith("> ") and res.stdout.count("> ") >= 4  # a prompt for each line read
    assert "/reset clears the history" in res.stderr


def test_chat_on_a_run_without_checkpoints_says_so(tmp_path):
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    res = _chat(tmp_path / "run", tmp_path, "-p", PROMPT)
    assert res.returncode == 2 and "without a checkpoint to talk to" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


def test_chat_runs_an_episode_turn_by_turn_with_an_environment(runs, tmp_path):
    """--environment: the message starts an episode of the environment (a class by import path), run
    as training runs it, shown turn by turn with each turn's writer marked: the model's turn, the
    tool's reply, the model's next turn."""
    ckpt = runs["full"] / "checkpoints" / "step-000001"
    res = _chat(ckpt, tmp_path, *ONE_SHOT, "--environment", "chat_environments:Lookup")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert [line.split("]")[0] + "]" for line in lines] == ["[assistant]", "[tool]", "[assistant]"], (
        res.stdout
    )
    assert lines[1] == "[tool] looked up: 42"
    again = _chat(ckpt, tmp_path, *ONE_SHOT, "--environment", "chat_environments:Lookup")
    assert again.stdout == res.stdout  # (seeded)
