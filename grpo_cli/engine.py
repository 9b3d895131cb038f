"""The training engine: `run` turns the config into plain objects; `train` is the GRPO loop,
one function to read top to bottom:

    sample -> score -> advantages -> (reference log-probs) -> loss/backward per micro-batch
           -> clip -> optimizer step -> metrics, eval, checkpoint
"""

from __future__ import annotations

import math
import random
import signal
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from rich.console import Console

from grpo_cli import checkpoint as ckpt
from grpo_cli.data import PromptStream, load_prompts
from grpo_cli.errors import UserError
from grpo_cli.evaluate import evaluate, score_examples
from grpo_cli.logprobs import token_logprobs, trim_padding
from grpo_cli.loss import group_advantages, grpo_loss, loss_normalizers
from grpo_cli.metrics import MetricsLogger
from grpo_cli.models import ModelSource, autocast, load_model, load_tokenizer, resolve_device, resolve_precision, resolve_source
from grpo_cli.rewards import build_rewards, reward_metrics
from grpo_cli.rollout import Rollout, concat, sample, select
from grpo_cli.selfcheck import SelfCheckError, compare_logprobs, diagnose

# ----------------------------------------------------------------------------- builders


def build_optimizer(model, *, name: str, learning_rate: float, weight_decay: float, adam_beta1: float,
                    adam_beta2: float, adam_epsilon: float, lr_scheduler: str, warmup_steps: int,
                    total_updates: int, **_unused):
    from transformers import get_scheduler

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=learning_rate, betas=(adam_beta1, adam_beta2),
                                  eps=adam_epsilon, weight_decay=weight_decay)
    scheduler = get_scheduler(lr_scheduler, optimizer, num_warmup_steps=warmup_steps,
                              num_training_steps=total_updates)
    return optimizer, scheduler


def eos_token_ids(tokenizer, model) -> list[int]:
    ids = {tokenizer.eos_token_id}
    gen = getattr(model, "generation_config", None)
    extra = getattr(gen, "eos_token_id", None)
    ids.update(extra if isinstance(extra, list) else [extra])
    return sorted(i for i in ids if i is not None)


