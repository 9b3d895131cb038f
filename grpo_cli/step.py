"""The phases of one training step, each a function the loop (engine.py) calls by name with the
few objects it uses:

    sample_and_score -> advantages -> micro_batches -> reference_logprobs -> update

Each returns what it made (and the seconds it spent), and changes nothing it was given but the
policy's gradients. The math is in loss/, the log-probs in logprobs/, the sampling behind a
samplers.Sampler, the optimizer's side of an update in optim.OptimizerStep. The group size is
read from the config once, where the sampler is asked for completions; from there on it travels
with the rollout (Rollout.num_generations). Rule numbers (ref 000.1, ...) are in docs/reference.md.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch

from grpo_cli import selfcheck
from grpo_cli.adapters import reference_weights
from grpo_cli.config import Config, LossConfig, SamplerConfig
from grpo_cli.distributed import Dist, gradient_sync, is_sharded, prompt_seed, shard
from grpo_cli.environments.path import RolloutPath
from grpo_cli.logprobs import ScoringOptions, score_tokens
from grpo_cli.loss import (
    Counts,
    LossBatch,
    group_advantages,
    grpo_loss,
    has_learning_signal,
    loss_normalizers,
    normalize_then_sum,
    variant,
    zero_std_groups,
)
from grpo_cli.loss.terms import SAMPLER_CORRECTIONS, sampler_weights
from grpo_cli.metrics import UpdateStats
from grpo_cli.optim import OptimizerStep, StepResult
from grpo_cli.packing import MicroBatches
from grpo_cli.precision import Precision, autocast
from grpo_cli.rewards import Rewards
from grpo_cli.rewards.scoring import TrainerProgress
from grpo_cli.scored import Batch, Scored, merge_rank_counters
from grpo_cli.scored import concat as concat_scored
from grpo_cli.scored import select as select_scored
from grpo_cli.scored import to as scored_to
from grpo_cli.selfcheck import compare_logprobs


@dataclass(frozen=True)
class Sampled:
    """One step's sampling, as scored records (scored.Scored): the groups to train on (`train`,
    None when dynamic sampling kept no group) and every completion drawn (`drawn`: adaptive rounds
    and discarded groups included, with the rewards' time, counters and log_metric values), the
    examples drawn (prompt_index points into them), how many groups and how many of them zero-std,
    what adaptive group sizes did (prompts given more rounds, and of them those whose group then
    carried signal), and the seconds spent sampling and scoring."""

    train: Scored | None
    drawn: Scored
    examples: tuple = ()  # every drawn example, in order
    groups: int = 0
    zero_std_groups: int = 0
    resampled_groups: int = 0
    rescued_groups: int = 0
    seconds: Mapping[str, float] = field(default_factory=lambda: {"rollout": 0.0, "reward": 0.0})
    # GRPO's first step under trainer.self_check: its self-check compares every row, zero-std
    # groups included (a replay reads it from the saved step).
    first: bool = False


@dataclass(frozen=True)
class _Groups:
    """One rank's sampled prompts: their training groups (G rows each) and every completion
    drawn for them (all rounds), both scored; how many prompts took more rounds, and were rescued."""

    train: Scored
    drawn: Scored
    resampled: int = 0
    rescued: int = 0


def sample_and_score(step: int, rollouts) -> Sampled:
    """trainer.prompts_per_step prompts from `stream` (data.PromptStream), a group of
    sampling.num_generations completions each (adaptive group sizes: _sample_groups), scored. With
    trainer.dynamic_sampling (DAPO), zero-std groups (loss.std, loss.zero_std_threshold) are
    dropped and more prompts are sampled (up to max_sampling_tries rollouts) to fill the step with
    groups that carry signal.

    Prompt i of the step's draw is sampled from its own seed (seed, step, i, round). With several
    processes each rank samples and scores its shard of the prompts, and the scored rollouts are
    gathered: every rank then holds the whole step, in the order one process would have it.
    `rollouts` (roles.Rollouts) holds what it draws with: the stream, sampler, rewards, tokenizer,
    the rank (dist), the device and the config."""
    cfg, dist, device = rollouts.cfg, rollouts.dist, rollouts.device
    t, loss, G, pad_id = cfg.trainer, cfg.loss, cfg.sampler.num_generations, rollouts.tokenizer.pad_token_id
    progress = TrainerProgress(global_step=step - 1, max_steps=t.max_steps)  # (steps done, as TRL)
    seconds = {"rollout": 0.0, "reward": 0.0}
    kept: list[Scored] = []  # each group kept, G rows
    drawn: list[Scored] = []  # each try's every completion
    examples: list = []
    zero_groups = resampled = rescued = 0
    for _ in range(t.max_sampling_tries if t.dynamic_sampling else 1):
        batch = rollouts.stream.take(t.prompts_per_step - len(kept))  # the same on every rank
        mine = list(shard(len(batch), dist.rank, dist.world_size))
        groups = _sample_groups(
            step,
            [batch[i] for i in mine],
            [len(examples) + i for i in mine],
            context=_Context(
                rollouts.path, rollouts.rewards, rollouts.tokenizer, dist, cfg.sampler, t.seed, progress
            ),
            seconds=seconds,
        )
        groups = _gather(dist, groups, device, pad_id)
        # [n*G] float32, the totals the loss's advantages are computed from
        zero = zero_std_groups(
            groups.train.totals.float(), G, std=loss.std, zero_std_threshold=loss.zero_std_threshold
        )
        zero_groups += int(zero.sum())
        resampled, rescued = resampled + groups.resampled, rescued + groups.rescued
        drawn.append(groups.drawn)
        keep = ~zero if t.dynamic_sampling else torch.ones_like(zero)
        for g in torch.nonzero(keep).flatten().tolist():
            kept.append(select_scored(groups.train, torch.arange(g * G, (g + 1) * G, device=device)))
        examples += batch
        if len(kept) >= t.prompts_per_step:
            break
    return Sampled(
        train=concat_scored(kept[: t.prompts_per_step], pad_id) if kept else None,
        drawn=concat_scored(drawn, pad_id),
        examples=tuple(examples),
        groups=len(examples),
        zero_std_groups=zero_groups,
        resampled_groups=resampled,
        rescued_groups=rescued,
        seconds=seconds,
        first=t.self_check and step == 1,  # (GRPO's first step, resumed from the warm-up or not)
    )


@dataclass(frozen=True)
class _Context:
    """What sampling and scoring a rank's prompts reads (the step's fixed parts)."""

    path: RolloutPath
    rewards: Rewards
    tokenizer: object
    dist: Dist
    sampling: SamplerConfig
    seed: int
    progress: TrainerProgress


def _sample_groups(
    step: int, examples, indices, *, context: _Context, seconds: dict[str, float]
) -> _Groups | None:
    """This rank's prompts (`indices`: their places in the step's draw, which the rows'
    prompt_index holds), a training group of G completions each. Round 0 samples G of every
    prompt. With sampler.max_generations > G (adaptive group sizes), a prompt whose completions so
    far all pass or all fail (the pass rule: rewards.passes) gets G more in the next round, until
    it has both or max_generations; its group is then G of them, balanced (balanced_group). Every
    process enters every round's sampler.sampling() (FSDP2 gathers the weights there), so rounds
    end on all ranks at once. Adds the seconds spent to `seconds` (rollout, reward)."""
    c = context
    G = c.sampling.num_generations
    rounds = (c.sampling.max_generations or G) // G
    pools: list[list[Scored]] = [[] for _ in examples]  # per prompt: its rounds' rows, scored
    scored_rounds: list[Scored] = []  # each round's whole record: its counters
    pending = list(range(len(examples)))
    for round in range(rounds):
        if round:
            pending = [j for j in pending if not _mixed(pools[j])]
            if not c.dist.any(bool(pending)):
                break
        tick = time.perf_counter()
        with c.path.sampler.sampling():  # (every process enters: FSDP2 gathers the weights)
            if pending:
                drawn = c.path.draw_for_scoring(
                    [examples[j] for j in pending],
                    seeds=[prompt_seed(c.seed, step, indices[j], round) for j in pending],
                    num_generations=G,
                    ignore_eos=c.sampling.ignore_eos,
                )
        seconds["rollout"] += time.perf_counter() - tick
        if pending:
            tick = time.perf_counter()
            scored = c.path.score(drawn, [examples[j] for j in pending], c.rewards, c.tokenizer, c.progress)
            seconds["reward"] += time.perf_counter() - tick
            scored_rounds.append(scored)
            for n, j in enumerate(pending):
                rows = select_scored(scored, torch.arange(n * G, (n + 1) * G))
                pools[j].append(replace(rows, prompt_index=torch.full_like(rows.prompt_index, indices[j])))
    if not examples:
        return None
    pad_id = c.tokenizer.pad_token_id
    groups, pooled, resampled, rescued = [], [], 0, 0
    for pool in pools:
        joined = concat_scored(pool, pad_id)  # the prompt's rounds: groups of G
        passed = joined.passed.tolist()
        groups.append(select_scored(joined, torch.tensor(balanced_group(passed, G)), num_generations=G))
        pooled.append(joined)
        resampled += len(pool) > 1
        rescued += len(pool) > 1 and len(set(passed)) == 2
    counters = concat_scored(scored_rounds, pad_id)  # (only its counters and logged values are read)
    drawn = replace(concat_scored(pooled, pad_id), counters=counters.counters, logged=counters.logged)
    return _Groups(concat_scored(groups, pad_id), drawn, resampled, rescued)


def _mixed(pool: list[Scored]) -> bool:
    """Whether a prompt's completions so far hold both a pass and a fail."""
    passed = torch.cat([p.passed for p in pool])
    return bool(passed.any()) and not bool(passed.all())


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


