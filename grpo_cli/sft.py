"""The supervised warm-up before GRPO (config group `sft`: none | demonstrations; docs/recipe.md).

A policy that never samples a right answer gets no gradient from GRPO (a zero-std group). The
field's answer is a short supervised fine-tuning on demonstrations first (TRL, NeMo-RL, prime-rl,
Unsloth): this module is that stage, run by grpo-train before the first GRPO step.

    demonstrations (read_demonstrations, before any model loads; keep_passing once the rewards
    are open) -> batches of sft.batch_size -> NLL per micro-batch (nll) -> AdamW step
    -> checkpoints sft-N, and sft-end where it ends

What it trains on: the data source's own demonstrations (data.Facts.demonstration: arithmetic
the bare answer, reasoning-gym "Answer: <answer>", a table its `completion` column), or sft.path's
rows in TRL's SFT formats; never a held-out prompt. A demonstration is its completion's tokens
(tokenized alone, no special tokens, the text round-tripping) plus the tokenizer's EOS, held as a
G=1 rollout whose trained tokens are the completion and the EOS (`demonstration_batch`): the
prompt's tokens are never targets. So the training forward GRPO uses scores it (chunked
log-probs, precision and fp32 masters, LoRA, gradient checkpointing, token-budget or equal
micro-batches, DDP), at temperature 1 without truncation (GRPO's scorer tempers and truncates).

The loss is the mean token NLL of the step: every trained token of every micro-batch and every
process weighs the same (each micro-batch's sum is divided by the step's token count), so one
micro-batch or four give the same gradient. Its optimizer and schedule are its own
(sft.learning_rate, sft.lr_scheduler); GRPO's starts fresh after it, as TRL's and verl's
SFT-then-RL recipes run them apart.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from grpo_cli.data import Example, Formatting, to_examples
from grpo_cli.data import plugin as data_source
from grpo_cli.errors import UserError, first_line

SFT_NAMES = ("none", "demonstrations")
REFERENCES = ("warmed", "base")


# ----------------------------------------------------------------------------- config checks


def check_sft(cfg) -> list[str]:
    """The sft group's problems (config validation, before any model loads)."""
    s, tr = cfg.sft, cfg.trainer
    problems = []
    if s.name not in SFT_NAMES:
        return [
            f"sft.name={s.name!r} is not one of {', '.join(SFT_NAMES)}: choose sft=demonstrations or sft=none."
        ]
    if s.name == "none":  # (keys set that sft=none ignores: config.validation.unused_settings)
        return []
    if s.steps is not None and s.epochs is not None:
        problems.append(
            f"sft.steps={s.steps} and sft.epochs={s.epochs} both set the warm-up's length: give one of them."
        )
    for key in ("steps", "epochs"):
        value = getattr(s, key)
        if value is not None and (not isinstance(value, int) or value < 1):
            problems.append(f"sft.{key}={value} must be a whole number >= 1 (or null).")
    if not s.learning_rate > 0:
        problems.append(f"sft.learning_rate={s.learning_rate} must be > 0, e.g. 5e-5.")
    from grpo_cli.optim import LR_SCHEDULERS

    if s.lr_scheduler not in LR_SCHEDULERS:
        problems.append(f"sft.lr_scheduler={s.lr_scheduler!r} is not one of {', '.join(LR_SCHEDULERS)}.")
    if s.reference not in REFERENCES:
        problems.append(f"sft.reference={s.reference!r} is not one of {', '.join(REFERENCES)}.")
    from grpo_cli.distributed import planned_world_size

    W = planned_world_size(tr)
    if s.batch_size < tr.gradient_accumulation_steps * W:
        problems.append(
            f"sft.batch_size={s.batch_size} is below trainer.gradient_accumulation_steps x processes "
            f"({tr.gradient_accumulation_steps} x {W}): each micro-batch needs a demonstration; raise "
            "sft.batch_size."
        )
    env = cfg.environment
    if env.fn or env.tools:
        what = f"environment.fn={env.fn!r}" if env.fn else f"environment.tools={list(env.tools)}"
        problems.append(
            f"sft=demonstrations with {what}: the warm-up trains single-turn completions, and an "
            "environment's episodes are several turns with tool replies; run the warm-up without the "
            "environment (its own run, then model.name_or_path=<its sft-end>), or sft=none."
        )
    if not s.path:
        try:
            declared = data_source(cfg.data.source).facts.demonstration
        except UserError:  # (the data check names the source)
            declared = True
        if declared is None:
            problems.append(
                f"sft=demonstrations: data.source={cfg.data.source} writes no demonstrations of its own; give "
                "sft.path=<a file in TRL's SFT formats: prompt and completion columns, or messages>."
            )
    if tr.distributed == "fsdp" and W > 1:
        problems.append(
            "sft=demonstrations with trainer.distributed=fsdp: under FSDP2 the warm-up did not train the "
            "weights one process trains (tests/test_distributed.py), so it is not offered there; use "
            "trainer.distributed=ddp (or one process) for the warm-up, or sft=none."
        )
    return problems