def run(cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    """Build everything from the config (fail on bad input before heavy work), then train."""
    t, s, lo, opt = cfg.trainer, cfg.sampler, cfg.loss, cfg.optimizer
    logger_console = Console(quiet=t.quiet)
    rewards = build_rewards(OmegaConf.to_container(cfg.reward, resolve=True))
    device = resolve_device(t.device)
    precision = resolve_precision(t.precision, device)
    resume_from = ckpt.find_resume_checkpoint(t.resume, run_dir) if t.resume else None
    random.seed(t.seed)
    torch.manual_seed(t.seed)

    source = resolve_source(cfg.model.name_or_path, cfg.model.gguf_file, offline_wheel=cfg.model.offline_wheel,
                            offline_gguf=cfg.model.offline_gguf, log=logger_console.print)
    logger_console.print(f"[bold]grpo-train[/] device={device} precision={precision.name} model: {source.description}")
    model_kw = dict(revision=cfg.model.revision, trust_remote_code=cfg.model.trust_remote_code)
    tokenizer = load_tokenizer(source, chat_template=cfg.model.chat_template,
                               tokenizer_path=cfg.model.tokenizer, **model_kw)
    d = cfg.data
    data = load_prompts(tokenizer=tokenizer, source=d.source, path=d.path, subset=d.subset, split=d.split,
                        eval_split=d.eval_split, eval_size=d.eval_size, prompt_column=d.prompt_column,
                        system_prompt=d.system_prompt, use_chat_template=d.use_chat_template,
                        long_prompts=d.long_prompts, max_prompt_length=s.max_prompt_length,
                        num_examples=d.num_examples, max_operand=d.max_operand,
                        max_multiplier=d.max_multiplier, operations=list(d.operations), seed=t.seed)
    logger_console.print(
        f"data: {len(data.train)} training prompts, {len(data.eval)} held-out"
        + (f"; {data.dropped} dropped as longer than max_prompt_length={s.max_prompt_length}" if data.dropped else "")
        + (f"; {data.truncated} truncated on the left" if data.truncated else ""))

    policy_source = ModelSource(str(resume_from), None, f"checkpoint {resume_from}") if resume_from else source
    policy = load_model(policy_source, device=device, trainable=True,
                        gradient_checkpointing=t.gradient_checkpointing, **model_kw)
    # The reference model exists only when the KL term does (beta > 0): frozen, eval, no grad.
    ref = load_model(source, device=device, trainable=False, **model_kw) if lo.beta > 0 else None

    steps_per_epoch = math.ceil(len(data.train) / t.prompts_per_step)
    total_steps = min(t.max_steps, t.epochs * steps_per_epoch)
    optimizer, scheduler = build_optimizer(policy, total_updates=total_steps * t.num_iterations,
                                           **OmegaConf.to_container(opt))
    stream = PromptStream(data.train, seed=t.seed)
    start_step = 0
    if resume_from:
        state, opt_state, sched_state = ckpt.load_training_state(resume_from)
        optimizer.load_state_dict(opt_state)
        scheduler.load_state_dict(sched_state)
        stream.load_state(state["stream"])
        ckpt.restore_rng_state(state["rng"])
        start_step = int(state["step"])
        logger_console.print(f"resumed from {resume_from} at step {start_step}")

    return train(
        policy=policy, ref=ref, tokenizer=tokenizer, stream=stream, eval_examples=data.eval,
        rewards=rewards, optimizer=optimizer, scheduler=scheduler, device=device,
        precision=precision, run_dir=run_dir, config_yaml=OmegaConf.to_yaml(cfg, resolve=True),
        start_step=start_step, total_steps=total_steps,
        sampling=dict(num_generations=s.num_generations, max_new_tokens=s.max_new_tokens,
                      temperature=s.temperature, top_p=s.top_p, top_k=s.top_k),
        advantage_kwargs=dict(scale_rewards=lo.scale_rewards, std=lo.std, eps=lo.eps,
                              estimator=lo.estimator, zero_std_threshold=lo.zero_std_threshold),
        loss_kwargs=dict(beta=lo.beta, epsilon=lo.epsilon, epsilon_high=lo.epsilon_high, delta=lo.delta,
                         importance_sampling_level=lo.importance_sampling_level,
                         kl_estimator=lo.kl_estimator, loss_type=lo.loss_type, zero_std=lo.zero_std),
        mask_truncated_completions=lo.mask_truncated_completions,
        prompts_per_step=t.prompts_per_step, gradient_accumulation_steps=t.gradient_accumulation_steps,
        num_iterations=t.num_iterations, max_grad_norm=opt.max_grad_norm,
        logging_steps=t.logging_steps, save_steps=t.save_steps, eval_steps=t.eval_steps,
        keep_last=t.keep_last, dynamic_sampling=t.dynamic_sampling,
        max_sampling_tries=t.max_sampling_tries, self_check=t.self_check and not resume_from,
        eval_before=t.eval_before and not resume_from,
        quiet=t.quiet,
    )


# ----------------------------------------------------------------------------- the loop


def train(*, policy, ref, tokenizer, stream: PromptStream, eval_examples, rewards, optimizer,
          scheduler, device, precision, run_dir: Path, config_yaml: str, start_step: int,
          total_steps: int, sampling: dict, advantage_kwargs: dict, loss_kwargs: dict,
          mask_truncated_completions: bool, prompts_per_step: int, gradient_accumulation_steps: int,
          num_iterations: int, max_grad_norm: float, logging_steps: int, save_steps: int,
          eval_steps: int, keep_last: int, dynamic_sampling: bool, max_sampling_tries: int,
          self_check: bool, quiet: bool, eval_before: bool = False) -> dict[str, Any]:
    G = sampling["num_generations"]
    pad_id = tokenizer.pad_token_id
    eos_ids = eos_token_ids(tokenizer, policy)
    scaler = torch.amp.GradScaler(device.type) if precision.use_grad_scaler else None
    micro_prompts = prompts_per_step // gradient_accumulation_steps
    stop = _StopFlag()
    last_row: dict[str, Any] = {}

    def save(step: int) -> Path:
        return ckpt.save_checkpoint(run_dir, step, model=policy, tokenizer=tokenizer,
                                    optimizer=optimizer, scheduler=scheduler,
                                    trainer_state={"stream": stream.state()},
                                    config_yaml=config_yaml, keep_last=keep_last)

    def run_eval() -> dict[str, float]:
        with autocast(device, precision):
            return evaluate(policy, tokenizer, eval_examples, rewards, max_new_tokens=sampling["max_new_tokens"],
                            temperature=sampling["temperature"], top_p=sampling["top_p"],
                            top_k=sampling["top_k"], eos_ids=eos_ids, pad_id=pad_id, greedy=True)

    log = MetricsLogger(run_dir, total_steps=total_steps, quiet=quiet, resume_step=start_step)
    before: dict[str, float] = {}
    with log, stop:
        if eval_before and eval_examples:
            before = run_eval()
            log.log({"step": 0, **before})
        for step in range(start_step + 1, total_steps + 1):
            t0 = time.perf_counter()

            # 1. Sample G completions per prompt and score them. Dynamic sampling (DAPO) drops
            #    groups whose rewards are all equal and samples more prompts to fill the step.
            kept, kept_examples, kept_rewards, per_reward_all = [], [], [], {}
            zero_std_seen = groups_seen = 0
            for attempt in range(max_sampling_tries if dynamic_sampling else 1):
                need = prompts_per_step - len(kept_examples)
                examples = stream.take(need)
                policy.eval()
                with autocast(device, precision):
                    rollout = sample(policy, [ex.prompt_ids for ex in examples], eos_ids=eos_ids,
                                     pad_id=pad_id, **sampling)
                policy.train()
                texts, total, per_reward = score_examples(rewards, tokenizer, examples, rollout, G)
                rewards_t = torch.tensor(total, dtype=torch.float32)  # [n*G]
                spread = rewards_t.view(-1, G).std(-1, unbiased=False)  # [n]
                zero = spread < advantage_kwargs["zero_std_threshold"]
                zero_std_seen += int(zero.sum())
                groups_seen += len(examples)
                for name, values in per_reward.items():
                    per_reward_all.setdefault(name, []).extend(values)
                keep = ~zero if dynamic_sampling else torch.ones_like(zero)
                for g in torch.nonzero(keep).flatten().tolist():
                    kept.append(select(rollout, torch.arange(g * G, (g + 1) * G, device=device)))
                    kept_examples.append(examples[g])
                    kept_rewards.append(rewards_t[g * G:(g + 1) * G])
                if len(kept_examples) >= prompts_per_step:
                    break
            if not kept:  # dynamic sampling found no group with signal: skip the update
                log.print(f"step {step}: every sampled group was zero-std after {max_sampling_tries} tries; "
                          "no update (consider harder/easier data or a higher temperature)")
                log.advance(step)
                continue
            batch: Rollout = concat(kept[:prompts_per_step], pad_id)
            rewards_t = torch.cat(kept_rewards[:prompts_per_step])  # [N]
            N = rewards_t.shape[0]

            # 2. Advantages per group (ref 004), detached; zero-std groups flagged (ref 002).
            advantages, zero_std, group_std = group_advantages(rewards_t, G, **advantage_kwargs)
            advantages, zero_std, group_std = advantages.to(device), zero_std.to(device), group_std.to(device)
            loss_mask = batch.completion_mask.clone()  # [N, C]
            if mask_truncated_completions:
                loss_mask[batch.truncated] = 0
            num_sequences, num_tokens = loss_normalizers(loss_mask, zero_std, zero_std_mode=loss_kwargs["zero_std"])

            # 3. Micro-batches of whole groups; reference log-probs once per rollout (beta > 0).
            groups = N // G
            micro_rows = [torch.arange(i * G, min(i + micro_prompts, groups) * G, device=device)
                          for i in range(0, groups, micro_prompts)]
            ref_logps = torch.zeros_like(batch.sampler_logps) if ref is not None else None
            if ref is not None:
                with torch.inference_mode(), autocast(device, precision):
                    for rows in micro_rows:
                        mb = trim_padding(batch.prompt_ids[rows], batch.prompt_mask[rows],
                                          batch.completion_ids[rows], batch.completion_mask[rows])
                        ref_logps[rows, :mb[2].shape[1]] = token_logprobs(
                            ref, *mb, temperature=sampling["temperature"]).float()
                ref_logps = ref_logps.clone()  # leave inference mode: usable in autograd

            # 4. num_iterations optimizer updates on this rollout, each accumulating the
            #    gradient over shuffled micro-batches. Old log-probs are the sampler's (ref 000.1).
            stats_sum: dict[str, float] = {}
            entropy_sum = entropy_tokens = 0.0
            ratio_max = 0.0
            for iteration in range(num_iterations):
                order = torch.randperm(len(micro_rows)).tolist()
                loss_total = 0.0
                for k in order:
                    rows = micro_rows[k]
                    p_ids, p_mask, c_ids, c_mask = trim_padding(batch.prompt_ids[rows], batch.prompt_mask[rows],
                                                                batch.completion_ids[rows], batch.completion_mask[rows])
                    C = c_ids.shape[1]
                    with autocast(device, precision):
                        logps, entropy = token_logprobs(policy, p_ids, p_mask, c_ids, c_mask,
                                                        temperature=sampling["temperature"], with_entropy=True)
                    if self_check and step == start_step + 1 and iteration == 0 and k == order[0]:
                        _self_check(policy, logps, batch, rows, C, precision, sampling, advantages, zero_std, log)
                    loss, stats = grpo_loss(
                        logps.float(), batch.sampler_logps[rows, :C],
                        ref_logps[rows, :C] if ref_logps is not None else None,
                        advantages[rows], loss_mask[rows, :C], zero_std_flags=zero_std[rows],
                        group_std=group_std[rows], num_sequences=num_sequences, num_tokens=num_tokens,
                        max_new_tokens=sampling["max_new_tokens"], group_size=G, **loss_kwargs)
                    (scaler.scale(loss) if scaler else loss).backward()
                    loss_total += float(loss.detach())
                    if iteration == 0:
                        n_tok = float(stats["num_tokens"])
                        for key in ("kl", "clip_ratio/low_mean", "clip_ratio/high_mean",
                                    "clip_ratio/region_mean", "ratio_mean"):
                            stats_sum[key] = stats_sum.get(key, 0.0) + float(stats[key]) * n_tok
                        stats_sum["num_tokens"] = stats_sum.get("num_tokens", 0.0) + n_tok
                        ratio_max = max(ratio_max, float(stats["ratio_max"]))
                        valid = c_mask.bool()
                        entropy_sum += float(entropy[valid].sum())
                        entropy_tokens += float(valid.sum())

                # 5. Clip (log the pre-clip norm: what clip_grad_norm_ returns, ref 000.7), step.
                if scaler:
                    scaler.unscale_(optimizer)
                grad_norm = float(torch.nn.utils.clip_grad_norm_(policy.parameters(), max_grad_norm))
                if not math.isfinite(loss_total) or not math.isfinite(grad_norm):
                    log.print(f"[yellow]step {step}: non-finite {'loss' if not math.isfinite(loss_total) else 'gradient'} "
                              f"(loss={loss_total}, grad_norm={grad_norm}); optimizer step skipped[/]")
                    optimizer.zero_grad(set_to_none=True)
                    if scaler:
                        scaler.update()
                    continue
                if scaler:
                    scaler.step(optimizer)
                    scaler.update()
                else:
                    optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)

            # 6. Metrics (TRL's names), eval, checkpoint.
            step_time = time.perf_counter() - t0
            lengths = batch.lengths.float()
            n_tok = max(stats_sum.get("num_tokens", 0.0), 1.0)
            row: dict[str, Any] = {
                "step": step,
                "reward": float(rewards_t.mean()),
                "reward_std": float(rewards_t.view(-1, G).std(-1, unbiased=False).mean()),
                **reward_metrics(per_reward_all),
                "frac_reward_zero_std": zero_std_seen / max(groups_seen, 1),
                "num_groups_sampled": groups_seen,
                "kl": stats_sum.get("kl", 0.0) / n_tok,
                "clip_ratio/low_mean": stats_sum.get("clip_ratio/low_mean", 0.0) / n_tok,
                "clip_ratio/high_mean": stats_sum.get("clip_ratio/high_mean", 0.0) / n_tok,
                "clip_ratio/region_mean": stats_sum.get("clip_ratio/region_mean", 0.0) / n_tok,
                "ratio_mean": stats_sum.get("ratio_mean", 0.0) / n_tok,
                "ratio_max": ratio_max,
                "completions/mean_length": float(lengths.mean()),
                "completions/min_length": float(lengths.min()),
                "completions/max_length": float(lengths.max()),
                "completions/clipped_ratio": float(batch.truncated.float().mean()),
                "entropy": entropy_sum / max(entropy_tokens, 1.0),
                "grad_norm": grad_norm,
                "learning_rate": float(scheduler.get_last_lr()[0]),
                "loss": loss_total,
                "step_time": step_time,
                "tokens_per_second": float(batch.completion_mask.sum()) / step_time,
                "pass_rate_hist": _pass_rate_histogram(per_reward_all, G),
            }
            if eval_examples and ((eval_steps and step % eval_steps == 0) or step == total_steps):
                row.update(run_eval())
            if step % logging_steps == 0 or step == total_steps:
                log.log(row)
            else:
                log.advance(step)
            last_row = row
            if step % save_steps == 0 and step != total_steps:
                save(step)
            if stop.requested:
                path = save(step)
                log.flush_table()
                log.print(f"[yellow]stopped by {stop.signal_name} after step {step}; checkpoint {path}.[/]\n"
                          f"Resume with the same command plus: hydra.run.dir={run_dir} trainer.resume=auto")
                raise SystemExit(stop.exit_code)

        path = save(total_steps)
        log.flush_table()
        log.print(f"done: {total_steps} steps; final checkpoint {path}; metrics in {run_dir / 'metrics.jsonl'}")
        for key in ("eval/accuracy", "eval/reward"):
            if key in before and key in last_row:
                log.print(f"held-out {key.split('/')[1]} ({len(eval_examples)} prompts, greedy): "
                          f"before {before[key]:.3f} -> after {last_row[key]:.3f} "
                          f"({last_row[key] - before[key]:+.3f})")
    return last_row


