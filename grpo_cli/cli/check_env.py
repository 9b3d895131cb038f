"""`grpo-check-env`: is this machine and install fit to train? Paste the block into bug reports."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
from typing import Any

from grpo_cli.errors import UserError, report_and_exit
from grpo_cli.precision import pick_precision

REQUIRED = (
    "torch",
    "transformers",
    "datasets",
    "hydra",
    "omegaconf",
    "rich",
    "safetensors",
    "accelerate",
    "peft",
)
OPTIONAL = ("gguf", "math_verify", "bitsandbytes", "pytest")
DIST_NAMES = {"hydra": "hydra-core", "math_verify": "math-verify"}


def _package_version(module: str) -> tuple[str | None, str | None]:
    """(version, error): error is set when the package is missing or fails to import."""
    try:
        mod = importlib.import_module(module)
    except Exception as exc:  # a broken install raises anything, not only ImportError
        return None, f"{type(exc).__name__}: {exc}"
    version = getattr(mod, "__version__", None)
    if version is None:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as dist_version

        try:
            version = dist_version(DIST_NAMES.get(module, module))
        except PackageNotFoundError:
            version = "unknown"
    return str(version), None


def _memory_gib() -> float | None:
    try:
        import psutil

        return psutil.virtual_memory().total / 2**30
    except Exception:
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        except (ValueError, OSError, AttributeError):
            return None


def collect() -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_cores": os.cpu_count(),
        "ram_gib": _memory_gib(),
        "packages": {},
        "problems": [],
    }
    for module in REQUIRED + OPTIONAL:
        version, error = _package_version(module)
        name = DIST_NAMES.get(module, module)
        info["packages"][name] = version
        if error and module in REQUIRED:
            info["problems"].append(
                f"required package {name} cannot be imported ({error}); reinstall it: pip install -e '.[dev]'"
            )
    cuda = bf16 = False
    gpu_name = vram = None
    info.update(gpu_count=0, gloo_available=False, nccl_available=False)
    if info["packages"].get("torch"):
        import torch
        import torch.distributed as dist

        from grpo_cli.distributed import launched_world_size

        cuda = torch.cuda.is_available()
        info["gpu_count"] = torch.cuda.device_count() if cuda else 0
        if dist.is_available():
            info["gloo_available"] = dist.is_gloo_available()
            info["nccl_available"] = dist.is_nccl_available()
        info["launched_world_size"] = launched_world_size()
        if cuda:
            gpu_name = torch.cuda.get_device_name(0)
            vram = torch.cuda.get_device_properties(0).total_memory / 2**30
            bf16 = torch.cuda.is_bf16_supported()
        else:
            from grpo_cli.precision import cpu_has_bf16

            bf16 = info["cpu_bf16"] = cpu_has_bf16()
        info["torch_cuda_version"] = torch.version.cuda
        info["torch_threads"] = torch.get_num_threads()
    info.update(cuda_available=cuda, gpu_name=gpu_name, vram_gib=vram, bf16_supported=bf16)
    precision, why = pick_precision(cuda, bf16)
    info["recommended_precision"] = precision
    info["recommended_precision_reason"] = why
    return info


def _yes(flag: bool) -> str:
    return "available" if flag else "not available"


def processes_line(info: dict[str, Any]) -> str:
    """How many processes a run would use here, and how (grpo_cli/distributed.py)."""
    launched = info.get("launched_world_size", 1)
    if launched > 1:
        return f"{launched} (started by torchrun: WORLD_SIZE={launched})"
    gpus = info["gpu_count"]
    if gpus:
        return (
            f"1 by default; trainer.num_processes=N (N <= {gpus}) or torchrun --nproc_per_node={gpus}: one GPU "
            f"each, {'NCCL' if info['nccl_available'] else 'gloo (NCCL is missing)'}"
        )
    cores = info["cpu_cores"] or 1
    return (
        f"1 by default; trainer.num_processes=N runs N CPU processes with gloo, {cores} cores shared "
        f"({max(1, cores // 2)} thread(s) each at N=2)"
        + ("" if info["gloo_available"] else " (gloo is missing: one process only)")
    )


def format_report(info: dict[str, Any]) -> str:
    def gib(x: float | None) -> str:
        return "unknown" if x is None else f"{x:.1f} GiB"

    lines = [
        "grpo-cli environment report",
        f"  python           {info['python']} ({info['platform']})",
        f"  cpu cores        {info['cpu_cores']}",
        f"  ram              {gib(info['ram_gib'])}",
        f"  cuda available   {info['cuda_available']}",
        f"  gpu              {info['gpu_name'] or '-'}",
        f"  vram             {gib(info['vram_gib']) if info['vram_gib'] else '-'}",
        f"  bf16 supported   {info['bf16_supported']}"
        + ("" if info["cuda_available"] else " (the CPU's bf16 units: AVX512-BF16 or AMX)"),
        f"  precision        {info['recommended_precision']} ({info['recommended_precision_reason']})",
        f"  gpus             {info['gpu_count']}",
        f"  distributed      gloo {_yes(info['gloo_available'])}, nccl {_yes(info['nccl_available'])}",
        f"  processes        {processes_line(info)}",
        "  packages:",
    ]
    for name, version in info["packages"].items():
        lines.append(f"    {name:<16} {version or 'MISSING'}")
    if info["problems"]:
        lines.append("problems:")
        lines += [f"  - {p}" for p in info["problems"]]
    else:
        lines.append("status: OK")
    return "\n".join(lines)


def _settings(cfg: Any, info: dict[str, Any], recurrent: bool = False) -> dict[str, Any]:
    """What the estimate reads from the composed config: lengths, batch sizes, beta, the device
    and the precision that grpo-train would use on it (`auto` resolved as it resolves it);
    recurrent: the model has recurrent or convolution layers (a token budget's groups then run
    every row in full)."""
    from grpo_cli import memory

    t, s = cfg.trainer, cfg.sampler
    # trainer.device=cuda plans for a GPU from any machine (with --memory-gib: its memory); a
    # GPU that is not here is assumed to have bf16 (every GPU since Ampere).
    planned = str(t.device).startswith("cuda") and not info["cuda_available"]
    cuda = str(t.device).startswith("cuda") or (bool(info["cuda_available"]) and t.device == "auto")
    precision = t.precision
    if precision == "auto":
        precision = pick_precision(cuda, planned or bool(info["bf16_supported"]))[0]
    if precision not in memory.PRECISIONS:
        raise UserError(
            f"trainer.precision={precision!r} is not one of auto, {', '.join(memory.PRECISIONS)}; "
            "pick one of those."
        )
    return dict(
        device_type="cuda" if cuda else "cpu",
        precision=precision,
        beta=float(cfg.loss.beta),
        prompts_per_step=int(t.prompts_per_step),
        prompts_per_micro_batch=memory.prompts_per_micro_batch(t, s, recurrent),
        num_generations=int(s.num_generations),
        prompt_length=int(s.max_prompt_length),
        completion_length=int(s.max_new_tokens),
        gradient_checkpointing=bool(t.gradient_checkpointing),
        logprob_chunk_size=t.logprob_chunk_size,
        optimizer=str(cfg.optimizer.name),
        frozen_precision=str(t.frozen_precision),
    )


def _reward_model(cfg) -> dict[str, Any]:
    """memory.EstimateInputs' reward-model fields for a config with a reward model (reward=model, or
    its declaration under another name), else none."""
    from grpo_cli import memory
    from grpo_cli.rewards import REGISTRY, resolve_reward

    for name, node in (cfg.reward or {}).items():
        fn = node.get("fn") if hasattr(node, "get") else None
        try:
            declared = resolve_reward(str(name), fn)
        except Exception:  # noqa: BLE001 - a bad reward is grpo-train's error to report, not the estimate's
            continue
        if declared.build is REGISTRY["model"].build and node.get("name_or_path"):
            options = REGISTRY["model"].options
            return dict(
                reward_model=memory.model_shape(
                    memory.resolve_model_config(str(node.get("name_or_path"))), classifier=True
                ),
                reward_batch_size=int(node.get("batch_size") or options.batch_size),
                reward_max_length=int(node.get("max_length") or options.max_length),
            )
    return {}


def memory_estimate(
    model: str,
    overrides: list[str],
    info: dict[str, Any],
    *,
    lora_r: int | None = None,
    memory_gib: float | None = None,
) -> dict[str, Any]:
    """Full fine-tuning, LoRA and QLoRA of `model` on this device (or one of memory_gib GiB), from
    the model's config and the composed training config; nothing is downloaded or loaded."""
    from grpo_cli import memory
    from grpo_cli.cli.common import compose_config

    if lora_r is not None and lora_r < 1:
        raise UserError(f"--lora-r {lora_r} must be a positive integer, e.g. --lora-r 16.")
    if memory_gib is not None and not memory_gib > 0:
        raise UserError(f"--memory-gib {memory_gib:g} must be > 0 (the device's memory in GiB), e.g. 24.")
    # A preset goes through Hydra as model=NAME; a hub id or folder is read as given (a path
    # need not survive Hydra's override grammar, and the model config feeds nothing else here).
    preset = memory.preset_source(model) is not None
    cfg = compose_config(overrides + ([f"model={model}"] if preset else []), check=False)
    name = str(cfg.model.name_or_path) if preset else model
    shape = memory.model_shape(memory.resolve_model_config(model))
    settings = _settings(cfg, info, shape.recurrent)
    lora_r = int(cfg.adapter.r) if lora_r is None else lora_r  # adapter.r (16) unless --lora-r says
    sampling = settings.pop("prompts_per_step")
    scorer = _reward_model(cfg)  # reward=model: its shape and batch, counted beside the policy
    if cfg.teacher.name_or_path:  # on-policy distillation: the teacher's weights beside the policy
        scorer["teacher"] = memory.model_shape(memory.resolve_model_config(str(cfg.teacher.name_or_path)))
    estimates = {
        method: memory.estimate(
            memory.EstimateInputs(
                shape, method, lora_r=lora_r, prompts_per_sampling_batch=sampling, **settings, **scorer
            )
        )
        for method in memory.METHODS
    }
    cuda = settings["device_type"] == "cuda"
    if memory_gib is not None:
        available, source = int(memory_gib * 2**30), "--memory-gib"
    else:
        gib = info["vram_gib"] if cuda else info["ram_gib"]
        available, source = (
            (None if gib is None else int(gib * 2**30)),
            "GPU memory" if cuda else "system RAM",
        )
    share = 0
    if available is not None:  # sampler=vllm: its engine's share is not training's
        share = memory.sampler_share(
            cfg.sampler, shape, settings["device_type"], available, settings["precision"]
        )
        if share:
            available -= share
            source += f", less {share / 2**30:.2f} GiB for vLLM's engine"
    if available is None:
        recommended = {"method": "unknown", "reason": "the device's memory is unknown; pass --memory-gib X."}
    else:
        rec = memory.recommend(estimates, available, cuda)
        recommended = {"method": rec.method, "reason": rec.reason}
    methods = {}
    for method, e in estimates.items():
        usable = method != "qlora" or cuda
        methods[method] = {
            **e.as_dict(),
            "usable": usable,
            "fits": None if available is None or not usable else memory.fits(e.total, available),
        }
    return {
        "model": model,
        "name_or_path": name,
        "model_type": shape.model_type,
        "available_bytes": available,
        "available_source": source,
        "sampler_share_bytes": share,
        "settings": {**settings, "prompts_per_step": sampling, "lora_r": lora_r},
        "params": {
            "total": shape.total_params,
            "linear": shape.linear_params,
            "lora_adapters": memory.lora_parameters(shape, lora_r),
        },
        # the decoder's layers by kind (attention, or a hybrid's gated_deltanet / short_conv / mamba2)
        "layers": {"attention": shape.attention_layers, **{m.kind: m.layers for m in shape.mixers}},
        "methods": methods,
        "recommended": recommended,
    }


