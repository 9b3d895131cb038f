"""The run's roles, built once from the config (build.py) and shared by grpo-train and grpo-eval:
`Rollouts` draws and scores (prompts -> scored records), `Learner` learns from them (a scored
batch -> an optimizer step). Each holds its parts and reads the config by name, so the loop
(engine.py) calls them with a few arguments and wires nothing by hand.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from grpo_cli import step as phases
from grpo_cli.config import Config
from grpo_cli.distributed import Dist
from grpo_cli.environments.episodes import Episodes
from grpo_cli.environments.path import RolloutPath
from grpo_cli.evaluate import evaluate, grade
from grpo_cli.logprobs import ScoringOptions
from grpo_cli.optim import OptimizerStep
from grpo_cli.packing import token_micro_batches
from grpo_cli.precision import Precision
from grpo_cli.rewards import Rewards
from grpo_cli.samplers import Sampler
from grpo_cli.scored import Scored


@dataclass
class Rollouts:
    """Prompts -> scored rollouts: the sampler, an environment's episodes on it (None: one turn
    each), the rewards (opened), the tokenizer, the training prompts' stream (None for grpo-eval)."""

    cfg: Config
    sampler: Sampler
    episodes: Episodes | None
    rewards: Rewards
    tokenizer: Any
    stream: Any
    dist: Dist
    device: Any

    @property
    def path(self) -> RolloutPath:
        """What draws the rollouts: the one path (environments.path.run_episodes)."""
        return RolloutPath(self.sampler, self.episodes)

    def draw(self, step: int) -> phases.Sampled:
        """The step's groups, sampled and scored (step.sample_and_score)."""
        return phases.sample_and_score(step, self)

    def grade(self, examples: list, num_generations: int = 1, greedy: bool = True) -> Scored | None:
        """Held-out prompts, G completions each, scored (evaluate.grade; 64 completions a call)."""
        return grade(
            self.path,
            self.tokenizer,
            examples,
            self.rewards,
            num_generations=num_generations,
            greedy=greedy,
            prompts_per_call=max(1, 64 // num_generations),
        )

    def evaluate(self, examples: list, prefix: str, groups: list[str]) -> dict[str, float]:
        """grpo-train's eval/ metrics of this rank's share of a held-out set (evaluate.evaluate)."""
        return evaluate(
            self.path,
            self.tokenizer,
            examples,
            self.rewards,
            reduce=self.dist.sum,
            prefix=prefix,
            group_by=self.cfg.data.eval_group_by,
            groups=groups,
        )

    def close(self) -> None:
        """The sampler, then the rewards, however either ends."""
        try:
            self.sampler.close()
        finally:
            self.rewards.close()


@dataclass
class Learner:
    """A scored batch -> an optimizer step: the policy, the reference (None when loss.beta is 0),
    the training forward (`scorer`: logprobs.TokenLogprobs, under DDP wrapped), the optimizer step,
    the precision, whether the model takes the tested fast paths, and the sampler's tolerance."""

    cfg: Config
    policy: Any
    ref: Any
    scorer: Any
    opt_step: OptimizerStep
    precision: Precision
    fast_paths: bool
    dist: Dist
    device: Any
    tolerance: tuple[
        float, float
    ]  # the sampler's declared (mean, max) log-prob gap (update's mismatch floor)
    teacher: Any = None  # the frozen teacher (loss.teacher_kl > 0), else None

    def batch(self, sampled: phases.Sampled):
        """(Batch, loss normalisers, has learning signal): step.advantages."""
        return phases.advantages(sampled, self.cfg.loss, self.device)

    def plan(self, batch, first: bool) -> phases.MicroBatches:
        """This rank's micro-batches (zero-std groups skipped, but on the first step: its self-check
        compares every row)."""
        t = self.cfg.trainer
        skip = t.skip_zero_std and not first and not self.cfg.loss.teacher_kl
        if t.micro_batch_tokens is not None:  # by a token budget (grpo_cli/packing.py)
            rows, real = token_micro_batches(
                batch,
                budget=t.micro_batch_tokens,
                skip=batch.zero_std.cpu() if skip and self.cfg.loss.zero_std == "mask" else None,
                d=self.dist,
                prompt_once=self.fast_paths and not t.gradient_checkpointing,
                bucketed=self.fast_paths
                and not (self.dist.enabled and t.distributed == "fsdp"),  # (as build.py's)
            )
            return phases.MicroBatches(rows, real)
        return phases.micro_batches(
            batch,
            prompts_per_step=t.prompts_per_step,
            accumulation_steps=t.gradient_accumulation_steps,
            zero_std_mode=self.cfg.loss.zero_std,
            d=self.dist,
            # (the teacher term trains every row, zero-std ones included: none is skipped)
            skip_zero_std=skip,
        )

    def reference(self, batch, plan) -> tuple[Any, float]:
        """The reference model's log-probs [N, C] (None without one) and the seconds they took."""
        return self._frozen_logps(self.ref, batch, plan)

    def teacher_scores(self, batch, plan) -> tuple[Any, float]:
        """The teacher's log-probs [N, C] of the batch's completions (None without one), scored
        with the chunked log-probs as the reference's are, and the seconds they took."""
        return self._frozen_logps(self.teacher, batch, plan)

    def _frozen_logps(self, model, batch, plan) -> tuple[Any, float]:
        """A frozen model's log-probs [N, C] of the batch's completions (step.reference_logprobs;
        None when `model` is None) and the seconds they took."""
        tick = time.perf_counter()
        if model is None:
            return None, time.perf_counter() - tick
        t = self.cfg.trainer
        options = ScoringOptions(
            self.cfg.sampler.temperature,
            shared_prompt=self.fast_paths,
            chunk_size=t.logprob_chunk_size,
            length_buckets=t.micro_batch_tokens is not None and self.fast_paths,
        )
        logps = phases.reference_logprobs(model, batch, plan, options, self.precision)
        return logps, time.perf_counter() - tick

    def update(self, batch, plan, context: phases.UpdateContext, log) -> phases.Updated:
        """num_iterations updates on the batch (step.update)."""
        return phases.update(batch, plan, context, learner=self, log=log)
