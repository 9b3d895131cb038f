"""trainer.micro_batch_tokens=auto: the token budget chosen for the device from a measured probe.

Before step 1 (`fit_budget`, called once by the builder, after every model and the sampler are
built), the probe runs the training forward and backward of the largest micro-batch the run can
produce: one group at its longest (the data's longest prompt, sampler.num_generations completions
of the longest completion: sampler.max_new_tokens, or an environment's episode budget), on the real
policy, precision, adapter and scorer, with the gradients a step's later micro-batches hold already
allocated. It runs twice, half the group's rows first, then the whole group, and reads each run's
peak from the device (CUDA: the allocator's peak reserved bytes; a CPU:
the process's peak resident set, VmHWM, reset before each run through /proc/self/clear_refs). The
probe changes no weight, leaves every gradient None and draws its tokens from its own generator
with the global RNG states restored after it, so a run with `auto` equals, bit for bit, the run
with the budget it chose pinned.

`plan_budget` is the pure planner. Its contract:

- The cost model is linear in the tokens a micro-batch runs (ScoringPlan.cost, the budget's own
  unit): peak(t) = fixed + per_token * t, the line through the two probes (one probe, where a group
  has one row: through the resident bytes before it). AdamW's moments are allocated at the first
  update, after the probe: their bytes are added analytically (`optimizer_state_bytes`), unless
  the optimizer already holds its state (a resumed run).
- The budget is the largest multiple of GRID tokens whose predicted peak is within the limit,
  capped at the step's tokens (one micro-batch holds every group of this rank); where GRID tokens
  are already over it, the largest number of tokens within it (at least one group: a group runs
  alone whatever the budget, and its peak is the measured one). A budget whose prediction is over
  the limit is never returned.
- Where one group's predicted peak is over the limit, there is no budget: `Unfit` says by how much,
  and `refusal` turns it into one paragraph with the levers that would make it fit (before step 1).

The limit (`memory_limit`): trainer.memory_limit_gib where set, else what this process holds now
plus MARGIN less than the memory still free (a CPU: the smaller of MemAvailable and the cgroup's
limit less its usage; CUDA: the device's free memory, in the allocator's terms). Processes that
share one host's memory share its limit. The plan is kept in the run's state: a resume reuses it
without probing (docs/performance.md).
"""

from __future__ import annotations

import contextlib
import gc
import math
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from grpo_cli.errors import UserError

GIB = 2**30
GRID = 512  # the budget is a multiple of this many tokens
# The share of the free memory left unplanned (fragmentation, the sampler's and the reference's
# transient tensors, the rewards): the limit is what the process holds now + (1 - MARGIN) x free.
MARGIN = 0.10


