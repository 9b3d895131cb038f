"""The phases of one training step, each a function the loop (engine.py) calls by name:

    sample_and_score -> advantages -> micro_batches -> reference_logprobs -> update

They read the typed config by name and run on the parts build.py made. The math is in loss.py,
the log-probs in logprobs.py, the sampling behind parts.sampler (samplers/), the optimizer's side
of an update in optim.OptimizerStep. Rule numbers (ref 000.1, ...) are in docs/reference.md.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from grpo_cli import selfcheck
from grpo_cli.adapters import disabled_adapters
from grpo_cli.config import Config
from grpo_cli.distributed import gradient_sync, is_sharded, prompt_seed, shard
from grpo_cli.logprobs import token_logprobs
from grpo_cli.loss import (
    group_advantages,
    grpo_loss,
    has_learning_signal,
    loss_normalizers,
    truncated_importance_weights,
    zero_std_groups,
)
from grpo_cli.metrics import UpdateStats
from grpo_cli.precision import autocast
from grpo_cli.rewards import correctness, passes, score_examples
from grpo_cli.rollout import Rollout, concat, select
from grpo_cli.selfcheck import compare_logprobs


@dataclass
class Sampled:
    """One step's sampling: the rollout to train on (None when dynamic sampling kept no group), and
    what was drawn in all: every sampled completion's per-reward values and totals (adaptive
    rounds and discarded groups included), how many prompts, how many of their groups zero-std,
    how many completions, and what adaptive group sizes did (prompts given more rounds, and of
    them those whose group then carried signal)."""

    batch: Rollout | None
    num_generations: int
    judge: str | None = None  # the correctness reward's name (the pass rule), rewards.correctness
    per_reward: dict[str, list] = field(default_factory=dict)
    totals: list[float] = field(default_factory=list)
    groups: int = 0
    zero_std_groups: int = 0
    completions: int = 0
    resampled_groups: int = 0
    rescued_groups: int = 0
    examples: list = field(default_factory=list)  # every drawn example (rollout.prompt_index's list)


@dataclass
class _Scored:
    """One rank's sampled prompts: the rollout of their training groups (G rows each) with those
    rows' totals and per-reward values, and every completion sampled (the pool: all rounds)."""

    rollout: Rollout | None = None
    totals: list[float] = field(default_factory=list)
    per_reward: dict[str, list] = field(default_factory=dict)
    pool_totals: list[float] = field(default_factory=list)
    pool_per_reward: dict[str, list] = field(default_factory=dict)
    resampled: int = 0
    rescued: int = 0


def sample_and_score(cfg: Config, parts, phase: dict[str, float], step: int) -> Sampled:
    """trainer.prompts_per_step prompts, a group of sampler.num_generations completions each
    (adaptive group sizes: _sample_groups), scored. With trainer.dynamic_sampling (DAPO),
    zero-std groups are dropped and more prompts are sampled (up to max_sampling_tries rollouts)
    to fill the step with groups that carry signal.

    Prompt i of the step's draw is sampled from its own seed (seed, step, i, round). With several
    processes each rank samples and scores its shard of the prompts, and the scored rollouts are
    gathered: every rank then holds the whole step, in the order one process would have it."""
    t, G, d = cfg.trainer, cfg.sampler.num_generations, parts.dist
    judge = correctness(parts.rewards)
    sampled = Sampled(batch=None, num_generations=G, judge=judge.name if judge else None)
    kept, drawn = [], 0
    for _ in range(t.max_sampling_tries if t.dynamic_sampling else 1):
        examples = parts.stream.take(t.prompts_per_step - len(kept))  # the same on every rank
        mine = list(shard(len(examples), d.rank, d.world_size))
        scored = _sample_groups(
            cfg, parts, phase, step, [examples[i] for i in mine], [drawn + i for i in mine], sampled.judge
        )
        drawn += len(examples)
        scored = _gather_scored(d, scored, parts.device, parts.tokenizer.pad_token_id)
        rollout = scored.rollout
        rollout.rewards = torch.tensor(scored.totals, dtype=torch.float32, device=parts.device)  # [n*G]
        rollout.prompt_index = torch.arange(
            len(sampled.examples), len(sampled.examples) + len(examples), device=parts.device
        ).repeat_interleave(G)  # [n*G]
        rollout.reward_values = torch.tensor(  # [n*G, R], None as NaN
            [[math.nan if v is None else v for v in values] for values in scored.per_reward.values()],
            dtype=torch.float32,
            device=parts.device,
        ).T
        sampled.examples += examples
        zero = zero_std_groups(
            rollout.rewards, G, std=cfg.loss.std, zero_std_threshold=cfg.loss.zero_std_threshold
        )
        sampled.zero_std_groups += int(zero.sum())
        sampled.groups += len(examples)
        sampled.totals += scored.pool_totals
        sampled.completions += len(scored.pool_totals)
        sampled.resampled_groups += scored.resampled
        sampled.rescued_groups += scored.rescued
        for name, values in scored.pool_per_reward.items():
            sampled.per_reward.setdefault(name, []).extend(values)
        keep = ~zero if t.dynamic_sampling else torch.ones_like(zero)
        kept += [
            select(rollout, torch.arange(g * G, (g + 1) * G, device=parts.device))
            for g in torch.nonzero(keep).flatten().tolist()
        ]
        if len(kept) >= t.prompts_per_step:
            break
    if kept:
        sampled.batch = concat(kept[: t.prompts_per_step], parts.tokenizer.pad_token_id)
    return sampled


