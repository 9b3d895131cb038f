"""The one rollout path (docs/how-training-works.md): run_episodes draws a batch's rollout, through
an environment's episodes (environments.episodes.Episodes) or, without one, the sampler's plain
generate; RolloutPath holds the pair that training, grpo-train's evaluation and grpo-eval draw with."""

from __future__ import annotations

from dataclasses import dataclass

from grpo_cli.environments.episodes import Episodes
from grpo_cli.rollout import Rollout
from grpo_cli.samplers import Sampler


def run_episodes(
    sampler: Sampler,
    examples: list,
    episodes: Episodes | None,
    *,
    seeds: list[int] | None = None,
    num_generations: int,
    greedy: bool = False,
    ignore_eos: bool = False,
) -> Rollout:
    """The rollout of a batch of data.Example, rows grouped by example: `episodes`' (an
    environment's) when given, else one turn each, the sampler's plain call (num_generations
    completions of each prompt). seeds: one per example (Sampler.generate's)."""
    if episodes is None:
        return sampler.generate(
            [ex.prompt_ids for ex in examples],
            seeds=seeds,
            num_generations=num_generations,
            greedy=greedy,
            ignore_eos=ignore_eos,
        )
    return episodes.run(
        sampler, examples, seeds=seeds, num_generations=num_generations, greedy=greedy, ignore_eos=ignore_eos
    )


@dataclass(frozen=True)
class RolloutPath:
    """What draws a batch's rollouts (training's, grpo-train's evaluation's, grpo-eval's): the
    sampler, and an environment's episodes on it (None: one turn each). draw: run_episodes."""

    sampler: Sampler
    episodes: Episodes | None = None

    def draw(self, examples, *, seeds=None, num_generations: int, greedy=False, ignore_eos=False) -> Rollout:
        return run_episodes(
            self.sampler,
            examples,
            self.episodes,
            seeds=seeds,
            num_generations=num_generations,
            greedy=greedy,
            ignore_eos=ignore_eos,
        )

    def close_environments(self) -> None:
        """Close the environments that the rollouts drawn so far kept open for the rewards
        (Episodes.keep_open): called once those rollouts are scored."""
        if self.episodes is not None:
            self.episodes.close_open()
