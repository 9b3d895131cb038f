"""Rollouts: a step's sampled completions as one frozen record, built whole by what drew them (a
sampler), and the scored batch one step trains on, built whole once its rewards and advantages
are known. Row operations: select (whole groups), concat, and Batch.rows (a micro-batch).

Three masks, three meanings (docs/how-training-works.md, "The rollout"):

    attention_mask  [N, C]  the completion-side tokens the model sees: every sampled token, and any
                            token something other than the policy wrote there (an environment's
                            reply). Right-padded; it may have holes (positions count the attended
                            tokens only, logprobs.position_ids_from_mask).
    trained_mask    [N, C]  the tokens the policy sampled: what the loss, the KL, the entropy, TIS,
                            the step-0 self-check and the mismatch metrics count. A subset of
                            attention_mask: tokens the policy did not sample are attended to and
                            never trained. Need not be a contiguous prefix either.
    the reward span         what rewards read: the attended completion, decoded
                            (rewards.decode_completions).

A single-turn rollout's two masks are equal (1 up to and including the first EOS).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch
import torch.nn.functional as F

from grpo_cli.logprobs import padding_bounds

_COMPLETION_COLUMNS = ("completion_ids", "attention_mask", "trained_mask", "sampler_logps", "roles")

#: Who wrote a completion-side token (Rollout.roles): the policy, or an environment's reply, inline
#: in the policy's own message (a tool result) or as a message of its own (tool, user).
ROLE_CODES = {"padding": 0, "assistant": 1, "tool": 2, "user": 3}
ROLE_NAMES = {code: name for name, code in ROLE_CODES.items()}


@dataclass(frozen=True)
class Rollout:
    """Sampled completions, G per prompt, never changed once built: by a sampler's generate
    (single_turn) or an environment's episodes (environments.episodes)."""

    num_generations: int  # G: the rows come in groups of G consecutive rows that share one prompt
    prompt_ids: torch.Tensor  # [N, P] left-padded, N = prompts * G
    prompt_mask: torch.Tensor  # [N, P] 1 on the prompt's tokens
    completion_ids: torch.Tensor  # [N, C] right-padded with pad_id
    attention_mask: torch.Tensor  # [N, C] long: the completion-side tokens the model sees
    trained_mask: torch.Tensor  # [N, C] long: the tokens the policy sampled (within attention_mask)
    truncated: torch.Tensor  # [N] bool: stopped by a length budget, not by an end of sequence
    # [N, C] fp32: each sampled token's log-prob under the distribution it was drawn from (the
    # samplers' contract, samplers.Sampler); 0 where trained_mask is 0.
    sampler_logps: torch.Tensor
    roles: torch.Tensor  # [N, C] long: who wrote each token (ROLE_CODES); padding 0
    # [N, S] float: an environment's counters per episode (environments.episodes.STAT_COLUMNS);
    # S = 0 for a single-turn draw, which has none (is_episode).
    episode_stats: torch.Tensor
    env_reward: torch.Tensor  # [N] float: the environment's own reward, NaN for none
    # The names of episode_stats' S columns (the episode loop's counters, then the environment's
    # own declared metrics); () for a single-turn draw.
    stat_names: tuple[str, ...] = ()

    def __post_init__(self):
        N, C = self.completion_ids.shape
        if self.num_generations < 1 or N % self.num_generations:
            raise ValueError(f"Rollout: {N} rows are not groups of num_generations={self.num_generations}")
        for name in _COMPLETION_COLUMNS:
            if tuple(getattr(self, name).shape) != (N, C):
                raise ValueError(f"Rollout.{name} is {tuple(getattr(self, name).shape)}, expected {(N, C)}")
        if self.episode_stats.shape[0] != N or tuple(self.env_reward.shape) != (N,):
            raise ValueError(f"Rollout: episode_stats and env_reward must have the {N} rows")
        if self.episode_stats.shape[1] != len(self.stat_names):
            raise ValueError(
                f"Rollout: episode_stats has {self.episode_stats.shape[1]} columns for the names {self.stat_names}"
            )
        if bool((self.trained_mask.bool() & ~self.attention_mask.bool()).any()):
            raise ValueError(
                "Rollout: a trained token must be attended to (trained_mask within attention_mask)"
            )

    @property
    def is_episode(self) -> bool:
        """Drawn as an environment's episodes (they carry its counters), not one completion per row."""
        return self.episode_stats.shape[1] > 0

    @property
    def lengths(self) -> torch.Tensor:
        """Completion-side tokens of each row, sampled or not: [N]."""
        return self.attention_mask.sum(-1)

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(prompt_ids, prompt_mask, completion_ids, attention_mask): what logprobs.token_logprobs scores."""
        return self.prompt_ids, self.prompt_mask, self.completion_ids, self.attention_mask

    def to(self, device) -> Rollout:
        """The rollout with every tensor on `device` (gathered across processes on the CPU)."""
        return _map_tensors(self, lambda t: t.to(device))


def single_turn(
    num_generations: int,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    mask: torch.Tensor,
    truncated: torch.Tensor,
    sampler_logps: torch.Tensor,
) -> Rollout:
    """A sampler's rollout, one completion per row: every attended token sampled by the policy
    (trained_mask = attention_mask = mask, every role the assistant's), no environment counters
    (episode_stats [N, 0]), no environment reward (NaN)."""
    N, device = completion_ids.shape[0], completion_ids.device
    return Rollout(
        num_generations=num_generations,
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion_ids,
        attention_mask=mask,
        trained_mask=mask,
        truncated=truncated,
        sampler_logps=sampler_logps,
        roles=mask * ROLE_CODES["assistant"],
        episode_stats=torch.zeros((N, 0), device=device),
        env_reward=torch.full((N,), float("nan"), device=device),
    )


def left_pad(sequences: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token sequences as [B, W] ids and mask, left-padded with pad_id (a rollout's prompt side)."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, s in enumerate(sequences):
        if s:
            ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s) :] = 1
    return ids.to(device), mask.to(device)


def _map_tensors(record, fn, **changes):
    """A frozen record with fn applied to each of its tensor fields (others kept), and `changes`."""
    return replace(
        record,
        **{
            f.name: fn(getattr(record, f.name))
            for f in fields(record)
            if isinstance(getattr(record, f.name), torch.Tensor)
        },
        **changes,
    )


def select(rollout: Rollout, rows: torch.Tensor, num_generations: int | None = None) -> Rollout:
    """The given rows (index tensor [n]): whole groups of the rollout's G, or `num_generations`
    rows of one prompt (a group chosen from several rounds)."""
    return _map_tensors(
        rollout,
        lambda t: t[rows],
        num_generations=num_generations or rollout.num_generations,
    )


def concat(rollouts: list[Rollout], pad_id: int) -> Rollout:
    """Stack rollouts of one G and different widths: prompts stay left-padded, completions right-padded."""
    if len(rollouts) == 1:
        return rollouts[0]
    G = {r.num_generations for r in rollouts}
    if len(G) != 1:
        raise ValueError(f"concat: rollouts of different num_generations {sorted(G)}")
    if len({r.stat_names for r in rollouts}) != 1:
        raise ValueError("concat: single-turn rollouts and episodes (or episodes of different counters)")
    P = max(r.prompt_ids.shape[1] for r in rollouts)
    C = max(r.completion_ids.shape[1] for r in rollouts)

    def pad(t, width, value, left):
        extra = width - t.shape[1]
        if extra == 0:
            return t
        return F.pad(t, (extra, 0) if left else (0, extra), value=value)

    return Rollout(
        num_generations=G.pop(),
        prompt_ids=torch.cat([pad(r.prompt_ids, P, pad_id, True) for r in rollouts]),
        prompt_mask=torch.cat([pad(r.prompt_mask, P, 0, True) for r in rollouts]),
        completion_ids=torch.cat([pad(r.completion_ids, C, pad_id, False) for r in rollouts]),
        attention_mask=torch.cat([pad(r.attention_mask, C, 0, False) for r in rollouts]),
        trained_mask=torch.cat([pad(r.trained_mask, C, 0, False) for r in rollouts]),
        truncated=torch.cat([r.truncated for r in rollouts]),
        sampler_logps=torch.cat([pad(r.sampler_logps, C, 0.0, False) for r in rollouts]),
        roles=torch.cat([pad(r.roles, C, ROLE_CODES["padding"], False) for r in rollouts]),
        episode_stats=torch.cat([r.episode_stats for r in rollouts]),
        env_reward=torch.cat([r.env_reward for r in rollouts]),
        stat_names=rollouts[0].stat_names,
    )


@dataclass(frozen=True)
class Drawn:
    """A rollout as drawn, and beside it what only its rewards read, held until they have scored it
    (environments.path.RolloutPath.score): per row, the prompt as the episode's environment reset it
    (chat messages; None: the example's own), which the rewards get as `prompts`; and the episode's
    environment, still open, which the rewards get as `environments` (TRL's keyword), closed once
    they have scored. () for none (a single-turn draw, or no reward takes them)."""

    rollout: Rollout
    reset_prompts: tuple = ()
    environments: tuple = ()

    def __post_init__(self):
        N = self.rollout.completion_ids.shape[0]
        for name in ("reset_prompts", "environments"):
            if len(getattr(self, name)) not in (0, N):
                raise ValueError(f"Drawn.{name} has {len(getattr(self, name))} entries for {N} rows")


def trimmed(r: Rollout) -> tuple[Rollout, int]:
    """The rollout without the prompt columns that are padding in every row and the completion
    columns past the last attended token, and how many completion columns it keeps (C')."""
    first, used = padding_bounds(r.prompt_mask, r.attention_mask)
    r = replace(
        r,
        prompt_ids=r.prompt_ids[:, first:],  # [n, P']
        prompt_mask=r.prompt_mask[:, first:],
        **{name: getattr(r, name)[:, :used] for name in _COMPLETION_COLUMNS},  # [n, C']
    )
    return r, used
