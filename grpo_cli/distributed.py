"""Several processes, one training step: torch.distributed as torchrun sets it up.

A run with W processes (ranks) is the same computation as a run with one:

- `trainer.prompts_per_step` is the global number of prompts per optimizer step. Every rank draws
  the same prompts from the stream (same seed), samples and scores its own contiguous shard of
  them (`shard`), and the scored rollouts are gathered (`Dist.gather`: token ids, masks and
  rewards, a few MB), so every rank holds the step's whole batch, in the one-process order.
  Advantages, zero-std flags, loss normalisers, `scale_rewards=batch`'s std, dynamic sampling's
  choices, the zero-signal skip and the reward metrics are then computed from that same batch on
  every rank: the all-reduce of their sums is the gather.
- Samples do not depend on W: prompt i of step s is sampled from its own generator, seeded by
  `prompt_seed(seed, s, i)`, so a rank draws exactly the tokens one process would draw.
- Each rank trains on its shard of the groups. DDP (or FSDP2) averages the gradients over the
  ranks, so the loss is multiplied by W: the sum is then the one-process gradient.
- What the update measured (loss, KL, clip ratios, entropy, ...) is summed over ranks
  (`Dist.sum`), and decisions that must agree (a non-finite loss, a stop signal) are taken on
  the all-reduced values.
- Rank 0 alone writes files and prints; every rank's RNG state is saved.

The launchers: `torchrun --nproc_per_node=N -m grpo_cli.cli.train ...` (each worker joins from
the environment torchrun sets: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), or
`grpo-train trainer.num_processes=N`, which starts torchrun's own launcher (`launch`) with the
same command.
"""

from __future__ import annotations

import hashlib
import inspect
import os
from dataclasses import dataclass
from typing import Any

MODES = ("ddp", "fsdp")


