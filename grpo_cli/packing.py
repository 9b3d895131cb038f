"""How the training forward runs a step's rows, decided once, and the micro-batches it runs them in.

`ScoringPlan` is the one record of the step's scoring decisions, made once by the builder from
(config, policy, processes) (`scoring_plan`): whether a group's prompt runs once, whether a
micro-batch's rows run in length buckets, the token budget, and what a micro-batch costs. The
learner (roles.Learner), the packer below, the memory estimate (memory.prompts_per_micro_batch) and
the scorers (their ScoringOptions) all read it; nothing else decides these.

The two micro-batch planners live here, and `plan_micro_batches` picks one:

- `equal_micro_batches`: gradient_accumulation_steps micro-batches of equal group counts per
  rank, whatever their lengths.
- `token_micro_batches` (trainer.micro_batch_tokens, issue #50): the step's groups packed by what
  their forward costs.

The token budget's rules:

- A group's cost is the tokens its forward runs: its prompt once (the scorer forwards a group's
  shared prompt once, logprobs/forward.py) plus G completions at the micro-batch's completion width
  (rows are padded to the micro-batch's longest attended column, scored.Batch.rows). Where the
  prompt is not forwarded once (gradient checkpointing, or a group whose episodes reset to other
  prompts), G prompts.
- The budget counts padded tokens, not only the real ones: a group of one 256-token completion and
  seven of 10 tokens runs [8, 256] tensors, and the budget is what bounds a micro-batch's memory.
  Groups are sorted by length first, so a micro-batch's padding is small and its padded tokens are
  close to its real ones.
- Where the scorer runs a micro-batch's rows in length buckets (ScoringPlan.length_buckets:
  whenever the budget is set on a tested architecture, but under FSDP2), a micro-batch's
  completions cost their buckets' padded tokens instead: close to the real ones, so one long
  episode no longer charges its group G times its length. (Its prompts still count once per
  group: a prefix they all share runs once, logprobs.forward._prefill_common, which this cost
  does not credit.)
- Micro-batches keep whole groups (ref 004). A group over the budget runs alone.
- The plan is one list for the whole step, the same on every rank (each holds the gathered step),
  with at least as many micro-batches as ranks where there are as many groups (the costliest
  halved until then: a budget that holds the whole step would leave the other ranks idle), dealt
  to the ranks in turn: every rank runs ceil(micro-batches / processes) of them, a short one
  making up the count with a stand-in (the step's cheapest group at weight 0). No collective.

The loss normalisers are the step's (step.advantages), so the gradient does not depend on how the
step is split, up to fp32 summation order (test_packing.py). The one exception is
loss.top_entropy_quantile < 1, whose quantile is taken per micro-batch (docs/reference.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo_cli.distributed import Dist, shard
from grpo_cli.logprobs import (
    ScoringOptions,
    length_buckets,
    prompt_runs_once,
    row_lengths,
    shared_prompt_groups,
)
from grpo_cli.scored import Batch


@dataclass(frozen=True)
class ScoringPlan:
    """The step's scoring decisions, made once (scoring_plan) and read everywhere.

    fast_paths: the model's type is in the tested matrix (models.tested_architecture): the
      shared-prompt KV cache in scoring forwards, the CPU decode's W @ x^T layers.
    shared_prompt: a scoring forward may run a group's prompt once and share its KV cache
      (ScoringOptions.shared_prompt; a model under gradient checkpointing still runs full rows:
      logprobs.forward.prompt_runs_once).
    prompt_once: the policy's training forward does run each group's prompt once (shared_prompt,
      and the policy not checkpointed): what a group's prompt costs in the packer.
    length_buckets: a micro-batch's rows run in buckets of similar length (a token budget on a
      tested architecture; not under FSDP2, whose forwards are collectives every rank must run
      alike), in the training forward and the frozen models' (reference, teacher) alike.
    token_budget: trainer.micro_batch_tokens (None: gradient_accumulation_steps equal splits);
      auto's, the budget its probe chose (grpo_cli/fit.py).
    """

    fast_paths: bool = True
    shared_prompt: bool = True
    prompt_once: bool = True
    length_buckets: bool = False
    token_budget: int | None = None

    def cost(self, shapes: list[GroupShape], G: int) -> int:
        """Tokens one micro-batch of these groups runs (micro_batch_cost under this plan)."""
        return micro_batch_cost(shapes, G, self.prompt_once, self.length_buckets)

    def group_cost(self, prompt: int, completion: int, G: int) -> int:
        """Tokens one group of G rows runs at these lengths (every row as long), its prompt shared."""
        return micro_batch_cost([GroupShape(prompt, completion, True)], G, self.prompt_once)

    def options(self, temperature: float, **kw) -> ScoringOptions:
        """A scoring forward's options under this plan (the training forward adds its own keys)."""
        return ScoringOptions(
            temperature, shared_prompt=self.shared_prompt, length_buckets=self.length_buckets, **kw
        )


