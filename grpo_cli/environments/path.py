"""The one rollout path (docs/how-training-works.md): run_episodes draws a batch's rollout, through
an environment's episodes (environments.episodes.Episodes) or, without one, the sampler's plain
generate; RolloutPath holds the pair that training, grpo-train's evaluation and grpo-eval draw
with, and owns a draw's scoring: the rewards, then the environments the draw kept open for them
closed, however the scoring ends (RolloutPath.score)."""

from __future__ import annotations

from dataclasses import dataclass

from grpo_cli.environments.episodes import Episodes
from grpo_cli.rewards import score
from grpo_cli.rewards.scoring import TrainerProgress
from grpo_cli.rollout import Drawn, Rollout
from grpo_cli.samplers import Sampler
from grpo_cli.scored import Scored


def run_episodes(
    sampler: Sampler,
    examples: list,
    episodes: Episodes | None,
    *,
    seeds: list[int] | None = None,
    num_generations: int,
    greedy: bool = False,
    ignore_eos: bool = False,
    temperature: float | None = None,
) -> Drawn:
    """The rollout of a batch of data.Example, rows grouped by example, with what its rewards read
    beside it (rollout.Drawn): `episodes`' (an environment's) when given, else one turn each, the
    sampler's plain call (num_generations completions of each prompt). seeds: one per example
    (Sampler.generate's); temperature: this draw's (None: the sampler's)."""
    if episodes is None:
        return Drawn(
            sampler.generate(
                [ex.prompt_ids for ex in examples],
                seeds=seeds,
                num_generations=num_generations,
                greedy=greedy,
                ignore_eos=ignore_eos,
                # (only when set: a sampler written before the keyword still draws at its own)
                **({} if temperature is None else {"temperature": temperature}),
            )
        )
    return episodes.run(
        sampler,
        examples,
        seeds=seeds,
        num_generations=num_generations,
        greedy=greedy,
        ignore_eos=ignore_eos,
        temperature=temperature,
    )


@dataclass(frozen=True)
class RolloutPath:
    """What draws a batch's rollouts (training's, grpo-train's evaluation's, grpo-eval's): the
    sampler, and an environment's episodes on it (None: one turn each).

    The scored draw is `drawn = path.draw_for_scoring(...)` inside the sampler's sampling()
    context, then `path.score(drawn, ...)`. The callers hold the context, because they differ in
    it: training leaves it before scoring, evaluation scores inside it, and under FSDP2 every
    process enters it alike, even with no prompts. `draw` is the rollout alone (the environments
    closed at once)."""

    sampler: Sampler
    episodes: Episodes | None = None

    def draw_for_scoring(
        self, examples, *, seeds=None, num_generations: int, greedy=False, ignore_eos=False, temperature=None
    ) -> Drawn:
        """The rollout and what its rewards read beside it (run_episodes); its open environments
        wait for score()."""
        return run_episodes(
            self.sampler,
            examples,
            self.episodes,
            seeds=seeds,
            num_generations=num_generations,
            greedy=greedy,
            ignore_eos=ignore_eos,
            temperature=temperature,
        )

    def draw(self, examples, *, seeds=None, num_generations: int, greedy=False, ignore_eos=False) -> Rollout:
        """The rollout alone (no reward will see its environments: they are closed here)."""
        try:
            drawn = self.draw_for_scoring(
                examples, seeds=seeds, num_generations=num_generations, greedy=greedy, ignore_eos=ignore_eos
            )
        finally:
            self.close_environments()
        return drawn.rollout

    def score(
        self, drawn: Drawn, examples, rewards, tokenizer, progress: TrainerProgress | None = None
    ) -> Scored:
        """The drawn rollout scored by `rewards` (rewards.score: `examples` in the rollout's row
        order), then the environments the draw kept open for them closed, however scoring ends."""
        try:
            return score(rewards, tokenizer, examples, drawn, progress)
        finally:
            self.close_environments()

    def close_environments(self) -> None:
        """Close the environments that the rollouts drawn so far kept open for the rewards
        (Episodes.keep_open)."""
        if self.episodes is not None:
            self.episodes.close_open()
