"""Samplers: what draws a step's completions (and the held-out evaluation's), behind one small
interface. `sampler.backend` chooses the implementation, once, in build_sampler; training,
grpo-train's evaluation and grpo-eval all sample through it.

    builtin   the exact decode loop over the policy itself (samplers/builtin.py)
    vllm      a colocated vLLM engine, its weights synced after every update (samplers/vllm.py)

A backend is one module here (its file name is its `sampler.backend` name) and a preset in
conf/sampler/. The module declares what the package asks of it:

    KEYS                     the SamplerConfig keys only this backend reads (validation rejects them
                             under the other backends); a new key also needs its default there
    validate(cfg, world_size) -> list[str]   its keys' values, what it cannot run with, its install
    build(cfg, policy, *, eos_ids, pad_id, precision, fast_decode, seed, tokenizer) -> Sampler

Every draw is an episode (environments.episodes.run_episodes): without an environment, one turn,
the sampler's plain `generate` call; with one, turn after turn through the sampler's `session`
(samplers/_session.py: Session, the Turn settings, and the default session, Reprefill).
"""

from __future__ import annotations

import importlib
import pkgutil
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Protocol

from grpo_cli.samplers._session import Reprefill, Session, Turn  # noqa: F401 (the interface's parts)

if TYPE_CHECKING:
    from grpo_cli.rollout import Rollout

# Every module of this package is a backend, named by its file (no import needed to list them).
BACKENDS = tuple(sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")))


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
    ) -> Rollout:
        """`num_generations` completions of each prompt (token ids), a group's rows consecutive,
        as one rollout.Rollout (its num_generations set, trained_mask = attention_mask: every
        completion token was sampled). seeds: one per prompt; prompt b's completions depend on
        seeds[b] alone (not on the other prompts of the batch, the device or the process count).
        greedy: argmax (evaluation). ignore_eos: sample max_new_tokens whatever is drawn.
        max_new_tokens: this call's budget (None: sampler.max_new_tokens; an episode's turn may
        have less). stop: strings that end a completion early, the token that completes one kept
        (an environment's tool tag); a sampler may also draw past one, the episode cuts there.

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


def backend(name: str):
    """The module of backend `name` (one of BACKENDS; validation rejects other names first)."""
    if name not in BACKENDS:
        raise ValueError(f"sampler.backend={name!r}: choose one of {', '.join(BACKENDS)}")
    return importlib.import_module(f"{__name__}.{name}")


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


def validate(cfg, world_size: int) -> list[str]:
    """The chosen backend's own checks of the whole config (cfg.sampler.backend is valid)."""
    return backend(cfg.sampler.backend).validate(cfg, world_size)


def foreign_keys(chosen: str) -> tuple[str, ...]:
    """The sampler keys that other backends read and `chosen` does not."""
    mine = set(backend(chosen).KEYS)
    return tuple(k for name in BACKENDS if name != chosen for k in backend(name).KEYS if k not in mine)


def build_sampler(
    cfg,
    policy,
    *,
    eos_ids: list[int],
    pad_id: int,
    precision,
    fast_decode: bool,
    seed: int = 0,
    tokenizer=None,
) -> Sampler:
    """The sampler that cfg.backend names. seed: the engine's own seed (vLLM: for requests
    without one; the built-in sampler has none). tokenizer: for stop strings (the built-in sampler)."""
    return backend(cfg.backend).build(
        cfg,
        policy,
        eos_ids=eos_ids,
        pad_id=pad_id,
        precision=precision,
        fast_decode=fast_decode,
        seed=seed,
        tokenizer=tokenizer,
    )