def format_estimate(est: dict[str, Any]) -> str:
    def gib(n: float) -> str:
        return f"{n / 2**30:.2f}"

    s, p = est["settings"], est["params"]
    have = "unknown" if est["available_bytes"] is None else f"{gib(est['available_bytes'])} GiB"
    lines = [
        f"memory estimate: {est['name_or_path']} ({est['model_type']})",
        f"  device           {s['device_type']}, {have} ({est['available_source']})",
        f"  precision        {s['precision']}, gradient checkpointing {'on' if s['gradient_checkpointing'] else 'off'}",
        f"  batch            {s['prompts_per_micro_batch']} prompts x {s['num_generations']} completions per "
        f"micro-batch ({s['prompts_per_step']} prompts sampled per step), {s['prompt_length']} prompt + "
        f"{s['completion_length']} completion tokens, loss.beta={s['beta']:g}",
        f"  parameters       {p['total']:,} total; LoRA r={s['lora_r']}: {p['lora_adapters']:,} adapter "
        f"parameters on {p['linear']:,} in linear layers",
    ]
    if len(est.get("layers", {})) > 1:  # a hybrid: its other layers' activations and cache are their own
        kinds = " + ".join(f"{n} {kind.replace('_', ' ')}" for kind, n in est["layers"].items() if n)
        lines.append(f"  layers           {kinds} (every row runs in full: no shared prompt)")
    reward_model = next(iter(est["methods"].values()))["reward_model"]
    if reward_model:
        lines.append(f"  reward model     {gib(reward_model)} GiB of weights, counted in weights and total")
    teacher = next(iter(est["methods"].values()))["teacher"]
    if teacher:
        lines.append(f"  teacher          {gib(teacher)} GiB of frozen weights, counted in the total")
    columns = ("weights", "gradients", "optimizer", "reference", "activations", "runtime", "total")
    header = (
        "method",
        "weights",
        "grads",
        "optimizer",
        "reference",
        "activations",
        "runtime",
        "total",
        "fits?",
    )
    rows = []
    for method, m in est["methods"].items():
        fit = "n/a (CUDA only)" if not m["usable"] else {True: "yes", False: "no", None: "?"}[m["fits"]]
        shown = {**m, "weights": m["weights"] + m["reward_model"]}  # (a reward model's, beside the policy's)
        rows.append((method, *(gib(shown[c]) for c in columns), fit))
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        cells = [
            str(c).ljust(w) if i in (0, len(r) - 1) else str(c).rjust(w)
            for i, (c, w) in enumerate(zip(r, widths))
        ]
        lines.append("  " + "  ".join(cells).rstrip())
    lines.append("  (GiB; fits? = total + 10% headroom within the device's memory; activations are rough)")
    rec = est["recommended"]
    lines.append(f"recommended: {rec['method']} ({rec['reason']})")
    return "\n".join(lines)