@dataclass(frozen=True)
class Dist:
    """This process's place in the run: rank of world_size (1: no process group)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sum over the ranks (float64)."""
        return self._reduce(values, "SUM")

    def max(self, values: list[float]) -> list[float]:
        return self._reduce(values, "MAX")

    def any(self, flag: bool) -> bool:
        """True on every rank when it is true on one (a stop signal, a fault)."""
        return bool(self._reduce([float(flag)], "MAX")[0])

    def _reduce(self, values: list[float], op: str) -> list[float]:
        if not self.enabled:
            return list(values)
        import torch
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64, device=_comm_device())
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
        return t.tolist()

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj` (picklable; tensors on the CPU), in rank order, on every rank."""
        if not self.enabled:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        if not self.enabled:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def sum_tensors_(self, tensors: list) -> None:
        """Each tensor replaced by its element-wise sum over the ranks, in place, in its own dtype
        (fp32 gradients), a few flat buckets at a time instead of one collective per tensor."""
        if not self.enabled or not tensors:
            return
        import torch
        import torch.distributed as dist

        bucket, size, limit = [], 0, 1 << 24  # elements per bucket (64 MB of fp32)
        for i, t in enumerate(tensors):
            bucket.append(t)
            size += t.numel()
            if size >= limit or i == len(tensors) - 1:
                flat = torch.cat([b.reshape(-1) for b in bucket]).to(_comm_device())
                dist.all_reduce(flat, op=dist.ReduceOp.SUM)
                offset = 0
                for b in bucket:
                    b.copy_(flat[offset : offset + b.numel()].view_as(b))
                    offset += b.numel()
                bucket, size = [], 0

    def barrier(self) -> None:
        if self.enabled:
            import torch.distributed as dist

            dist.barrier()


def _comm_device():
    import torch
    import torch.distributed as dist

    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"


def from_env() -> Dist:
    """The place torchrun gave this process (RANK, WORLD_SIZE, LOCAL_RANK), or a single process."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world <= 1:
        return Dist()
    return Dist(
        rank=int(os.environ.get("RANK", "0")),
        world_size=world,
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
    )


def launched_world_size() -> int:
    """WORLD_SIZE when this process was started by torchrun (or trainer.num_processes), else 1."""
    return from_env().world_size


def planned_world_size(tr) -> int:
    """The processes that will share each step: trainer.num_processes, or torchrun's WORLD_SIZE.
    tr: the trainer group."""
    return tr.num_processes if tr.num_processes > 1 else launched_world_size()


def check_processes(tr) -> list[str]:
    """trainer.num_processes against torchrun's, and FSDP's need of several (config validation)."""
    problems = []
    launched, W = launched_world_size(), planned_world_size(tr)
    if launched > 1 and tr.num_processes > 1 and tr.num_processes != launched:
        problems.append(
            f"trainer.num_processes={tr.num_processes}, but this process was started by torchrun with "
            f"WORLD_SIZE={launched}: under torchrun the number of processes is torchrun's "
            f"(--nproc_per_node, --nnodes); drop trainer.num_processes (or set it to {launched})."
        )
    if tr.distributed == "fsdp" and W < 2:
        problems.append(
            "trainer.distributed=fsdp shards the model over several processes, but this run has one; "
            "set trainer.num_processes=2 (or more), launch with torchrun, or use trainer.distributed=ddp."
        )
    return problems


def join(d: Dist, device_type: str, timeout_s: float) -> None:
    """Join the process group: NCCL on GPUs (one per process: cuda:LOCAL_RANK), gloo on the CPU.
    The timeout bounds every collective: a dead or stuck rank makes the others raise instead of
    waiting forever."""
    import datetime

    import torch
    import torch.distributed as dist

    if not d.enabled or dist.is_initialized():
        return
    if device_type == "cuda":
        torch.cuda.set_device(d.local_rank)
    dist.init_process_group(
        backend="nccl" if device_type == "cuda" else "gloo",
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def leave(finished: bool = True) -> None:
    """Leave the process group. finished: every rank got here (the end of the run): wait for
    the others first, so that no rank tears its connections down while another still uses
    them (gloo aborts the process then). After a failure the group is torn down at once.
    What the run built (models, DDP's reducer, FSDP's state) is collected first: left to the
    interpreter's exit, their destructors can run after the group's and abort the process."""
    import gc

    gc.collect()
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            if finished:
                dist.barrier()
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - a broken group cannot be torn down more politely
        pass


def shard(n: int, rank: int, world_size: int) -> range:
    """Rank `rank`'s contiguous share of n items (the first n % world_size ranks get one more)."""
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


def prompt_seed(seed: int, step: int, index: int, round: int = 0) -> int:
    """The seed of the generator that samples prompt `index` (its place in the step's draw) of
    `step`, in sampling round `round` (adaptive group sizes: 0 is the first group): a function of
    these only, so the completions do not depend on how many processes share the step, nor on the
    order the ranks run in."""
    key = f"{seed}/{step}/{index}" + (f"/{round}" if round else "")  # round 0: the seed it always had
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def is_peer_failure(exc: BaseException) -> bool:
    """A collective broke because another rank died (its error is that rank's to report)."""
    text = str(exc).lower()
    return any(
        word in text
        for word in ("connection closed by peer", "connection reset by peer", "broken pipe", "econnreset")
    )


def is_timeout(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


# ----------------------------------------------------------------------------- the launcher


def threads_per_process(num_processes: int) -> int:
    """CPU threads for each of num_processes workers on this machine: its cores, shared."""
    return max(1, (os.cpu_count() or 1) // num_processes)


def launch(entry: list[str], args: list[str], num_processes: int, timeout_s: float) -> None:
    """Start num_processes workers running `entry + args` on this machine through torchrun's
    launcher (torch.distributed.launcher), and wait for them. A failure of one rank stops the
    others; raises ChildFailedError (or SignalException after Ctrl-C) as torchrun does."""
    import logging
    import uuid

    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # The workers print their own errors (once); torchrun's agent would repeat them as a table.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_process(num_processes)))
    # Ctrl-C: the workers finish their step and save; only after this long are they killed
    # (torch >= 2.13; before it the agent waits its own 30 s).
    grace = {"shutdown_timeout": int(timeout_s)} if "shutdown_timeout" in _field_names(LaunchConfig) else {}
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=num_processes,
        run_id=f"grpo-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        monitor_interval=0.2,
        **grace,
    )
    elastic_launch(config, entrypoint=entry[0])(*entry[1:], *args)


# ----------------------------------------------------------------------------- the model


def wrap_scorer(scorer, d: Dist, device):
    """The training forward (logprobs.TokenLogprobs) for W processes: DistributedDataParallel
    around it, which all-reduces (averages) the trainable parameters' gradients in the backward.
    One process, or a model sharded by FSDP2 (whose own hooks reduce-scatter the gradients):
    the module itself."""
    if not d.enabled or is_sharded(scorer.model):
        return scorer
    from torch.nn.parallel import DistributedDataParallel

    # No buffer changes in training (rotary tables are constants), so no buffer sync per forward:
    # forward_sync_buffers since torch 2.13, broadcast_buffers before it (2.11, the lent GPU's).
    params = inspect.signature(DistributedDataParallel.__init__).parameters
    no_sync = "forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers"
    return DistributedDataParallel(
        scorer, device_ids=[device.index] if device.type == "cuda" else None, **{no_sync: False}
    )


def _field_names(cls) -> set[str]:
    import dataclasses

    return {f.name for f in dataclasses.fields(cls)}


def gradient_sync(scorer, last: bool):
    """Within gradient accumulation, DDP all-reduces only in the last micro-batch's backward
    (no_sync() before it); a module that is not DDP runs as is."""
    import contextlib

    if last or not hasattr(scorer, "no_sync"):
        return contextlib.nullcontext()
    return scorer.no_sync()


def shard_model(model, param_dtype=None) -> None:
    """FSDP2 (trainer.distributed=fsdp): shard each decoder layer (the block classes transformers
    names in the model's _no_split_modules, as accelerate's auto-wrap does), then the rest (the
    embeddings, final norm and head) with the whole model. Parameters become DTensors holding
    this process's shard; each forward all-gathers a layer's weights just before it runs.
    param_dtype (trainer.precision=bf16): the shards stay fp32 (the master weights the optimizer
    steps) and are gathered in bf16 for compute; gradients are reduced in fp32."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from grpo_cli.errors import UserError

    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise UserError(
            f"trainer.distributed=fsdp shards a model layer by layer, but {type(model).__name__} names no "
            "decoder-layer class (its _no_split_modules is empty); use trainer.distributed=ddp."
        )
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype else None
    kwargs = {"mp_policy": mp} if mp else {}
    for layer in layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)


def is_sharded(model) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        return False
    return isinstance(model, FSDPModule)


class full_weights:
    """Within the block, an FSDP2 model's weights are gathered whole (one all-gather per layer for
    the whole block, instead of one per layer per forward) and stay so: the decode loop runs a
    forward per token, each rank a different number of them, with no collective inside. Sharded
    again on exit. A model that is not sharded runs as is."""

    def __init__(self, model):
        from torch.distributed.fsdp import FSDPModule

        self.modules = [m for m in model.modules() if isinstance(m, FSDPModule)] if is_sharded(model) else []

    def __enter__(self):
        for m in self.modules:
            m.set_reshard_after_forward(False, recurse=False)
            m.unshard()
        return self

    def __exit__(self, *exc):
        for m in self.modules:
            m.reshard()
            m.set_reshard_after_forward(True, recurse=False)
        return False
