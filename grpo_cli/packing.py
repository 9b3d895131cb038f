"""Micro-batches by a token budget (trainer.micro_batch_tokens, issue #50).

Today's planner (step.micro_batches) cuts a rank's groups into gradient_accumulation_steps
micro-batches of equal group counts, whatever their lengths: every row of a micro-batch is padded
to its longest completion, and one long episode pads its neighbours. Here the step's groups are
packed by what their forward costs:

- A group's cost is the tokens its forward runs: its prompt once (the scorer forwards a group's
  shared prompt once, logprobs/forward.py) plus G completions at the micro-batch's completion width
  (rows are padded to the micro-batch's longest attended column, rollout.Batch.rows). Where the
  prompt is not forwarded once (gradient checkpointing, or a group whose episodes reset to other
  prompts), G prompts.
- The budget counts padded tokens, not only the real ones: a group of one 256-token completion and
  seven of 10 tokens runs [8, 256] tensors, and the budget is what bounds a micro-batch's memory.
  Groups are sorted by length first, so a micro-batch's padding is small and its padded tokens are
  close to its real ones.
- Where the scorer runs a micro-batch's rows in length buckets (logprobs.forward.length_buckets:
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

from grpo_cli.distributed import Dist
from grpo_cli.logprobs import length_buckets, row_lengths
from grpo_cli.rollout import Batch


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
    P = r.prompt_ids.shape[1]
    same = (r.prompt_ids.view(-1, G, P) == r.prompt_ids[::G].unsqueeze(1)).all(-1).all(-1).tolist()
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
    budget: int,
    skip: torch.Tensor | None,
    d: Dist,
    prompt_once: bool,
    bucketed: bool = False,
) -> tuple[list[torch.Tensor], int]:
    """This rank's micro-batches (row indices, whole groups) and how many are real (the rest are
    stand-ins): the step's groups, less those `skip` flags ([N] bool, zero-std groups skipped; None:
    none), packed by `budget` and dealt to the ranks in turn."""
    G = batch.num_generations
    n_groups = batch.rewards.shape[0] // G
    kept = [g for g in range(n_groups) if skip is None or not bool(skip[g * G])]
    if not kept:  # every group skipped: nothing to run on any rank
        return [], 0
    shapes = group_shapes(batch, kept)
    packed = pack_groups(shapes, G, budget, prompt_once=prompt_once, bucketed=bucketed)
    while len(packed) < min(d.world_size, len(kept)):  # every rank gets work: halve the costliest
        k = max(
            range(len(packed)),
            key=lambda j: (micro_batch_cost([shapes[i] for i in packed[j]], G, prompt_once, bucketed), -j),
        )
        b = sorted(packed.pop(k), key=lambda i: -shapes[i].width)
        packed[k:k] = [sorted(b[: len(b) // 2]), sorted(b[len(b) // 2 :])]
    bins = [[kept[i] for i in b] for b in packed]
    mine = bins[d.rank :: d.world_size]
    rows = [torch.cat([torch.arange(g * G, (g + 1) * G) for g in b]) for b in mine]
    count = -(-len(bins) // d.world_size)  # ceil: every rank runs as many
    cheapest = kept[min(range(len(kept)), key=lambda i: (micro_batch_cost([shapes[i]], G, prompt_once), i))]
    real = len(rows)
    rows += [torch.arange(cheapest * G, (cheapest + 1) * G)] * (count - real)
    return rows, real
