"""What grpo-train does before its first GRPO step, in one place and in this order:

    start (held-out, before the warm-up) -> warm-up (sft) -> the learnable band (data.pass_rate_band)
    -> eval_before (held-out, the GRPO phase's "before") -> GRPO (engine.py)

Each stage is stored in the run and skipped on resume: the warm-up's steps in its checkpoints
(sft-N; TrainerState.sft_step, sft_done) and its end in sft-end; the band's prompts in
TrainerState.band and band.json. Evaluations are greedy and draw from no global generator, so
evaluating or not leaves a resumed run bit for bit on its course.
"""

from __future__ import annotations

import math
import time
from typing import Any

from grpo_cli import band as bands
from grpo_cli import checkpoint as ckpt
from grpo_cli import sft
from grpo_cli.adapters import is_adapted, load_reference_adapter
from grpo_cli.data import PromptStream
from grpo_cli.frozen import warmed_reference


def before_grpo(run, stop) -> dict[str, dict[str, float]]:
    """Run the stages that remain (run: engine._Run; stop: its signal flag); returns the held-out
    evaluations made, by point: `start` (before the warm-up) and `before` (before GRPO)."""
    parts, cfg, log = run.parts, run.cfg, run.log
    state, t = parts.state, cfg.trainer
    points: dict[str, dict[str, float]] = {}
    evaluate = t.eval_before and bool(parts.eval_examples) and state.step == 0
    if parts.demonstrations is not None:
        if evaluate and state.sft_step == 0:
            points["start"] = run.evaluate()
            log.log({"step": 0, "phase": "start", **points["start"]}, table=False)
        warm_up(run, stop)
    if cfg.data.pass_rate_band is not None and state.band is None and state.step == 0:
        learnable_band(run)
    if evaluate:
        points["before"] = run.evaluate()
        log.log({"step": 0, **points["before"]})
    return points


# ----------------------------------------------------------------------------- the warm-up


def warm_up(run, stop) -> None:
    """The warm-up (grpo_cli/sft.py) from where it stands: its demonstrations that the run's
    correctness reward passes, its steps (a metrics row each, `phase: sft`), a checkpoint sft-N
    every trainer.save_steps and sft-end at its end; then the KL reference becomes the warmed
    policy (sft.reference=warmed, loss.beta > 0)."""
    parts, cfg, log = run.parts, run.cfg, run.log
    state, learner, t = parts.state, parts.learner, cfg.trainer
    demos = sft.keep_passing(parts.demonstrations, parts.rollouts.rewards, parts.rollouts.tokenizer)
    per_epoch, total = sft.length(cfg, len(demos))
    log.print(
        f"warm-up: {demos.summary()}; {total} steps of {cfg.sft.batch_size} "
        f"({total / per_epoch:.3g} epochs) at learning rate {cfg.sft.learning_rate:g} ({cfg.sft.lr_scheduler})"
    )
    opt = sft.sft_optimizer(cfg, learner, total)
    if state.sft_step:  # resumed inside the warm-up: its optimizer, schedule (and fp16 scaler) as they were
        sft.restore_optimizer(opt, parts.resume, fsdp=run.fsdp)
        if opt.scaler is not None and state.grad_scaler:
            opt.scaler.load_state_dict(state.grad_scaler)
    options = sft.nll_options(learner)
    pad_id = parts.rollouts.tokenizer.pad_token_id
    log.phase("warm-up", total, state.sft_step)
    for k in range(state.sft_step + 1, total + 1):
        indices = sft.batch_indices(len(demos), cfg.sft.batch_size, t.seed, k)
        batch = sft.demonstration_batch(demos, indices, pad_id, learner.device)
        done = sft.train_step(batch, learner, opt, options)
        if not math.isfinite(done.loss) or not done.applied:
            run.diverged_in_warm_up(k, done.loss, done.grad_norm)
        state.sft_step = k
        row = {
            "step": 0,
            "phase": "sft",
            "sft/step": k,
            "sft/epoch": k / per_epoch,
            "sft/loss": done.loss,
            "sft/token_accuracy": done.token_accuracy,
            "sft/tokens": done.tokens,
            "sft/grad_norm": done.grad_norm,
            "sft/learning_rate": opt.learning_rate,
            "time/sft": done.seconds,
        }
        log.log(row, table=False)
        log.advance_phase(k, f"loss {done.loss:.3f}  token acc {done.token_accuracy:.2f}")
        if k % t.logging_steps == 0 or k == total:
            log.print(
                f"warm-up step {k}/{total}: loss {done.loss:.4f}, token accuracy {done.token_accuracy:.3f}, "
                f"{done.seconds:.1f} s"
            )
        if k == total:
            break
        if run.dist_any(stop.requested):
            run.stop_in_warm_up(stop, k, run.save(0, name=f"sft-{k:06d}", opt=opt))
        if k % t.save_steps == 0:
            run.save(0, name=f"sft-{k:06d}", opt=opt)
    state.sft_done = True
    # (its own folder in the state it saves: a resume from it, or from GRPO's later checkpoints,
    # finds the warmed reference there, whichever run folder it resumes into)
    state.warmed = str((ckpt.checkpoints_dir(run.run_dir) / ckpt.SFT_END).resolve())
    warmed = run.save(0, name=ckpt.SFT_END)  # (GRPO's fresh optimizer beside the warmed weights)
    log.end_phase()
    parts.rollouts.sampler.sync(learner.policy)  # (a sampler with its own weights: vLLM's)
    if warmed is not None:
        log.print(f"warm-up done: {total} steps; the warmed policy is {warmed}")
    _warmed_reference(run, warmed)