def _self_check(policy, logps, batch, rows, C, precision, sampling, advantages, zero_std, log) -> None:
    """Step-0 self-check (ref 000.8): trainer log-probs equal the sampler's before any update."""
    check = compare_logprobs(logps.detach(), batch.sampler_logps[rows, :C], batch.completion_mask[rows, :C],
                             precision.name)
    if not check.ok:
        with torch.no_grad():
            p_ids, p_mask, c_ids, c_mask = trim_padding(batch.prompt_ids[rows], batch.prompt_mask[rows],
                                                        batch.completion_ids[rows], batch.completion_mask[rows])
            why = diagnose(policy, p_ids, p_mask, c_ids, c_mask, batch.sampler_logps[rows, :C],
                           sampling["temperature"])
        raise SelfCheckError(
            f"step-0 self-check failed: trainer and sampler log-probs differ by up to "
            f"{check.max_abs_diff:.3g} (tolerance {check.tolerance:g} for {precision.name}) over "
            f"{check.valid_tokens} tokens, so the ratio would not start at 1.\n{why}")
    signs = "both signs" if (advantages > 0).any() and (advantages < 0).any() else (
        "every group zero-std (no learning signal in this batch)" if bool(zero_std.all()) else "one sign only")
    log.print(f"self-check ok: |trainer - sampler| log-prob <= {check.max_abs_diff:.2e} "
              f"(ratio within {check.ratio_max_dev:.1e} of 1) over {check.valid_tokens} tokens; "
              f"advantages: {signs}")


def _pass_rate_histogram(per_reward: dict[str, list], G: int) -> list[int]:
    """How many groups had 0, 1, ..., G passing completions (pass: accuracy == 1, or, with no
    accuracy reward, a positive first reward)."""
    name = "accuracy" if "accuracy" in per_reward else next(iter(per_reward))
    values = per_reward[name]
    hist = [0] * (G + 1)
    for g in range(len(values) // G):
        passes = sum(1 for v in values[g * G:(g + 1) * G] if v is not None and v >= (1.0 if name == "accuracy" else 1e-12))
        hist[passes] += 1
    return hist


class _StopFlag:
    """SIGINT/SIGTERM finish the current step, save a checkpoint and exit 130/143."""

    def __init__(self):
        self.requested = False
        self.signal_name = ""
        self.exit_code = 0
        self._previous = {}

    def _handle(self, signum, frame):
        if self.requested:  # second signal: stop now
            raise KeyboardInterrupt
        self.requested = True
        self.signal_name = signal.Signals(signum).name
        self.exit_code = 128 + signum

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