def _sample_groups(cfg: Config, parts, phase, step: int, examples, indices, judge) -> _Scored | None:
    """This rank's prompts (`indices`: their places in the step's draw), a training group of G
    completions each. Round 0 samples G of every prompt. With sampler.max_generations > G
    (adaptive group sizes), a prompt whose completions so far all pass or all fail (the pass
    rule: rewards.passes) gets G more in the next round, until it has both or max_generations;
    its group is then G of them, balanced (balanced_group). Every process enters every round's
    sampler.sampling() (FSDP2 gathers the weights there), so rounds end on all ranks at once."""
    G, d, t = cfg.sampler.num_generations, parts.dist, cfg.trainer
    rounds = (cfg.sampler.max_generations or G) // G
    pools: list[list] = [[] for _ in examples]  # per prompt: its rounds' (rollout, totals, per_reward)
    pending = list(range(len(examples)))
    for round in range(rounds):
        if round:
            pending = [j for j in pending if not _mixed(pools[j], judge)]
            if not d.any(bool(pending)):
                break
        tick = time.perf_counter()
        with parts.sampler.sampling():  # (every process enters: FSDP2 gathers the weights)
            if pending:
                rollout = parts.sampler.generate(
                    [examples[j].prompt_ids for j in pending],
                    seeds=[prompt_seed(t.seed, step, indices[j], round) for j in pending],
                    num_generations=G,
                    ignore_eos=cfg.sampler.ignore_eos,
                )
        phase["rollout"] += time.perf_counter() - tick
        if pending:
            tick = time.perf_counter()
            _, total, per_reward = score_examples(
                parts.rewards, parts.tokenizer, [examples[j] for j in pending], rollout, G
            )
            phase["reward"] += time.perf_counter() - tick
            for n, j in enumerate(pending):
                rows = slice(n * G, (n + 1) * G)
                pools[j].append(
                    (
                        select(rollout, torch.arange(n * G, (n + 1) * G)),
                        total[rows],
                        {name: values[rows] for name, values in per_reward.items()},
                    )
                )
    if not examples:
        return None
    pad_id = parts.tokenizer.pad_token_id
    groups, scored = [], _Scored()
    for pool in pools:
        totals, per_reward = _pooled(pool)
        passed = passes(per_reward, totals, judge)
        chosen = balanced_group(passed, G)
        rollout = concat([r for r, _, _ in pool], pad_id)
        groups.append(select(rollout, torch.tensor(chosen)))
        scored.totals += [totals[i] for i in chosen]
        for name, values in per_reward.items():
            scored.per_reward.setdefault(name, []).extend(values[i] for i in chosen)
            scored.pool_per_reward.setdefault(name, []).extend(values)
        scored.pool_totals += totals
        scored.resampled += len(pool) > 1
        scored.rescued += len(pool) > 1 and len(set(passed)) == 2
    scored.rollout = concat(groups, pad_id)
    return scored


def _pooled(pool: list) -> tuple[list[float], dict[str, list]]:
    """A prompt's rounds joined: every completion's total and per-reward values, in sampling order."""
    totals = [v for _, round_totals, _ in pool for v in round_totals]
    return totals, {name: [v for _, _, pr in pool for v in pr[name]] for name in pool[0][2]}


def _mixed(pool: list, judge: str | None) -> bool:
    """Whether a prompt's completions so far hold both a pass and a fail."""
    totals, per_reward = _pooled(pool)
    return len(set(passes(per_reward, totals, judge))) == 2


