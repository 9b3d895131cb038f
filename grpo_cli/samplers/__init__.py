"""Samplers: what draws a step's completions (and the held-out evaluation's), behind one small
interface. `sampler.backend` chooses the implementation, once, in build_sampler; training,
grpo-train's evaluation and grpo-eval all sample through it.

    builtin   the exact decode loop over the policy itself (samplers/builtin.py)
    vllm      a colocated vLLM engine, its weights synced after every update (samplers/vllm.py)

A backend is a plug-in (grpo_cli/plugins.py): one module declaring `PLUGIN = Plugin(...)` (a
module of this package is named by its file; a user's is chosen by import path,
`sampler.backend=my_pkg.my_sampler`) and a preset in conf/sampler/. What the package asks of it:

    build(cfg, context) -> Sampler    cfg: the sampler section; context: a Context (the policy,
                                      token ids, precision, seed, tokenizer, its own options)
    check(cfg, world_size) -> problems   its checks of the whole config, its install
    options                           the dataclass of its own options (`sampler.options.<key>`)
    facts: Facts                      exact_draw (decides loss.sampler_correction=auto) and the
                                      flat SamplerConfig keys only it reads (validation rejects
                                      them under the other backends)

Every draw is an episode (environments.path.run_episodes): without an environment, one turn,
the sampler's plain `generate` call; with one, turn after turn through the sampler's `session`
(samplers/_session.py: Session, the Turn settings, and the default session, Reprefill).
"""

from __future__ import annotations

import dataclasses
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from grpo_cli import plugins
from grpo_cli.errors import UserError
from grpo_cli.plugins import Plugin
from grpo_cli.samplers._session import Reprefill, Session, Turn  # noqa: F401 (the interface's parts)

if TYPE_CHECKING:
    from grpo_cli.rollout import Rollout

# Every module of this package is a backend, named by its file (no import needed to list them).
BACKENDS = plugins.builtin_names(__name__)


@dataclass(frozen=True)
class Facts:
    """What a backend declares about itself.

    exact_draw: its draw uses the trainer's own numerics (the same model object, the same
      kernels up to their order), so its log-probs match the trainer's within its tolerance and
      loss.sampler_correction=auto means none; False (an inference engine with its own kernels,
      precision or weights copy): auto means tis (truncated importance sampling, ref 000.8).
    keys: the flat SamplerConfig keys only this backend reads.
    """

    exact_draw: bool
    keys: tuple[str, ...] = ()


@dataclass(frozen=True)
class Context:
    """What a backend's build gets besides the sampler section: the policy it samples from (or
    copies), the token ids that end and pad a completion, the trainer's precision.Precision,
    fast_decode (trainer.fast_decode: the CPU decode linears), the run's seed (for requests
    without one), the tokenizer (stop strings) and the backend's own options (filled in by
    build_sampler)."""

    policy: Any
    eos_ids: list[int]
    pad_id: int
    precision: Any
    fast_decode: bool = False
    seed: int = 0
    tokenizer: Any = None
    options: Any = None


