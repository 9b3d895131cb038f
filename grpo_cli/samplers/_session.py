"""How a sampler continues sequences turn after turn (an environment's episodes): the Session
interface that samplers.Sampler.session returns, a turn's settings (Turn), and the default
session, Reprefill, for a sampler with no cache of its own to keep (each turn reads every
sequence again). The built-in sampler's Session (samplers/builtin.py) keeps its KV cache instead.
Private (its name starts with "_"): not a sampler backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from grpo_cli.samplers import Sampler


@dataclass(frozen=True)
class Turn:
    """One turn's draw. seeds: on a session's first turn one per prompt (the seeds of the
    sampler's plain generate call), then one per row continued; None: unseeded. The others as
    Sampler.generate's."""

    seeds: list[int] | None
    greedy: bool
    ignore_eos: bool
    max_new_tokens: int
    stop: list[str]
    temperature: float | None = None  # None: the sampler's


#: A row's turn: the tokens drawn and each one's log-prob (the samplers' contract).
Drawn = tuple[list[int], list[float]]


class Session(Protocol):
    """A batch of sequences continued turn after turn: B prompts, G rows each (grouped by prompt)."""

    def turn(self, rows: list[int], histories: list[list[int]], how: Turn) -> list[Drawn]:
        """The next turn of `rows` (indices into the B * G rows; every row on the first turn).
        histories: each given row's completion side so far (every token drawn for it that was
        kept, then whatever else joined it, e.g. an environment's reply); [] on the first turn.
        The first turn draws what sampler.generate(prompts, seeds=how.seeds, num_generations=G)
        draws. Returns, per given row, the tokens drawn and their log-probs."""


class Reprefill:
    """The default Session: the first turn is the sampler's plain generate call (G per prompt);
    a later turn gives the sampler each row's whole sequence again (its prompt and its history),
    one completion per row. Any sampler can return it from its `session`."""

    def __init__(self, sampler: Sampler, prompts: list[list[int]], num_generations: int):
        self.sampler, self.prompts, self.G = sampler, prompts, num_generations
        self.turns = 0

    def turn(self, rows: list[int], histories: list[list[int]], how: Turn) -> list[Drawn]:
        kw = dict(
            greedy=how.greedy,
            ignore_eos=how.ignore_eos,
            max_new_tokens=how.max_new_tokens,
            stop=how.stop,
            # (only when set: a sampler written before the keyword still draws at its own)
            **({} if how.temperature is None else {"temperature": how.temperature}),
        )
        if self.turns == 0:
            if list(rows) != list(range(len(self.prompts) * self.G)):
                raise ValueError("Reprefill: the first turn continues every row")
            r = self.sampler.generate(self.prompts, seeds=how.seeds, num_generations=self.G, **kw)
        else:
            sequences = [self.prompts[n // self.G] + list(h) for n, h in zip(rows, histories)]
            r = self.sampler.generate(sequences, seeds=how.seeds, num_generations=1, **kw)
        self.turns += 1
        out = []
        for k in range(len(rows)):
            kept = r.attention_mask[k].bool()
            out.append((r.completion_ids[k][kept].tolist(), r.sampler_logps[k][kept].tolist()))
        return out