def _gather(d: Dist, groups: _Groups | None, device, pad_id: int) -> _Groups:
    """Every rank's groups, joined in rank order (= prompt order); the rewards' seconds are the
    slowest rank's, their counters summed."""
    if not d.enabled:
        return groups
    if groups is not None:
        groups = _Groups(
            scored_to(groups.train, "cpu"), scored_to(groups.drawn, "cpu"), groups.resampled, groups.rescued
        )
    parts = [p for p in d.gather(groups) if p is not None]
    drawn = concat_scored([p.drawn for p in parts], pad_id)
    return _Groups(
        scored_to(concat_scored([p.train for p in parts], pad_id), device),
        scored_to(replace(drawn, counters=merge_rank_counters([p.drawn.counters for p in parts])), device),
        sum(p.resampled for p in parts),
        sum(p.rescued for p in parts),
    )


def advantages(train: Scored, lo: LossConfig, device) -> tuple[Batch, tuple[int, int], bool]:
    """The scored batch (scored.Batch) of a step's training groups (Sampled.train): the rows'
    advantages, zero-std flags and group stds (ref 002, 004) and the loss mask (the trained tokens,
    less truncated completions under loss.mask_truncated_completions); and the step's loss
    normalisers (num_sequences, num_tokens) and whether it has any learning signal."""
    r, G = train.rollout, train.num_generations
    rewards = train.totals.float()  # [N] the loss's rewards are fp32
    # A NaN total: a reward could not score that completion (Reward.nan_ok, e.g. a judge under
    # on_error=nan). Its whole group is left out: advantages 0 (as a zero-std group) and no trained
    # token, so it adds nothing to the loss, the KL or the normalisers.
    failed = rewards.isnan().view(-1, G).any(-1).repeat_interleave(G)  # [N]
    signal = rewards.nan_to_num(0.0)  # [N]
    if lo.multi_objective_aggregation == "normalize_then_sum":  # GDPO: per reward, then summed
        weights = torch.tensor(train.weights, dtype=torch.float32)  # [R]
        signal = normalize_then_sum(train.values.float(), weights, G, cfg=lo)  # [N]
    adv, zero_std, group_std = group_advantages(signal * ~failed, G, cfg=lo)
    loss_mask = r.trained_mask.clone()  # [N, C]
    loss_mask[failed] = 0
    if lo.mask_truncated_completions:
        loss_mask[r.truncated] = 0
    batch = Batch(
        scored=train,
        advantages=adv.to(device),
        zero_std=zero_std.to(device),
        group_std=group_std.to(device),
        loss_mask=loss_mask,
    )
    norms = loss_normalizers(batch.loss_mask, batch.zero_std, zero_std_mode=lo.zero_std)
    signal = has_learning_signal(
        batch.advantages, batch.loss_mask, batch.zero_std, zero_std_mode=lo.zero_std, beta=lo.beta
    ) or bool(lo.teacher_kl and (batch.loss_mask != 0).any())  # the teacher speaks on every trained token
    return batch, norms, signal


