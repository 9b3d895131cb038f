#!/usr/bin/env bash
# grpo-cli's device check: everything that needs a GPU, in one call, written under one folder.
#
#   bash scripts/run.sh bash scripts/device_check.sh OUT          # on a CUDA machine (~8 min)
#   bash scripts/run.sh bash scripts/device_check.sh --cpu OUT    # the same on the CPU (CI runs it)
#
# 1. the gpu-marked tests on the device (GRPO_TEST_DEVICE)    -> OUT/tests.log, OUT/junit.xml
# 2. a short bf16 run of the default recipe, step-0 self-check -> OUT/train.log, OUT/metrics.jsonl
# 3. grpo-check-env --json                                     -> OUT/check_env.json
# 4. TRL's own environment (.bench/trl-own: torch, trl, the newest transformers from PyPI; made
#    once, kept), then the benchmark against TRL (scripts/bench_vs_trl.py) -> OUT/bench.log, .json
#    GPU: 8 prompts x 8 x 256 tokens on SmolLM2 and a Qwen2.5-0.5B-shaped model, bf16;
#    CPU: one 1-prompt step of each variant (a smoke run of the benchmark, not a measurement).
#    Where TRL's environment cannot be made (no PyPI), the benchmark runs grpo-cli alone and says so.
# --cpu: every part on the CPU with CPU-sized work: everything but CUDA. Every part runs even
# when one fails; OUT/summary.txt lists each part's status; the exit status is 1 if any failed.
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

step() {  # step NAME SECONDS LOG COMMAND...: run with a time limit, output to LOG, record the status
  local name="$1" limit="$2" log="$3"; shift 3
  local t0=$SECONDS line
  echo "== $name (log: $log)" >&2
  timeout --signal=INT --kill-after=30 "$limit" "$@" >"$log" 2>&1
  local rc=$?
  if [ $rc -eq 0 ]; then
    line="ok      $name ($((SECONDS - t0)) s)"
  else
    line="FAILED  $name (exit $rc, $((SECONDS - t0)) s; see $log)"
    failed=1
  fi
  echo "$line" | tee -a "$summary" >&2
  return $rc
}

if [ "$mode" = cuda ]; then
  python -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' || {
    echo "device_check: no CUDA GPU is visible to torch here; on a CPU machine run it with --cpu" >&2
    exit 2
  }
  device=cuda; train_steps=4; eval_size=50
  bench=(--device cuda --steps 2 --variants "grpo-cli bf16,TRL bf16 defaults,TRL bf16 tuned")
  alone=(--device cuda --steps 2 --variants "grpo-cli bf16,grpo-cli fp32,floor fp32")
else
  device=cpu; train_steps=2; eval_size=20; precision=bf16
  bench=(--device cpu --cases 1:0.04:1 --steps 1 --variants "grpo-cli fp32,grpo-cli bf16,TRL bf16 tuned")
  alone=(--device cpu --cases 1:0.04:1 --steps 1 --variants "grpo-cli fp32,grpo-cli bf16,floor fp32")
  # A CPU without bf16 units (no AVX512-BF16/AMX) emulates bf16 many times slower than fp32 (two
  # steps of the default recipe ran past 300 s on one): check fp32 there, and say so.
  if ! python -c 'import sys; from grpo_cli.precision import cpu_has_bf16; sys.exit(not cpu_has_bf16())'; then
    precision=fp32
    bench=(--device cpu --cases 1:0.04:1 --steps 1 --variants "grpo-cli fp32,TRL fp32 tuned")
    alone=(--device cpu --cases 1:0.04:1 --steps 1 --variants "grpo-cli fp32,floor fp32")
    echo "note    this CPU has no bf16 units: the recipe and the benchmark run in fp32" | tee -a "$summary" >&2
  fi
fi

# 1. the gpu-marked tests, on the device
step "gpu-marked tests on $device" 300 "$out/tests.log" env "GRPO_TEST_DEVICE=$device" \
  python -m pytest -q -m gpu -p no:cacheprovider --junitxml="$out/junit.xml" tests

# 2. the default recipe in bf16 for a few steps; the step-0 self-check must pass
rm -rf "$out/train"
if step "${precision:-bf16} default recipe, $train_steps steps" 300 "$out/train.log" grpo-train "trainer.precision=${precision:-bf16}" \
  "trainer.device=$device" "trainer.max_steps=$train_steps" "trainer.save_steps=$train_steps" \
  trainer.eval_before=false "data.eval_size=$eval_size" "hydra.run.dir=$out/train"; then
  cp "$out/train/metrics.jsonl" "$out/metrics.jsonl"
  if grep -q "self-check ok" "$out/train.log"; then
    echo "ok      step-0 self-check passed" | tee -a "$summary" >&2
  else
    echo "FAILED  no 'self-check ok' line in $out/train.log" | tee -a "$summary" >&2
    failed=1
  fi
fi

# 3. the environment report
step "grpo-check-env --json" 60 "$out/check_env.json" grpo-check-env --json

# 4. TRL's environment, then the benchmark
before=$failed
trl=(python -c "import sys; sys.path.insert(0, 'scripts'); import bench_vs_trl as b; from pathlib import Path; b.trl_python(Path('.bench/trl-own'))")
if step "TRL's environment (.bench/trl-own)" 900 "$out/trl-env.log" "${trl[@]}"; then
  step "benchmark vs TRL ($device)" 900 "$out/bench.log" python scripts/bench_vs_trl.py "${bench[@]}" \
    --trl-bf16-cases none --json "$out/bench.json"
else
  echo "note    TRL's environment could not be made (see trl-env.log): grpo-cli's rows alone" | tee -a "$summary" >&2
  failed=$before  # (not a failure of grpo-cli)
  step "benchmark, grpo-cli alone ($device)" 900 "$out/bench.log" python scripts/bench_vs_trl.py "${alone[@]}" \
    --trl-bf16-cases none --json "$out/bench.json"
fi

echo "== summary ($out)" >&2
cat "$summary" >&2
exit $failed
