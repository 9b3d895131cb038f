"""The one scored record (grpo_cli/scored.py): the accuracy rule, and the row operations dynamic
sampling, adaptive group sizes and the rank gather are made of."""

import math

import torch
from conftest import scored_rows

from grpo_cli.rollout import single_turn
from grpo_cli.scored import concat, merge_rank_counters, select


def _rollout(N, G=2, C=3):
    return single_turn(
        G,
        torch.ones(N, 2, dtype=torch.long),
        torch.ones(N, 2, dtype=torch.long),
        torch.arange(N * C).view(N, C),
        torch.ones(N, C, dtype=torch.long),
        torch.zeros(N, dtype=torch.bool),
        torch.zeros(N, C),
    )


def test_the_accuracy_rule_is_the_pass_share_among_the_rows_it_applies_to():
    from dataclasses import replace

    # A part-mark correctness reward: 1.0 passes, 0.5 does not, None is not applicable.
    judged = [1.0, 0.5, None, 1.0]
    rows = scored_rows(_rollout(4), [1.0, 0.5, 0.2, 1.0], {"judge": judged})
    rows = replace(
        rows,
        passed=torch.tensor([v is not None and v >= 1 for v in judged]),
        applies=torch.tensor([v is not None for v in judged]),
    )
    assert rows.accuracy() == (2, 3)  # not the mean value (2.5 / 3), and the None row left out
    assert rows.column("judge") == judged


def test_select_keeps_rows_and_concat_sums_the_draws_counters():
    from dataclasses import replace

    a = replace(
        scored_rows(_rollout(4), [1, 0, 0, 1]), counters={"rewards/x/failures": 1.0}, logged={"m": (1.0,)}
    )
    b = replace(scored_rows(_rollout(2), [0, 0]), counters={"rewards/x/failures": 2.0}, logged={"m": (3.0,)})
    part = select(a, torch.tensor([2, 3]))
    assert part.totals.tolist() == [0.0, 1.0] and part.counters == {} and part.logged == {}
    assert torch.equal(part.rollout.completion_ids, a.rollout.completion_ids[2:4])
    joined = concat([a, b], pad_id=0)
    assert joined.totals.tolist() == [1, 0, 0, 1, 0, 0] and len(joined.rollout.completion_ids) == 6
    assert joined.counters == {"rewards/x/failures": 3.0} and joined.logged == {"m": (1.0, 3.0)}
    assert math.isclose(joined.values[:, 0].sum().item(), 2.0)


def test_ranks_counters_are_summed_and_their_seconds_the_slowest():
    merged = merge_rank_counters([{"time/rewards/x": 2.0, "rewards/x/calls": 3.0}, {"time/rewards/x": 5.0}])
    assert merged == {"time/rewards/x": 5.0, "rewards/x/calls": 3.0}
