"""Episodes: a prompt's G multi-turn episodes through any samplers.Sampler, as one Rollout.

Turn 0 is the sampler's ordinary call (G completions of each prompt, from the prompt's seed: the
draws a single-turn run makes). Every later turn continues each live episode from its exact
token sequence so far (the prompt, the tokens sampled, the tokens the environment wrote: nothing
is re-rendered), one completion per episode, from a seed derived from the prompt's seed, the
episode and the turn (turn_seed), so an episode depends on its prompt's seed alone, not on the
batch, the sampler or the process count.

The rollout's completion side is every turn concatenated: sampled tokens (trained_mask 1, their
sampler log-probs) and the environment's (attended, trained_mask 0, log-prob 0). Rollout.roles
says who wrote each token (ROLE_CODES), so the rewards and the logs see the conversation.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field

import torch

from grpo_cli.data import format_prompt
from grpo_cli.environments import Reply, call_with_timeout, fresh_copies
from grpo_cli.errors import UserError
from grpo_cli.rollout import ROLE_CODES, Rollout
from grpo_cli.samplers.builtin import left_pad

#: Per-episode counts on Rollout.episode_stats, in this order.
STAT_COLUMNS = ("turns", "tool_calls", "tool_errors", "replies_cut", "errors", "out_of_turns")


def turn_seed(prompt_seed: int, episode: int, turn: int) -> int:
    """The seed of episode `episode`'s (0..G-1) turn `turn` (>= 1) of a prompt seeded prompt_seed."""
    digest = hashlib.blake2b(f"{prompt_seed}/{episode}/{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2  # < 2**62: a valid seed for torch and vLLM


@dataclass
class _Episode:
    env: object
    ids: list[int] = field(default_factory=list)  # completion side so far
    trained: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    roles: list[int] = field(default_factory=list)
    reply_start: int = 0  # where the environment's last reply starts in ids
    truncated: bool = False
    failed: bool = False
    done: bool = False
    stats: dict = field(default_factory=lambda: dict.fromkeys(STAT_COLUMNS, 0))


class Episodes:
    """A samplers.Sampler that runs an environment's episodes (`episodes`, what samplers.draw
    calls) on the sampler it wraps; the rest of the interface is that sampler's.
    cfg: config.EnvironmentConfig."""

    def __init__(self, sampler, factory, cfg, *, tokenizer, eos_ids, pad_id, max_new_tokens, data=None):
        self.sampler = sampler
        self.tolerance = sampler.tolerance
        self.factory = factory
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.eos_ids = set(eos_ids)
        self.pad_id = pad_id
        self.max_new_tokens = max_new_tokens
        self.data = data  # config.DataConfig: the prompt's system prompt and chat template use
        self.describe = cfg.fn or f"tools [{', '.join(cfg.tools)}]"
        self.budget = cfg.max_episode_tokens or cfg.max_turns * (max_new_tokens + cfg.max_reply_tokens)
        self._message_affixes: dict[str, tuple[str, str]] = {}
        self.seconds = 0.0  # spent in the environment's own code (reset, step, reward)

    # ------------------------------------------------------------------ the Sampler interface

    def sampling(self):
        return self.sampler.sampling()

    def generate(self, prompts, **kwargs):
        return self.sampler.generate(prompts, **kwargs)

    def sync(self, policy) -> None:
        self.sampler.sync(policy)

    def close(self) -> None:
        self.sampler.close()

    # ------------------------------------------------------------------ the environment's calls

    def _call(self, fn, args, what: str, example, episode: int):
        tick = time.perf_counter()
        try:
            return call_with_timeout(fn, args, self.cfg.timeout_s, what)
        except Exception as exc:
            if self.cfg.on_error == "mask":
                return _Failed(exc)
            prompt = str(example.prompt)
            raise UserError(
                f"environment {self.describe}: {what} raised {type(exc).__name__}: {exc} (episode "
                f"{episode} of the prompt {prompt[:100]!r}). Fix the environment, or set "
                "environment.on_error=mask to leave such an episode out of the loss and go on."
            ) from exc
        finally:
            self.seconds += time.perf_counter() - tick

    def _reply(self, value, example, episode: int) -> Reply:
        if isinstance(value, Reply):
            return value
        if value is None:
            return Reply(done=True)
        if isinstance(value, str):
            return Reply(value)
        raise UserError(
            f"environment {self.describe}: step() returned {type(value).__name__} {value!r:.80} (episode "
            f"{episode} of the prompt {str(example.prompt)[:100]!r}); it must return a Reply, a str (the "
            "reply) or None (the episode is done)."
        )

    # ------------------------------------------------------------------ rendering

    def message_affixes(self, role: str) -> tuple[str, str]:
        """The chat template's text around a `role` message that follows an assistant turn's end
        of turn, up to the next assistant turn: (before the content, after it)."""
        if role not in self._message_affixes:
            t = self.tokenizer
            eos_text = t.decode([min(self.eos_ids)]) if self.eos_ids else ""
            marker, answer = "\u2063CONTENT\u2063", "\u2063ANSWER\u2063"
            convo = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": answer}]
            text = t.apply_chat_template(
                convo + [{"role": role, "content": marker}], tokenize=False, add_generation_prompt=True
            )
            # After the model's end of turn (its EOS, sampled): the template's text that follows it.
            # A template that ends a turn without the EOS token: the text after the answer.
            start, skip = text.find(answer + eos_text), len(answer) + len(eos_text)
            if start < 0 or not eos_text:
                start, skip = text.find(answer), len(answer)
            if start < 0 or marker not in text[start:]:
                raise UserError(
                    f"environment {self.describe}: the model's chat template does not render a {role!r} "
                    "message after an assistant turn (or the end-of-turn token is not where it ends "
                    "one); reply with role='user', or give the model a chat template that renders it."
                )
            after = text[start + skip :]
            before, _, rest = after.partition(marker)
            self._message_affixes[role] = (before, rest)
        return self._message_affixes[role]

    def _reply_tokens(self, reply: Reply, ended_turn: bool) -> list[int]:
        text = reply.content
        if ended_turn:  # the model ended its message: the reply is a message of its own
            before, after = self.message_affixes(reply.role)
            text = before + text + after
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _cut_at_stop(self, ids: list[int], stop: list[str]) -> tuple[list[int], bool]:
        """The turn's tokens up to the one that completes a stop string (kept), and whether it did."""
        if not stop or not any(s in self.tokenizer.decode(ids) for s in stop):
            return ids, False
        for j in range(1, len(ids) + 1):
            if any(s in self.tokenizer.decode(ids[:j]) for s in stop):
                return ids[:j], True
        return ids, False

    def _prompt_ids(self, example, messages, tools=None) -> list[int]:
        if messages is None and not tools:
            return list(example.prompt_ids)
        d = self.data
        text = format_prompt(
            messages if messages is not None else example.prompt,
            self.tokenizer,
            system_prompt=d.system_prompt if d else None,
            use_chat_template=True,
            tools=tools,
        )
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    # ------------------------------------------------------------------ the episodes

    def episodes(self, examples, *, seeds, num_generations: int, greedy=False, ignore_eos=False) -> Rollout:
        """The G episodes of each example (data.Example), as one Rollout (rows grouped by example)."""
        G, cfg, sampler = num_generations, self.cfg, self.sampler
        episodes, prompts = [], []
        for ex in examples:
            env = self._call(self.factory, (), "making the environment", ex, 0)
            row = {"prompt": ex.prompt, **ex.columns}
            messages = env if isinstance(env, _Failed) else self._call(env.reset, (row,), "reset(row)", ex, 0)
            failed = isinstance(messages, _Failed)
            tools = None if failed else getattr(env, "template_tools", None)
            prompts.append(self._prompt_ids(ex, None if failed else messages, tools))
            for copy_ in fresh_copies(env, G) if not failed else [None] * G:
                episodes.append(_Episode(env=copy_, failed=failed))
        first = next((e.env for e in episodes if e.env is not None), None)
        stop = list(getattr(first, "stop", None) or [])
        # Turn 0: the sampler's plain call, G per prompt from the prompt's seed.
        live = list(range(len(episodes)))
        # The built-in sampler keeps its KV cache across turns (a session); any other sampler
        # is given each live episode's whole token sequence again.
        session = sampler.session(prompts, G) if hasattr(sampler, "session") else None
        for turn in range(cfg.max_turns):
            room = [self.budget - len(episodes[n].ids) for n in live]
            width = max(1, min(self.max_new_tokens, max(room)))
            row_seeds = None
            if turn and not greedy and seeds is not None:
                row_seeds = [turn_seed(seeds[n // G], n % G, turn) for n in live]
            kw = dict(greedy=greedy, ignore_eos=ignore_eos, max_new_tokens=width, stop=stop)
            if session is not None:
                appended = [episodes[n].ids[episodes[n].reply_start :] for n in live]
                out = session.turn(live, appended, seeds=seeds if turn == 0 else row_seeds, **kw)
                drawn = [(out.tokens[n][out.mask[n].bool()], out.logps[n][out.mask[n].bool()]) for n in live]
            elif turn == 0:
                r = sampler.generate(prompts, seeds=seeds, num_generations=G, **kw)
                drawn = [(r.completion_ids[n][r.attention_mask[n].bool()], r.sampler_logps[n]) for n in live]
            else:
                r = sampler.generate(
                    [prompts[n // G] + episodes[n].ids for n in live],
                    seeds=row_seeds,
                    num_generations=1,
                    **kw,
                )
                drawn = [
                    (r.completion_ids[k][r.attention_mask[k].bool()], r.sampler_logps[k])
                    for k in range(len(live))
                ]
            still = []
            for k, n in enumerate(live):
                e = episodes[n]
                sampled = drawn[k][0].tolist()
                ids = sampled[: room[k]]
                logps = drawn[k][1].tolist()
                ids, stopped = self._cut_at_stop(ids, stop)
                ended = bool(ids) and ids[-1] in self.eos_ids and not ignore_eos
                if session is not None and len(ids) < len(sampled) and (ended or stopped):
                    raise RuntimeError(  # the cache would hold tokens the episode does not
                        f"episodes: the sampler drew {len(sampled)} tokens past a stop string the episode "
                        f"ends at {len(ids)}; a stop string longer than 16 tokens is not supported"
                    )
                e.ids += ids
                e.trained += [1] * len(ids)
                e.logps += logps[: len(ids)]
                e.roles += [ROLE_CODES["assistant"]] * len(ids)
                e.stats["turns"] += 1
                if not (ended or stopped):  # a token budget cut the turn
                    e.truncated = True
                    continue
                if e.failed:
                    continue
                ex = examples[n // G]
                value = self._call(
                    e.env.step,
                    (self.tokenizer.decode(ids, skip_special_tokens=True),),
                    "step(text)",
                    ex,
                    n % G,
                )
                if isinstance(value, _Failed):
                    e.failed = True
                    continue
                reply = self._reply(value, ex, n % G)
                e.stats["tool_calls"] += reply.tool_call
                e.stats["tool_errors"] += reply.error
                if reply.done or reply.content is None:
                    e.done = True
                    continue
                if turn == cfg.max_turns - 1:
                    e.stats["out_of_turns"] += 1
                    continue
                tokens = self._reply_tokens(reply, ended_turn=ended)
                if len(tokens) > cfg.max_reply_tokens:
                    tokens = tokens[: cfg.max_reply_tokens]
                    e.stats["replies_cut"] += 1
                if len(e.ids) + len(tokens) >= self.budget:  # no room left for the model to answer
                    e.truncated = True
                    continue
                role = ROLE_CODES["tool" if not ended or reply.role == "tool" else "user"]
                e.reply_start = len(e.ids)
                e.ids += tokens
                e.trained += [0] * len(tokens)
                e.logps += [0.0] * len(tokens)
                e.roles += [role] * len(tokens)
                still.append(n)
            live = still
            if not live:
                break
        env_reward = [self._episode_reward(e, examples[n // G], n % G) for n, e in enumerate(episodes)]
        return self._rollout(prompts, episodes, G, env_reward)

    def _episode_reward(self, e: _Episode, example, episode: int) -> float:
        fn = getattr(e.env, "reward", None)
        if e.failed or fn is None:
            return float("nan")
        value = self._call(fn, (), "reward()", example, episode)
        if isinstance(value, _Failed):
            e.failed = True
            return float("nan")
        return float("nan") if value is None else float(value)

    def _rollout(self, prompts, episodes, G: int, env_reward) -> Rollout:
        N = len(episodes)
        C = max(1, max(len(e.ids) for e in episodes))
        ids = torch.full((N, C), self.pad_id, dtype=torch.long)
        attention, trained = torch.zeros((N, C), dtype=torch.long), torch.zeros((N, C), dtype=torch.long)
        logps, roles = torch.zeros((N, C)), torch.zeros((N, C), dtype=torch.long)
        for n, e in enumerate(episodes):
            L = len(e.ids)
            ids[n, :L] = torch.tensor(e.ids, dtype=torch.long)
            attention[n, :L] = 1
            trained[n, :L] = 0 if e.failed else torch.tensor(e.trained, dtype=torch.long)
            logps[n, :L] = torch.tensor(e.logps) * (0 if e.failed else 1)
            roles[n, :L] = torch.tensor(e.roles, dtype=torch.long)
            e.stats["errors"] = int(e.failed)
        prompt_ids, prompt_mask = left_pad(prompts, self.pad_id, "cpu")
        return Rollout(
            num_generations=G,
            prompt_ids=prompt_ids.repeat_interleave(G, dim=0),
            prompt_mask=prompt_mask.repeat_interleave(G, dim=0),
            completion_ids=ids,
            attention_mask=attention,
            trained_mask=trained,
            truncated=torch.tensor([e.truncated for e in episodes]),
            sampler_logps=logps,
            roles=roles,
            episode_stats=torch.tensor(
                [[e.stats[k] for k in STAT_COLUMNS] for e in episodes], dtype=torch.float32
            ),
            env_reward=torch.tensor(env_reward, dtype=torch.float32),
        )


class _Failed:
    """An environment call that raised under environment.on_error=mask."""

    def __init__(self, exc: BaseException):
        self.exc = exc


def with_environment(sampler, cfg, *, tokenizer, eos_ids: list[int], pad_id: int):
    """The sampler itself when cfg (the whole config) has no environment, else Episodes around it."""
    from grpo_cli.environments import environment_factory

    factory = environment_factory(cfg.environment)
    if factory is None:
        return sampler
    if cfg.environment.protocol == "native" and cfg.environment.tools:
        from grpo_cli.environments import renders_tools, tool_schema

        schemas = [tool_schema(t) for t in factory().tools.values()]
        if not renders_tools(tokenizer, schemas):
            raise UserError(
                "environment.protocol=native: the model's chat template does not render tools (SmolLM2's "
                "renders role and content only); use environment.protocol=tag (a tag the model writes, "
                "which any template carries), or a model whose template renders tools."
            )
    return Episodes(
        sampler,
        factory,
        cfg.environment,
        tokenizer=tokenizer,
        eos_ids=eos_ids,
        pad_id=pad_id,
        max_new_tokens=cfg.sampler.max_new_tokens,
        data=cfg.data,
    )


def episode_metrics(rollout: Rollout) -> dict[str, float]:
    """env/* of a rollout of episodes (nothing for a single-turn one): per episode,
    the mean turns, tool calls and tool errors; the share of episodes that called a tool at least
    once (tool_call_rate), that a token budget ended (truncated), that ran out of turns, that
    failed (environment.on_error=mask) or had a reply cut; the share of completion-side tokens
    the environment wrote."""
    if rollout.episode_stats is None:
        return {}
    stats = rollout.episode_stats.float()  # [N, S]
    col = {name: stats[:, i] for i, name in enumerate(STAT_COLUMNS)}
    attended = float(rollout.attention_mask.sum())
    written = float((rollout.attention_mask.bool() & ~rollout.trained_mask.bool()).sum())
    failed = col["errors"] > 0
    return {
        "env/turns": float(col["turns"].mean()),
        "env/tool_calls": float(col["tool_calls"].mean()),
        "env/tool_call_rate": float((col["tool_calls"] > 0).float().mean()),
        "env/tool_errors": float(col["tool_errors"].mean()),
        "env/truncated": float(rollout.truncated.float().mean()),
        "env/out_of_turns": float((col["out_of_turns"] > 0).float().mean()),
        "env/errors": float(failed.float().mean()),
        "env/replies_cut": float((col["replies_cut"] > 0).float().mean()),
        "env/env_token_share": written / max(attended, 1.0),
    }
