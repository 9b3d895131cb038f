"""Runs of the tiny model with 1 or 2 processes for tests/test_distributed.py: every case of
CASES trains in this process (one process group for all of them), into OUT/<case>/.

    python tests/distributed_helpers.py OUT     # one process (the test calls train_cases(OUT) instead)
    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/distributed_helpers.py OUT
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

BASE = [
    "model=tiny",
    "data.num_examples=32",
    "data.eval_size=6",
    "sampler.num_generations=4",
    "sampler.max_new_tokens=6",
    "reward=[]",
    "+reward.code.fn=reward_fixtures:char_code",
    "optimizer.learning_rate=1e-3",
    "trainer.prompts_per_step=4",
    "trainer.max_steps=2",
    "trainer.save_steps=50",
    "trainer.eval_before=false",
    "trainer.quiet=true",
    "trainer.precision=fp32",  # (the bf16 cases below set theirs)
]
# Every loss type with beta 0 and 0.04, gradient accumulation, dynamic sampling, batch-wide
# reward scaling, two iterations per rollout.
CASES = {
    **{
        f"{loss}-beta{beta}": [f"loss={loss}", f"loss.beta={beta}"]
        for loss in ("grpo", "dr_grpo", "dapo", "gspo")
        for beta in ("0", "0.04")
    },
    "accumulation": ["loss.beta=0.04", "trainer.gradient_accumulation_steps=2"],
    "dynamic-sampling": ["trainer.dynamic_sampling=true", "reward.code.fn=reward_fixtures:plus_parity"],
    "batch-scale": ["loss.scale_rewards=batch", "trainer.num_iterations=2"],
    # Zero-std groups skipped (minus prompts carry no signal) with a micro-batch per group: the
    # ranks skip different counts, the one with fewer left runs stand-ins.
    "skip-zero-std": [
        "reward.code.fn=reward_fixtures:no_signal_on_minus",
        "loss.beta=0.04",
        "trainer.gradient_accumulation_steps=2",
    ],
    # Adaptive group sizes (rare passes: rounds until a group mixes), DDP and FSDP2 (whose
    # sampling gathers the weights: every rank enters every round).
    "adaptive": ["sampler.max_generations=12", "reward.code.fn=reward_fixtures:rare_pass"],
    "fsdp-adaptive": [
        "trainer.distributed=fsdp",
        "sampler.max_generations=12",
        "reward.code.fn=reward_fixtures:rare_pass",
        "trainer.dynamic_sampling=true",
    ],
    # The warm-up (issue #60): its NLL through the same DDP forward, normalised by the step's
    # tokens over both ranks, then GRPO with the warmed policy as the reference.
    "sft": ["sft=demonstrations", "sft.steps=2", "sft.batch_size=4", "loss.beta=0.04"],
    # LoRA adapters under DDP (the reference: the same model with its adapters disabled)
    "lora": [
        "adapter=lora",
        "adapter.r=4",
        "loss.beta=0.04",
        "optimizer.learning_rate=1e-2",
        "trainer.gradient_accumulation_steps=2",
    ],
    # The loss menu (issue #49), paired to keep this test short: CISPO with the entropy bonus
    # (its gradient through the chunked log-probs), SAPO with GDPO; a teacher (on-policy
    # distillation) with LoRA and under FSDP2 (each rank scores its rows with its own teacher).
    # (the adaptive entropy control: no bonus on step 1, 0.055 on step 2 as every rank measured
    # the same entropy, below the target)
    "cispo-entropy": [
        "loss=cispo",
        "loss.entropy_coef=0.05",
        "loss.use_adaptive_entropy=true",
        "loss.entropy_target=100",
        "trainer.gradient_accumulation_steps=2",
    ],
    "sapo-gdpo": [
        "loss=sapo",
        "loss.multi_objective_aggregation=normalize_then_sum",
        "+reward.digits.fn=reward_fixtures:digit_sum",
    ],
    "teacher-lora": [
        "adapter=lora",
        "adapter.r=4",
        "optimizer.learning_rate=1e-2",
        "teacher.name_or_path=builtin:tiny32",
        "loss.teacher_kl=0.5",
        "trainer.gradient_accumulation_steps=2",
    ],
    "fsdp-teacher": [
        "trainer.distributed=fsdp",
        "teacher.name_or_path=builtin:tiny32",
        "loss.teacher_kl=0.5",
    ],
    # Micro-batches by a token budget (issue #50): one plan for the step, dealt to the ranks in
    # turn (a rank short of one runs a stand-in); zero-std groups skipped; two iterations.
    "token-budget": [
        "trainer.micro_batch_tokens=64",
        "reward.code.fn=reward_fixtures:no_signal_on_minus",
        "loss.beta=0.04",
        "trainer.num_iterations=2",
    ],
    "fsdp-token-budget": ["trainer.distributed=fsdp", "trainer.micro_batch_tokens=64", "loss.beta=0.04"],
    # FSDP2 (one process: the same run unsharded)
    "fsdp": ["trainer.distributed=fsdp", "loss.beta=0.04", "trainer.gradient_accumulation_steps=2"],
    "fsdp-dynamic-sampling": [
        "trainer.distributed=fsdp",
        "trainer.dynamic_sampling=true",
        "reward.code.fn=reward_fixtures:plus_parity",
    ],
    # bf16 weights with fp32 masters (DDP reduces bf16 gradients; FSDP2's mixed precision), one
    # step: a second would sample from weights that differ by bf16's rounding, so other tokens.
    "bf16": [
        "trainer.precision=bf16",
        "loss.beta=0.04",
        "trainer.gradient_accumulation_steps=2",
        "trainer.max_steps=1",
    ],
    "fsdp-bf16": [
        "trainer.distributed=fsdp",
        "trainer.precision=bf16",
        "loss.beta=0.04",
        "trainer.max_steps=1",
    ],
}


def main() -> None:
    from grpo_cli import distributed

    d = distributed.from_env()
    distributed.join(d, "cpu", 120)
    train_cases(Path(sys.argv[1]), d)
    distributed.leave()


def train_cases(out: Path, d=None) -> None:
    """Train every case of CASES into OUT/<case>/, as this process's rank of d (default: one
    process; tests/test_distributed.py calls it so in its own process)."""
    from hydra import compose, initialize_config_module

    from grpo_cli import distributed
    from grpo_cli.cli.train import train_config
    from grpo_cli.config import validate

    d = d or distributed.Dist()
    with initialize_config_module(config_module="grpo_cli.conf", version_base="1.3"):
        for name, overrides in CASES.items():
            if not d.enabled:
                overrides = [o for o in overrides if o != "trainer.distributed=fsdp"]
            cfg = compose(config_name="config", overrides=BASE + overrides)
            assert not validate(cfg), validate(cfg)
            (out / name).mkdir(parents=True, exist_ok=True)  # (what Hydra does for grpo-train)
            train_config(cfg, out / name, d=d)
            gc.collect()  # this case's models and their DDP wrappers go now (see distributed.leave)


if __name__ == "__main__":
    main()