# ----------------------------------------------------------------------------- demonstrations


@dataclass(frozen=True)
class Demonstrations:
    """Prompts and the completions that answer them, tokenized: examples[i] (its prompt ids and
    columns) is answered by completions[i] (token ids, the tokenizer's EOS last) whose text is
    texts[i]. dropped: why -> how many rows were left out. where: what they came from."""

    examples: tuple[Example, ...]
    completions: tuple[tuple[int, ...], ...]
    texts: tuple[str, ...]
    where: str
    dropped: Mapping[str, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.examples)

    def subset(self, keep: list[int], why: str) -> Demonstrations:
        """Those at the indices `keep`; the others counted as dropped for `why`."""
        gone = len(self) - len(keep)
        dropped = dict(self.dropped) | ({why: self.dropped.get(why, 0) + gone} if gone else {})
        return replace(
            self,
            examples=tuple(self.examples[i] for i in keep),
            completions=tuple(self.completions[i] for i in keep),
            texts=tuple(self.texts[i] for i in keep),
            dropped=dropped,
        )

    def summary(self) -> str:
        drops = "; ".join(f"{n} dropped: {why}" for why, n in self.dropped.items() if n)
        return f"{len(self)} demonstrations from {self.where}" + (f" ({drops})" if drops else "")


def read_demonstrations(cfg, tokenizer, train: list[Example], held_out: list[list[int]]) -> Demonstrations:
    """The warm-up's demonstrations, before any model loads: sft.path's rows, or the data source's
    own for each training example (`train`). held_out: the prompt ids of every held-out prompt
    (held-out and wide sets), which sft.path's rows may not repeat."""
    if cfg.sft.path:
        examples, texts, dropped = _from_file(cfg, tokenizer, held_out)
        where = f"sft.path={cfg.sft.path}"
    else:
        write = data_source(cfg.data.source).facts.demonstration
        examples, texts, dropped = [], [], {}
        for ex in train:
            text = write(ex.columns)
            if text is None or not str(text).strip():
                dropped["the data source wrote none for the row"] = (
                    dropped.get("the data source wrote none for the row", 0) + 1
                )
                continue
            examples.append(ex)
            texts.append(str(text))
        where = f"data.source={cfg.data.source}'s training rows"
    completions, kept, why = [], [], "the completion's text does not survive tokenizing and decoding"
    for i, text in enumerate(texts):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if not ids or tokenizer.decode(ids) != text:
            dropped[why] = dropped.get(why, 0) + 1
            continue
        completions.append((*ids, tokenizer.eos_token_id))
        kept.append(i)
    demos = Demonstrations(
        examples=tuple(examples[i] for i in kept),
        completions=tuple(completions),
        texts=tuple(texts[i] for i in kept),
        where=where,
        dropped=dropped,
    )
    if not len(demos):
        raise UserError(
            f"sft=demonstrations found no usable demonstration in {where} ({demos.summary()}): give "
            "sft.path=<a file with prompt and completion columns>, or sft=none."
        )
    return demos


