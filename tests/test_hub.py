"""A hub id on a machine that cannot reach the hub: one probe, then one clear paragraph (no
minute of retries); a model in the local Hugging Face cache loads offline."""

from __future__ import annotations

import sys
import textwrap

import pytest
from conftest import console_script, run_cli

pytestmark = pytest.mark.slow

CLOSED = "http://127.0.0.1:9"  # the discard port on this machine: nothing listens, refused at once


def test_an_unreachable_hub_is_one_clear_paragraph_not_a_minute_of_retries(tmp_path):
    env = {"HF_ENDPOINT": CLOSED, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "0"}
    res = run_cli(
        [console_script("grpo-train"), "model=qwen0.5b", "trainer.max_steps=1"], cwd=tmp_path, env=env
    )
    out = res.stdout + res.stderr
    assert res.returncode == 2, out
    assert (
        "'Qwen/Qwen2.5-0.5B-Instruct' is a Hugging Face Hub id" in out
        and "could not be reached (one probe, 3 s timeout)" in out
    )
    assert "--local-dir DIR" in out and "model.name_or_path=DIR" in out
    assert "Traceback" not in out and "etry" not in out  # no retry messages
    assert list(tmp_path.glob("outputs/*")) == []


def test_a_cached_hub_model_loads_offline(tmp_path):
    """A hub id whose files are in the local cache (the layout huggingface_hub writes) loads with
    the hub out of reach: the probe finds it cached and the loads stay local."""
    from grpo_cli.models import build_tiny

    snapshot = tmp_path / "hub" / "models--someone--tiny" / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    for f in build_tiny().iterdir():
        (snapshot / f.name).write_bytes(f.read_bytes())
    (tmp_path / "hub" / "models--someone--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--someone--tiny" / "refs" / "main").write_text("0123abcd")
    code = textwrap.dedent("""
        import torch
        from grpo_cli.models import load_model, load_tokenizer, resolve_source
        source = resolve_source("someone/tiny")
        print(source.description, source.local_files_only)
        load_tokenizer(source)
        load_model(source, device=torch.device("cpu"))
        print("loaded")
    """)
    env = {"HF_ENDPOINT": CLOSED, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "0"}
    res = run_cli([sys.executable, "-c", code], cwd=tmp_path, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "hub model someone/tiny (cached) True" in res.stdout and "loaded" in res.stdout