def _measure_lever(base: list[str], lever: str, pulls: tuple[str, ...]) -> dict[str, Any]:
    """One lever of --fit, in a process of its own (fit_report starts one per lever): the config with
    the lever's settings, built as grpo-train builds it and probed as auto probes; its row's dict."""
    from rich.console import Console

    from grpo_cli import fit
    from grpo_cli.build import build_fit_probe
    from grpo_cli.cli.common import typed_config
    from grpo_cli.distributed import Dist

    cfg = typed_config(base + list(pulls))
    parts, plan, examples, multi_turn, _ = build_fit_probe(cfg, Console(stderr=True))
    probed = fit.probe(cfg, parts, plan, examples, multi_turn, Dist())
    return fit.solve_fit(lever, tuple(pulls), probed, plan.group_cost).as_dict()


def fit_report(model: str, overrides: list[str], *, memory_gib: float | None = None) -> dict[str, Any]:
    """grpo-check-env --fit: the config as it is and each memory lever that applies to it
    (fit.levers), each in a fresh process (what one lever's models leave in the heap must not count
    toward the next one's peaks), built as grpo-train builds it on this device and probed as
    trainer.micro_batch_tokens=auto probes (fit.probe: one group at the data's longest prompt and
    sampler.max_new_tokens, G/2 rows then G). Per lever: the measured peaks, the optimizer state
    counted, and, solved from the line through the probes, the longest completion and the largest
    group that fit (fit.solve_fit). Progress and the builders' notes go to stderr."""
    import importlib.util
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from rich.console import Console

    from grpo_cli import fit, memory
    from grpo_cli.cli.common import typed_config
    from grpo_cli.precision import resolve_device, resolve_precision

    if memory_gib is not None and not memory_gib > 0:
        raise UserError(f"--memory-gib {memory_gib:g} must be > 0 (the device's memory in GiB), e.g. 24.")
    chosen = (
        [f"model={model}"] if memory.preset_source(model) is not None else [f"model.name_or_path={model}"]
    )
    if memory_gib is not None:  # (the limit auto plans for: its key needs auto set)
        chosen += ["trainer.micro_batch_tokens=auto", f"trainer.memory_limit_gib={memory_gib:g}"]
    base = chosen + list(overrides)
    cfg = typed_config(base)  # (every problem of the config said before any model loads)
    device = resolve_device(cfg.trainer.device)
    precision = resolve_precision(cfg.trainer.precision, device, adapted=cfg.adapter.name != "none").name
    available = {m for m in ("bitsandbytes", "torchao") if importlib.util.find_spec(m) is not None}
    console = Console(stderr=True)
    rows = []
    for lever, pulls in fit.levers(cfg, precision, available):
        console.print(f"[bold]--fit[/]: {lever}{' (' + ' '.join(pulls) + ')' if pulls else ''}")
        with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as one:
            rows.append(one.submit(_measure_lever, base, lever, tuple(pulls)).result())
    return {
        "model": model,
        "device": device.type,
        "precision": precision,
        "overrides": list(overrides),
        "levers": rows,
    }


