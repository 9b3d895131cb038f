"""Episodes: an environment's side of the one rollout path (environments.path.run_episodes draws
through them), a prompt's G episodes each, through any samplers.Sampler. Without an environment
an episode is one turn, the sampler's plain generate call (G completions of each prompt, from the
prompt's seed). With one, turn 0 is that same draw (the first turn of the sampler's session:
samplers.Session), and every later turn continues each live episode from its exact token sequence
so far (the prompt, the tokens sampled, the tokens the environment wrote: nothing is
re-rendered), one completion per episode, from a seed derived from the prompt's seed, the
episode and the turn (turn_seed), so an episode depends
on its prompt's seed alone, not on the batch, the sampler or the process count.

How episodes end is declared, not inlined: EpisodeRules (environment.max_turns, max_episode_tokens,
max_reply_tokens, a turn's budget, and the environment's own stop strings); each turn's Reply says
whether the episode is done and what to count (tool_call, error).

The rollout's completion side is every turn concatenated: sampled tokens (trained_mask 1, their
sampler log-probs) and the environment's (attended, trained_mask 0, log-prob 0). Rollout.roles
says who wrote each token (ROLE_CODES), so the rewards and the logs see the conversation.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import torch

from grpo_cli.environments import ACTION_NOT_CUT, ROUTE_COLUMN, Reply, call_with_timeout
from grpo_cli.environments.rendering import Rendering
from grpo_cli.errors import UserError
from grpo_cli.rollout import ROLE_CODES, Drawn, Rollout, left_pad
from grpo_cli.samplers import Sampler, Turn

#: Per-episode counts on Rollout.episode_stats, in this order.
STAT_COLUMNS = ("turns", "tool_calls", "tool_errors", "replies_cut", "errors", "out_of_turns")


def turn_seed(prompt_seed: int, episode: int, turn: int) -> int:
    """The seed of episode `episode`'s (0..G-1) turn `turn` (>= 1) of a prompt seeded prompt_seed."""
    digest = hashlib.blake2b(f"{prompt_seed}/{episode}/{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2  # < 2**62: a valid seed for torch and vLLM


@dataclass(frozen=True)
class EpisodeRules:
    """How an environment's episodes run and end, read by the loop: at most max_turns turns of
    at most max_new_tokens each; a reply cut at max_reply_tokens (counted); `budget` completion-
    side tokens in all (a turn or a reply that reaches it truncates the episode); the strings
    that end the model's turn besides its end of turn (the environment's `stop`); and the names
    of the environment's own per-episode metrics (its `metrics`), which its replies carry."""

    max_turns: int
    max_new_tokens: int
    max_reply_tokens: int
    budget: int
    stop: tuple[str, ...] = ()
    metrics: tuple[str, ...] = ()

    @classmethod
    def declared(cls, cfg, max_new_tokens: int, envs=()) -> EpisodeRules:
        """cfg: config.EnvironmentConfig; envs: environments whose optional `stop` and `metrics`
        are read (the environment interface declares both, with a default), joined in order
        (several where environment.fn routes rows to environments)."""
        budget = cfg.max_episode_tokens or cfg.max_turns * (max_new_tokens + cfg.max_reply_tokens)
        stop = tuple(dict.fromkeys(s for env in envs for s in getattr(env, "stop", None) or ()))
        metrics = tuple(dict.fromkeys(str(m) for env in envs for m in getattr(env, "metrics", None) or ()))
        return cls(cfg.max_turns, max_new_tokens, cfg.max_reply_tokens, budget, stop, metrics)

    @property
    def columns(self) -> tuple[str, ...]:
        """The rollout's episode_stats columns: the loop's counters, then the environment's metrics."""
        return (*STAT_COLUMNS, *self.metrics)


@dataclass
class _Episode:
    env: object
    example: object  # data.Example
    index: int  # 0..G-1 among the prompt's episodes
    failed: bool = False
    closed_badly: bool = False  # close() raised (environment.on_error=mask)
    ids: list[int] = field(default_factory=list)  # completion side so far
    trained: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    roles: list[int] = field(default_factory=list)
    truncated: bool = False
    done: bool = False
    stats: dict = field(default_factory=lambda: dict.fromkeys(STAT_COLUMNS, 0))
    metrics: dict = field(default_factory=dict)  # the environment's own (Reply.metrics), summed
    reset_prompt: list | None = None  # the messages its reset made the prompt (None: the example's)

    def join(self, ids: list[int], logps: list[float], role: str) -> None:
        """Tokens onto the completion side: sampled (the assistant's, trained) or written."""
        sampled = role == "assistant"
        self.ids += ids
        self.trained += [int(sampled)] * len(ids)
        self.logps += logps[: len(ids)] if sampled else [0.0] * len(ids)
        self.roles += [ROLE_CODES[role]] * len(ids)


class _Failed:
    """An environment call that raised under environment.on_error=mask."""

    def __init__(self, exc: BaseException):
        self.exc = exc


class Episodes:
    """An environment's episodes (run), on whatever sampler it is given. factory: makes a fresh
    environment (environments.environment_factory); cfg: config.EnvironmentConfig; rendering:
    the episode's text side; max_new_tokens: a turn's budget (sampler.max_new_tokens)."""

    def __init__(
        self, factory, cfg, rendering: Rendering, *, pad_id: int, max_new_tokens: int, keep_open: bool = False
    ):
        self.factory = factory
        # Whether the episodes' environments stay open after the draw (a reward takes them, TRL's
        # `environments`): each rollout then carries them, and close_open closes them once scored.
        self.keep_open = keep_open
        self._open: list[_Episode] = []
        self.cfg = cfg
        self.routed = isinstance(cfg.fn, Mapping)  # environment.fn maps names to environments
        self._declared: EpisodeRules | None = None  # (routed: the rules, read once)
        self.rendering = rendering
        self.pad_id = pad_id
        self.max_new_tokens = max_new_tokens

    # ------------------------------------------------------------------ the environment's calls

    def _call(self, fn, args, what: str, e: _Episode):
        try:
            return call_with_timeout(fn, args, self.cfg.timeout_s, what)
        except UserError:  # a setting or a row at fault (a routing column), not the environment
            raise
        except Exception as exc:
            if self.cfg.on_error == "mask":
                return _Failed(exc)
            prompt = str(e.example.prompt)
            raise UserError(
                f"environment {self.rendering.describe}: {what} raised {type(exc).__name__}: {exc} (episode "
                f"{e.index} of the prompt {prompt[:100]!r}). Fix the environment, or set "
                "environment.on_error=mask to leave such an episode out of the loss and go on."
            ) from exc

    def _reply(self, value, e: _Episode) -> Reply:
        if isinstance(value, Reply):
            return value
        if value is None:
            return Reply(done=True)
        if isinstance(value, str):
            return Reply(value)
        raise UserError(
            f"environment {self.rendering.describe}: step() returned {type(value).__name__} {value!r:.80} "
            f"(episode {e.index} of the prompt {str(e.example.prompt)[:100]!r}); it must return a Reply, a "
            "str (the reply) or None (the episode is done)."
        )

    # ------------------------------------------------------------------ the episodes

    def run(
        self,
        sampler: Sampler,
        examples,
        *,
        seeds,
        num_generations: int,
        greedy=False,
        ignore_eos=False,
        temperature: float | None = None,
    ):
        """The G episodes of each example (data.Example), as one rollout (rows grouped by example)
        with, beside it, the prompts their resets made and (keep_open) their open environments
        (rollout.Drawn).
        Every episode's environment is closed at the end (close(), where it has one), however the
        episodes ended."""
        G = num_generations
        episodes: list[_Episode] = []
        try:
            prompts = self._start(examples, G, episodes)
            rules = self._rules(episodes)
            shared = all(prompts[i] == prompts[i - i % G] for i in range(len(prompts)))
            if shared:  # turn 0: the sampler's plain call, G per prompt
                session = sampler.session(prompts[::G], G)
            else:  # a group whose resets differ: each episode its own prompt and turn-0 seed
                session = sampler.session(prompts, 1)
                if seeds is not None:
                    seeds = [turn_seed(seeds[n // G], n % G, 0) for n in range(len(prompts))]
            how = Turn(
                None, greedy, ignore_eos, 0, [], temperature
            )  # (each turn's seeds, width, stops: _turns)
            self._turns(session, episodes, rules, seeds if shared else None, seeds, G, how)
            env_reward = [self._episode_reward(e) for e in episodes]
        except BaseException:
            self._close(episodes)
            raise
        if self.keep_open:  # the rewards take them (`environments`): closed once scored (close_open)
            self._open += episodes
        else:
            self._close(episodes)
        return Drawn(
            self._rollout(prompts, episodes, G, env_reward, rules.metrics),
            reset_prompts=tuple(e.reset_prompt for e in episodes),
            environments=tuple(_instance(e.env) for e in episodes) if self.keep_open else (),
        )

    def close_open(self) -> None:
        """Close the environments kept open for the rewards (keep_open) since the last call: after
        the rollouts that hold them are scored. A close that raises stops the run in one paragraph
        under environment.on_error=raise; under mask the episode was scored already, so it is
        reported on stderr and the run goes on."""
        kept, self._open = self._open, []
        self._close(kept)
        failed = [e for e in kept if e.failed and e.closed_badly]
        if failed:
            print(
                f"environment {self.rendering.describe}: close() raised for {len(failed)} episode(s) after "
                "they were scored (environment.on_error=mask: the run goes on).",
                file=sys.stderr,
            )

    def _rules(self, episodes: list[_Episode]) -> EpisodeRules:
        """The rules the episodes run by: declared by the batch's first environment, or where rows
        are routed to several, by one of each (the same for every batch: its metrics' columns)."""
        if self.routed:
            if self._declared is None:
                samples = self.factory.samples()
                self._declared = EpisodeRules.declared(self.cfg, self.max_new_tokens, samples)
                for env in samples:  # (made to be read: closed at once, as an episode's would be)
                    if getattr(type(env), "close", None) is not None:
                        call_with_timeout(env.close, (), self.cfg.timeout_s, "close()")
            return self._declared
        first = next((e.env for e in episodes if e.env is not None), None)
        return EpisodeRules.declared(self.cfg, self.max_new_tokens, () if first is None else (first,))

    def _turns(self, session, episodes, rules, prompt_seeds, row_seeds, G, drawing: Turn) -> None:
        """The episodes' turns, until every one has ended or max_turns. prompt_seeds: one per
        prompt (turn 0 of a shared prompt); row_seeds: one per episode otherwise. drawing: how
        every turn draws (greedy, ignore_eos, temperature)."""
        greedy = drawing.greedy
        live = list(range(len(episodes)))
        seeds = prompt_seeds if prompt_seeds is not None else row_seeds
        for turn in range(rules.max_turns):
            room = [rules.budget - len(episodes[n].ids) for n in live]
            turn_seeds = seeds
            if turn:
                turn_seeds = None
                if not greedy and prompt_seeds is not None:
                    turn_seeds = [turn_seed(prompt_seeds[n // G], n % G, turn) for n in live]
                elif not greedy and row_seeds is not None:
                    turn_seeds = [turn_seed(row_seeds[n], 0, turn) for n in live]
            width = max(1, min(rules.max_new_tokens, max(room)))
            how = replace(drawing, seeds=turn_seeds, max_new_tokens=width, stop=list(rules.stop))
            drawn = session.turn(live, [episodes[n].ids for n in live], how)
            last = turn == rules.max_turns - 1
            live = [
                n
                for k, n in enumerate(live)
                if self._play(episodes[n], drawn[k], room[k], rules, last=last, ignore_eos=drawing.ignore_eos)
            ]
            if not live:
                break

    def _start(self, examples, G: int, episodes: list[_Episode]) -> list[list[int]]:
        """Each episode's environment, made fresh (the factory) and reset with its example's row,
        added to `episodes` as it is made (so a failure closes those made); each episode's prompt."""
        prompts = []
        for ex in examples:
            row = {"prompt": ex.prompt, **ex.columns}
            # A routing column (environment.fn a mapping) picks the environment; as TRL does, it is
            # not passed on to reset.
            reset_row = {k: v for k, v in row.items() if k != ROUTE_COLUMN} if self.routed else row
            for i in range(G):
                e = _Episode(env=None, example=ex, index=i)
                episodes.append(e)
                env = self._call(self.factory, (row,), "making the environment", e)
                messages = (
                    env
                    if isinstance(env, _Failed)
                    else self._call(env.reset, (dict(reset_row),), "reset(row)", e)
                )
                e.env, e.failed = (None if isinstance(env, _Failed) else env), isinstance(messages, _Failed)
                e.reset_prompt = None if e.failed or messages is None else list(messages)
                tools = None if e.failed else getattr(env, "template_tools", None)
                prompts.append(self.rendering.prompt_ids(ex, None if e.failed else messages, tools))
        return prompts

    def _close(self, episodes: list[_Episode]) -> None:
        """close() each episode's environment that has one; the first failure is raised after all
        were closed (under on_error=mask, counted as the episode's error instead)."""
        first = None
        for e in episodes:
            close = getattr(type(e.env), "close", None) if e.env is not None else None
            if close is None:
                continue
            try:
                call_with_timeout(e.env.close, (), self.cfg.timeout_s, "close()")
            except Exception as exc:  # noqa: BLE001 - every environment is closed; then the first raised
                if self.cfg.on_error == "mask":
                    e.failed = e.closed_badly = True
                elif first is None:
                    first = (e, exc)
        if first is not None:
            e, exc = first
            raise UserError(
                f"environment {self.rendering.describe}: close() raised {type(exc).__name__}: {exc} (episode "
                f"{e.index} of the prompt {str(e.example.prompt)[:100]!r}). Fix the environment, or set "
                "environment.on_error=mask to leave such an episode out of the loss and go on."
            ) from exc

    def _play(
        self, e: _Episode, drawn, room: int, rules: EpisodeRules, *, last: bool, ignore_eos: bool
    ) -> bool:
        """A turn's draw joins the episode, the environment answers it (step) and its reply joins
        it: whether the episode goes on to another turn."""
        ids, stopped = self.rendering.cut_at_stop(drawn[0][:room], list(rules.stop))
        ended = bool(ids) and ids[-1] in self.rendering.eos_ids and not ignore_eos
        e.join(ids, drawn[1], "assistant")
        e.stats["turns"] += 1
        if not (ended or stopped):  # a token budget cut the turn
            e.truncated = True
            return False
        if e.failed:
            return False
        value = self._call(e.env.step, (self.rendering.text(ids),), "step(text)", e)
        if isinstance(value, _Failed):
            e.failed = True
            return False
        reply = self._reply(value, e)
        e.stats["tool_calls"] += reply.tool_call
        e.stats["tool_errors"] += reply.error
        self._count(reply, rules, e)
        written = [] if reply.keep_text is None else self._keep(e, ids, reply.keep_text, rules, ended)
        if reply.done or reply.content is None:
            e.done = True
            return False
        if last:
            e.stats["out_of_turns"] += 1
            return False
        tokens = self.rendering.reply_tokens(reply, ended_turn=ended)
        if written:
            tokens = [*written, *tokens]
        if len(tokens) > rules.max_reply_tokens:
            tokens = tokens[: rules.max_reply_tokens]
            e.stats["replies_cut"] += 1
        if len(e.ids) + len(tokens) >= rules.budget:  # no room left for the model to answer
            e.truncated = True
            return False
        e.join(tokens, [], "tool" if not ended or reply.role == "tool" else "user")
        return True

    def _keep(self, e: _Episode, ids: list[int], keep: str, rules: EpisodeRules, ended: bool) -> list[int]:
        """Reply.keep_text: the turn's sampled tokens (the last len(ids) joined) cut at the shortest
        prefix decoding to it exactly, ids, log-probs, trained and roles alike; where none does,
        kept whole and counted (ACTION_NOT_CUT). The tokens the reply then writes first: the
        turn's end-of-turn token where the cut dropped it (the environment's, never trained)."""
        n = self.rendering.kept_tokens(ids, keep)
        if n is None:
            self._count(Reply(metrics={ACTION_NOT_CUT: 1.0}), rules, e)
            return []
        drop = len(ids) - n  # >= 1: a cut that drops text
        del e.ids[-drop:], e.trained[-drop:], e.logps[-drop:], e.roles[-drop:]
        return [ids[-1]] if ended else []

    def _count(self, reply: Reply, rules: EpisodeRules, e: _Episode) -> None:
        """The reply's own metrics onto the episode's sums; a name it did not declare is refused."""
        for name, value in reply.metrics.items():
            if name not in rules.metrics:
                raise UserError(
                    f"environment {self.rendering.describe}: a reply reports the metric {name!r}, which the "
                    f"environment does not declare (its metrics: {list(rules.metrics)}); add it to the "
                    "environment's `metrics` attribute, e.g. metrics = ('attempts',)."
                )
            e.metrics[name] = e.metrics.get(name, 0.0) + float(value)

    def _episode_reward(self, e: _Episode) -> float:
        fn = getattr(e.env, "reward", None)
        if e.failed or fn is None:
            return float("nan")
        value = self._call(fn, (), "reward()", e)
        if isinstance(value, _Failed):
            e.failed = True
            return float("nan")
        return float("nan") if value is None else float(value)

    def _rollout(self, prompts, episodes: list[_Episode], G: int, env_reward, metrics=()) -> Rollout:
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
        prompt_ids, prompt_mask = left_pad(prompts, self.pad_id, "cpu")  # [N, P]: one per episode
        return Rollout(
            num_generations=G,
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            completion_ids=ids,
            attention_mask=attention,
            trained_mask=trained,
            truncated=torch.tensor([e.truncated for e in episodes]),
            sampler_logps=logps,
            roles=roles,
            episode_stats=torch.tensor(
                [
                    [e.stats[k] for k in STAT_COLUMNS] + [e.metrics.get(k, 0.0) for k in metrics]
                    for e in episodes
                ],
                dtype=torch.float32,
            ),
            env_reward=torch.tensor(env_reward, dtype=torch.float32),
            stat_names=(*STAT_COLUMNS, *metrics),
        )


def _instance(env):
    """What the rewards get as an episode's environment (`environments`): the object the user wrote
    (an environment's optional `instance`: a TRL class's instance, a skyrl-gym env), else itself."""
    return None if env is None else getattr(env, "instance", env)


def environment_episodes(
    cfg, *, tokenizer, eos_ids: list[int], pad_id: int, keep_open: bool = False
) -> Episodes | None:
    """The episodes of cfg's (the whole config's) environment, None when it has none (single-turn).
    keep_open: a reward takes the environments (Episodes.keep_open)."""
    from grpo_cli.environments import environment_factory

    env = cfg.environment
    factory = environment_factory(env)
    if factory is None:
        return None
    if env.protocol == "native" and env.tools:
        from grpo_cli.environments import renders_tools, tool_schema

        schemas = [tool_schema(t) for t in factory({}).tools.values()]
        if not renders_tools(tokenizer, schemas):
            raise UserError(
                "environment.protocol=native: the model's chat template does not render tools (SmolLM2's "
                "renders role and content only); use environment.protocol=tag (a tag the model writes, "
                "which any template carries), or a model whose template renders tools."
            )
    describe = (
        f"{{{', '.join(f'{k}: {v}' for k, v in env.fn.items())}}}"
        if isinstance(env.fn, Mapping)
        else env.fn or f"tools [{', '.join(env.tools)}]"
    )
    rendering = Rendering(tokenizer, eos_ids, data=cfg.data, describe=describe)
    return Episodes(
        factory, env, rendering, pad_id=pad_id, max_new_tokens=cfg.sampler.max_new_tokens, keep_open=keep_open
    )


def episode_metrics(rollout: Rollout) -> dict[str, float]:
    """env/* of a rollout of episodes (nothing for a single-turn one): per episode,
    the mean turns, tool calls and tool errors; the share of episodes that called a tool at least
    once (tool_call_rate), that a token budget ended (truncated), that ran out of turns, that
    failed (environment.on_error=mask) or had a reply cut; the share of completion-side tokens
    the environment wrote; and each of the environment's own metrics (its declared `metrics`), the
    mean per episode."""
    if not rollout.is_episode:
        return {}
    stats = rollout.episode_stats.float()  # [N, S]
    col = {name: stats[:, i] for i, name in enumerate(rollout.stat_names)}
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
        **{f"env/{name}": float(col[name].mean()) for name in rollout.stat_names[len(STAT_COLUMNS) :]},
    }