def balanced_group(passed: list[bool], G: int) -> list[int]:
    """The G completions (indices into a prompt's pool, in sampling order) it trains on. A pool of
    one outcome: its first G (the first round's group). Otherwise half passes and half fails where
    the pool has them, the rarer outcome's all when it has fewer, the rest from the other; within
    an outcome the first ones sampled (the samples are i.i.d., so the first k are a uniform draw).
    A pool that mixed in its first round is its first G, as without adaptive group sizes."""
    wins = [i for i, p in enumerate(passed) if p]
    fails = [i for i, p in enumerate(passed) if not p]
    if not wins or not fails:
        return list(range(G))
    k = min(len(wins), max(G // 2, G - len(fails)))  # passes taken
    return sorted(wins[:k] + fails[: G - k])


def _gather_scored(d, scored: _Scored | None, device, pad_id: int) -> _Scored:
    """Every rank's _Scored, joined in rank order (= prompt order)."""
    if not d.enabled:
        return scored
    if scored is not None:
        scored.rollout = scored.rollout.to("cpu")
    parts = [p for p in d.gather(scored) if p is not None]
    joined = _Scored(concat([p.rollout for p in parts], pad_id).to(device))
    for p in parts:
        joined.totals += p.totals
        joined.pool_totals += p.pool_totals
        for name, values in p.per_reward.items():
            joined.per_reward.setdefault(name, []).extend(values)
        for name, values in p.pool_per_reward.items():
            joined.pool_per_reward.setdefault(name, []).extend(values)
        joined.resampled += p.resampled
        joined.rescued += p.rescued
    return joined


def advantages(cfg: Config, batch: Rollout, device) -> tuple[tuple[int, int], bool]:
    """Fill the scored batch's advantages, zero-std flags, group stds and loss mask; return the
    step's loss normalisers (num_sequences, num_tokens) and whether it has any learning signal."""
    lo = cfg.loss
    advantages, zero_std, group_std = group_advantages(batch.rewards, cfg.sampler.num_generations, cfg=lo)
    batch.advantages, batch.zero_std, batch.group_std = (
        advantages.to(device),
        zero_std.to(device),
        group_std.to(device),
    )
    batch.loss_mask = batch.completion_mask.clone()  # [N, C]
    if lo.mask_truncated_completions:
        batch.loss_mask[batch.truncated] = 0
    norms = loss_normalizers(batch.loss_mask, batch.zero_std, zero_std_mode=lo.zero_std)
    signal = has_learning_signal(
        batch.advantages, batch.loss_mask, batch.zero_std, zero_std_mode=lo.zero_std, beta=lo.beta
    )
    return norms, signal


@dataclass
class MicroBatches:
    """Row indices of each micro-batch of this rank: whole groups of num_generations consecutive
    rows (ref 004), less the zero-std groups under loss.zero_std=mask (trainer.skip_zero_std: their
    loss terms are exactly 0, so they skip the forward and backward; a micro-batch of only such
    groups is empty and skipped; the engine keeps them on a run's first step, for its
    self-check). Every rank runs as many (DDP reduces in the last backward, FSDP2's forward and
    backward are collectives): one with fewer (dynamic sampling kept fewer groups, or more were
    skipped) makes up the count with stand-ins, a group at weight 0 (index >= real)."""

    rows: list[torch.Tensor]
    real: int

    def order(self) -> list[int]:
        """One iteration's micro-batches in a random order, the empty ones left out. (The
        permutation covers every micro-batch, empty or not, so the skip changes neither the
        random stream nor the order in which the others accumulate: the update is bit-identical.)"""
        return [k for k in torch.randperm(len(self.rows)).tolist() if len(self.rows[k])]


def micro_batches(cfg: Config, batch: Rollout, d, skip_zero_std: bool = True) -> MicroBatches:
    t, G = cfg.trainer, cfg.sampler.num_generations
    groups = shard(batch.rewards.shape[0] // G, d.rank, d.world_size)
    per_micro_batch = t.prompts_per_step // (t.gradient_accumulation_steps * d.world_size)
    rows = [
        torch.arange(i * G, min(i + per_micro_batch, groups.stop) * G)
        for i in range(groups.start, groups.stop, per_micro_batch)
    ]
    if cfg.loss.zero_std == "mask" and skip_zero_std:
        zero = batch.zero_std.cpu()  # [N] bool
        rows = [r[~zero[r]] for r in rows]
    real, runs = len(rows), sum(len(r) > 0 for r in rows)
    if d.enabled:
        rows += [torch.arange(G)] * (int(d.max([runs])[0]) - runs)
    return MicroBatches(rows, real)


def reference_logprobs(parts, batch: Rollout, plan: MicroBatches, temperature: float) -> torch.Tensor:
    """The reference model's log-probs [N, C] of the rollout's completions, micro-batch by
    micro-batch (with LoRA the reference is the policy with its adapters disabled)."""
    ref = parts.ref
    ref_logps = torch.zeros_like(batch.sampler_logps)  # [N, C]
    # (FSDP2's all-gathers run under no_grad, not inference mode.)
    with (
        disabled_adapters(ref),
        torch.no_grad() if is_sharded(ref) else torch.inference_mode(),
        autocast(ref_logps.device, parts.precision),
    ):
        for rows in plan.rows:
            if not len(rows):
                continue
            mb = batch.rows(rows)
            ref_logps[rows, : mb.completion_ids.shape[1]] = token_logprobs(
                ref, *mb.inputs(), temperature=temperature, shared_prompt=parts.fast_paths
            ).float()
    return ref_logps.clone()  # leave inference mode: usable in autograd


@dataclass
class UpdateContext:
    """What one step's updates share: the step's loss normalisers, whether it has any learning
    signal, and the first step's self-check (None on later steps)."""

    norms: tuple[int, int]
    has_signal: bool
    self_check: bool


def update(cfg: Config, parts, batch: Rollout, plan: MicroBatches, ctx: UpdateContext, phase, log):
    """trainer.num_iterations updates on this rollout, each accumulating the gradient over the
    shuffled micro-batches, then one optimizer step (parts.opt_step). Returns the UpdateStats and
    the optimizer steps' results.

    The ratio's old log-probs are the trainer's own, detached, from before the first update (ref
    000.1): on iteration 0 the very forward being trained (ratio exactly 1 in any precision);
    later iterations reuse them. The sampler's log-probs measure the sampler/trainer mismatch and
    feed the optional TIS correction."""
    t, lo, opt = cfg.trainer, cfg.loss, parts.opt_step
    updates = UpdateStats(grad_scaler=opt.scaler is not None)
    old_logps = torch.zeros_like(batch.sampler_logps) if t.num_iterations > 1 else None  # [N, C]
    is_weights = torch.ones_like(batch.sampler_logps) if lo.sampler_correction == "tis" else None  # [N, C]
    results, check = [], None
    for iteration in range(t.num_iterations):
        order = plan.order()
        loss_total = 0.0
        updates.new_iteration()
        tick = time.perf_counter()
        for n, k in enumerate(order):
            rows = plan.rows[k]
            mb = batch.rows(rows)
            C = mb.completion_ids.shape[1]
            # Several processes: DDP all-reduces the gradients in the last backward only (not at all
            # when the optimizer step reduces the fp32 masters' gradients itself).
            sync = n == len(order) - 1 and not opt.reduces_grads
            with gradient_sync(parts.scorer, sync), autocast(parts.device, parts.precision):
                logps, entropy = parts.scorer(*mb.inputs())  # token_logprobs, [b, C] each
            logps = logps.float()  # [b, C]
            if k >= plan.real:  # a stand-in micro-batch: zero gradients, reduced with the others
                with gradient_sync(parts.scorer, sync):
                    opt.backward(logps.nan_to_num().sum() * 0.0)
                continue
            if iteration == 0:
                old = logps.detach()  # [b, C]
                if old_logps is not None:
                    old_logps[rows, :C] = old
                mismatch = compare_logprobs(
                    old, mb.sampler_logps, mb.completion_mask, parts.sampler.tolerance
                )
                updates.add_mismatch(mismatch, len(rows))
                if is_weights is not None:
                    is_weights[rows, :C] = truncated_importance_weights(
                        old, mb.sampler_logps, mb.completion_mask, cap=lo.tis_cap
                    )
                if ctx.self_check:
                    check = selfcheck.check_micro_batch(
                        parts.policy, mismatch, mb, parts.precision.name, cfg.sampler.temperature, check
                    )
            else:
                old = old_logps[rows, :C]
            loss, stats = grpo_loss(
                logps,
                old,
                mb.ref_logps,
                mb.advantages,
                mb.loss_mask,
                cfg=lo,
                zero_std_flags=mb.zero_std,
                group_std=mb.group_std,
                num_sequences=ctx.norms[0],
                num_tokens=ctx.norms[1],
                max_new_tokens=cfg.sampler.max_new_tokens,
                num_generations=cfg.sampler.num_generations,
                importance_weights=None if is_weights is None else is_weights[rows, :C],
            )
            with gradient_sync(parts.scorer, sync):
                opt.backward(loss)
            loss_total += float(loss.detach())
            updates.add(stats, entropy, mb.completion_mask)
        if iteration == 0 and check is not None:
            selfcheck.report(check, batch.advantages, batch.zero_std, len(plan.rows), log)
        phase["policy"] += time.perf_counter() - tick

        tick = time.perf_counter()
        result = opt.step(loss_total, ctx.has_signal)
        updates.update(result.loss, result.grad_norm)
        results.append(result)
        if result.applied:
            phase["optimizer"] += time.perf_counter() - tick
    return updates, results