def scoring_plan(trainer, *, fast_paths: bool, policy=None, fsdp: bool = False) -> ScoringPlan:
    """The plan of a run: trainer (config.TrainerConfig), whether the model takes the tested fast
    paths, the policy as built (whether its forward runs the prompt once: prompt_runs_once; None,
    before any model loads: predicted from trainer.gradient_checkpointing), and whether the
    model is sharded by FSDP2."""
    checkpointed = trainer.gradient_checkpointing if policy is None else not prompt_runs_once(policy)
    budget = trainer.micro_batch_tokens
    return ScoringPlan(
        fast_paths=fast_paths,
        shared_prompt=fast_paths,
        prompt_once=fast_paths and not checkpointed,
        length_buckets=budget is not None and fast_paths and not fsdp,
        token_budget=None if budget == "auto" else budget,  # (auto: set by the builder, grpo_cli/fit.py)
    )


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


def plan_micro_batches(batch: Batch, plan: ScoringPlan, cfg, d: Dist, *, skip_zero_std: bool) -> MicroBatches:
    """This rank's micro-batches of the step: by the plan's token budget (token_micro_batches) or
    in gradient_accumulation_steps equal splits (equal_micro_batches). cfg: the run's Config
    (trainer.prompts_per_step, gradient_accumulation_steps, loss.zero_std). skip_zero_std: leave
    out zero-std groups (under loss.zero_std=mask, where their terms are exactly 0)."""
    t, zero_std_mode = cfg.trainer, cfg.loss.zero_std
    if plan.token_budget is not None:
        skip = batch.zero_std.cpu() if skip_zero_std and zero_std_mode == "mask" else None
        return MicroBatches(*token_micro_batches(batch, plan=plan, skip=skip, d=d))
    return equal_micro_batches(
        batch,
        prompts_per_step=t.prompts_per_step,
        accumulation_steps=t.gradient_accumulation_steps,
        zero_std_mode=zero_std_mode,
        d=d,
        skip_zero_std=skip_zero_std,
    )