def _from_file(cfg, tokenizer, held_out: list[list[int]]) -> tuple[list[Example], list[str], dict[str, int]]:
    """sft.path's rows in TRL's SFT formats as (prompt examples, completion texts, dropped)."""
    from grpo_cli.data._tables import load_table

    path = cfg.sft.path
    try:
        rows = load_table(path, None, "train", "file")
    except UserError as exc:
        raise UserError(str(exc).replace("data.path", "sft.path")) from exc
    columns = set(rows[0]) if rows else set()
    if "messages" not in columns and not {"prompt", "completion"} <= columns:
        raise UserError(
            f"sft.path={path!r} has the columns {', '.join(sorted(map(str, columns))) or 'none'}; a warm-up file "
            "is in one of TRL's SFT formats: `prompt` and `completion` (strings or chat messages), or "
            "`messages` (a conversation whose last assistant turn is the completion). (gsm8k's `answer` "
            "is another format: write its completions into a `completion` column.)"
        )
    pairs, dropped = [], {}
    for row in rows:
        prompt, completion = _prompt_completion(row)
        if prompt is None or completion is None:
            dropped["a row without a prompt and an assistant completion"] = (
                dropped.get("a row without a prompt and an assistant completion", 0) + 1
            )
            continue
        others = {k: v for k, v in row.items() if k not in ("prompt", "completion", "messages")}
        pairs.append({**others, "prompt": prompt, "completion": completion})  # (answer: the reward's)
    d = cfg.data
    formatting = Formatting(
        "prompt", d.system_prompt, d.use_chat_template, cfg.sampler.max_prompt_length, "drop"
    )
    examples = to_examples(pairs, tokenizer, formatting, f"sft.path={path}")
    too_long = len(pairs) - len(examples)
    if too_long:
        dropped[f"the prompt is over sampler.max_prompt_length={cfg.sampler.max_prompt_length}"] = too_long
    seen = {tuple(ids) for ids in held_out}
    kept = [ex for ex in examples if tuple(ex.prompt_ids) not in seen]
    if len(kept) < len(examples):
        dropped["the prompt is a held-out prompt"] = len(examples) - len(kept)
    return kept, [ex.columns["completion"] for ex in kept], dropped


def _prompt_completion(row: dict) -> tuple[Any, str | None]:
    """(prompt, completion text) of a row in TRL's SFT formats; (None, None) where it has none."""
    if "messages" in row and isinstance(row["messages"], list):
        messages = row["messages"]
        last = max(
            (i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "assistant"),
            default=None,
        )
        if not last:  # (none, or nothing before it to prompt with)
            return None, None
        return messages[:last], _text(messages[last].get("content"))
    prompt, completion = row.get("prompt"), row.get("completion")
    if isinstance(completion, list):  # conversational: the assistant's turn(s)
        completion = "".join(_text(m.get("content")) or "" for m in completion if isinstance(m, dict))
    if prompt in (None, "", []) or not isinstance(completion, str) or not completion.strip():
        return None, None
    return prompt, completion


def _text(content) -> str | None:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: their text
        return "".join(part.get("text", "") for part in content if isinstance(part, dict)) or None
    return None


def keep_passing(demos: Demonstrations, rewards, tokenizer) -> Demonstrations:
    """The demonstrations the run's correctness reward passes (all of them without one): a
    demonstration its own reward fails would teach the policy what GRPO then punishes."""
    from grpo_cli.rewards import correctness
    from grpo_cli.rewards.scoring import score
    from grpo_cli.rollout import Drawn

    judge = correctness(rewards)
    if judge is None:
        return demos
    # Only rows that hold the gold answer can be judged (an sft.path file may have none): the
    # others are kept as they are.
    judged = [i for i, ex in enumerate(demos.examples) if ex.columns.get(judge.answer_column) is not None]
    if not judged:
        return demos
    part = demos.subset(judged, "")
    batch = demonstration_batch(part, list(range(len(part))), tokenizer.pad_token_id, "cpu")
    try:
        scored = score(rewards, tokenizer, list(part.examples), Drawn(batch.rollout))
    except UserError as exc:
        raise UserError(f"scoring the warm-up's demonstrations ({demos.where}): {exc}") from exc
    failed = {judged[j] for j, ok in enumerate((scored.passed | ~scored.applies).tolist()) if not ok}
    return demos.subset(
        [i for i in range(len(demos)) if i not in failed], "the run's correctness reward fails it"
    )


