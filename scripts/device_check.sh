#!/usr/bin/env bash
# grpo-cli's device check: everything that needs a GPU, in one call, written under one folder.
#
#   bash scripts/run.sh bash scripts/device_check.sh OUT          # on a CUDA machine (<= ~8 min)
#   bash scripts/run.sh bash scripts/device_check.sh --cpu OUT    # the same on the CPU (CI runs it)
#
# 1. the gpu-marked tests on the device (GRPO_TEST_DEVICE)    -> OUT/tests.log, OUT/junit.xml
# 2. a short bf16 run of the default recipe, step-0 self-check -> OUT/train.log, OUT/metrics.jsonl
# 3. grpo-check-env --json                                     -> OUT/check_env.json
# 4. the benchmark against TRL (scripts/bench_vs_trl.py)      -> OUT/bench.log, OUT/bench.json
#    GPU: 8 prompts x 8 x 256 tokens on SmolLM2 and a Qwen2.5-0.5B-shaped model, bf16;
#    CPU: one 1-prompt step of each variant (a smoke run of the benchmark, not a measurement).
#    TRL runs in its own environment (.bench/trl-own), created on first use from PyPI; where
#    PyPI cannot be reached the benchmark runs grpo-cli's rows alone and says so.
# --cpu: every step on the CPU with CPU-sized work: everything but CUDA. Every step runs even
# when one fails; OUT/summary.txt lists each step's status; the exit status is 1 if any failed.
set -uo pipefail
mode=cuda
if [ "${1:-}" = "--cpu" ]; then mode=cpu; shift; fi
out="${1:-device-check}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
summary="$out/summary.txt"
: > "$summary"
failed=0
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1

step() {  # step NAME SECONDS COMMAND...: run with a time limit, record ok / FAILED (status)
  local name="$1" limit="$2"; shift 2
  local t0=$SECONDS
  echo "== $name" >&2
  timeout --signal=INT --kill-after=30 "$limit" "$@"
  local rc=$?
  local line
  if [ $rc -eq 0 ]; then line="ok      $name ($((SECONDS - t0)) s)"; else line="FAILED  $name (exit $rc, $((SECONDS - t0)) s)"; failed=1; fi
  echo "$line" | tee -a "$summary" >&2
}

if [ "$mode" = cuda ]; then
  python -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' || {
    echo "device_check: no CUDA GPU is visible to torch here; run it with --cpu on a CPU machine" >&2
    exit 2
  }
  device=cuda; train_steps=4; eval_size=50
  bench=(--device cuda --steps 2 --variants "grpo-cli bf16,TRL bf16 defaults,TRL bf16 tuned" --trl-bf16-cases none)
  grpo_only=(--device cuda --steps 2 --variants "grpo-cli bf16,grpo-cli fp32,floor fp32" --trl-bf16-cases none)
else
  device=cpu; train_steps=2; eval_size=20
  bench=(--device cpu --cases 1:0.04:1 --steps 1 --variants "grpo-cli fp32,grpo-cli bf16,TRL bf16 tuned,floor fp32" --trl-bf16-cases none)
  grpo_only=(--device cpu --cases 1:0.04:1 --steps 1 --variants "grpo-cli fp32,grpo-cli bf16,floor fp32" --trl-bf16-cases none)
fi

# 1. the gpu-marked tests, on the device
step "gpu-marked tests on $device" 240 env GRPO_TEST_DEVICE=$device \
  python -m pytest -q -m gpu -p no:cacheprovider --junitxml="$out/junit.xml" tests >"$out/tests.log" 2>&1

# 2. the default recipe in bf16 for a few steps: the step-0 self-check must pass
train_check() {
  rm -rf "$out/train"
  grpo-train trainer.precision=bf16 "trainer.device=$device" "trainer.max_steps=$train_steps" \
    "trainer.save_steps=$train_steps" trainer.eval_before=false "data.eval_size=$eval_size" \
    "hydra.run.dir=$out/train" >"$out/train.log" 2>&1 || return 1
  cp "$out/train/metrics.jsonl" "$out/metrics.jsonl"
  grep -q "self-check ok" "$out/train.log" || { echo "no 'self-check ok' line in train.log" >&2; return 1; }
}
step "bf16 default recipe, $train_steps steps, self-check" 240 bash -c "$(declare -f train_check); out=$out device=$device train_steps=$train_steps eval_size=$eval_size train_check"

# 3. the environment report
step "grpo-check-env --json" 60 bash -c "grpo-check-env --json > '$out/check_env.json'"

# 4. the benchmark (with TRL where its environment can be made)
bench_run() {
  python scripts/bench_vs_trl.py "$@" --json "$out/bench.json" >"$out/bench.log" 2>&1
}
if python - <<'EOF' >/dev/null 2>&1
import subprocess, sys
from pathlib import Path
python = Path(".bench/trl-own/bin/python")
sys.exit(0 if python.exists() else subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", "/tmp/trl-probe", "trl"], timeout=60).returncode)
EOF
then
  step "benchmark vs TRL ($device)" 300 bash -c "$(declare -f bench_run); out=$out; bench_run ${bench[*]@Q}"
else
  echo "PyPI cannot be reached and TRL's environment does not exist: the benchmark runs grpo-cli alone" | tee -a "$summary" >&2
  step "benchmark, grpo-cli only ($device)" 300 bash -c "$(declare -f bench_run); out=$out; bench_run ${grpo_only[*]@Q}"
fi

echo "== summary ($out)" >&2
cat "$summary" >&2
exit $failed
