"""The GRPO training loop, one function to read top to bottom (`_train`): each step's phases,
numbered, call the functions of step.py by name

    0 the stages before GRPO (stages.py: start eval -> warm-up -> band -> eval_before), then per step
    1 sample and score -> 2 advantages -> 3 micro-batches, reference -> 4 update (optimizer step)
    -> 5 sampler sync -> 6 metrics, eval, checkpoint

It reads the typed config (config.Config) by name and runs on the parts that build.py made from
it: the sampler (samplers/), the scorer (logprobs/), the optimizer step (optim.py). What a run
keeps around the loop (checkpoints, evaluation, divergence stops) is `_Run`; the signals that
stop a run, `_StopFlag`. Rule numbers (ref 000.1, ...) are in docs/reference.md.
"""

from __future__ import annotations

import math
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from grpo_cli import checkpoint as ckpt
from grpo_cli import early, fit, guards, replay, stages
from grpo_cli import step as phases
from grpo_cli.build import Parts
from grpo_cli.config import Config
from grpo_cli.distributed import is_sharded, prompt_seed, shard
from grpo_cli.errors import Interrupted, UserError, first_line
from grpo_cli.evaluate import group_values
from grpo_cli.health import HealthMonitor
from grpo_cli.metrics import MetricsLogger, UpdateReport, UpdateStats, step_row
from grpo_cli.optim import StepResult
from grpo_cli.rewards import conversation, decode_completions
from grpo_cli.samples import Completions, step_records
from grpo_cli.scored import Batch

_OUT_OF_MEMORY = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


