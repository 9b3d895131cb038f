"""Rollouts: a step's sampled completions as tensors (prompts, completions, masks, the sampler's
log-probs, and what scoring adds), and the row operations the loop uses (rows, select, concat).
What draws them is a sampler (grpo_cli/samplers/)."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch
import torch.nn.functional as F

from grpo_cli.logprobs import padding_bounds


@dataclass
class Rollout:
    prompt_ids: torch.Tensor  # [N, P] left-padded, N = prompts * G, one group's rows consecutive
    prompt_mask: torch.Tensor  # [N, P]
    completion_ids: torch.Tensor  # [N, C] right-padded with pad_id after EOS
    completion_mask: torch.Tensor  # [N, C] 1 up to and including the first EOS
    truncated: torch.Tensor  # [N] bool: no EOS within max_new_tokens
    sampler_logps: torch.Tensor  # [N, C] fp32 log-probs of the sampled tokens, tempered
    # Filled by the trainer once the rollout is scored (None until then):
    rewards: torch.Tensor | None = None  # [N] weighted total reward
    advantages: torch.Tensor | None = None  # [N] per group (loss.group_advantages), detached
    zero_std: torch.Tensor | None = None  # [N] bool: the row's group carries no signal
    group_std: torch.Tensor | None = None  # [N] the row's group reward std
    loss_mask: torch.Tensor | None = None  # [N, C] completion tokens that may enter the loss
    ref_logps: torch.Tensor | None = None  # [N, C] reference-model log-probs (loss.beta > 0)
    # For the completions log (samples.py): the row's prompt as an index into the step's drawn
    # examples, and each configured reward's value (NaN where a reward returned None).
    prompt_index: torch.Tensor | None = None  # [N] long
    reward_values: torch.Tensor | None = None  # [N, R]

    @property
    def lengths(self) -> torch.Tensor:
        return self.completion_mask.sum(-1)  # [N]

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(prompt_ids, prompt_mask, completion_ids, completion_mask): what logprobs.token_logprobs scores."""
        return self.prompt_ids, self.prompt_mask, self.completion_ids, self.completion_mask

    def to(self, device) -> Rollout:
        """The rollout with every tensor on `device` (gathered across processes on the CPU)."""
        return Rollout(
            **{
                f.name: None if getattr(self, f.name) is None else getattr(self, f.name).to(device)
                for f in fields(self)
            }
        )

    def rows(self, index: torch.Tensor) -> Rollout:
        """A micro-batch: the rows `index` [n], without the prompt columns that are padding in all
        of them and the completion columns past their longest completion."""
        sub = select(self, index)
        first, used = padding_bounds(sub.prompt_mask, sub.completion_mask)
        trimmed = {f.name: getattr(sub, f.name) for f in fields(self) if getattr(sub, f.name) is not None}
        for name in ("prompt_ids", "prompt_mask"):
            trimmed[name] = trimmed[name][:, first:]  # [n, P']
        for name in ("completion_ids", "completion_mask", "sampler_logps", "loss_mask", "ref_logps"):
            if name in trimmed:
                trimmed[name] = trimmed[name][:, :used]  # [n, C']
        return replace(sub, **trimmed)


def select(rollout: Rollout, rows: torch.Tensor) -> Rollout:
    """The given rows (index tensor [n]) of a rollout."""
    return Rollout(
        **{
            f.name: None if getattr(rollout, f.name) is None else getattr(rollout, f.name)[rows]
            for f in fields(Rollout)
        }
    )


def concat(rollouts: list[Rollout], pad_id: int) -> Rollout:
    """Stack sampled (and scored) rollouts of different widths: prompts stay left-padded,
    completions right-padded."""
    if len(rollouts) == 1:
        return rollouts[0]
    P = max(r.prompt_ids.shape[1] for r in rollouts)
    C = max(r.completion_ids.shape[1] for r in rollouts)

    def pad(t, width, value, left):
        extra = width - t.shape[1]
        if extra == 0:
            return t
        return F.pad(t, (extra, 0) if left else (0, extra), value=value)

    return Rollout(
        prompt_ids=torch.cat([pad(r.prompt_ids, P, pad_id, True) for r in rollouts]),
        prompt_mask=torch.cat([pad(r.prompt_mask, P, 0, True) for r in rollouts]),
        completion_ids=torch.cat([pad(r.completion_ids, C, pad_id, False) for r in rollouts]),
        completion_mask=torch.cat([pad(r.completion_mask, C, 0, False) for r in rollouts]),
        truncated=torch.cat([r.truncated for r in rollouts]),
        sampler_logps=torch.cat([pad(r.sampler_logps, C, 0.0, False) for r in rollouts]),
        **{
            name: torch.cat([getattr(r, name) for r in rollouts])
            if all(getattr(r, name) is not None for r in rollouts)
            else None
            for name in ("rewards", "prompt_index", "reward_values")
        },
    )