def demonstration_batch(demos: Demonstrations, indices: list[int], pad_id: int, device):
    """Demonstrations `indices` as one step's batch (scored.Batch of a G=1 rollout): prompts
    left-padded, completions right-padded, the trained tokens (and loss_mask) the completion and
    its EOS; advantages 0 (the NLL reads none)."""
    from grpo_cli.rollout import left_pad, single_turn
    from grpo_cli.scored import Batch, Scored

    prompt_ids, prompt_mask = left_pad([demos.examples[i].prompt_ids for i in indices], pad_id, device)
    N, C = len(indices), max(len(demos.completions[i]) for i in indices)
    completion_ids = torch.full((N, C), pad_id, dtype=torch.long)
    mask = torch.zeros((N, C), dtype=torch.long)
    for row, i in enumerate(indices):
        ids = demos.completions[i]
        completion_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        mask[row, : len(ids)] = 1
    completion_ids, mask = completion_ids.to(device), mask.to(device)
    rollout = single_turn(
        1,
        prompt_ids,
        prompt_mask,
        completion_ids,
        mask,
        torch.zeros(N, dtype=torch.bool, device=device),
        torch.zeros((N, C), device=device),
    )
    ones = torch.ones(N, dtype=torch.bool, device=device)
    scored = Scored(
        rollout=rollout,
        names=(),
        values=torch.zeros((N, 0), dtype=torch.float64, device=device),
        totals=torch.zeros(N, dtype=torch.float64, device=device),
        passed=ones,
        applies=ones,
        prompt_index=torch.arange(N, device=device),
    )
    zeros = torch.zeros(N, device=device)
    return Batch(scored, advantages=zeros, zero_std=~ones, group_std=zeros, loss_mask=mask)


# ----------------------------------------------------------------------------- the loss


