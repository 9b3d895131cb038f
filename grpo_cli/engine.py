"""The GRPO training loop, one function to read top to bottom (`train`):

    sample -> score -> advantages -> (reference log-probs) -> loss/backward per micro-batch
           -> clip -> optimizer step -> metrics, eval, checkpoint

It reads the typed config (config.Config) by name and runs on the parts that build.py made from
it. The math is in loss.py, the log-probs in logprobs.py, sampling in rollout.py, the step-0
self-check in selfcheck.py, the divergence guards in guards.py, the metrics row in metrics.py
and the resume state in checkpoint.py. Rule numbers (ref 000.1, ...) are in docs/reference.md.
"""

from __future__ import annotations

import math
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from grpo_cli import checkpoint as ckpt
from grpo_cli import guards, selfcheck
from grpo_cli.adapters import disabled_adapters
from grpo_cli.build import Parts, sampler_kwargs
from grpo_cli.config import Config
from grpo_cli.distributed import full_weights, gradient_sync, is_sharded, prompt_seed, shard
from grpo_cli.errors import Interrupted, UserError, first_line
from grpo_cli.evaluate import decode_completions, evaluate, group_values, score_examples
from grpo_cli.health import HealthMonitor
from grpo_cli.logprobs import token_logprobs
from grpo_cli.loss import (
    group_advantages,
    grpo_loss,
    has_learning_signal,
    loss_normalizers,
    truncated_importance_weights,
    zero_std_groups,
)
from grpo_cli.metrics import MetricsLogger, UpdateStats, step_row
from grpo_cli.precision import autocast
from grpo_cli.rollout import Rollout, concat, sample, select
from grpo_cli.samples import step_records
from grpo_cli.selfcheck import compare_logprobs

_OUT_OF_MEMORY = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


def train(cfg: Config, parts: Parts, run_dir: Path, config_yaml: str, on_start=None) -> dict[str, Any]:
    """Train from parts.state.step to parts.total_steps; return the last metrics row. `on_start()`
    runs right before the first step (grpo-train writes the run record there)."""
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
            f"out of {parts.device.type} memory during training ({first_line(exc, 120)}). Lower "
            "trainer.prompts_per_step, sampler.num_generations or sampler.max_new_tokens, raise "
            "trainer.gradient_accumulation_steps, or set trainer.gradient_checkpointing=true"
            + (
                f"; then resume from {found[-1]} (hydra.run.dir={run_dir} trainer.resume=auto)."
                if found
                else "."
            )
        ) from exc