def reference_logprobs(
    ref, batch: Batch, plan: MicroBatches, options: ScoringOptions, precision: Precision
) -> torch.Tensor:
    """A frozen model's (the reference's, the teacher's) log-probs [N, C] of the batch's
    completions, micro-batch by micro-batch (with LoRA the reference is the policy with its
    adapters disabled, or its warmed adapter active: adapters.reference_weights);
    options: the scoring plan's (packing.ScoringPlan.options)."""
    r = batch.rollout
    ref_logps = torch.zeros_like(r.sampler_logps)  # [N, C]
    # (FSDP2's all-gathers run under no_grad, not inference mode.)
    with (
        reference_weights(ref),
        torch.no_grad() if is_sharded(ref) else torch.inference_mode(),
        autocast(ref_logps.device, precision),
    ):
        for k, rows in enumerate(plan.rows):
            if len(rows) and (k < plan.real or is_sharded(ref)):  # (stand-ins: for FSDP2's collectives)
                mb = batch.rows(rows).rollout
                scores = score_tokens(ref, *mb.inputs(), options, mb.num_generations)
                if k < plan.real:  # (a stand-in's are not written back)
                    ref_logps[rows, : mb.completion_ids.shape[1]] = scores.logps.float()
    return ref_logps.clone()  # leave inference mode: usable in autograd