@dataclass(frozen=True)
class FitPlan:
    """The budget auto chose and why: the probes' (tokens, peak bytes), the line through them, the
    optimizer state added, the limit, and the predicted peak at the chosen budget."""

    budget: int  # trainer.micro_batch_tokens
    limit_bytes: int
    limit_source: str  # how the limit was set (trainer.memory_limit_gib, the free memory)
    predicted_peak_bytes: int
    micro_batches: int  # a step's micro-batches, every group at its longest
    fixed_bytes: int
    bytes_per_token: float
    optimizer_bytes: int
    group_tokens: int  # one group at its longest
    probes: tuple[tuple[int, int], ...]  # (tokens, peak bytes)
    device: str

    def line(self) -> str:
        return (
            f"memory plan: trainer.micro_batch_tokens={self.budget} (auto: {self.micro_batches} micro-batch"
            f"{'es' if self.micro_batches != 1 else ''} a step at the longest, predicted peak "
            f"{self.predicted_peak_bytes / GIB:.2f} of {self.limit_bytes / GIB:.2f} GiB, {self.limit_source}; "
            f"measured by {len(self.probes)} probe{'s' if len(self.probes) != 1 else ''} on the {self.device}); "
            f"pin it with trainer.micro_batch_tokens={self.budget}"
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FitPlan:
        data = dict(data)
        data["probes"] = tuple(tuple(int(x) for x in p) for p in data["probes"])
        return cls(**data)


@dataclass(frozen=True)
class Unfit:
    """One group's predicted peak over the limit (plan_budget's other answer)."""

    group_peak_bytes: int  # one group's predicted peak, optimizer state included
    limit_bytes: int
    fixed_bytes: int
    bytes_per_token: float
    optimizer_bytes: int
    group_tokens: int

    @property
    def over_bytes(self) -> int:
        return self.group_peak_bytes - self.limit_bytes


def plan_budget(
    probes: list[tuple[int, int]],
    *,
    before_bytes: int,
    optimizer_bytes: int,
    limit_bytes: int,
    groups: int,
    cost_of_groups,
    device: str = "cpu",
    limit_source: str = "",
) -> FitPlan | Unfit:
    """The largest budget that fits (the module docstring's contract). probes: (tokens, peak) of
    each probe run; before_bytes: resident before the probes; groups: this rank's groups a step;
    cost_of_groups(k): the tokens k groups at their longest run in one micro-batch (the largest
    probe ran cost_of_groups(1))."""
    group_tokens = cost_of_groups(1)
    fixed, per_token = _line(probes, before_bytes)
    group_peak = max(peak for _, peak in probes) + optimizer_bytes
    if group_peak > limit_bytes:
        return Unfit(group_peak, limit_bytes, fixed, per_token, optimizer_bytes, group_tokens)

    def predicted(tokens: int) -> int:  # (never under what a whole group measured)
        return max(group_peak, int(math.ceil(fixed + per_token * tokens)) + optimizer_bytes)

    cap = -(-cost_of_groups(groups) // GRID) * GRID  # (one micro-batch holds the step)
    room = limit_bytes - optimizer_bytes - fixed
    raw = cap if per_token <= 0 else min(cap, int(room // per_token))
    # On the grid; under it only where even GRID tokens would be over the limit (then the room
    # itself, at least one group: a group runs alone whatever the budget).
    budget = raw // GRID * GRID if raw >= GRID else max(raw, group_tokens)
    while budget > GRID and predicted(budget) > limit_bytes:  # (rounding: never over the limit)
        budget -= GRID
    together = max([k for k in range(1, groups + 1) if cost_of_groups(k) <= budget], default=1)
    return FitPlan(
        budget=budget,
        limit_bytes=limit_bytes,
        limit_source=limit_source,
        predicted_peak_bytes=predicted(cost_of_groups(together)),
        micro_batches=-(-groups // together),
        fixed_bytes=fixed,
        bytes_per_token=per_token,
        optimizer_bytes=optimizer_bytes,
        group_tokens=group_tokens,
        probes=tuple(probes),
        device=device,
    )


def _line(probes: list[tuple[int, int]], before_bytes: int) -> tuple[int, float]:
    """(fixed bytes, bytes per token): the line through the two probes, or through the resident
    bytes before one probe. A line falling with the tokens (noise) is replaced by the conservative
    one through `before_bytes` and the larger probe."""
    (t_hi, p_hi) = max(probes)
    if len(probes) >= 2:
        (t_lo, p_lo) = min(probes)
        if t_hi > t_lo and p_hi > p_lo:
            slope = (p_hi - p_lo) / (t_hi - t_lo)
            return int(p_hi - slope * t_hi), slope
    return before_bytes, max(p_hi - before_bytes, 0) / max(t_hi, 1)


# ----------------------------------------------------------------------------- the device's memory


def memory_limit(trainer, device: torch.device, world_size: int = 1) -> tuple[int, str]:
    """The bytes this process may peak at, and how they were set (module docstring)."""
    if trainer.memory_limit_gib is not None:
        return int(
            float(trainer.memory_limit_gib) * GIB
        ), f"trainer.memory_limit_gib={trainer.memory_limit_gib:g}"
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        held = torch.cuda.memory_reserved(device)
        return held + int(free * (1 - MARGIN)), f"the GPU's free memory less {MARGIN:.0%}"
    free = _host_free_bytes()
    share = f", shared by {world_size} processes" if world_size > 1 else ""
    return resident_bytes() + int(free * (1 - MARGIN) / world_size), f"the free RAM less {MARGIN:.0%}{share}"


def _host_free_bytes() -> int:
    """The smaller of MemAvailable and the cgroup's limit less its usage (a container's own limit)."""
    free = _meminfo_kib("MemAvailable") * 1024
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),  # cgroup v2
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        with contextlib.suppress(OSError, ValueError):
            limit = Path(limit_file).read_text().strip()
            if limit != "max" and int(limit) < 2**60:
                free = min(free, int(limit) - int(Path(usage_file).read_text()))
            break
    return max(free, 0)


def _meminfo_kib(field: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise UserError(
        f"trainer.micro_batch_tokens=auto reads {field} from /proc/meminfo, which has none: set trainer.memory_limit_gib."
    )


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise OSError(f"no {field} in /proc/self/status")


def resident_bytes() -> int:
    """This process's resident set now."""
    return _status_kib("VmRSS") * 1024


class PeakMeter:
    """The peak bytes of the block it is entered for: CUDA's allocator peak (reserved), or a CPU
    process's resident-set high-water mark reset at entry (/proc/self/clear_refs); where that
    cannot be reset, a thread reading the resident set every millisecond (it can miss a peak
    shorter than that: the margin covers it)."""

    def __init__(self, device: torch.device):
        self.device, self.peak = device, 0
        self._thread, self._stop = None, threading.Event()

    def __enter__(self) -> PeakMeter:
        gc.collect()
        _trim()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            return self
        try:
            Path("/proc/self/clear_refs").write_text("5")
            self._hwm = True
        except OSError:
            self._hwm = False
            self.peak = resident_bytes()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, resident_bytes())
            time.sleep(0.001)

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_reserved(self.device)
        elif self._hwm:
            self.peak = _status_kib("VmHWM") * 1024
        else:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, resident_bytes())


def reset_peak(device: torch.device) -> None:
    """Start a step's peak (peak_bytes): CUDA's allocator peak reset; a CPU's VmHWM set to the
    resident set now (a no-op where /proc/self/clear_refs cannot be written)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def peak_bytes(device: torch.device) -> int | None:
    """The peak since reset_peak (the metric memory/peak_gib): CUDA's allocator peak reserved
    bytes; a CPU's peak resident set (None where /proc has none)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_reserved(device))
    try:
        return _status_kib("VmHWM") * 1024
    except OSError:
        return None


def _trim() -> None:
    """glibc's free heap pages back to the system (a probe's peak then starts from what is held)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)


# ----------------------------------------------------------------------------- the probe


def optimizer_state_bytes(opt_step, name: str) -> int:
    """The bytes the optimizer allocates at its first update (0 where it holds its state already):
    adamw two fp32 moments a parameter; adamw_8bit two 8-bit moments (a tensor under
    optim.MIN_8BIT_SIZE elements keeps fp32 ones); adamw_bf16_sr two moments in the weights' bf16."""
    from grpo_cli.optim import MIN_8BIT_SIZE

    if len(opt_step.optimizer.state):
        return 0
    total = 0
    for p in opt_step.params:
        n = p.numel()
        if name == "adamw_8bit":
            total += 2 * n if n >= MIN_8BIT_SIZE else 8 * n
        elif name == "adamw_bf16_sr":
            total += 2 * n * p.element_size()
        else:
            total += 8 * n
    return total


def longest_group(cfg, examples, multi_turn: bool) -> tuple[int, int, int]:
    """(prompt tokens, completion tokens, rows) of the run's largest group: the longest training
    prompt (at most sampler.max_prompt_length), sampler.max_new_tokens or an environment's episode
    budget, sampler.num_generations rows."""
    s, env = cfg.sampler, cfg.environment
    prompt = min(max((len(ex.prompt_ids) for ex in examples), default=1), s.max_prompt_length)
    if multi_turn:
        prompt = s.max_prompt_length  # (the environment's instructions may add to the row's prompt)
        completion = env.max_episode_tokens or env.max_turns * (s.max_new_tokens + env.max_reply_tokens)
    else:
        completion = s.max_new_tokens
    return max(prompt, 1), max(completion, 1), s.num_generations


def _probe_rollout(prompt: int, completion: int, rows: int, vocab: int, device):
    """One group of `rows` rows at these lengths, every token attended and trained (random ids
    from the probe's own generator)."""
    from grpo_cli.rollout import single_turn

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (rows, prompt + completion), generator=g).to(device)
    ones = torch.ones((rows, completion), dtype=torch.long, device=device)
    return single_turn(
        rows,
        ids[:, :prompt],
        torch.ones((rows, prompt), dtype=torch.long, device=device),
        ids[:, prompt:],
        ones,
        torch.zeros(rows, dtype=torch.bool, device=device),
        torch.zeros((rows, completion), device=device),
    )


def probe_peak(policy, scorer, opt_step, precision, rollout, device) -> int:
    """The peak bytes of one training forward and backward of `rollout` (one micro-batch), under
    the run's precision, as a step's second and later micro-batches run it: with the optimizer's
    gradients already held (they accumulate across a step's micro-batches; a probe that starts
    without them peaks, on long rows, before its backward has made them, and measured 2.3-2.5 GiB
    under the steps of the 0.5B shape at 256 new tokens). Every gradient None after it, the
    global RNG states as before."""
    from grpo_cli.distributed import gradient_sync
    from grpo_cli.precision import autocast

    for param in opt_step.params:  # (before the meter: resident, as in a step)
        param.grad = torch.zeros_like(param)
    cuda = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda), PeakMeter(device) as meter:
        with gradient_sync(scorer, False), autocast(device, precision):
            scores = scorer(*rollout.inputs(), num_generations=rollout.num_generations)
        loss = scores.logps.float().mean()
        if scores.entropy is not None and scores.entropy.requires_grad:
            loss = loss + scores.entropy.float().mean()
        with gradient_sync(scorer, False):
            loss.backward()
        if opt_step.masters:
            opt_step.masters.take_grads()
        del scores, loss
    opt_step.optimizer.zero_grad(set_to_none=True)
    policy.zero_grad(set_to_none=True)
    return meter.peak


@dataclass(frozen=True)
class Probed:
    """What fit_budget's probes measured: the run's largest group, each probe's (tokens, peak
    bytes), the resident bytes before them, the optimizer state the first update adds, the limit."""

    lengths: tuple[int, int, int]  # (prompt tokens, completion tokens, rows) of the largest group
    probes: tuple[tuple[int, int], ...]  # (tokens, peak bytes)
    before_bytes: int
    optimizer_bytes: int
    limit_bytes: int
    limit_source: str


def probe(cfg, learner_parts, plan, examples, multi_turn: bool, d) -> Probed:
    """The two probes of one group at its longest (G/2 rows, then G), on the learner's parts:
    (policy, scorer, opt_step, precision, device). Every rank's peaks are the largest of any."""
    policy, scorer, opt_step, precision, device = learner_parts
    prompt, completion, G = longest_group(cfg, examples, multi_turn)
    vocab = int(policy.get_input_embeddings().weight.shape[0])
    limit, source = memory_limit(cfg.trainer, device, d.world_size if device.type == "cpu" else 1)
    before = torch.cuda.memory_reserved(device) if device.type == "cuda" else resident_bytes()
    probes = []
    for rows in ([G // 2] if G >= 2 else []) + [G]:
        rollout = _probe_rollout(prompt, completion, rows, vocab, device)
        peak = probe_peak(policy, scorer, opt_step, precision, rollout, device)
        probes.append((plan.group_cost(prompt, completion, rows), peak))
        del rollout
    if d.enabled:  # (every rank plans with the largest peaks: one budget for all)
        peaks = d.max([float(p) for _, p in probes])
        probes = [(t, int(p)) for (t, _), p in zip(probes, peaks)]
    opt_bytes = optimizer_state_bytes(opt_step, cfg.optimizer.name)
    return Probed((prompt, completion, G), tuple(probes), before, opt_bytes, limit, source)


def fit_budget(cfg, learner_parts, plan, examples, multi_turn: bool, d) -> FitPlan:
    """trainer.micro_batch_tokens=auto's plan, probed now (the builder calls it once, before step
    1). learner_parts: (policy, scorer, opt_step, precision, device). Raises UserError (refusal)
    where one group cannot fit."""
    from grpo_cli.packing import GroupShape

    policy, _, opt_step, _, device = learner_parts
    m = probe(cfg, learner_parts, plan, examples, multi_turn, d)
    prompt, completion, G = m.lengths
    longest = GroupShape(prompt, completion, True, (completion,) * G)
    result = plan_budget(
        list(m.probes),
        before_bytes=m.before_bytes,
        optimizer_bytes=m.optimizer_bytes,
        limit_bytes=m.limit_bytes,
        groups=max(1, cfg.trainer.prompts_per_step // max(1, d.world_size)),
        cost_of_groups=lambda k: plan.cost([longest] * k, G),
        device=device.type,
        limit_source=m.limit_source,
    )
    if isinstance(result, Unfit):
        raise UserError(refusal(result, cfg, m.lengths, plan, opt_step, policy, m.limit_source))
    return result


def _largest(fixed: int, per_token: float, optimizer: int, limit: int, cost, cap: int = 1 << 20) -> int:
    """The largest n in [1, cap] whose predicted peak, fixed + per_token * cost(n) + optimizer, is
    within the limit (0: none); cost rises with n."""

    def fits(n: int) -> bool:
        return fixed + per_token * cost(n) + optimizer <= limit

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= cap and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, cap + 1)
    while hi - lo > 1:  # fits(lo), not fits(hi) (or hi past the cap)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _longest_that_fits(unfit: Unfit, cost) -> int:
    """The largest n with fixed + per_token * cost(n) + optimizer within the limit (0: none)."""
    return _largest(unfit.fixed_bytes, unfit.bytes_per_token, unfit.optimizer_bytes, unfit.limit_bytes, cost)


# ----------------------------------------------------------------------------- grpo-check-env --fit


@dataclass(frozen=True)
class LeverFit:
    """One row of grpo-check-env --fit: a lever's measured probes and what they let fit. The probes'
    peaks are measured; the optimizer state is counted (it is allocated at the first update);
    longest_completion and largest_group are solved from the line through the probes."""

    lever: str  # "as configured", or what the lever is
    overrides: tuple[str, ...]  # the settings that pull it (none: as configured)
    lengths: tuple[int, int, int]  # (prompt tokens, completion tokens, rows) probed
    probes: tuple[tuple[int, int], ...]  # (tokens, peak bytes): measured
    optimizer_bytes: int  # counted
    group_peak_bytes: int  # one group at the configured lengths: the largest probe + the optimizer state
    limit_bytes: int
    limit_source: str
    longest_completion: int  # the longest max_new_tokens at num_generations rows that fits (0: none)
    largest_group: int  # the largest num_generations at max_new_tokens that fits (0: none)

    @property
    def fits(self) -> bool:
        return self.group_peak_bytes <= self.limit_bytes

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "fits": self.fits}


def solve_fit(lever: str, overrides: tuple[str, ...], probed: Probed, group_cost) -> LeverFit:
    """A lever's row from its probes: group_cost(prompt, completion, rows) is the scoring plan's
    (ScoringPlan.group_cost). Solved on the line through the probes (linear in the tokens; the
    attention mask's quadratic term and the allocator's slack are the margin's to cover)."""
    prompt, completion, G = probed.lengths
    fixed, per_token = _line(list(probed.probes), probed.before_bytes)
    largest_peak = max(peak for _, peak in probed.probes)
    args = (fixed, per_token, probed.optimizer_bytes, probed.limit_bytes)
    return LeverFit(
        lever=lever,
        overrides=overrides,
        lengths=probed.lengths,
        probes=probed.probes,
        optimizer_bytes=probed.optimizer_bytes,
        group_peak_bytes=largest_peak + probed.optimizer_bytes,
        limit_bytes=probed.limit_bytes,
        limit_source=probed.limit_source,
        longest_completion=_largest(*args, lambda c: group_cost(prompt, c, G)),
        largest_group=_largest(*args, lambda g: group_cost(prompt, completion, g), cap=4096),
    )


def levers(cfg, precision_name: str, available: set[str]) -> list[tuple[str, tuple[str, ...]]]:
    """(lever, overrides) of each memory lever that applies to cfg, after the config as it is:
    gradient checkpointing, 8-bit AdamW state (bitsandbytes), LoRA, the frozen models in bf16
    beside an fp32 policy, and bf16 weights without fp32 masters stepped with stochastic rounding
    (torchao; only where the run's precision is bf16, or auto picks it on this device).
    precision_name: what trainer.precision resolves to here; available: the importable optional
    libraries ("bitsandbytes", "torchao")."""
    t, out = cfg.trainer, [("as configured", ())]
    if not t.gradient_checkpointing:
        out.append(("gradient checkpointing", ("trainer.gradient_checkpointing=true",)))
    if cfg.optimizer.name == "adamw" and "bitsandbytes" in available:
        out.append(("8-bit AdamW state", ("optimizer=adamw_8bit",)))
    if cfg.adapter.name == "none":
        out.append(("LoRA", ("adapter=lora",)))
    frozen = bool(cfg.loss.beta) or bool(cfg.teacher.name_or_path)
    if frozen and t.frozen_precision == "same" and precision_name == "fp32":
        out.append(("frozen models in bf16", ("trainer.frozen_precision=bf16",)))
    if precision_name == "bf16" and cfg.optimizer.name == "adamw" and "torchao" in available:
        out.append(("bf16 without fp32 masters", ("trainer.precision=bf16", "optimizer.name=adamw_bf16_sr")))
    return out


def refusal(unfit: Unfit, cfg, lengths, plan, opt_step, policy, source: str) -> str:
    """One paragraph: one group cannot fit, by how much, and the levers (each with what it saves)."""
    prompt, completion, G = lengths
    t, gib = cfg.trainer, (lambda b: f"{b / GIB:.2f} GiB")
    params = sum(p.numel() for p in opt_step.params)
    levers = []
    if not t.gradient_checkpointing:
        activations = unfit.bytes_per_token * unfit.group_tokens
        levers.append(f"trainer.gradient_checkpointing=true (most of the {gib(activations)} of activations)")
    if cfg.optimizer.name == "adamw" and unfit.optimizer_bytes:
        levers.append(f"optimizer=adamw_8bit (its state {gib(6 * params)} smaller)")
    from grpo_cli.adapters import is_adapted

    if not is_adapted(policy):
        levers.append(
            f"adapter=lora (no gradients nor optimizer state for the {params / 1e6:.0f}M base weights)"
        )
    if cfg.loss.beta and t.frozen_precision == "same" and t.precision in ("fp32", "auto"):
        levers.append("trainer.frozen_precision=bf16 (the reference's weights in half the bytes)")
    shorter = _longest_that_fits(unfit, lambda c: plan.group_cost(prompt, c, G))
    if 0 < shorter < completion:
        levers.append(f"sampler.max_new_tokens={shorter} (the longest completion that fits {G} a group)")
    fewer = _longest_that_fits(unfit, lambda g: plan.group_cost(prompt, completion, g))
    if 2 <= fewer < G:
        levers.append(f"sampler.num_generations={fewer}")
    return (
        f"trainer.micro_batch_tokens=auto: one group cannot fit in {gib(unfit.limit_bytes)} ({source}). Its "
        f"training forward and backward at the longest (a {prompt}-token prompt and {G} completions of "
        f"{completion} tokens: {unfit.group_tokens} tokens) peaked at {gib(unfit.group_peak_bytes - unfit.optimizer_bytes)}"
        f" measured, and the optimizer's state adds {gib(unfit.optimizer_bytes)} at the first update: "
        f"{gib(unfit.over_bytes)} over the limit. Nothing was trained. Levers that lower the peak: "
        + "; ".join(levers)
        + ". Or set trainer.memory_limit_gib higher if the device has more memory than that."
    )
