"""What a reward is: one declaration (`Reward`), its configured use in a run (`RewardSpec`), and the
run's rewards with their lifecycle (`Rewards`: opened on the training device, closed at the end).

A built-in is a module of this package that declares `REWARD = Reward(...)` (the package's other
modules are its machinery); the registry is derived from those declarations (rewards/__init__.py),
the rule of every plug-in kind (grpo_cli/plugins.py). A reward of yours is a plain function with
TRL's signature (`fn(completions, **kwargs) -> list[float | None]`) given by import path, which
gets the default declaration (`Reward(name, fn=...)`: shaping, no options), or a `Reward` object
at that path when it needs more: options checked before the run, a role, or a lifecycle, e.g. a
model loaded once per process:

    def load(device, dist, **options):            # -> the scoring function
        model = ...to(device)
        return lambda completions, **kw: ...

    MY_REWARD = Reward(name="my_model", build=load, close=lambda scorer: ...)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from typing import Any, Optional

from ._calling import names_parameter

#: What a reward is for. correctness: it says whether a completion is right (1.0 = right), so it
#: drives eval/accuracy, the pass rule (pass@k, pass_rate_hist) and the check that the data has
#: its answer column; at most one reward has it. shaping: any other (format, length, ...).
ROLES = ("correctness", "shaping")


@dataclass(frozen=True)
class Node:
    """The keys of a reward's config node (`reward.<name>.<key>`) that say how the run uses it,
    every reward has them, with their defaults; every other key is one of the reward's own
    options. weight: its share of the total; fn: its import path (None: the built-in of that
    name); role: one of ROLES (None: its declaration's); workers, call_timeout_s: how it is called
    (RewardSpec). The one place these keys are written (Optional: OmegaConf reads the hints)."""

    weight: float = 1.0
    fn: Optional[str] = None
    role: Optional[str] = None
    workers: int = 0
    call_timeout_s: Optional[float] = None


#: Node's keys, in order.
NODE_KEYS: tuple[str, ...] = tuple(f.name for f in fields(Node))


@dataclass(frozen=True)
class Facts:
    """What the rest of the code may rely on about a reward (a Plugin's `facts`, spelled out as
    Reward's own fields): its role (ROLES), whether NaN is a value it may return (nan_ok), and
    columns(options) -> the dataset columns it reads (None: none beyond the answer column);
    check_rows(rows, options) -> problems with the data's rows that it cannot score."""

    role: str = "shaping"
    nan_ok: bool = False
    columns: Callable[..., list[str]] | None = None
    check_rows: Callable[..., list[str]] | None = None


@dataclass(frozen=True)
class Reward:
    """One reward, declared once.

    fn: the scoring function, TRL's signature (None when `build` makes it).
    options: the dataclass of its YAML options and their defaults (the typed config node), or None.
    check(options) -> problems: its options' checks, run by config validation before any model loads.
    role: one of ROLES.
    build(device, dist, **options) -> scoring function: called once per process when the run
      starts (rewards from a model load it here); dist is the run's distributed.Dist or None;
      a build that takes `dtype` (or **options) gets the trainer's (torch.bfloat16 under
      trainer.precision=bf16; None: fp32).
    close(scorer): frees what build made, when the run ends however it ends.
    nan_ok: NaN is a value it may return: "this completion could not be scored" (a judge whose
      call failed under on_error=nan). Its group is then left out of the loss, counted in
      rewards/<name>/failures. (For any other reward a NaN is an error.)
    columns(options) -> the dataset columns it reads, checked against the data before training.
    check_rows(rows, options) -> problems: rows it cannot score (gold answers of another kind than
      it reads), one paragraph each, checked against the data before any model loads.

    A scoring function (fn, or what build made) may be async: calling it returns an awaitable,
    and the step awaits every async reward together on one loop (rewards/aio.py). It may have a
    `pop_metrics()` returning counters since its last call ({"calls": 32, "retries": 1}), logged
    as rewards/<name>/<key>.
    """

    name: str
    fn: Callable[..., list] | None = None
    options: type | None = None
    check: Callable[..., list[str]] | None = None
    role: str = "shaping"
    build: Callable[..., Callable[..., list]] | None = None
    close: Callable[[Callable[..., list]], None] | None = None
    nan_ok: bool = False
    columns: Callable[..., list[str]] | None = None
    check_rows: Callable[..., list[str]] | None = None

    def __post_init__(self):
        if (self.fn is None) == (self.build is None):
            raise TypeError(f"Reward {self.name!r}: give exactly one of fn and build")

    @property
    def facts(self) -> Facts:
        """Its facts as one record (role, nan_ok, columns, check_rows)."""
        return Facts(role=self.role, nan_ok=self.nan_ok, columns=self.columns, check_rows=self.check_rows)


@dataclass
class RewardSpec:
    """One configured reward of a run: its YAML name, declaration, weight, options and role, and
    how it is called: workers (0: in the training process; N: a pool of N processes, one call
    per completion, rewards/workers.py) and call_timeout_s (a call's time limit; None: none).
    `fn` is what scores: the declaration's function, or what its build made (after open)."""

    name: str
    reward: Reward
    weight: float
    options: dict = field(default_factory=dict)
    role: str = "shaping"
    workers: int = 0
    call_timeout_s: float | None = None
    scorer: Callable[..., list] | None = None
    pool: Any = None

    @property
    def fn(self) -> Callable[..., list]:
        if self.scorer is not None:
            return self.scorer
        if self.reward.fn is None:
            raise RuntimeError(f"reward {self.name!r} is used before Rewards.open() built it")
        return self.reward.fn

    @property
    def answer_column(self) -> str:
        """The dataset column with the gold answers (a correctness reward's)."""
        from grpo_cli.rewards import DEFAULT_ANSWER_COLUMN

        return self.options.get("answer_column", DEFAULT_ANSWER_COLUMN)


def _takes(fn: Callable, name: str) -> bool:
    """Whether fn accepts the keyword argument `name` (by name, or through **kwargs)."""
    import inspect

    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


class Rewards:
    """The run's rewards, in config order, with their lifecycle: `open(device, dist)` builds the
    rewards that have a build (once per process), `close()` frees them (idempotent; also on a
    failed open). A context manager too: `with build_rewards(cfg).open(device): ...`."""

    def __init__(self, specs: list[RewardSpec]):
        self._specs = list(specs)
        self._opened: list[RewardSpec] = []

    def __getitem__(self, i):
        return self._specs[i]

    def __len__(self) -> int:
        return len(self._specs)

    def __iter__(self) -> Iterator[RewardSpec]:
        return iter(self._specs)

    def __repr__(self) -> str:
        return f"Rewards({[s.name for s in self._specs]})"

    @property
    def take_environments(self) -> bool:
        """Whether a reward names `environments` (TRL's keyword: the episodes' environment objects),
        so the episodes keep them open until they are scored."""
        return any(
            s.reward.fn is not None and names_parameter(s.reward.fn, "environments") for s in self._specs
        )

    def open(self, device: Any = None, dist: Any = None, dtype: Any = None) -> Rewards:
        """Builds the rewards that have a build, with the training device, the run's Dist and the
        trainer's dtype (a build that takes `dtype` or **options gets it; None: fp32)."""
        from grpo_cli.rewards.workers import Pool

        try:
            for spec in self._specs:
                if spec.workers and spec.pool is None:
                    spec.pool = Pool(spec.name, spec.fn, spec.workers, spec.call_timeout_s)
                    self._opened.append(spec)
                if spec.reward.build is not None and spec.scorer is None:
                    extra = {"dtype": dtype} if _takes(spec.reward.build, "dtype") else {}
                    spec.scorer = spec.reward.build(device, dist, **extra, **spec.options)
                    self._opened.append(spec)
                    if not callable(spec.scorer):
                        raise TypeError(
                            f"reward {spec.name!r}: its build returned {type(spec.scorer).__name__}, not a "
                            "scoring function"
                        )
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        errors = []
        while self._opened:
            spec = self._opened.pop()
            if spec.pool is not None:
                pool, spec.pool = spec.pool, None
                pool.close()
                continue
            scorer, spec.scorer = spec.scorer, None
            try:
                if spec.reward.close is not None:
                    spec.reward.close(scorer)
            except Exception as exc:  # noqa: BLE001 - every reward is closed; the first failure re-raised
                errors.append((spec.name, exc))
        if errors:
            name, exc = errors[0]
            raise RuntimeError(f"reward {name!r}: its close() raised {type(exc).__name__}: {exc}") from exc

    def __enter__(self) -> Rewards:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
