"""The run's roles, built once from the config (build.py) and shared by grpo-train and grpo-eval:
`Rollouts` draws and scores (prompts -> scored records), `Learner` learns from them (a step's
scored draw -> an optimizer step: Learner.step). Each holds its parts and reads the config by name, so the loop
(engine.py) calls them with a few arguments and wires nothing by hand.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from grpo_cli import selfcheck
from grpo_cli import step as phases
from grpo_cli.checkpoint import TrainerState
from grpo_cli.config import Config
from grpo_cli.distributed import Dist
from grpo_cli.environments.episodes import Episodes
from grpo_cli.environments.path import RolloutPath
from grpo_cli.evaluate import evaluate, grade
from grpo_cli.loss import adapt_entropy_coef, applied_entropy_coef
from grpo_cli.metrics import UpdateStats
from grpo_cli.optim import OptimizerStep
from grpo_cli.packing import ScoringPlan, plan_micro_batches
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
    saved: Any = None  # replay.Saved under trainer.replay: the steps are read, not sampled

    @property
    def path(self) -> RolloutPath:
        """What draws the rollouts: the one path (environments.path.run_episodes)."""
        return RolloutPath(self.sampler, self.episodes)

    def draw(self, step: int) -> phases.Sampled:
        """The step's groups, sampled and scored (step.sample_and_score); under trainer.replay, the
        original run's, read back with the generator state its update started from (replay.Saved)."""
        if self.saved is not None:
            return self.saved.draw(step, self.device, self.dist.rank)
        return phases.sample_and_score(step, self)

    def grade(
        self, examples: list, num_generations: int = 1, greedy: bool = True, seeds: list[int] | None = None
    ) -> Scored | None:
        """Held-out prompts, G completions each, scored (evaluate.grade; 64 completions a call;
        seeds: each prompt's sampling seed)."""
        return grade(
            self.path,
            self.tokenizer,
            examples,
            self.rewards,
            num_generations=num_generations,
            greedy=greedy,
            prompts_per_call=max(1, 64 // num_generations),
            seeds=seeds,
        )

    def evaluate(
        self, examples: list, prefix: str, groups: list[str], samples: int = 0, seeds: list[int] | None = None
    ) -> dict[str, float]:
        """grpo-train's eval/ metrics of this rank's share of a held-out set (evaluate.evaluate):
        greedy, or `samples` sampled completions a prompt (seeds: each prompt's) at
        trainer.eval_temperature (null: the sampler's temperature)."""
        return evaluate(
            self.path,
            self.tokenizer,
            examples,
            self.rewards,
            reduce=self.dist.sum,
            prefix=prefix,
            group_by=self.cfg.data.eval_group_by,
            groups=groups,
            samples=samples,
            seeds=seeds,
            temperature=self.cfg.trainer.eval_temperature if samples else None,
        )

    def close(self) -> None:
        """The sampler, then the rewards, however either ends."""
        try:
            self.sampler.close()
        finally:
            self.rewards.close()


@dataclass(frozen=True)
class Stepped:
    """What Learner.step did with one step's scored draw: the batch it trained on (scored.Batch),
    the updates (step.Updated: stats, each optimizer step's result, the notes for the log), the
    seconds its frozen models took (reference; teacher, where there is one), and the adaptive
    entropy control's row (entropy_coef, where it applies)."""

    batch: Any
    updated: phases.Updated
    seconds: dict[str, float]
    entropy: dict[str, float]


@dataclass
class Learner:
    """A step's scored draw -> an optimizer step: the policy, the reference (None when loss.beta is
    0), the training forward (`scorer`: logprobs.TokenLogprobs, under DDP wrapped), the optimizer
    step, the precision, the scoring plan (packing.ScoringPlan: made once by the builder, read by
    the micro-batch planner and every scoring forward), the run's state (its adaptive entropy
    coefficient, which checkpoints keep) and the sampler's tolerance."""

    cfg: Config
    policy: Any
    ref: Any
    scorer: Any
    opt_step: OptimizerStep
    precision: Precision
    plan: ScoringPlan
    dist: Dist
    device: Any
    tolerance: tuple[
        float, float
    ]  # the sampler's declared (mean, max) log-prob gap (update's mismatch floor)
    state: TrainerState
    teacher: Any = None  # the frozen teacher (loss.teacher_kl > 0), else None

    def step(self, scored: Scored, first: bool) -> Stepped:
        """One step on `scored` (the groups to train on): advantages (the Batch), this rank's
        micro-batches, the frozen models' log-probs, num_iterations updates, the adaptive entropy
        control. first: the run's first step, whose self-check compares every row (none skipped)."""
        lo = self.cfg.loss
        batch, norms, has_signal = phases.advantages(scored, lo, self.device)
        skip = (
            self.cfg.trainer.skip_zero_std and not first and not lo.teacher_kl
        )  # (the teacher trains every row)
        plan = plan_micro_batches(batch, self.plan, self.cfg, self.dist, skip_zero_std=skip)
        ref_logps, ref_seconds = self._frozen_logps(self.ref, batch, plan)
        teacher_logps, teacher_seconds = self._frozen_logps(self.teacher, batch, plan)  # (distillation)
        check = (
            selfcheck.FirstStep(self.policy, self.precision.name, self.cfg.sampler.temperature)
            if first
            else None
        )
        coef = applied_entropy_coef(self._entropy_coef(), self.state.last_entropy, lo)
        context = phases.UpdateContext(norms, has_signal, ref_logps, check, teacher_logps, coef)
        updated = phases.update(batch, plan, context, learner=self)
        updated.stats.all_reduce(
            self.dist
        )  # (every rank then holds the step's stats: the controller's input)
        seconds = {
            "reference": ref_seconds,
            **({"teacher": teacher_seconds} if self.teacher is not None else {}),
        }
        return Stepped(batch, updated, seconds, self._adapt_entropy(updated.stats))

    def _frozen_logps(self, model, batch, plan) -> tuple[Any, float]:
        """A frozen model's log-probs [N, C] of the batch's completions (step.reference_logprobs,
        under the scoring plan; None when `model` is None) and the seconds they took."""
        tick = time.perf_counter()
        if model is None:
            return None, time.perf_counter() - tick
        options = self.plan.options(
            self.cfg.sampler.temperature, chunk_size=self.cfg.trainer.logprob_chunk_size
        )
        logps = phases.reference_logprobs(model, batch, plan, options, self.precision)
        return logps, time.perf_counter() - tick

    def _entropy_coef(self) -> float:
        """The adaptive entropy controller's coefficient (loss.entropy_coef until it first adapts)."""
        return self.cfg.loss.entropy_coef if self.state.entropy_coef is None else self.state.entropy_coef

    def _adapt_entropy(self, stats: UpdateStats) -> dict[str, float]:
        """TRL's adaptive entropy control after a step: the coefficient moves by this step's entropy
        (every rank's trained tokens: `stats` is all-reduced, so every rank holds the same state), which
        the next step's gate reads; the row's `entropy_coef` (TRL's metric: the value after the step).
        A step that trained no token measured nothing and leaves the state as it was."""
        lo, state = self.cfg.loss, self.state
        if not lo.use_adaptive_entropy:
            return {"entropy_coef": lo.entropy_coef} if lo.entropy_coef else {}
        if stats.entropy_tokens:
            entropy = stats.entropy_sum / stats.entropy_tokens
            state.entropy_coef = adapt_entropy_coef(self._entropy_coef(), entropy, lo)
            state.last_entropy = entropy
        return {"entropy_coef": self._entropy_coef()}