def equal_micro_batches(
    batch: Batch,
    *,
    prompts_per_step: int,
    accumulation_steps: int,
    zero_std_mode: str,
    d: Dist,
    skip_zero_std: bool,
) -> MicroBatches:
    """This rank's micro-batches of a step of prompts_per_step groups, accumulation_steps of them
    per update (over all ranks)."""
    G = batch.num_generations
    groups = shard(batch.rewards.shape[0] // G, d.rank, d.world_size)
    per_micro_batch = prompts_per_step // (accumulation_steps * d.world_size)
    rows = [
        torch.arange(i * G, min(i + per_micro_batch, groups.stop) * G)
        for i in range(groups.start, groups.stop, per_micro_batch)
    ]
    if zero_std_mode == "mask" and skip_zero_std:
        zero = batch.zero_std.cpu()  # [N] bool
        rows = [r[~zero[r]] for r in rows]
    real, runs = len(rows), sum(len(r) > 0 for r in rows)
    if d.enabled:
        rows += [torch.arange(G)] * (int(d.max([runs])[0]) - runs)
    return MicroBatches(rows, real)


@dataclass(frozen=True)
class GroupShape:
    """One group's padded extent: prompt tokens (its widest row), completion width (the last
    attended column + 1 over its rows: a multi-turn completion may have holes), and whether its
    rows hold one prompt (the scorer then forwards it once)."""

    prompt: int
    width: int
    shared: bool
    lengths: tuple[int, ...] = ()  # each row's completion length (for length buckets)


def group_shapes(batch: Batch, groups: list[int]) -> list[GroupShape]:
    """The shapes of `groups` (indices of the step's groups of num_generations rows)."""
    r, G = batch.rollout, batch.num_generations
    prompt = r.prompt_mask.sum(-1).view(-1, G).amax(-1).tolist()  # [n_groups]
    lengths = row_lengths(r.attention_mask)  # [N]: each row's last attended column + 1
    same = shared_prompt_groups(r.prompt_ids, G)  # [n_groups]
    rows = [tuple(lengths[g * G : (g + 1) * G]) for g in groups]
    return [GroupShape(int(prompt[g]), max(max(n), 1), bool(same[g]), n) for g, n in zip(groups, rows)]


def micro_batch_cost(shapes: list[GroupShape], G: int, prompt_once: bool, bucketed: bool = False) -> int:
    """Tokens one micro-batch of these groups runs: prompts at the widest prompt (once per group
    where forwarded once), G completions per group at the widest completion; bucketed (the scorer
    runs rows in length buckets, ScoringOptions.length_buckets): the completions at their buckets'
    widths instead, the padded tokens those passes run."""
    P, C = max(s.prompt for s in shapes), max(s.width for s in shapes)
    once = prompt_once and all(s.shared for s in shapes)
    if not bucketed:
        return len(shapes) * (P * (1 if once else G) + G * C)
    lengths = [max(1, n) for s in shapes for n in s.lengths]
    runs = length_buckets(lengths)
    return len(shapes) * P * (1 if once else G) + sum(len(b) * max(lengths[i] for i in b) for b in runs)


def pack_groups(
    shapes: list[GroupShape], G: int, budget: int, *, prompt_once: bool, bucketed: bool = False
) -> list[list[int]]:
    """Indices into `shapes`, in micro-batches of at most `budget` tokens (micro_batch_cost; a group
    over it alone). Groups sorted by (prompt not shared, width, prompt), longest first, then filled
    in that order (next fit): neighbours have similar lengths, so little padding; groups that do not
    share their prompt sit apart from those that do (one of them would make its micro-batch forward
    every row's prompt). Each micro-batch lists its groups in the step's order. Deterministic."""
    order = sorted(
        range(len(shapes)), key=lambda i: (not shapes[i].shared, -shapes[i].width, -shapes[i].prompt, i)
    )
    bins: list[list[int]] = []
    for i in order:
        if bins and micro_batch_cost([shapes[j] for j in bins[-1] + [i]], G, prompt_once, bucketed) <= budget:
            bins[-1].append(i)
        else:
            bins.append([i])
    return [sorted(b) for b in bins]


def token_micro_batches(
    batch: Batch,
    *,
    plan: ScoringPlan,
    skip: torch.Tensor | None,
    d: Dist,
) -> tuple[list[torch.Tensor], int]:
    """This rank's micro-batches (row indices, whole groups) and how many are real (the rest are
    stand-ins): the step's groups, less those `skip` flags ([N] bool, zero-std groups skipped; None:
    none), packed by the plan's token budget at its cost and dealt to the ranks in turn."""
    G = batch.num_generations
    n_groups = batch.rewards.shape[0] // G
    kept = [g for g in range(n_groups) if skip is None or not bool(skip[g * G])]
    if not kept:  # every group skipped: nothing to run on any rank
        return [], 0
    shapes = group_shapes(batch, kept)
    packed = pack_groups(
        shapes, G, plan.token_budget, prompt_once=plan.prompt_once, bucketed=plan.length_buckets
    )
    while len(packed) < min(d.world_size, len(kept)):  # every rank gets work: halve the costliest
        k = max(
            range(len(packed)),
            key=lambda j: (plan.cost([shapes[i] for i in packed[j]], G), -j),
        )
        b = sorted(packed.pop(k), key=lambda i: -shapes[i].width)
        packed[k:k] = [sorted(b[: len(b) // 2]), sorted(b[len(b) // 2 :])]
    bins = [[kept[i] for i in b] for b in packed]
    mine = bins[d.rank :: d.world_size]
    rows = [torch.cat([torch.arange(g * G, (g + 1) * G) for g in b]) for b in mine]
    count = -(-len(bins) // d.world_size)  # ceil: every rank runs as many
    cheapest = kept[
        min(range(len(kept)), key=lambda i: (micro_batch_cost([shapes[i]], G, plan.prompt_once), i))
    ]
    real = len(rows)
    rows += [torch.arange(cheapest * G, (cheapest + 1) * G)] * (count - real)
    return rows, real