@dataclass
class UpdateContext:
    """What one step's updates share: the step's loss normalisers, whether it has any learning
    signal, the reference log-probs (None when loss.beta is 0), and the first step's self-check
    (None on later steps)."""

    norms: tuple[int, int]
    has_signal: bool
    ref_logps: torch.Tensor | None  # [N, C]
    self_check: selfcheck.FirstStep | None
    teacher_logps: torch.Tensor | None = None  # [N, C] the teacher's (loss.teacher_kl > 0), else None
    entropy_coef: float | None = None  # this step's entropy bonus (adaptive control); None: loss.entropy_coef


@dataclass
class Updated:
    """What update() did: its stats (the metrics row's share), each optimizer step's result, and
    the seconds spent in the forward/backward passes and in the optimizer."""

    stats: UpdateStats
    results: list[StepResult]
    seconds: dict[str, float]
    notes: tuple[str, ...] = ()  # lines for the run's log (the first step's self-check)


class Trains(Protocol):
    """What update() runs with (roles.Learner is one): the config (loss, trainer.num_iterations,
    sampler.max_new_tokens), the training forward (`scorer`: logprobs.TokenLogprobs,
    DDP-wrapped under several processes), the optimizer step, the precision, and the sampler's
    declared (mean, max) log-prob gap (Sampler.tolerance: the mismatch check's floor)."""

    cfg: Config
    scorer: Any
    opt_step: OptimizerStep
    precision: Precision
    tolerance: tuple[float, float]