def format_fit(report: dict[str, Any]) -> str:
    """The --fit table: one row per lever, measured and solved columns named."""

    def gib(n: float) -> str:
        return f"{n / 2**30:.2f}"

    first = report["levers"][0]
    prompt, completion, G = first["lengths"]
    lines = [
        f"fit: {report['model']} on the {report['device']} ({report['precision']}), one group of {G} x "
        f"({prompt} prompt + {completion} completion tokens), limit {gib(first['limit_bytes'])} GiB "
        f"({first['limit_source']})",
    ]
    header = ("lever", "probes (measured)", "optimizer", "group peak", "fits?", "longest", "largest G")
    rows = []
    for r in report["levers"]:
        probes = " / ".join(f"{gib(peak)}" for _, peak in r["probes"])
        rows.append(
            (
                r["lever"],
                probes,
                gib(r["optimizer_bytes"]),
                gib(r["group_peak_bytes"]),
                "yes" if r["fits"] else "no",
                str(r["longest_completion"]),
                str(r["largest_group"]),
            )
        )
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    lines.append(
        f"  (GiB. probes: the peak of one training forward and backward at {G // 2} then {G} rows, measured "
        "on this device; optimizer: the state the first update allocates, counted; group peak: the "
        f"larger probe + it; longest: the longest sampler.max_new_tokens at {G} rows and largest G: the "
        f"largest sampler.num_generations at {completion} tokens, both solved on the line through the "
        "probes, not measured. A lever's settings:"
    )
    for r in report["levers"][1:]:
        lines.append(f"   {r['lever']}: {' '.join(r['overrides'])}")
    lines[-1] += ")"
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="grpo-check-env",
        description="Check that this machine and install can run grpo-train; with --model, estimate "
        "whether training that model fits this device (full fine-tuning, LoRA, QLoRA).",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--model", help="a preset (qwen0.5b, smollm2-135m, tiny, ...), hub id or model folder to size up"
    )
    parser.add_argument(
        "--lora-r", type=int, default=None, help="LoRA rank of the estimate (default: adapter.r, 16)"
    )
    parser.add_argument(
        "--memory-gib", type=float, default=None, help="pretend the device has this many GiB (for planning)"
    )
    parser.add_argument(
        "--fit",
        action="store_true",
        help="with --model: load the model and measure, as trainer.micro_batch_tokens=auto does, the "
        "longest completion and the largest group that fit this device, with and without each memory "
        "lever (minutes: the model is loaded and probed once a lever)",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        help="Hydra key=value overrides as for grpo-train (e.g. loss.beta=0.04 sampler.max_new_tokens=256)",
    )
    args = parser.parse_args(argv)
    info = collect()
    try:
        if args.overrides and not args.model:
            raise UserError(
                f"the overrides {' '.join(args.overrides)} only apply to the memory estimate, which needs "
                "--model; e.g. grpo-check-env --model qwen0.5b loss.beta=0.04."
            )
        if args.fit and not args.model:
            raise UserError("--fit measures a model: name it, e.g. grpo-check-env --model qwen0.5b --fit.")
        if args.model:
            info["memory_estimate"] = memory_estimate(
                args.model, args.overrides, info, lora_r=args.lora_r, memory_gib=args.memory_gib
            )
        if args.fit:
            info["fit"] = fit_report(args.model, args.overrides, memory_gib=args.memory_gib)
    except UserError as exc:
        report_and_exit("grpo-check-env", [str(exc)])
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print(format_report(info))
        if "memory_estimate" in info:
            print(format_estimate(info["memory_estimate"]))
        if "fit" in info:
            print(format_fit(info["fit"]))
    return 1 if info["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
