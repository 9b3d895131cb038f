"""docs/agents.md, the coding agents' guide: its front matter is a skill file's, and every command it
quotes exists as quoted. A grpo-train line is composed and validated as grpo-train would (nothing
trains); any other tool runs with --help and every flag the line uses is one the tool has."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import pytest
from conftest import ROOT, console_script, grpo_env

DOC = ROOT / "docs" / "agents.md"


def _commands() -> list[str]:
    text = DOC.read_text()
    blocks = re.findall(r"```\n(.*?)```", text, flags=re.S)
    return [
        line.strip() for block in blocks for line in block.splitlines() if line.strip().startswith("grpo-")
    ]


def test_the_guide_is_a_skill_file():
    text = DOC.read_text()
    front = re.match(r"---\n(.*?)\n---\n", text, flags=re.S)
    assert front, "docs/agents.md must open with --- front matter ---"
    fields = dict(line.split(": ", 1) for line in front.group(1).splitlines())
    assert fields["name"] == "grpo-cli" and len(fields["description"]) > 40
    assert len(_commands()) >= 10


@pytest.mark.parametrize("line", [c for c in _commands() if c.startswith("grpo-train")])
def test_each_grpo_train_line_composes_and_validates(line, tmp_path, monkeypatch):
    from grpo_cli.cli.common import typed_config

    (tmp_path / "my_data.jsonl").write_text('{"prompt": "What is 1 plus 1?", "answer": "2"}\n')
    (tmp_path / "my_rewards.py").write_text(
        "def mine(completions, **kwargs):\n    return [0.0 for _ in completions]\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    args = shlex.split(line)[1:]
    args = [a for a in args if a not in ("--cfg", "job")]  # (prints the config: compose-only already)
    overrides = [a for a in args if not a.startswith("hydra.")]  # (the run folder: not config)
    assert all("=" in a for a in overrides), line
    try:
        typed_config(overrides)
    finally:  # (the file's reward module must not stay imported: other tests write their own my_rewards)
        sys.modules.pop("my_rewards", None)


@pytest.mark.parametrize("line", [c for c in _commands() if not c.startswith("grpo-train")])
def test_each_tool_line_names_a_tool_and_its_flags(line, tmp_path):
    args = shlex.split(line)
    res = subprocess.run(
        [console_script(args[0]), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env=grpo_env(),
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr
    for flag in (a for a in args[1:] if a.startswith("-")):
        assert re.search(rf"(^|[\s,\[]){re.escape(flag)}\b", res.stdout), (
            f"{args[0]} has no {flag}: {res.stdout}"
        )