def update(batch: Batch, plan: MicroBatches, ctx: UpdateContext, *, learner: Trains) -> Updated:
    """trainer.num_iterations updates on this batch, each accumulating the gradient over the
    shuffled micro-batches, then one optimizer step (learner.opt_step). The training forward
    (learner.scorer) runs under learner.precision's autocast.

    The ratio's old log-probs are the trainer's own, detached, from before the first update (ref
    000.1): on iteration 0 the very forward being trained (ratio exactly 1 in any precision);
    later iterations reuse them. The sampler's log-probs are compared with the trainer's replay
    of the distribution they were drawn from (TokenScores.behaviour): that gap is the mismatch
    metric and feeds the optional TIS correction. Every one of them counts the trained tokens
    only (Rollout.trained_mask)."""
    scorer, opt, precision, cfg = learner.scorer, learner.opt_step, learner.precision, learner.cfg
    lo, num_iterations, max_new_tokens = cfg.loss, cfg.trainer.num_iterations, cfg.sampler.max_new_tokens
    if ctx.entropy_coef is not None and ctx.entropy_coef != lo.entropy_coef:
        lo = replace(lo, entropy_coef=ctx.entropy_coef)  # adaptive entropy control's coefficient
    masks = ("off_policy_mask/masked",) if lo.off_policy_mask_threshold is not None else ()
    masks += ("teacher/kl", "teacher/logp") if lo.teacher_kl else ()
    trained_tokens = int((batch.loss_mask != 0).sum())  # the step's, zero-std rows included (teacher)
    updates = UpdateStats(
        grad_scaler=opt.scaler is not None, variant_stats=(*variant(lo.loss_type).stat_names, *masks)
    )
    seconds = {"policy": 0.0, "optimizer": 0.0}
    sampler_logps = batch.rollout.sampler_logps  # [N, C]
    old_logps = torch.zeros_like(sampler_logps) if num_iterations > 1 else None  # [N, C]
    corrects = lo.sampler_correction in SAMPLER_CORRECTIONS
    is_weights = torch.ones_like(sampler_logps) if corrects else None  # [N, C]
    results, check, notes = [], None, ()
    for iteration in range(num_iterations):
        order = plan.order()
        loss_total = 0.0
        updates.new_iteration()
        tick = time.perf_counter()
        for n, k in enumerate(order):
            rows = plan.rows[k]
            mb = batch.rows(rows)
            r = mb.rollout
            C = r.completion_ids.shape[1]
            # Several processes: DDP all-reduces the gradients in the last backward only (not at all
            # when the optimizer step reduces the fp32 masters' gradients itself).
            sync = n == len(order) - 1 and not opt.reduces_grads
            with gradient_sync(scorer, sync), autocast(sampler_logps.device, precision):
                scores = scorer(*r.inputs(), num_generations=r.num_generations)  # TokenScores, [b, C] each
            logps = scores.logps.float()  # [b, C]
            if k >= plan.real:  # a stand-in micro-batch: zero gradients, reduced with the others
                with gradient_sync(scorer, sync):
                    opt.backward(logps.nan_to_num().sum() * 0.0)
                continue
            if iteration == 0:
                old = logps.detach()  # [b, C]
                if old_logps is not None:
                    old_logps[rows, :C] = old
                mismatch = compare_logprobs(
                    scores.behaviour, r.sampler_logps, r.trained_mask, learner.tolerance
                )
                updates.add_mismatch(mismatch, len(rows))
                if corrects:  # loss.sampler_correction's weights (loss.terms.sampler_weights)
                    is_weights[rows, :C], masked = sampler_weights(
                        scores.behaviour, r.sampler_logps, r.trained_mask, cfg=lo
                    )
                    if masked is not None:  # (sequence_mask: the rows it masked)
                        updates.add_masked(masked)
                if ctx.self_check is not None:
                    check = ctx.self_check.micro_batch(mismatch, r, check)
            else:
                old = old_logps[rows, :C]
            loss_batch = LossBatch(
                old,
                mb.advantages,
                mb.loss_mask,
                ref_logps=None if ctx.ref_logps is None else ctx.ref_logps[rows, :C],
                zero_std_flags=mb.zero_std,
                group_std=mb.group_std,
                importance_weights=None if is_weights is None else is_weights[rows, :C],
                sampler_logps=r.sampler_logps if lo.off_policy_mask_threshold is not None else None,
                teacher_logps=None if ctx.teacher_logps is None else ctx.teacher_logps[rows, :C],
                num_generations=r.num_generations,
            )
            counts = Counts(*ctx.norms, max_new_tokens, all_tokens=trained_tokens)
            loss, stats = grpo_loss(logps, loss_batch, cfg=lo, counts=counts, entropy=scores.entropy)
            with gradient_sync(scorer, sync):
                opt.backward(loss)
            loss_total += float(loss.detach())
            updates.add(stats, scores.entropy.detach(), r.trained_mask)
        if iteration == 0 and check is not None:
            notes = (selfcheck.report(check, batch.advantages, batch.zero_std, len(plan.rows)),)
        seconds["policy"] += time.perf_counter() - tick

        tick = time.perf_counter()
        result = opt.step(loss_total, ctx.has_signal)
        updates.update(result.loss, result.grad_norm)
        results.append(result)
        if result.applied:
            seconds["optimizer"] += time.perf_counter() - tick
    return Updated(updates, results, seconds, notes)