def _train(cfg: Config, parts: Parts, run_dir: Path, config_yaml: str, on_start) -> dict[str, Any]:
    t, s, lo = cfg.trainer, cfg.sampler, cfg.loss
    policy, ref, optimizer, scheduler, state = (
        parts.policy,
        parts.ref,
        parts.optimizer,
        parts.scheduler,
        parts.state,
    )
    device, precision, G, d = parts.device, parts.precision, s.num_generations, parts.dist
    # What the optimizer updates, grad clipping and grad_norm cover: every weight, or the adapters';
    # under trainer.precision=bf16 the fp32 master copies of the (bf16) model's weights.
    masters = parts.masters
    trainable = masters.params if masters else [p for p in policy.parameters() if p.requires_grad]
    scorer = (
        parts.scorer
    )  # the training forward: token_logprobs as a module (under DDP with several processes)
    scaler = torch.amp.GradScaler(device.type) if precision.use_grad_scaler else None
    if scaler is not None and state.grad_scaler:
        scaler.load_state_dict(state.grad_scaler)
    start_step, said_no_signal, last_row, before = state.step, False, {}, {}
    resume_hint = f"Resume with the same command plus: hydra.run.dir={run_dir} trainer.resume=auto"

    def bad_weights() -> list[str]:
        """Parameters holding a NaN or an infinity, decided alike on every process (FSDP: each
        checks its shard)."""
        bad = guards.nonfinite_params(policy)
        anywhere = d.any(bool(bad))  # (every process takes part: a collective)
        return bad or (["a parameter of another process"] if anywhere else [])

    def diverged(step: int) -> None:
        guards.stop_diverged(
            bad_weights(),
            state,
            step,
            max_bad_steps=t.max_bad_steps,
            save=save,
            run_dir=run_dir,
            resume_hint=resume_hint,
            log=log,
        )

    def save(step: int) -> Path | None:
        bad = bad_weights()
        if bad:  # never write weights that would load but are garbage
            log.warn(
                f"step {step}: the weights are not finite (e.g. {', '.join(bad)}); checkpoint not written."
            )
            return None
        state.step, state.stream = step, parts.stream.state()
        state.grad_scaler = scaler.state_dict() if scaler else {}
        rng_ranks = d.gather(ckpt.rng_state())  # every rank's; rank 0 writes the checkpoint
        path = None
        if d.is_main or is_sharded(policy):  # (FSDP: every process writes its shard)
            path = ckpt.save_checkpoint(
                run_dir,
                state,
                model=policy,
                tokenizer=parts.tokenizer,
                optimizer=optimizer,
                scheduler=scheduler,
                config_yaml=config_yaml,
                keep_last=t.keep_last,
                rng_ranks=rng_ranks,
                dist=d,
                state_dict=masters.state_dict(policy) if masters else None,  # the fp32 weights
            )
        return d.broadcast(path)  # no rank runs ahead of a checkpoint being written

    group_by = cfg.data.eval_group_by
    eval_sets = [  # (metric prefix, examples, their values of data.eval_group_by), found once
        (prefix, examples, group_values(examples, group_by))
        for prefix, examples in (("eval", parts.eval_examples), ("eval_wide", parts.wide_eval_examples))
        if examples
    ]

    def run_eval() -> dict[str, float]:
        # The held-out set, and the wide one (operands outside training's) when there is one,
        # with accuracy per value of data.eval_group_by (operation). Each rank evaluates its
        # shard; the sums are all-reduced (d.sum).
        out: dict[str, float] = {}
        for prefix, examples, groups in eval_sets:
            mine = [examples[i] for i in shard(len(examples), d.rank, d.world_size)]
            with autocast(device, precision), full_weights(policy):
                out |= evaluate(
                    policy,
                    parts.tokenizer,
                    mine,
                    parts.rewards,
                    reduce=d.sum,
                    prefix=prefix,
                    group_by=group_by,
                    groups=groups,
                    eos_ids=parts.eos_ids,
                    pad_id=parts.tokenizer.pad_token_id,
                    **sampler_kwargs(s, num_generations=1, greedy=True, fast_decode=parts.fast_paths),
                )
        return out

    if on_start is not None:
        on_start()
    if state.rng is not None:  # last, right before the first step: nothing may draw from the RNGs in between
        ckpt.restore_rng_state(state.rng_of(d.rank))
    log = MetricsLogger(
        run_dir,
        total_steps=parts.total_steps,
        quiet=t.quiet,
        writer=d.is_main,  # rank 0 alone writes metrics and prints
        resume_step=start_step,
        report_to=tuple(t.report_to),
        run_config=asdict(cfg),  # for W&B / Trackio
    )
    health = HealthMonitor(
        num_iterations=t.num_iterations,
        beta=lo.beta,
        dynamic_sampling=t.dynamic_sampling,
        enabled=t.health_checks,
        resume_step=start_step,
    )
    with log, _StopFlag(quiet=not d.is_main) as stop:
        if t.eval_before and parts.eval_examples and not parts.resumed_from:
            before = run_eval()
            log.log({"step": 0, **before})
        for step in range(start_step + 1, parts.total_steps + 1):
            t0 = time.perf_counter()
            phase = dict.fromkeys(("rollout", "reward", "reference", "policy", "optimizer"), 0.0)

            # 1. Sample G completions per prompt and score them (dynamic sampling: groups with signal).
            sampled = _sample_groups(cfg, parts, phase, step)
            if sampled.batch is None:  # dynamic sampling found no group with signal: skip the update
                log.print(
                    f"step {step}: every sampled group was zero-std after {t.max_sampling_tries} tries; "
                    "no update (consider harder/easier data or a higher temperature)"
                )
                for warning in health.check({"step": step, "frac_reward_zero_std": 1.0}):
                    log.warn(warning)
                log.advance(step)
                continue
            batch = sampled.batch

            # 2. Advantages per group (ref 004), detached; zero-std groups flagged (ref 002); the
            #    step's loss normalisers; whether the step has any learning signal at all.
            norms, signal_ = _advantages(cfg, batch, device)

            # 3. Micro-batches of whole groups (this rank's shard of them, distributed.py);
            #    reference log-probs once per rollout (beta > 0).
            mine = shard(batch.rewards.shape[0] // G, d.rank, d.world_size)
            micro_rows = _micro_batches(
                mine, G, t.prompts_per_step // (t.gradient_accumulation_steps * d.world_size)
            )
            # Every rank runs as many micro-batches (DDP reduces in the last backward, FSDP2's
            # forward and backward are collectives): one with fewer groups (dynamic sampling kept
            # fewer than prompts_per_step) makes up the count with a group at weight 0.
            real = len(micro_rows)
            if d.enabled:
                micro_rows += [torch.arange(G)] * (int(d.max([real])[0]) - real)
            tick = time.perf_counter()
            if ref is not None:
                with disabled_adapters(
                    ref
                ):  # with LoRA, ref is the policy: its adapters off = the base model
                    batch.ref_logps = _reference_logprobs(
                        ref, batch, micro_rows, s.temperature, precision, parts.fast_paths
                    )
            phase["reference"] += time.perf_counter() - tick

            # 4. num_iterations updates on this rollout, each accumulating the gradient over shuffled
            #    micro-batches. The ratio's old log-probs are the trainer's own, detached, from before
            #    the first update (ref 000.1): on iteration 0 this very forward (ratio exactly 1 in any
            #    precision), later iterations reuse them. The sampler's log-probs measure the
            #    sampler/trainer mismatch and feed the optional TIS correction.
            updates, check = UpdateStats(grad_scaler=scaler is not None), None
            old_logps = torch.zeros_like(batch.sampler_logps) if t.num_iterations > 1 else None  # [N, C]
            is_weights = (
                torch.ones_like(batch.sampler_logps) if lo.sampler_correction == "tis" else None
            )  # TIS
            applied = 0
            for iteration in range(t.num_iterations):
                order = torch.randperm(len(micro_rows)).tolist()
                loss_total = 0.0
                updates.new_iteration()
                tick = time.perf_counter()
                for n, k in enumerate(order):
                    rows = micro_rows[k]
                    mb = batch.rows(rows)
                    C = mb.completion_ids.shape[1]
                    # Several processes: DDP all-reduces the gradients in the last backward only.
                    last = n == len(order) - 1
                    with gradient_sync(scorer, last), autocast(device, precision):
                        logps, entropy = scorer(*mb.inputs())  # token_logprobs, [b, C] each
                    logps = logps.float()  # [b, C]
                    if k >= real:  # a stand-in micro-batch: zero gradients, reduced with the others
                        with gradient_sync(scorer, last):
                            (logps.nan_to_num().sum() * 0.0).backward()  # zero gradients, all-reduced
                        continue
                    if iteration == 0:
                        old = logps.detach()  # [b, C]
                        if old_logps is not None:
                            old_logps[rows, :C] = old
                        mismatch = compare_logprobs(old, mb.sampler_logps, mb.completion_mask, precision.name)
                        updates.add_mismatch(mismatch)
                        if is_weights is not None:  # [N, C]
                            is_weights[rows, :C] = truncated_importance_weights(
                                old, mb.sampler_logps, mb.completion_mask, cap=lo.tis_cap
                            )
                        if t.self_check and not parts.resumed_from and step == start_step + 1:
                            check = selfcheck.check_micro_batch(
                                policy, mismatch, mb, precision.name, s.temperature, check
                            )
                    else:
                        old = old_logps[rows, :C]
                    loss, stats = _loss(
                        cfg, logps, old, mb, norms, None if is_weights is None else is_weights[rows, :C]
                    )
                    # DDP averages the ranks' gradients: times W, their sum is the one-process gradient.
                    scaled = loss * d.world_size if d.enabled else loss
                    with gradient_sync(scorer, last):
                        (scaler.scale(scaled) if scaler else scaled).backward()
                    if masters and not d.enabled:  # bf16: sum the micro-batches in fp32
                        masters.take_grads()
                    loss_total += float(loss.detach())
                    updates.add(stats, entropy, mb.completion_mask)
                if iteration == 0 and check is not None:
                    selfcheck.report(check, batch.advantages, batch.zero_std, len(micro_rows), log)
                phase["policy"] += time.perf_counter() - tick

                # 5. Clip (log the pre-clip norm: what clip_grad_norm_ returns, ref 000.7), step. A
                #    non-finite loss or gradient skips the update (weights stay as they were), and so
                #    does a step without learning signal (ref 002): its gradient is 0, but AdamW's
                #    momentum and weight decay would still move the weights.
                tick = time.perf_counter()
                loss_total = d.sum([loss_total])[0]  # the step's loss: every rank decides alike
                if masters:  # (DDP: the ranks' bf16 sum, reduced in the last backward) into fp32
                    masters.take_grads()
                if scaler:
                    scaler.unscale_(optimizer)
                grad_norm = torch.nn.utils.clip_grad_norm_(trainable, cfg.optimizer.max_grad_norm)
                grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
                updates.update(loss_total, grad_norm)
                finite = math.isfinite(loss_total) and math.isfinite(grad_norm)
                if not finite or not signal_:
                    where = (
                        ""
                        if finite or not math.isfinite(loss_total)
                        else guards.nonfinite_grads(masters or policy)
                    )
                    optimizer.zero_grad(set_to_none=True)
                    if scaler:
                        scaler.update()
                    if not finite:
                        _note_nonfinite(updates, step, loss_total, grad_norm, where, scaler, state, t, log)
                    else:
                        updates.no_signal += 1
                        said_no_signal = said_no_signal or _say_no_signal(step, log)
                    continue
                if scaler:
                    scaler.step(optimizer)
                    scaler.update()
                else:
                    optimizer.step()
                if masters:  # the updated fp32 weights, rounded, into the bf16 model
                    masters.put_weights()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                applied += 1
                phase["optimizer"] += time.perf_counter() - tick
            if applied and bad_weights():  # a finite gradient can overflow the weights
                diverged(step)

            # 6. Metrics (TRL's names), eval, checkpoint.
            updates.all_reduce(d)
            row = step_row(
                step, batch, sampled, updates, t.num_iterations, scheduler.get_last_lr()[0], t0, phase
            )
            guards.record_step(state, step, updates.faults, t.max_bad_steps, t.num_iterations)
            if state.bad_steps >= t.max_bad_steps:
                log.log(row)
                diverged(step)
            if parts.eval_examples and (
                (t.eval_steps and step % t.eval_steps == 0) or step == parts.total_steps
            ):
                row.update(run_eval())
            logged = step % t.logging_steps == 0 or step == parts.total_steps
            if t.log_completions and d.is_main:  # completions.jsonl; the samples table on logged steps
                log.log_samples(
                    _completion_records(batch, sampled, parts.tokenizer, step, t.log_completions), logged
                )
            for warning in health.check(row):  # each kind said once, with its fix
                log.warn(warning)
            if logged:
                log.log(row)
            else:
                log.advance(step)
            last_row = row
            # (On the last step: finish normally.) Every rank stops at the same step.
            if d.any(stop.requested) and step != parts.total_steps:
                _stop_requested(stop, step, parts.total_steps, save, run_dir, resume_hint, log)
            if step % t.save_steps == 0 and step != parts.total_steps:
                save(step)

        path = save(parts.total_steps)
        log.flush_table()
        if health.seen:
            log.warn(health.summary())
        log.print(f"done: {parts.total_steps} steps; final checkpoint {path}; metrics in {log.path}")
        for key in ("eval/accuracy", "eval/reward", "eval_wide/accuracy"):
            if key in before and key in last_row:
                which = "wide held-out" if key.startswith("eval_wide") else "held-out"
                n = len(parts.wide_eval_examples if key.startswith("eval_wide") else parts.eval_examples)
                by_group = [
                    f"{k.split('/')[-1]} {before[k]:.2f} -> {last_row[k]:.2f}"
                    for k in sorted(last_row)
                    if k.startswith(key + "/") and k in before
                ]
                log.print(
                    f"{which} {key.split('/')[1]} ({n} prompts, greedy): "
                    f"before {before[key]:.3f} -> after {last_row[key]:.3f} "
                    f"({last_row[key] - before[key]:+.3f})" + (f"; {', '.join(by_group)}" if by_group else "")
                )
    return last_row


def _completion_records(batch: Rollout, sampled: Sampled, tokenizer, step: int, limit: int) -> list[dict]:
    """The first `limit` completions of the rollout trained on, as completions.jsonl records."""
    n = min(limit, batch.rewards.shape[0])
    texts = decode_completions(tokenizer, batch.completion_ids[:n], batch.completion_mask[:n])

    # fp32 values to 8 significant digits (fp32 holds about 7): 1.2, not 1.2000000476837158.
    def floats(t: torch.Tensor) -> list:
        return [float(f"{v:.8g}") for v in t.tolist()]

    values = [floats(column) for column in batch.reward_values[:n].T]  # [R][n]
    return step_records(
        step,
        prompts=[sampled.examples[i].prompt for i in batch.prompt_index[:n].tolist()],
        texts=texts,
        reward_values={
            name: [None if math.isnan(v) else v for v in column]
            for name, column in zip(sampled.per_reward, values)
        },
        totals=floats(batch.rewards[:n]),
        advantages=floats(batch.advantages[:n]),
        lengths=batch.lengths[:n].tolist(),
        truncated=batch.truncated[:n].tolist(),
        zero_std=batch.zero_std[:n].tolist(),
        group_size=sampled.group_size,
    )


def _loss(cfg: Config, logps, old_logps, mb: Rollout, norms: tuple[int, int], importance_weights):
    """grpo_loss of one micro-batch `mb`, with the loss group's settings spelled out by name (its
    single call site); `norms`: the step's (num_sequences, num_tokens), from loss_normalizers."""
    lo = cfg.loss
    num_sequences, num_tokens = norms
    return grpo_loss(
        logps,
        old_logps,
        mb.ref_logps,
        mb.advantages,
        mb.loss_mask,
        beta=lo.beta,
        epsilon=lo.epsilon,
        epsilon_high=lo.epsilon_high,
        delta=lo.delta,
        importance_sampling_level=lo.importance_sampling_level,
        kl_estimator=lo.kl_estimator,
        loss_type=lo.loss_type,
        zero_std=lo.zero_std,
        zero_std_flags=mb.zero_std,
        group_std=mb.group_std,
        num_sequences=num_sequences,
        num_tokens=num_tokens,
        max_new_tokens=cfg.sampler.max_new_tokens,
        group_size=cfg.sampler.num_generations,
        importance_weights=importance_weights,
    )


def _advantages(cfg: Config, batch: Rollout, device) -> tuple[tuple[int, int], bool]:
    """Fill the scored batch's advantages, zero-std flags, group stds and loss mask; return the
    step's loss normalisers (num_sequences, num_tokens) and whether it has any learning signal."""
    lo, G = cfg.loss, cfg.sampler.num_generations
    advantages, zero_std, group_std = group_advantages(
        batch.rewards,
        G,
        scale_rewards=lo.scale_rewards,
        std=lo.std,
        eps=lo.eps,
        estimator=lo.estimator,
        zero_std_threshold=lo.zero_std_threshold,
    )
    batch.advantages, batch.zero_std, batch.group_std = (
        advantages.to(device),
        zero_std.to(device),
        group_std.to(device),
    )
    batch.loss_mask = batch.completion_mask.clone()  # [N, C]
    if lo.mask_truncated_completions:
        batch.loss_mask[batch.truncated] = 0
    norms = loss_normalizers(batch.loss_mask, batch.zero_std, zero_std_mode=lo.zero_std)
    signal = has_learning_signal(
        batch.advantages, batch.loss_mask, batch.zero_std, zero_std_mode=lo.zero_std, beta=lo.beta
    )
    return norms, signal


def _micro_batches(groups: range, G: int, prompts_per_micro_batch: int) -> list[torch.Tensor]:
    """Row indices of each micro-batch: whole groups of G consecutive rows (ref 004), of the
    groups `groups` (this rank's)."""
    return [
        torch.arange(i * G, min(i + prompts_per_micro_batch, groups.stop) * G)
        for i in range(groups.start, groups.stop, prompts_per_micro_batch)
    ]


@dataclass
class Sampled:
    """One step's sampling: the rollout to train on (None when dynamic sampling kept no group), and
    what was drawn in all: every sampled group's per-reward values and totals, how many groups,
    how many of them zero-std."""

    batch: Rollout | None
    group_size: int  # G
    per_reward: dict[str, list] = field(default_factory=dict)
    totals: list[float] = field(default_factory=list)
    groups: int = 0
    zero_std_groups: int = 0
    examples: list = field(default_factory=list)  # every drawn example (rollout.prompt_index's list)


def _sample_groups(cfg: Config, parts: Parts, phase: dict[str, float], step: int) -> Sampled:
    """trainer.prompts_per_step prompts, G completions each, scored. With trainer.dynamic_sampling
    (DAPO), zero-std groups are dropped and more prompts are sampled (up to max_sampling_tries
    rollouts) to fill the step with groups that carry signal.

    Prompt i of the step's draw is sampled from its own seed (seed, step, i). With several
    processes each rank samples and scores its shard of the prompts, and the scored rollouts are
    gathered: every rank then holds the whole step, in the order one process would have it."""
    t, s, G, d = cfg.trainer, cfg.sampler, cfg.sampler.num_generations, parts.dist
    sampled, kept, drawn = Sampled(batch=None, group_size=G), [], 0
    for _ in range(t.max_sampling_tries if t.dynamic_sampling else 1):
        examples = parts.stream.take(t.prompts_per_step - len(kept))  # the same on every rank
        mine = shard(len(examples), d.rank, d.world_size)
        seeds = [prompt_seed(t.seed, step, drawn + i) for i in mine]
        drawn += len(examples)
        scored = None
        # (FSDP: every process gathers the weights, a collective, even one with nothing to sample.)
        with full_weights(parts.policy):
            if len(mine):
                tick = time.perf_counter()
                parts.policy.eval()
                with autocast(parts.device, parts.precision):
                    rollout = sample(
                        parts.policy,
                        [examples[i].prompt_ids for i in mine],
                        eos_ids=[] if s.ignore_eos else parts.eos_ids,
                        pad_id=parts.tokenizer.pad_token_id,
                        seeds=seeds,
                        **sampler_kwargs(s, fast_decode=parts.fast_paths),
                    )
                parts.policy.train()
                phase["rollout"] += time.perf_counter() - tick
                tick = time.perf_counter()
                _, total, per_reward = score_examples(
                    parts.rewards, parts.tokenizer, [examples[i] for i in mine], rollout, G
                )
                phase["reward"] += time.perf_counter() - tick
                scored = (rollout, total, per_reward)
        rollout, total, per_reward = _gather_scored(d, scored, parts.device, parts.tokenizer.pad_token_id)
        rollout.rewards = torch.tensor(total, dtype=torch.float32, device=parts.device)  # [n*G]
        rollout.prompt_index = torch.arange(
            len(sampled.examples), len(sampled.examples) + len(examples), device=parts.device
        ).repeat_interleave(G)  # [n*G]
        rollout.reward_values = torch.tensor(  # [n*G, R], None as NaN
            [[math.nan if v is None else v for v in values] for values in per_reward.values()],
            dtype=torch.float32,
            device=parts.device,
        ).T
        sampled.examples += examples
        zero = zero_std_groups(
            rollout.rewards, G, std=cfg.loss.std, zero_std_threshold=cfg.loss.zero_std_threshold
        )
        sampled.zero_std_groups += int(zero.sum())
        sampled.groups += len(examples)
        sampled.totals += total
        for name, values in per_reward.items():
            sampled.per_reward.setdefault(name, []).extend(values)
        keep = ~zero if t.dynamic_sampling else torch.ones_like(zero)
        kept += [
            select(rollout, torch.arange(g * G, (g + 1) * G, device=parts.device))
            for g in torch.nonzero(keep).flatten().tolist()
        ]
        if len(kept) >= t.prompts_per_step:
            break
    if kept:
        sampled.batch = concat(kept[: t.prompts_per_step], parts.tokenizer.pad_token_id)
    return sampled


def _gather_scored(d, scored, device, pad_id: int):
    """Every rank's (rollout, totals, per-reward values), joined in rank order (= prompt order)."""
    if not d.enabled:
        return scored
    cpu = None if scored is None else (scored[0].to("cpu"), scored[1], scored[2])
    parts = [p for p in d.gather(cpu) if p is not None]
    rollout = concat([p[0] for p in parts], pad_id).to(device)
    per_reward: dict[str, list] = {}
    for p in parts:
        for name, values in p[2].items():
            per_reward.setdefault(name, []).extend(values)
    return rollout, [v for p in parts for v in p[1]], per_reward


def _reference_logprobs(
    ref, batch: Rollout, micro_rows: list[torch.Tensor], temperature: float, precision, shared_prompt: bool
):
    """The reference model's log-probs [N, C] of the rollout's completions, micro-batch by micro-batch."""
    ref_logps = torch.zeros_like(batch.sampler_logps)  # [N, C]
    # (FSDP2's all-gathers run under no_grad, not inference mode.)
    with (
        torch.no_grad() if is_sharded(ref) else torch.inference_mode(),
        autocast(ref_logps.device, precision),
    ):
        for rows in micro_rows:
            mb = batch.rows(rows)
            ref_logps[rows, : mb.completion_ids.shape[1]] = token_logprobs(
                ref, *mb.inputs(), temperature=temperature, shared_prompt=shared_prompt
            ).float()
    return ref_logps.clone()  # leave inference mode: usable in autograd


def _note_nonfinite(
    updates: UpdateStats, step: int, loss: float, grad_norm: float, where: str, scaler, state, t, log
) -> None:
    """A skipped update with a non-finite loss or gradient (`where`: the parameters whose gradient
    was not finite): warn, and count it toward trainer.max_bad_steps unless fp16's grad scaler
    handles it."""
    what = "loss" if not math.isfinite(loss) else "gradient"
    # fp16: an overflowing gradient is the grad scaler's business (it lowers its scale and skips)
    # until the scale is below 1, where scaling cannot help.
    benign = scaler is not None and what == "gradient" and scaler.get_scale() >= 1.0
    note = f"; grad scaler lowers its scale to {scaler.get_scale():g}" if scaler else ""
    if benign:
        updates.scaler_skips += 1
    else:
        updates.faults.append(f"step {step}: non-finite {what} (loss={loss}, grad_norm={grad_norm}{where})")
    log.warn(
        f"step {step}: non-finite {what} (loss={loss}, grad_norm={grad_norm}{where}); optimizer step "
        f"skipped{note}"
        + ("" if benign else f" ({state.bad_steps + 1} of trainer.max_bad_steps={t.max_bad_steps} in a row)")
    )


def _say_no_signal(step: int, log) -> bool:
    log.warn(
        f"step {step}: no learning signal (every group's rewards are equal, or no completion token enters "
        "the loss), so the optimizer and scheduler step was skipped and the weights did not move. Such steps "
        "are counted in skipped_updates/no_signal (said once). If they are frequent: "
        "trainer.dynamic_sampling=true, a higher sampler.temperature, or data of a difficulty the model "
        "sometimes solves."
    )
    return True


def _stop_requested(
    stop: _StopFlag, step: int, total_steps: int, save, run_dir: Path, resume_hint: str, log
) -> None:
    """After a SIGINT/SIGTERM: save this step, say how to resume, exit 130/143."""
    path = save(step)
    log.flush_table()
    found = ckpt.list_checkpoints(run_dir)
    log.warn(
        f"grpo-train: stopped by {stop.signal_name} after step {step} of {total_steps}; "
        + (
            f"checkpoint {path}.\n{resume_hint}"
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
