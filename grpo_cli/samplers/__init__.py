"""Samplers: what draws a step's completions (and the held-out evaluation's), behind one small
interface. `sampler.backend` chooses the implementation, once, in build_sampler; training,
grpo-train's evaluation and grpo-eval all sample through it.

    builtin   the exact decode loop over the policy itself (samplers/builtin.py)
    vllm      a colocated vLLM engine, its weights synced after every update (samplers/vllm.py)

A backend is one module here, a name in BACKENDS, a branch in build_sampler, its keys in
config.SamplerConfig (rejected under the other backends) and a preset in conf/sampler/.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # (config validation imports BACKENDS before torch is imported)
    from grpo_cli.rollout import Rollout

BACKENDS = ("builtin", "vllm")


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
    ) -> Rollout:
        """`num_generations` completions of each prompt (token ids), a group's rows consecutive.
        seeds: one per prompt; prompt b's completions depend on seeds[b] alone (not on the other
        prompts of the batch, the device or the process count). greedy: argmax (evaluation).
        ignore_eos: sample max_new_tokens whatever is drawn. The log-probs are those of the
        tempered distribution the tokens were drawn from."""

    def sync(self, policy) -> None:
        """Called after every optimizer step that changed the policy's weights: a sampler holding
        its own copy of them loads the new ones."""

    def close(self) -> None:
        """Free what the sampler holds (at the end of a run, and of each sweep job)."""


def build_sampler(
    cfg, policy, *, eos_ids: list[int], pad_id: int, precision, fast_decode: bool, seed: int = 0
) -> Sampler:
    """The sampler that cfg.backend names (config.SamplerConfig; validation rejects other names).
    seed: the engine's own seed (vLLM: for requests without one; the built-in sampler has none)."""
    if cfg.backend == "vllm":
        from grpo_cli.samplers.vllm import VLLMSampler

        return VLLMSampler(cfg, policy, eos_ids=eos_ids, pad_id=pad_id, precision=precision, seed=seed)
    if cfg.backend == "builtin":
        from grpo_cli.samplers.builtin import BuiltinSampler

        return BuiltinSampler(
            cfg, policy, eos_ids=eos_ids, pad_id=pad_id, precision=precision, fast_decode=fast_decode
        )
    raise ValueError(f"sampler.backend={cfg.backend!r}: choose one of {', '.join(BACKENDS)}")