class Sampler(Protocol):
    # |trainer - sampler| log-prob over valid tokens, (mean, max), that its numerics explain: the
    # step-0 self-check's bounds (ref 000.8), and a floor for the mismatch health warning.
    tolerance: tuple[float, float]

    def sampling(self) -> AbstractContextManager:
        """Ready to generate within the block (built-in: the weights gathered whole under FSDP2,
        eval mode, autocast). Every process enters it, even one with nothing to sample; generate
        enters it by itself when called outside one."""

    def generate(
        self,
        prompts: list[list[int]],
        *,
        seeds: list[int] | None = None,
        num_generations: int,
        greedy: bool = False,
        ignore_eos: bool = False,
        max_new_tokens: int | None = None,
        stop: list[str] | None = None,
        temperature: float | None = None,
    ) -> Rollout:
        """`num_generations` completions of each prompt (token ids), a group's rows consecutive,
        as one rollout.Rollout (its num_generations set, trained_mask = attention_mask: every
        completion token was sampled). seeds: one per prompt; prompt b's completions depend on
        seeds[b] alone (not on the other prompts of the batch, the device or the process count).
        greedy: argmax (evaluation). ignore_eos: sample max_new_tokens whatever is drawn.
        max_new_tokens: this call's budget (None: sampler.max_new_tokens; an episode's turn may
        have less). stop: strings that end a completion early, the token that completes one kept
        (an environment's tool tag); a sampler may also draw past one, the episode cuts there.
        temperature: this call's (sampled evaluation's trainer.eval_temperature); None: the
        sampler's sampler.temperature.

        The log-prob contract, the same for every backend: sampler_logps holds each sampled
        token's log-prob under the distribution it was drawn from, softmax(logits / temperature)
        after top-k then top-p truncation (the behaviour policy; without truncation, the very
        distribution the trainer scores). It is the only one an inference engine reports (vLLM's
        processed log-probs), and the trainer replays the same truncation on its own logits to
        compare with it (logprobs.TokenScores.behaviour): the mismatch metric and the TIS weights
        then measure numerics alone, in every setting."""

    def session(self, prompts: list[list[int]], num_generations: int) -> Session:
        """How this sampler continues sequences turn after turn (an environment's episodes): a
        samplers.Session over `num_generations` rows of each prompt, whose first turn draws what
        generate(prompts, seeds=..., num_generations=...) draws and whose later turns continue each
        row from its exact token sequence so far. Every backend defines it. The default, for a
        sampler with no cache to keep: `return Reprefill(self, prompts, num_generations)` (each
        later turn calls generate on the whole sequences again, one completion per row). The
        built-in sampler returns its KV-cache Session (only the new tokens are fed); both draw the
        same tokens (tests/test_environments.py)."""

    def sync(self, policy) -> None:
        """Called after every optimizer step that changed the policy's weights: a sampler holding
        its own copy of them loads the new ones."""

    def close(self) -> None:
        """Free what the sampler holds (at the end of a run, and of each sweep job)."""


def plugin(name: str) -> Plugin:
    """The declaration of backend `name`: a module of this package, or a user's by import path
    (plugins.load; UserError otherwise)."""
    return plugins.load(__name__, name, "sampler.backend")


def plugin_problems(name: str) -> list[str]:
    """sampler.backend's problem when `name` names no backend (a list of at most one)."""
    return plugins.check_name(__name__, name, "sampler.backend")


def check_sampling(s) -> list[str]:
    """The sampler group's values that every backend reads (config validation): G, the adaptive
    group's bound, temperature and top-p. s: the sampler group."""
    problems = []
    G = s.num_generations
    if G < 2:
        problems.append(
            f"sampler.num_generations={G}: GRPO compares completions within a group, so it needs "
            "at least 2 per prompt; set sampler.num_generations=8 (or any value >= 2)."
        )
    if s.max_generations is not None and (s.max_generations < G or s.max_generations % max(G, 1)):
        problems.append(
            f"sampler.max_generations={s.max_generations} must be a multiple of sampler.num_generations={G} "
            f"and at least it (a prompt gets more completions {G} at a time); e.g. "
            f"sampler.max_generations={4 * G}, or null for one round."
        )
    if not s.temperature > 0:
        problems.append(
            f"sampler.temperature={s.temperature} must be > 0 (log-probs are computed from "
            "logits / temperature); use 1.0 for plain sampling."
        )
    if not 0 < s.top_p <= 1:
        problems.append(f"sampler.top_p={s.top_p} must be in (0, 1]; 1.0 disables nucleus sampling.")
    return problems


def validate(cfg) -> list[str]:
    """The chosen backend's problems: its name, its options' (`sampler.options`), then its own
    checks of the whole config."""
    try:
        chosen = plugin(cfg.sampler.backend)
        plugins.read_options(chosen, cfg.sampler.options, "sampler.options")
    except UserError as exc:
        return [str(exc)]
    return chosen.problems(cfg)


def foreign_keys(chosen: str) -> dict[str, str]:
    """The flat sampler keys that other built-in backends read and `chosen` does not, each with
    the backend that reads it."""
    return plugins.foreign_keys(__name__, chosen, lambda name: plugin(name).facts)


def sampler_correction(loss, sampler) -> str:
    """loss.sampler_correction with auto resolved for the chosen backend's facts: none where its
    draw is exact (the trainer's own numerics), tis otherwise. loss, sampler: the two sections."""
    if loss.sampler_correction != "auto":
        return loss.sampler_correction
    return "none" if plugin(sampler.backend).facts.exact_draw else "tis"


def build_sampler(cfg, context: Context) -> Sampler:
    """The sampler that cfg.backend names (cfg: the sampler section), its own options read from
    cfg.options into context.options."""
    chosen = plugin(cfg.backend)
    options = plugins.read_options(chosen, cfg.options, "sampler.options")
    return chosen.build(cfg, dataclasses.replace(context, options=options))