def _warmed_reference(run, warmed) -> None:
    """After the warm-up: the KL reference (loss.beta > 0) becomes the warmed policy, unless
    sft.reference=base: under LoRA its adapter is loaded as the policy's frozen second adapter;
    otherwise a frozen copy is loaded from sft-end."""
    cfg, parts = run.cfg, run.parts
    if cfg.loss.beta <= 0 or cfg.sft.reference != "warmed" or warmed is None:
        return
    learner = parts.learner
    if is_adapted(learner.policy):
        load_reference_adapter(learner.policy, warmed)
    else:
        learner.ref = warmed_reference(cfg, warmed, parts.placement, run.fsdp)
    run.log.print(
        f"the KL reference (loss.beta={cfg.loss.beta:g}) is the warmed policy (sft.reference=warmed)"
    )


# ----------------------------------------------------------------------------- the band


def learnable_band(run) -> None:
    """data.pass_rate_band: every training prompt's pass rate from data.band_samples samples (a
    seed stream of its own), the prompts inside the band kept (said per group, stored in the run:
    TrainerState.band, band.json); the prompt stream, the run's length and GRPO's (fresh)
    optimizer follow the kept prompts."""
    from grpo_cli.build import optimizer_step

    parts, cfg, log = run.parts, run.cfg, run.log
    d, t = cfg.data, cfg.trainer
    examples = parts.train_examples
    tick = time.perf_counter()
    rates = bands.pass_rates(parts.rollouts, examples, d.band_samples, t.seed, parts.dist)
    kept = bands.in_band(rates, d.pass_rate_band)
    report = bands.BandReport(
        kept=kept,
        total=len(examples),
        groups=bands.by_group(examples, kept, d.eval_group_by),
        completions=len(examples) * d.band_samples,
        seconds=time.perf_counter() - tick,
    )
    if len(kept) < t.prompts_per_step:
        raise bands.too_few(report, d.pass_rate_band, t.prompts_per_step)
    parts.state.band = kept
    if parts.dist.is_main:
        bands.write_band(run.run_dir, report, d.pass_rate_band, d.band_samples, rates)
    log.print(report.line(d.pass_rate_band, d.band_samples))
    log.log(
        {
            "step": 0,
            "phase": "band",
            "band/kept": len(kept),
            "band/total": len(examples),
            "band/completions": report.completions,
            "time/band": report.seconds,
        },
        table=False,
    )
    chosen = [examples[i] for i in kept]
    parts.rollouts.stream = PromptStream(chosen, seed=t.seed)
    total_steps = min(t.max_steps, t.epochs * math.ceil(len(chosen) / t.prompts_per_step))
    if total_steps != parts.total_steps:
        log.print(
            f"the run is now {total_steps} steps (trainer.epochs={t.epochs} over {len(chosen)} prompts, "
            f"trainer.max_steps={t.max_steps})"
        )
        parts.total_steps = total_steps
        log.set_total(total_steps)
        learner = parts.learner
        old = learner.opt_step
        learner.opt_step = optimizer_step(
            cfg, learner.policy, old.masters, old.scaler, total_steps, parts.dist
        )


def say_points(log, points: dict[str, Any], last_row: dict, eval_sizes: dict[str, int]) -> None:
    """The run's last lines: held-out accuracy and reward at each point (start -> after the
    warm-up -> after GRPO, or before -> after), per group too."""
    before = points.get("before", {})
    start = points.get("start")
    for key in ("eval/accuracy", "eval/reward", "eval_wide/accuracy"):
        if key not in before or key not in last_row:
            continue
        prefix = key.split("/")[0]
        which = "wide held-out" if prefix == "eval_wide" else "held-out"
        groups = [k for k in sorted(last_row) if k.startswith(key + "/") and k in before]
        if start is not None and key in start:
            by_group = [
                f"{k.split('/')[-1]} {start.get(k, math.nan):.2f} -> {before[k]:.2f} -> {last_row[k]:.2f}"
                for k in groups
            ]
            log.print(
                f"{which} {key.split('/')[1]} ({eval_sizes[prefix]} prompts, greedy): start {start[key]:.3f} -> "
                f"after warm-up {before[key]:.3f} -> after GRPO {last_row[key]:.3f}"
                + (f"; {', '.join(by_group)}" if by_group else "")
            )
            continue
        by_group = [f"{k.split('/')[-1]} {before[k]:.2f} -> {last_row[k]:.2f}" for k in groups]
        log.print(
            f"{which} {key.split('/')[1]} ({eval_sizes[prefix]} prompts, greedy): "
            f"before {before[key]:.3f} -> after {last_row[key]:.3f} "
            f"({last_row[key] - before[key]:+.3f})" + (f"; {', '.join(by_group)}" if by_group else "")
        )