def nll(logps: torch.Tensor, mask: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The warm-up's loss on one micro-batch: -sum(log p of the trained tokens) / num_tokens.
    logps [b, C] (temperature 1, untruncated); mask [b, C] the trained tokens; num_tokens: the
    step's trained tokens over every micro-batch and process, so the micro-batches' losses add up
    to the step's mean token NLL (TRL's completion-only loss) however the step is split."""
    return -(logps * mask).sum() / max(num_tokens, 1)


# ----------------------------------------------------------------------------- the schedule


def length(cfg, n: int) -> tuple[int, int]:
    """(steps per epoch, total steps) of a warm-up over n demonstrations: full batches of
    sft.batch_size (the last partial one of an epoch is left out, as a drop_last loader), for
    sft.steps or sft.epochs (neither: one epoch)."""
    s = cfg.sft
    if n < s.batch_size:
        raise UserError(
            f"the warm-up has {n} demonstrations, fewer than sft.batch_size={s.batch_size}: lower "
            "sft.batch_size, or give more (sft.path)."
        )
    per_epoch = n // s.batch_size
    return per_epoch, s.steps if s.steps is not None else (s.epochs or 1) * per_epoch


def batch_indices(n: int, batch_size: int, seed: int, step: int) -> list[int]:
    """The demonstrations of warm-up step `step` (1-based): epoch e's order is a permutation drawn
    from (seed, e) alone, so a resumed warm-up takes exactly the batches it would have."""
    per_epoch = n // batch_size
    epoch, k = divmod(step - 1, per_epoch)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100003 + epoch + 7)).tolist()
    return order[k * batch_size : (k + 1) * batch_size]


@dataclass(frozen=True)
class SftStep:
    """One warm-up step: its loss (the mean token NLL), the share of trained tokens that are the
    model's argmax (TRL's mean_token_accuracy), its tokens, the pre-clip gradient norm, whether
    the update applied, and its seconds."""

    loss: float
    token_accuracy: float
    tokens: int
    grad_norm: float
    applied: bool
    seconds: float


def train_step(batch, learner, opt, options) -> SftStep:
    """One optimizer step of the NLL over `batch` (demonstration_batch), micro-batch by
    micro-batch (the scoring plan's token budget, or gradient_accumulation_steps equal splits,
    this process's share): the training forward (learner.scorer) with `options` (temperature
    1, top_k=1 so that TokenScores.behaviour is 0 exactly at the argmax tokens)."""
    from grpo_cli.distributed import gradient_sync
    from grpo_cli.packing import MicroBatches, equal_micro_batches, token_micro_batches
    from grpo_cli.precision import autocast

    tick = time.perf_counter()
    cfg, d, scorer = learner.cfg, learner.dist, learner.scorer
    n = batch.rewards.shape[0]
    if learner.plan.token_budget is not None:
        plan = MicroBatches(*token_micro_batches(batch, plan=learner.plan, skip=None, d=d))
    else:
        plan = equal_micro_batches(
            batch,
            prompts_per_step=n,
            accumulation_steps=cfg.trainer.gradient_accumulation_steps,
            zero_std_mode="keep",
            d=d,
            skip_zero_std=False,
        )
    num_tokens = int(batch.loss_mask.sum())  # the step's, every process's (each holds the whole batch)
    loss_total, right = 0.0, 0
    order = plan.order()
    for m, k in enumerate(order):
        mb = batch.rows(plan.rows[k])
        r = mb.rollout
        sync = m == len(order) - 1 and not opt.reduces_grads
        with gradient_sync(scorer, sync), autocast(batch.loss_mask.device, learner.precision):
            scores = scorer(*r.inputs(), num_generations=1, options=options)  # [b, C] each
        logps = scores.logps.float()
        if k >= plan.real:  # a stand-in micro-batch (another process has more): zero gradient
            with gradient_sync(scorer, sync):
                opt.backward(logps.nan_to_num().sum() * 0.0)
            continue
        loss = nll(logps, mb.loss_mask, num_tokens)
        with gradient_sync(scorer, sync):
            opt.backward(loss)
        loss_total += float(loss.detach())
        # top_k=1 keeps the argmax and the target (the sampler's rule): the target's behaviour
        # log-prob is 0 where it is the argmax, at most -log 2 where it is not.
        right += int(((scores.behaviour > -0.5) & mb.loss_mask.bool()).sum())
    right = int(d.sum([float(right)])[0]) if d.enabled else right
    result = opt.step(loss_total, True)
    return SftStep(
        loss=result.loss,
        token_accuracy=right / max(num_tokens, 1),
        tokens=num_tokens,
        grad_norm=result.grad_norm,
        applied=result.applied,
        seconds=time.perf_counter() - tick,
    )


def nll_options(learner):
    """The warm-up's scoring options: temperature 1, no truncation of the trained log-probs (top_k=1
    shapes TokenScores.behaviour alone, which the token accuracy reads), the plan's prompt
    sharing, buckets and chunking."""
    return learner.plan.options(1.0, top_k=1, chunk_size=learner.cfg.trainer.logprob_chunk_size)


def sft_optimizer(cfg, learner, total_steps: int):
    """The warm-up's own optimizer step (optim.OptimizerStep): AdamW with optimizer.*'s betas,
    epsilon, weight decay and clipping, at sft.learning_rate on sft.lr_scheduler over its steps,
    over the same trainable weights (bf16: their fp32 masters) as GRPO's."""
    from grpo_cli.optim import OptimizerStep, build_optimizer

    s, grpo = cfg.sft, learner.opt_step
    settings = replace(
        cfg.optimizer, learning_rate=s.learning_rate, lr_scheduler=s.lr_scheduler, warmup_steps=0
    )
    optimizer, scheduler = build_optimizer(grpo.params, settings, total_updates=total_steps)
    scaler = torch.amp.GradScaler(learner.device.type) if grpo.scaler is not None else None
    return OptimizerStep(
        optimizer,
        scheduler,
        policy=learner.policy,
        masters=grpo.masters,
        grad_scaler=scaler,
        max_grad_norm=cfg.optimizer.max_grad_norm,
        dist=learner.dist,
    )


def restore_optimizer(opt, resume, *, fsdp: bool) -> None:
    """A warm-up resumed from its checkpoint sft-N: its optimizer and schedule as they were."""
    from grpo_cli import checkpoint as ckpt

    try:
        if fsdp:
            ckpt.load_sharded(resume.path, opt.policy, opt.optimizer)
        else:
            opt.optimizer.load_state_dict(resume.loaded[1])
        opt.scheduler.load_state_dict(resume.loaded[2])
    except (ValueError, KeyError, TypeError, RuntimeError, IndexError) as exc:
        raise UserError(
            f"checkpoint {resume.path}: its warm-up optimizer state does not fit this run "
            f"({first_line(exc, 160)}); resume with the checkpoint's own model, adapter and sft settings."
        ) from exc
