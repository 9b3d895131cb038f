"""The built-in sampler: a lean decode loop over the model's own KV cache (transformers'
DynamicCache) instead of `generate`. The sampling distribution is exactly softmax(logits /
temperature) with top-k then top-p truncation and nothing else (no warpers hidden in a model's
generation_config); each sampled token's log-prob under the tempered distribution is recorded as
it is drawn (no [N, C, V] buffer of logits); finished rows stop costing anything but a padded
token. Tests check that greedy decoding matches `generate` token for token and that sampling
draws the same tokens as `generate` under the same seed.

Its low-level parts (left padding, the CPU decode linears, the float64 CDF draws, the KV-cache
state) are in samplers/_primitives.py. BuiltinSampler wraps it as a samplers.Sampler and owns what
only it needs: the weights gathered whole under FSDP2, eval mode while sampling, autocast, and the
CPU decode linears (few_rows_linears). It samples from the policy itself, so its sync() has nothing to do.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from grpo_cli.distributed import full_weights
from grpo_cli.logprobs import filter_logits, model_logits
from grpo_cli.models import recurrent
from grpo_cli.plugins import Plugin
from grpo_cli.precision import Precision, autocast
from grpo_cli.rollout import Rollout, single_turn
from grpo_cli.samplers import Facts

# The low-level parts live in samplers/_primitives.py. Re-imported here: other modules and tests
# import them from this module, and tests patch builtin.draw and builtin.few_rows_linears, which
# _decode below looks up in this module's namespace.
from grpo_cli.samplers._primitives import (  # noqa: F401
    _Decoded,
    _DecodeState,
    _few_rows_linear,
    _patch_counts,
    _prefilled,
    _uniforms,
    draw,
    few_rows_linears,
    left_pad,
    sampling_cdf,
)
from grpo_cli.samplers._session import Drawn, Reprefill, Turn

# Its declared tolerance of |trainer - sampler| log-prob over valid tokens, (mean, max), per
# precision: the step-0 self-check's bounds (ref 000.8). The sampler decodes with a KV cache and
# the trainer runs one forward, so only kernel order and rounding differ; the bugs the check
# exists for (temperature, shift, padding) move the mean by tenths of a nat or more. Measured on
# SmolLM2-135M (default recipe, 484 tokens): fp32 mean 8e-6, max 3e-5; bf16 autocast on the CPU
# mean 0.027, max 0.21 (its logits are rounded to bf16). The tolerances leave 5-10x room over
# those; fp16 (GPU only, not measured here) gets bf16's, although its mantissa has three more bits.
TOLERANCE = {"fp32": (1e-4, 5e-4), "bf16": (0.1, 1.0), "bf16-autocast": (0.1, 1.0), "fp16": (0.1, 1.0)}


def build(cfg, context) -> BuiltinSampler:
    """The sampler (its draws are seeded per request through generate's seeds, so context.seed
    is unused)."""
    c = context
    return BuiltinSampler(
        cfg,
        c.policy,
        eos_ids=c.eos_ids,
        pad_id=c.pad_id,
        precision=c.precision,
        fast_decode=c.fast_decode,
        tokenizer=c.tokenizer,
    )


# It samples from the policy itself with the trainer's kernels: its draw is exact, so
# loss.sampler_correction=auto needs no correction. It reads only the shared sampler keys.
PLUGIN = Plugin(name="builtin", build=build, facts=Facts(exact_draw=True))


class BuiltinSampler:
    """samplers.Sampler over the policy itself (sampler.backend=builtin)."""

    def __init__(
        self,
        cfg,
        policy,
        *,
        eos_ids: list[int],
        pad_id: int,
        precision: Precision,
        fast_decode: bool,
        tokenizer=None,
    ):
        self.cfg = cfg  # config.SamplerConfig
        self.policy = policy
        self.eos_ids = eos_ids
        self.pad_id = pad_id
        self.precision = precision
        self.fast_decode = fast_decode  # the tested architectures' W @ x^T decode linears (CPU)
        self.tolerance = TOLERANCE[precision.name]
        self._depth = 0  # open sampling() blocks (re-entrant)
        self.tokenizer = tokenizer  # stop strings: a row stops once its text holds one

    @contextlib.contextmanager
    def sampling(self):
        """Within the block the policy samples: eval mode, autocast, and under FSDP2 its weights
        gathered whole (a collective: every rank enters, even one with nothing to sample)."""
        if self._depth:
            yield self
            return
        was_training = self.policy.training
        device = next(self.policy.parameters()).device
        self._depth += 1
        try:
            with full_weights(self.policy), autocast(device, self.precision):
                self.policy.eval()
                yield self
        finally:
            self._depth -= 1
            self.policy.train(was_training)

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
        s = self.cfg
        stopped = self._stopped(stop)
        with self.sampling():
            return sample(
                self.policy,
                prompts,
                num_generations=num_generations,
                max_new_tokens=max_new_tokens or s.max_new_tokens,
                temperature=s.temperature if temperature is None else temperature,
                top_p=s.top_p,
                top_k=s.top_k,
                eos_ids=[] if ignore_eos else self.eos_ids,
                pad_id=self.pad_id,
                greedy=greedy,
                seeds=seeds,
                fast_decode=self.fast_decode,
                stopped=stopped,
            )

    def session(self, prompts: list[list[int]], num_generations: int) -> Session | Reprefill:
        """Sequences continued turn after turn with the KV cache kept across turns (an
        environment's episodes): only the new tokens are fed, never the history again. A model with
        recurrent or convolution layers (models.recurrent) reads each row's history again every turn
        (Reprefill): its cache was fed pads after a row ended, and new tokens left-padded
        mid-sequence, which its states would not forget as attention's mask does."""
        if recurrent(self.policy):
            return Reprefill(self, prompts, num_generations)
        return Session(self, prompts, num_generations)

    def _decoding(
        self, greedy: bool, ignore_eos: bool, stop: list[str] | None, device, temperature: float | None = None
    ) -> Decoding:
        s = self.cfg
        return Decoding(
            temperature=s.temperature if temperature is None else temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            eos=torch.tensor(
                [] if ignore_eos else sorted(set(self.eos_ids)), dtype=torch.long, device=device
            ),
            pad_id=self.pad_id,
            greedy=greedy,
            fast_decode=self.fast_decode,
            stopped=self._stopped(stop),
        )

    def _stopped(self, stop: list[str] | None):
        """[N, t] tokens so far -> [N] bool: rows whose text now holds a stop string (None: none)."""
        if not stop or self.tokenizer is None:
            return None
        tokenizer = self.tokenizer

        def stopped(tokens: torch.Tensor) -> torch.Tensor:
            tails = tokenizer.batch_decode(tokens[:, -16:].tolist())
            return torch.tensor([any(x in tail for x in stop) for tail in tails], device=tokens.device)

        return stopped

    def sync(self, policy) -> None:
        """Nothing to do: it samples from the policy's own weights."""

    def close(self) -> None:
        """Nothing to free: the policy is the trainer's."""


@dataclass(frozen=True)
class Decoding:
    """How a decode call draws: the tempered, top-k then top-p truncated distribution (or argmax
    when greedy), the end-of-sequence ids (a tensor, may be empty), the padding id, the CPU
    decode linears (fast_decode), and `stopped` (tokens so far [N, t] -> [N] bool: rows a stop
    string ends; None: none)."""

    temperature: float
    top_p: float
    top_k: int
    eos: torch.Tensor
    pad_id: int
    greedy: bool
    fast_decode: bool
    stopped: object = None


def _decode(
    model, state: _DecodeState, how: Decoding, *, live: torch.Tensor, max_new_tokens: int, generator, uniforms
) -> _Decoded:
    """Draw up to max_new_tokens for the `live` rows [N] bool from state.logits, feeding each
    drawn token but the last into state's KV cache (a row's tokens after its end are masked out
    of the cache). Rows not live draw nothing."""
    temperature, top_p, top_k, eos, pad_id = how.temperature, how.top_p, how.top_k, how.eos, how.pad_id
    greedy, fast_decode, stopped = how.greedy, how.fast_decode, how.stopped
    device, N = state.logits.device, state.logits.shape[0]
    tokens, logps = [], []
    finished = ~live  # [N]
    cut_at = torch.full((N,), -1, dtype=torch.long, device=device)  # [N] the step a stop string ended a row
    logits = state.logits
    with few_rows_linears(model) if fast_decode else contextlib.nullcontext():  # decode: one token per row
        for step in range(max_new_tokens):
            logits = logits.float() / temperature  # [N, V]
            if greedy:
                token = logits.argmax(-1)  # [N]
                kept = logits
            else:
                u = None if uniforms is None else uniforms[step, :, None]  # [N, 1]
                kept = filter_logits(logits, top_k, top_p)  # [N, V] (logits itself when nothing truncates)
                token = draw(kept.softmax(-1), generator, u)  # [N]
            # Log-prob under the distribution the token was drawn from (the samplers' contract):
            # tempered, then truncated by top-k/top-p when they are set; without truncation the very
            # distribution the trainer scores (logprobs.token_logprobs, ref 000.1, 000.4).
            logp = F.log_softmax(kept, -1).gather(-1, token[:, None]).squeeze(-1)  # [N]
            token = token.masked_fill(finished, pad_id)
            fed = (~finished).long()  # [N] this token is part of its row's sequence
            tokens.append(token)
            logps.append(logp.masked_fill(finished, 0.0))
            finished = finished | torch.isin(token, eos)
            if stopped is not None:
                done = stopped(torch.stack(tokens, dim=1)) & ~finished  # [N]
                cut_at = torch.where(done, step, cut_at)
                finished = finished | done
            state.pending = torch.where(fed.bool(), token, state.pending)  # drawn, not yet in the cache
            state.has_pending = state.has_pending | fed.bool()
            if bool(finished.all()) or step == max_new_tokens - 1:
                break
            state.attention_mask = torch.cat([state.attention_mask, fed[:, None]], dim=1)
            position_ids = state.attention_mask.sum(-1, keepdim=True) - 1  # [N, 1]
            logits = model_logits(
                model,
                input_ids=token[:, None],
                attention_mask=state.attention_mask,
                position_ids=position_ids,
                past_key_values=state.cache,
                use_cache=True,
            )[:, -1, :]
            state.has_pending = state.has_pending & ~fed.bool()  # the token just fed is in the cache
    state.logits = logits

    completion_ids = torch.stack(tokens, dim=1)  # [N, C]
    is_eos = torch.isin(completion_ids, eos)  # [N, C]
    C = completion_ids.shape[1]
    # Index of the first EOS (C when none): tokens up to and including it are the completion.
    first_eos = torch.where(
        is_eos.any(-1), is_eos.long().argmax(-1), torch.full_like(is_eos[:, 0], C, dtype=torch.long)
    )
    first_eos = torch.where(cut_at >= 0, cut_at, first_eos)  # a stopped row ends at its last token
    mask = (torch.arange(C, device=device)[None, :] <= first_eos[:, None]).long() * live[:, None]  # [N, C]
    return _Decoded(
        tokens=completion_ids.masked_fill(mask == 0, pad_id),
        logps=torch.stack(logps, dim=1) * mask,
        mask=mask,
        truncated=~is_eos.any(-1) & (cut_at < 0),
    )


@torch.no_grad()
def sample(
    model,
    prompts: list[list[int]],
    *,
    num_generations: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float = 1.0,
    top_k: int = 0,
    eos_ids: list[int],
    pad_id: int,
    greedy: bool = False,
    generator: torch.Generator | None = None,
    seeds: list[int] | None = None,
    fast_decode: bool = True,
    stopped=None,
) -> Rollout:
    """`num_generations` completions of each prompt (token ids), rows grouped by prompt.
    seeds: one per prompt; prompt b's completions draw from a CPU generator seeded seeds[b] (its
    G uniforms per decode step), so they do not depend on which other prompts share the batch
    (nor on the device, nor on how many processes share the step). Without seeds, `generator`
    (default: torch's global one) draws for the whole batch.
    fast_decode: the CPU decode steps' W @ x^T linear layers (off for an architecture not
    tested here: the model's own layers run).
    stopped: tokens so far [N, t] -> [N] bool, rows that may stop drawing (a stop string); they
    end without an EOS (their last token kept), and the tokens they would have drawn are not.
    A row's draws do not depend on when the others stop."""
    if seeds is not None and len(seeds) != len(prompts):
        raise ValueError(f"sample: {len(seeds)} seeds for {len(prompts)} prompts")
    state, prompt_ids, prompt_mask = _prefilled(model, prompts, num_generations, pad_id)
    device = prompt_ids.device
    uniforms = None  # [max_new_tokens, N]: row n's uniform at each decode step
    if seeds is not None and not greedy:
        uniforms = _uniforms(seeds, num_generations, max_new_tokens, device)
    how = Decoding(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        eos=torch.tensor(sorted(set(eos_ids)), dtype=torch.long, device=device),  # may be empty
        pad_id=pad_id,
        greedy=greedy,
        fast_decode=fast_decode,
        stopped=stopped,
    )
    live = torch.ones(prompt_ids.shape[0], dtype=torch.bool, device=device)
    out = _decode(
        model, state, how, live=live, max_new_tokens=max_new_tokens, generator=generator, uniforms=uniforms
    )
    return single_turn(
        num_generations, prompt_ids, prompt_mask, out.tokens, out.mask, out.truncated, out.logps
    )


class Session:
    """samplers.Session on the built-in sampler, its KV cache kept across turns: a later turn
    feeds only what is new (the last token drawn, then what joined each row's history since),
    never the history again. Rows: the prompts' G sequences, grouped by prompt."""

    def __init__(self, sampler: BuiltinSampler, prompts: list[list[int]], num_generations: int):
        self.sampler, self.G, self.B = sampler, num_generations, len(prompts)
        with sampler.sampling(), torch.no_grad():
            self.state, _, _ = _prefilled(sampler.policy, prompts, num_generations, sampler.pad_id)
        self.turns = 0
        N = self.B * num_generations
        self.drawn: list[list[int]] = [[] for _ in range(N)]  # each row's tokens drawn last turn
        self.seen = [0] * N  # each row's completion-side tokens in the cache (or pending)

    def _appended(self, rows: list[int], histories: list[list[int]]) -> list[list[int]]:
        """Each row's history past what the cache holds; it must start with the tokens drawn."""
        out = []
        for n, history in zip(rows, histories):
            start = self.seen[n] - len(self.drawn[n])
            if list(history[start : self.seen[n]]) != self.drawn[n]:
                raise RuntimeError(  # the cache would hold tokens the sequence does not
                    f"Session: row {n}'s history does not keep the {len(self.drawn[n])} tokens drawn "
                    "last turn (cut at a stop string?); a stop string longer than 16 tokens is not supported"
                )
            out.append(list(history[self.seen[n] :]))
        return out

    @torch.no_grad()
    def turn(self, rows: list[int], histories: list[list[int]], how: Turn) -> list[Drawn]:
        sp, st = self.sampler, self.state
        device, N = st.logits.device, st.logits.shape[0]
        live = torch.zeros(N, dtype=torch.bool, device=device)
        live[rows] = True
        with sp.sampling():
            self._feed(rows, self._appended(rows, histories), live)
            uniforms = None
            if how.seeds is not None and not how.greedy:
                if self.turns == 0:
                    uniforms = _uniforms(how.seeds, self.G, how.max_new_tokens, device)
                else:
                    uniforms = torch.zeros((how.max_new_tokens, N), dtype=torch.float64, device=device)
                    uniforms[:, rows] = _uniforms(how.seeds, 1, how.max_new_tokens, device)
            decoding = sp._decoding(how.greedy, how.ignore_eos, how.stop, device, how.temperature)
            out = _decode(
                sp.policy,
                st,
                decoding,
                live=live,
                max_new_tokens=how.max_new_tokens,
                generator=None,
                uniforms=uniforms,
            )
        self.turns += 1
        drawn = []
        for n, history in zip(rows, histories):
            kept = out.mask[n].bool()
            tokens, logps = out.tokens[n][kept].tolist(), out.logps[n][kept].tolist()
            self.drawn[n], self.seen[n] = tokens, len(history) + len(tokens)
            drawn.append((tokens, logps))
        return drawn

    def _feed(self, rows: list[int], appended: list[list[int]], live: torch.Tensor) -> None:
        """Into the cache: each row's pending token (drawn last, not yet fed) and its new tokens."""
        sp, st = self.sampler, self.state
        device, N = st.logits.device, st.logits.shape[0]
        chunks = [[] for _ in range(N)]
        for n, extra in zip(rows, appended):
            chunks[n] = ([int(st.pending[n])] if bool(st.has_pending[n]) else []) + list(extra)
        st.has_pending = st.has_pending & ~live
        W = max(len(c) for c in chunks)
        if not W:
            return
        ids = torch.full(
            (N, W), sp.pad_id, dtype=torch.long
        )  # left-padded: a row's last column is its last token
        mask = torch.zeros((N, W), dtype=torch.long)
        for n, c in enumerate(chunks):
            if c:
                ids[n, W - len(c) :], mask[n, W - len(c) :] = torch.tensor(c), 1
        st.attention_mask = torch.cat([st.attention_mask, mask.to(device)], dim=1)
        positions = (st.attention_mask.cumsum(-1) - 1).clamp(min=0)[:, -W:]
        logits = model_logits(
            sp.policy,
            input_ids=ids.to(device),
            attention_mask=st.attention_mask,
            position_ids=positions,
            past_key_values=st.cache,
            use_cache=True,
        )[:, -1, :]
        fed = mask[:, -1].bool().to(device)
        st.logits = torch.where(fed[:, None], logits.to(st.logits.dtype), st.logits)