def train(cfg: Config, parts: Parts, run_dir: Path, config_yaml: str, on_start=None) -> dict[str, Any]:
    """Train from parts.state.step to parts.total_steps; return the last metrics row. `on_start()`
    runs right before the first step (grpo-train writes the run record there). The sampler and the
    rewards are closed at the end, however the run ends (a sweep's next job starts with its memory
    free)."""
    try:
        return _train(cfg, parts, run_dir, config_yaml, on_start)
    except Interrupted as exc:  # a second signal: the step in progress (or the save) is abandoned
        found = ckpt.list_checkpoints(run_dir)
        print(
            f"grpo-train: stopped by {exc.signal_name} at once; the step in progress was abandoned and not "
            "saved. "
            + (
                f"Latest checkpoint: {found[-1]}.\nResume with the same command plus: "
                f"hydra.run.dir={run_dir} trainer.resume=auto"
                if found
                else "No checkpoint was written yet: start the run again."
            ),
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(exc.exit_code) from None
    except _OUT_OF_MEMORY as exc:
        found = ckpt.list_checkpoints(run_dir)
        raise UserError(
            f"out of {parts.learner.device.type} memory during training ({first_line(exc, 120)}). Lower "
            "trainer.prompts_per_step, sampler.num_generations or sampler.max_new_tokens, raise "
            "trainer.gradient_accumulation_steps, or set trainer.gradient_checkpointing=true"
            + (
                f"; then resume from {found[-1]} (hydra.run.dir={run_dir} trainer.resume=auto)."
                if found
                else "."
            )
        ) from exc
    finally:
        parts.rollouts.close()


def _train(cfg: Config, parts: Parts, run_dir: Path, config_yaml: str, on_start) -> dict[str, Any]:
    t, d, state = cfg.trainer, parts.dist, parts.state
    rollouts, learner = parts.rollouts, parts.learner
    start_step, said_no_signal, last_row = state.step, False, {}
    if on_start is not None:
        on_start()
    if state.rng is not None:  # last, right before the first step: nothing may draw from the RNGs in between
        ckpt.restore_rng_state(state.rng_of(d.rank))
    run = _Run(cfg, parts, run_dir, config_yaml)
    log, health = run.log, run.health
    with log, _StopFlag(quiet=not d.is_main) as stop:
        # 0. The stages before GRPO (stages.py): start eval -> warm-up -> band -> eval_before.
        points = stages.before_grpo(run, stop)
        ended = parts.total_steps  # (the step the run ends at: early stopping may end it sooner)
        for step in range(start_step + 1, parts.total_steps + 1):
            t0 = time.perf_counter()
            fit.reset_peak(learner.device)  # (the step's peak memory: memory/peak_gib)

            # 1. Sample G completions per prompt and score them (dynamic sampling: groups with signal;
            #    trainer.replay: read back); trainer.save_rollouts keeps them as the update reads them.
            sampled = rollouts.draw(step)
            run.keep_rollouts(step, sampled)
            if sampled.train is None:  # dynamic sampling found no group with signal: skip the update
                _no_group(step, t.max_sampling_tries, health, log)
                continue

            # 2-4. The learner's step (roles.Learner.step): advantages per group (ref 004), detached,
            #    zero-std groups flagged (ref 002); this rank's micro-batches of whole groups
            #    (zero-std ones left out but on the first step, whose self-check compares every row);
            #    the reference's and the teacher's log-probs; num_iterations updates (an optimizer step
            #    each, skipped when the loss or gradient is not finite, or there is no signal).
            stepped = learner.step(sampled.train, sampled.first)
            updated = stepped.updated
            for note in updated.notes:  # (the first step's self-check)
                log.print(note)
            said_no_signal = _count_results(updated, step, run, said_no_signal)
            applied = any(result.applied for result in updated.results)
            if applied and run.bad_weights():  # a finite gradient can overflow the weights
                run.diverged(step)

            # 5. A sampler with its own copy of the weights loads the new ones.
            tick = time.perf_counter()
            if applied:
                rollouts.sampler.sync(learner.policy)
            phase = {  # where the step's time went (seconds)
                **sampled.seconds,
                **stepped.seconds,
                **updated.seconds,
                "sync": time.perf_counter() - tick if applied else 0.0,
            }

            # 6. Metrics (TRL's names), eval, completions, health; a checkpoint every save_steps.
            report = UpdateReport(updated.stats, learner.opt_step.learning_rate, t0, phase)
            row = step_row(step, stepped.batch, sampled, report) | stepped.entropy | run.memory(step)
            guards.record_step(state, step, updated.stats.faults, t)
            last_row = run.record(step, row, stepped.batch, sampled)
            if run.decides(step, last_row):  # checkpoints/best; early stopping ends the run here
                ended = step
                break
            if d.any(stop.requested) and step != parts.total_steps:  # (the last step finishes normally)
                _stop_requested(stop, step, run)
            if step % t.save_steps == 0 and step != parts.total_steps:
                run.save(step)

        path = run.save(ended)

        log.flush_table()
        if health.seen:
            log.warn(health.summary())
        log.print(f"done: {ended} steps; final checkpoint {path}; metrics in {log.path}")
        run.say_end(points, last_row, ended, path)
    return last_row


def _no_group(step: int, tries: int, health: HealthMonitor, log) -> None:
    """A step whose dynamic sampling kept no group: said, and counted by the health checks."""
    text = (
        f"step {step}: every sampled group was zero-std after {tries} tries; "
        "no update (consider harder/easier data or a higher temperature)"
    )
    log.print(text)
    log.event(step, "skipped", text)
    for warning in health.check({"step": step, "frac_reward_zero_std": 1.0}):
        log.warn(warning, step=step, kind="health")
    log.advance(step)


def _count_results(updated: phases.Updated, step: int, run: _Run, said_no_signal: bool) -> bool:
    """Each optimizer step's outcome counted: non-finite (noted), or skipped for want of signal
    (said once per run); returns whether that was said."""
    t, state = run.cfg.trainer, run.parts.state
    for result in updated.results:
        if not result.finite:
            _note_nonfinite(updated.stats, step, result, state, t, run.log)
        elif not result.applied:
            updated.stats.no_signal += 1
            said_no_signal = said_no_signal or _say_no_signal(step, run.log)
    return said_no_signal


class _Run:
    """What the loop keeps around the steps: the metrics log and the health checks, checkpoints
    (rank 0 writes; FSDP: every rank its shard), held-out evaluation (each rank its shard, sums
    all-reduced), and divergence stops."""

    def __init__(self, cfg: Config, parts: Parts, run_dir: Path, config_yaml: str):
        self.cfg, self.parts, self.run_dir, self.config_yaml = cfg, parts, run_dir, config_yaml
        t, start_step = cfg.trainer, parts.state.step
        self.log = MetricsLogger(
            run_dir,
            total_steps=parts.total_steps,
            quiet=t.quiet,
            writer=parts.dist.is_main,  # rank 0 alone writes metrics and prints
            resume_step=start_step,
            resume_sft_step=parts.state.sft_step if parts.resumed_from and not start_step else None,
            report_to=tuple(t.report_to),
            run_config=asdict(cfg),  # for W&B / Trackio
        )
        self.health = HealthMonitor(
            num_iterations=t.num_iterations,
            beta=cfg.loss.beta,
            dynamic_sampling=t.dynamic_sampling,
            enabled=t.health_checks,
            resume_step=start_step,
            mismatch_tolerance=parts.rollouts.sampler.tolerance[0],
        )
        self.resume_hint = f"Resume with the same command plus: hydra.run.dir={run_dir} trainer.resume=auto"
        self.rollout_writer = replay.writer(cfg, parts, run_dir, config_yaml)  # trainer.save_rollouts
        self._said_over_plan = False  # (memory: the step's peak over auto's plan, said once)
        self._said_best_sharded = False
        group_by = cfg.data.eval_group_by
        self.eval_sets = [  # (metric prefix, examples, their values of data.eval_group_by), found once
            (prefix, examples, group_values(examples, group_by))
            for prefix, examples in (
                ("eval", parts.eval_examples),
                ("eval_wide", parts.wide_eval_examples),
                ("val", parts.val_examples),
            )
            if examples
        ]

    def record(self, step: int, row: dict, batch: Batch, sampled: phases.Sampled) -> dict:
        """A step's row, as logged: the divergence stop (trainer.max_bad_steps: guards.record_step
        counted the step), held-out
        evaluation every trainer.eval_steps and at the end, the completions (completions.jsonl; the
        samples table on logged steps), the health warnings, the row on every logging_steps."""
        t, state, log, last = self.cfg.trainer, self.parts.state, self.log, step == self.parts.total_steps
        if state.bad_steps >= t.max_bad_steps:
            log.log(row)
            self.diverged(step)
        during = t.eval_steps and step % t.eval_steps == 0 and step >= t.eval_start
        if self.eval_sets and (during or last):
            tick = time.perf_counter()
            row.update(self.evaluate(step))
            row["time/eval"] = time.perf_counter() - tick
        logged = step % t.logging_steps == 0 or last
        if t.log_completions and self.parts.dist.is_main:
            records = _completion_records(
                batch, sampled, self.parts.rollouts.tokenizer, step, t.log_completions
            )
            log.log_samples(records, logged)
        for warning in self.health.check(row):  # each kind said once, with its fix
            log.warn(warning, step=step, kind="health")
        if logged:
            log.log(row)
        else:
            log.advance(step)
        return row

    def keep_rollouts(self, step: int, sampled: phases.Sampled) -> None:
        """trainer.save_rollouts: the step's scored rollouts and every rank's generator state, right
        before the update reads them (replay.RolloutWriter)."""
        if self.rollout_writer is not None:
            self.rollout_writer.write(step, sampled, self.parts.dist, self.cfg.trainer.seed)

    def memory(self, step: int) -> dict[str, float]:
        """The step's peak memory (memory/peak_gib: the process's peak resident set on a CPU, the
        allocator's peak on CUDA). Where trainer.micro_batch_tokens=auto planned the run and the
        step went over the plan's predicted peak, said once: the probe missed part of the step."""
        peak = fit.peak_bytes(self.parts.learner.device)
        if peak is None:
            return {}
        plan = self.parts.state.fit
        if plan and peak > plan["predicted_peak_bytes"] and not self._said_over_plan:
            self._said_over_plan = True
            gib, smaller = 2**30, max(plan["group_tokens"], plan["budget"] // 2)
            self.log.warn(
                step=step,
                kind="memory",
                text=f"memory: step {step} peaked at {peak / gib:.2f} GiB, over the "
                f"{plan['predicted_peak_bytes'] / gib:.2f} GiB that trainer.micro_batch_tokens=auto predicted "
                f"for its budget {plan['budget']} (limit "
                f"{plan['limit_bytes'] / gib:.2f} GiB): the probe did not see all of the step (its sampling, the "
                "heap that freed tensors leave resident). If the run nears the device's memory, stop it and resume "
                f"with a smaller budget pinned (trainer.micro_batch_tokens={smaller}) "
                "or a lower trainer.memory_limit_gib.",
            )
        return {"memory/peak_gib": peak / 2**30}

    def decides(self, step: int, row: dict) -> bool:
        """After an evaluation with a validation set: a new best of trainer.best_metric is written
        to checkpoints/best, and early stopping may end the run at this step (early.decide; the
        progress kept in the run's state). True: stop now."""
        t, state = self.cfg.trainer, self.parts.state
        if not self.parts.val_examples or t.best_metric not in row:
            return False
        decision = early.decide(
            early.Progress.from_dict(state.early),
            row[t.best_metric],
            step,
            patience=t.early_stopping_patience,
            target=t.early_stopping_target,
            held_out=row.get("eval/accuracy"),
            metric=t.best_metric,
        )
        state.early = decision.progress.as_dict()
        if decision.improved:
            self.save_best(step, t.best_metric, row[t.best_metric])
        if decision.stop:
            self.log.warn(f"early stopping at step {step}: {decision.reason}")
        return decision.stop

    def save_best(self, step: int, metric: str, value: float) -> None:
        """checkpoints/best (checkpoint.save_best), by rank 0; not under FSDP (said once)."""
        d, policy, opt = self.parts.dist, self.parts.learner.policy, self.parts.learner.opt_step
        if is_sharded(policy):
            if not self._said_best_sharded:
                self._said_best_sharded = True
                self.log.warn(
                    "checkpoints/best is not written under trainer.distributed=fsdp (the best step is said at the end)."
                )
            return
        if self.bad_weights():
            return
        path = None
        if d.is_main:
            path = ckpt.save_best(
                self.run_dir,
                model=policy,
                tokenizer=self.parts.rollouts.tokenizer,
                config_yaml=self.config_yaml,
                record={"metric": metric, "value": value, "step": step},
                state_dict=opt.masters.state_dict(policy) if opt.masters else None,
            )
        d.broadcast(path)

    def say_end(self, points: dict, last_row: dict, ended: int, path: Path | None) -> None:
        """The run's last lines: held-out accuracy before -> after (stages.say_points), the best step,
        and a replay's final weights against the original's at the same step."""
        parts = self.parts
        sizes = {"eval": len(parts.eval_examples), "eval_wide": len(parts.wide_eval_examples)}
        stages.say_points(self.log, points, last_row, sizes)
        self.say_best(last_row)
        saved = parts.rollouts.saved
        if saved is not None and parts.dist.is_main:
            if said := replay.compare_weights(saved.run_dir, path, ended):
                self.log.print(said)

    def say_best(self, last_row: dict) -> None:
        """The run's last line on its best step: the metric there, and the held-out accuracy at that
        step beside the last one's (chosen on the validation set, reported on the held-out set)."""
        progress = early.Progress.from_dict(self.parts.state.early)
        if not progress.best_step:
            return
        metric = self.cfg.trainer.best_metric
        held = ""
        if progress.best_held_out is not None and "eval/accuracy" in last_row:
            held = f"; held-out accuracy there {progress.best_held_out:.3f}, at the end {last_row['eval/accuracy']:.3f}"
        where = ckpt.checkpoints_dir(self.run_dir) / ckpt.BEST
        self.log.print(f"best: step {progress.best_step} ({metric} {progress.best:.3f}{held}); {where}")

    def bad_weights(self) -> list[str]:
        """Parameters holding a NaN or an infinity, decided alike on every process (FSDP: each
        checks its shard)."""
        bad = guards.nonfinite_params(self.parts.learner.policy)
        anywhere = self.parts.dist.any(bool(bad))  # (every process takes part: a collective)
        return bad or (["a parameter of another process"] if anywhere else [])

    def diverged(self, step: int) -> None:
        bad_params = self.bad_weights()
        self.log.flush_table()
        if bad_params:
            guards.stop_nonfinite_weights(bad_params, step, self.run_dir)
        guards.stop_diverged(
            self.parts.state,
            step,
            max_bad_steps=self.cfg.trainer.max_bad_steps,
            save=self.save,
            resume_hint=self.resume_hint,
        )

    @property
    def fsdp(self) -> bool:
        return is_sharded(self.parts.learner.policy)

    def dist_any(self, flag: bool) -> bool:
        return self.parts.dist.any(flag)

    def save(self, step: int, *, name: str | None = None, opt=None) -> Path | None:
        """Checkpoint step-<step>, or `name` (the warm-up's sft-N, sft-end: with its optimizer
        step `opt`, default GRPO's)."""
        d, state, policy = self.parts.dist, self.parts.state, self.parts.learner.policy
        opt = opt or self.parts.learner.opt_step
        bad = self.bad_weights()
        if bad:  # never write weights that would load but are garbage
            self.log.warn(
                f"step {step}: the weights are not finite (e.g. {', '.join(bad)}); checkpoint not written."
            )
            return None
        state.step, state.stream = step, self.parts.rollouts.stream.state()
        state.grad_scaler = opt.scaler_state()
        rng_ranks = d.gather(ckpt.rng_state())  # every rank's; rank 0 writes the checkpoint
        path, tick = None, time.perf_counter()
        if d.is_main or is_sharded(policy):  # (FSDP: every process writes its shard)
            path = ckpt.save_checkpoint(
                self.run_dir,
                state,
                model=policy,
                tokenizer=self.parts.rollouts.tokenizer,
                optimizer=opt.optimizer,
                scheduler=opt.scheduler,
                config_yaml=self.config_yaml,
                keep_last=self.cfg.trainer.keep_last,
                rng_ranks=rng_ranks,
                dist=d,
                state_dict=opt.masters.state_dict(policy) if opt.masters else None,  # the fp32 weights
                name=name,
            )
        path = d.broadcast(path)  # no rank runs ahead of a checkpoint being written
        if name is None and path is not None:  # (GRPO's: the timeline's checkpoint seconds)
            self.log.event(step, "checkpoint", str(path), seconds=round(time.perf_counter() - tick, 3))
        return path

    def diverged_in_warm_up(self, k: int, loss: float, grad_norm: float) -> None:
        """A warm-up step whose loss or gradient was not finite: stop, naming the fix (no
        skip-and-continue there: a supervised loss that overflows will again)."""
        found = ckpt.list_checkpoints(self.run_dir)
        raise UserError(
            f"warm-up step {k}: the loss ({loss}) or the gradient (norm {grad_norm}) is not finite, so the update "
            f"was not applied. Lower sft.learning_rate (it is {self.cfg.sft.learning_rate:g}), or use "
            "trainer.precision=fp32" + (f"; latest checkpoint: {found[-1]}." if found else ".")
        )

    def stop_in_warm_up(self, stop: _StopFlag, k: int, path: Path | None) -> None:
        """After a SIGINT/SIGTERM inside the warm-up: its checkpoint sft-k written, say how to resume."""
        self.log.warn(
            f"grpo-train: stopped by {stop.signal_name} after warm-up step {k}; checkpoint {path}.\n{self.resume_hint}"
        )
        raise SystemExit(stop.exit_code)

    def evaluate(self, step: int = 0) -> dict[str, float]:
        """The held-out set, the wide one (operands outside training's) and the validation set,
        where there are, greedy, with accuracy per value of data.eval_group_by (kind of problem);
        with trainer.eval_samples k, also k sampled completions a prompt (pass@1, pass@k), each
        prompt from its own seed (prompt_seed of the step, on a key no training draw uses): the
        training's draws do not depend on whether the run evaluates this way."""
        d, out, k = self.parts.dist, {}, self.cfg.trainer.eval_samples
        for prefix, examples, groups in self.eval_sets:
            indices = shard(len(examples), d.rank, d.world_size)
            mine = [examples[i] for i in indices]
            out |= self.parts.rollouts.evaluate(mine, prefix, groups)
            if k:
                seeds = [prompt_seed(self.cfg.trainer.seed, -1 - step, i) for i in indices]
                out |= self.parts.rollouts.evaluate(mine, prefix, groups, samples=k, seeds=seeds)
        return out


def _completion_records(
    batch: Batch, sampled: phases.Sampled, tokenizer, step: int, limit: int
) -> list[dict]:
    """The first `limit` completions of the batch trained on, as completions.jsonl records."""
    n = min(limit, batch.rewards.shape[0])
    r = batch.rollout
    texts = decode_completions(tokenizer, r.completion_ids[:n], r.attention_mask[:n])
    if r.is_episode:  # every turn, with who wrote it
        texts = [
            " ".join(f"[{m['role']}] {m['content']}" for m in conversation(tokenizer, ids, roles))
            for ids, roles in zip(r.completion_ids[:n], r.roles[:n])
        ]

    # fp32 values to 8 significant digits (fp32 holds about 7): 1.2, not 1.2000000476837158.
    def floats(t: torch.Tensor) -> list:
        return [float(f"{v:.8g}") for v in t.tolist()]

    values = [floats(column) for column in batch.reward_values[:n].T]  # [R][n]
    completions = Completions(
        prompts=[sampled.examples[i].prompt for i in batch.prompt_index[:n].tolist()]
        if sampled.examples
        else decode_completions(tokenizer, r.prompt_ids[:n], r.prompt_mask[:n]),  # (a replay: from its ids)
        texts=texts,
        reward_values={
            name: [None if math.isnan(v) else v for v in column]
            for name, column in zip(sampled.drawn.names, values)
        },
        totals=floats(batch.rewards[:n]),
        advantages=floats(batch.advantages[:n]),
        lengths=r.lengths[:n].tolist(),
        truncated=r.truncated[:n].tolist(),
        zero_std=batch.zero_std[:n].tolist(),
        extra={name: list(column[:n]) for name, column in sampled.train.extra.items()},
    )
    return step_records(step, completions, batch.num_generations)


def _note_nonfinite(updates: UpdateStats, step: int, result: StepResult, state, t, log) -> None:
    """A skipped update with a non-finite loss or gradient: warn, and count it toward
    trainer.max_bad_steps unless fp16's grad scaler handles it."""
    loss, grad_norm, where, scale = result.loss, result.grad_norm, result.nonfinite_where, result.scale
    what = "loss" if not math.isfinite(loss) else "gradient"
    # fp16: an overflowing gradient is the grad scaler's business (it lowers its scale and skips)
    # until the scale is below 1, where scaling cannot help.
    benign = scale is not None and what == "gradient" and scale >= 1.0
    note = f"; grad scaler lowers its scale to {scale:g}" if scale is not None else ""
    if benign:
        updates.scaler_skips += 1
    else:
        updates.faults.append(f"step {step}: non-finite {what} (loss={loss}, grad_norm={grad_norm}{where})")
    log.warn(
        f"step {step}: non-finite {what} (loss={loss}, grad_norm={grad_norm}{where}); optimizer step "
        f"skipped{note}"
        + ("" if benign else f" ({state.bad_steps + 1} of trainer.max_bad_steps={t.max_bad_steps} in a row)"),
        step=step,
        kind="nonfinite",
    )


def _say_no_signal(step: int, log) -> bool:
    log.warn(
        f"step {step}: no learning signal (every group's rewards are equal, or no completion token enters "
        "the loss), so the optimizer and scheduler step was skipped and the weights did not move. Such steps "
        "are counted in skipped_updates/no_signal (said once). If they are frequent: "
        "trainer.dynamic_sampling=true, sampler.max_generations=32 (more completions for a prompt whose "
        "group scored alike), a higher sampler.temperature, or data of a difficulty the model "
        "sometimes solves."
    )
    return True


def _stop_requested(stop: _StopFlag, step: int, run: _Run) -> None:
    """After a SIGINT/SIGTERM: save this step, say how to resume, exit 130/143."""
    total_steps, log = run.parts.total_steps, run.log
    path = run.save(step)
    log.flush_table()
    found = ckpt.list_checkpoints(run.run_dir)
    log.warn(
        f"grpo-train: stopped by {stop.signal_name} after step {step} of {total_steps}; "
        + (
            f"checkpoint {path}.\n{run.resume_hint}"
            if path
            else f"no checkpoint written (the weights are not finite); latest: {found[-1] if found else 'none'}."
        )
    )
    raise SystemExit(stop.exit_code)


class _StopFlag:
    """SIGINT/SIGTERM finish the current step, save a checkpoint and exit 130/143; a second one
    abandons the step (or the checkpoint being written) and exits at once."""

    def __init__(self, quiet: bool = False):
        self.quiet = quiet  # ranks other than 0 take the signal without a word
        self.requested = False
        self.signal_name = ""
        self.exit_code = 0
        self._previous = {}

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self.requested:  # second signal: abandon the step now
            raise Interrupted(name, 128 + signum)
        self.requested = True
        self.signal_name = name
        self.exit_code = 128 + signum
        if self.quiet:
            return
        print(
            f"grpo-train: {name} received; finishing this step, then saving a checkpoint "
            "(send it again to stop at once without saving this step).",
            file=sys.stderr,
            flush=True,
        )

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                pass
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        return False
