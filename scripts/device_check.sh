#!/usr/bin/env bash
# grpo-cli's device check: everything that needs a GPU, in one call, its results in one folder.
#
#   bash scripts/run.sh bash scripts/device_check.sh OUT         # a CUDA machine with the project installed
#   bash scripts/run.sh bash scripts/device_check.sh --cpu OUT   # the same on the CPU
#   bash scripts/device_check.sh --offline .whl OUT              # the lent GPU machine: no network, its
#                                                                # own python3 and torch (device_prepare.sh)
#   bash scripts/device_check.sh --cpu --offline .whl OUT        # the dry run of that, on a CPU
#
# --offline WHEELS: no virtual environment and no download. The wheels (scripts/device_prepare.sh)
# and the project, built from this tree, are installed with --no-index --no-deps --target into a
# temporary folder put on PYTHONPATH; models are random-init ones of real shapes (SmolLM2-135M's,
# Qwen2.5-0.5B's) with a locally built tokenizer, since the default model's offline copy does not
# travel; TRL is the carried wheel, run by this same interpreter.
#
# Parts (each with a time limit; every part runs even when one fails):
# 1. the gpu-marked tests on the device (GRPO_TEST_DEVICE)          -> OUT/tests.log
# 2. a short bf16 run with the step-0 self-check (the default recipe;
#    --offline: on the SmolLM2-shaped model, a length reward)         -> OUT/train.log, OUT/metrics.jsonl
# 3. fp16 with its real grad scaler, 2 steps (CUDA only: a CPU has no fp16 autocast; the gpu-marked
#    tests check the scaler's skip path there); then 2 processes over NCCL if there are 2 GPUs
#                                                                     -> OUT/more.log
# 4. grpo-check-env --json                                            -> OUT/check_env.json
# 5. the benchmark against TRL (scripts/bench_vs_trl.py): GPU: 8 prompts x 8 x 256 tokens on the
#    SmolLM2- and Qwen2.5-0.5B-shaped models, bf16; CPU: one 1-prompt step of each variant (a smoke
#    run, not a measurement). Where TRL cannot be had, grpo-cli's rows alone, said so.
#                                                                     -> OUT/bench.log, OUT/bench.json
# 6. a short sampler=vllm run where vLLM can be imported; otherwise one line saying it is skipped
#                                                                     -> OUT/more.log
# OUT/summary.json: each part's status, seconds and note, and the machine; the table is printed
# too. At most 8 files under OUT (what the lent machine sends back). Exit 1 if any part failed.
set -uo pipefail
mode=cuda wheels=""
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu) mode=cpu; shift ;;
    --offline) wheels="${2:?--offline needs the wheel folder (scripts/device_prepare.sh makes .whl)}"; shift 2 ;;
    -*) echo "device_check: unknown option $1" >&2; exit 2 ;;
    *) break ;;
  esac
done
out="${1:-device-check}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
work="$(mktemp -d "${TMPDIR:-/tmp}/grpo-device-check.XXXXXX")"  # run folders, models: not sent back
rm -f "$out"/*
parts="$work/parts.tsv"
: >"$parts"
failed=0
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
started=$SECONDS

record() {  # record STATUS NAME SECONDS NOTE
  printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >>"$parts"
  printf '%-8s%s (%s s)%s\n' "$1" "$2" "$3" "${4:+: $4}" >&2
}
note() { record note "$1" 0 "${2:-}"; }

step() {  # step NAME SECONDS LOG COMMAND...: run with a time limit, output appended to LOG
  local name="$1" limit="$2" log="$3"; shift 3
  local t0=$SECONDS
  echo "== $name (limit $limit s, log: $log)" >&2
  echo "== $name" >>"$log"
  timeout --signal=INT --kill-after=20 "$limit" "$@" >>"$log" 2>&1
  local rc=$?
  if [ $rc -eq 0 ]; then
    record ok "$name" $((SECONDS - t0)) ""
  else
    record FAILED "$name" $((SECONDS - t0)) "exit $rc$([ $rc -eq 124 ] && echo ", past its $limit s") (see $(basename "$log"))"
    failed=1
  fi
  return $rc
}

# 0. --offline: the carried wheels and the project, on PYTHONPATH; no network, no environment.
if [ -n "$wheels" ]; then
  wheels="$(cd "$wheels" 2>/dev/null && pwd)" || { echo "device_check: no wheel folder $wheels" >&2; exit 2; }
  site="$work/site"
  t0=$SECONDS
  {
    python3 -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check \
      --target "$site/deps" "$wheels"/*.whl &&
      PYTHONPATH="$site/deps" python3 -m pip install -q --no-index --no-deps --no-build-isolation \
        --no-compile --disable-pip-version-check --target "$site/project" "$root"
  } >"$work/install.log" 2>&1
  rc=$?
  if [ $rc -ne 0 ]; then
    tail -30 "$work/install.log" >&2
    cp "$work/install.log" "$out/more.log"
    record FAILED "install the wheels and the project (--offline)" $((SECONDS - t0)) "exit $rc (see more.log)"
    exit 1
  fi
  # (scripts/ last: python3 -P below does not put a script's folder on the path, and the
  # benchmarks import scripts/harness.py.)
  export PYTHONPATH="$site/project:$site/deps:$root/scripts${PYTHONPATH:+:$PYTHONPATH}" PATH="$site/project/bin:$PATH"
  record ok "install $(ls "$wheels"/*.whl | wc -l) wheels and the project (--offline)" $((SECONDS - t0)) ""
fi
# -P: the working tree's grpo_cli/ (which has no conf/ inside) must not shadow the installed one.
py=(python3)
[ -n "$wheels" ] && py=(python3 -P)
"${py[@]}" - <<'EOF' >&2
import importlib.metadata as md, platform, sys
names = ("torch", "transformers", "accelerate", "peft", "safetensors", "tokenizers", "datasets", "trl", "hydra-core", "grpo-cli")
def version(n):
    try:
        return md.version(n)
    except md.PackageNotFoundError:
        return "-"
print(f"[device_check] Python {platform.python_version()} ({sys.executable}); " + ", ".join(f"{n} {version(n)}" for n in names))
EOF

if [ "$mode" = cuda ]; then
  "${py[@]}" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' || {
    echo "device_check: no CUDA GPU is visible to torch here; on a CPU machine run it with --cpu" >&2
    exit 2
  }
  device=cuda precision=bf16 train_steps=4 eval_size=50
  bench=(--device cuda --steps 1 --warmup 1 --rounds 1 --variants "grpo-cli bf16,TRL bf16 tuned")
  alone=(--device cuda --steps 1 --warmup 1 --rounds 1 --variants "grpo-cli bf16,grpo-cli fp32")
  limits=(90 80 70 30 180 45)  # tests, bf16 run, fp16 (and NCCL), check-env, benchmark, calculator: 8 min with the rest
else
  device=cpu precision=bf16 train_steps=2 eval_size=20
  bench=(--device cpu --cases 1:0.04:1 --steps 1 --variants "grpo-cli fp32,grpo-cli bf16,TRL bf16 tuned")
  alone=(--device cpu --cases 1:0.04:1 --steps 1 --variants "grpo-cli fp32,grpo-cli bf16,floor fp32")
  limits=(300 300 0 120 900 300)
  # A CPU without bf16 units (no AVX512-BF16/AMX) emulates bf16 many times slower than fp32 (two
  # steps of the default recipe ran past 300 s on one): check fp32 there, and say so.
  if ! "${py[@]}" -c 'import sys; from grpo_cli.precision import cpu_has_bf16; sys.exit(not cpu_has_bf16())'; then
    precision=fp32
    bench=(--device cpu --cases 1:0.04:1 --steps 1 --variants "grpo-cli fp32,TRL fp32 tuned")
    alone=(--device cpu --cases 1:0.04:1 --steps 1 --variants "grpo-cli fp32,floor fp32")
    note "this CPU has no bf16 units: the recipe and the benchmark run in fp32"
  fi
fi
# The model of parts 2, 3 and 5: the default one (its offline copy), or, offline, random-init
# models of real shapes; random weights answer nothing right, so part 2 rewards length instead.
recipe=()
bench_models=()
if [ -n "$wheels" ]; then
  shape="$work/smollm2-135m-shape"
  if step "build a random-init SmolLM2-135M-shaped model" 120 "$out/train.log" "${py[@]}" -c \
    "import sys; sys.path.insert(0, 'scripts'); from pathlib import Path; from bench_qwen_shape import build; build(Path('$shape'), 'smollm2-135m')"; then
    recipe=("model.name_or_path=$shape" model.offline_wheel=null model.offline_gguf=null "reward=[length]" reward.length.unit=chars)
  fi
  [ "$mode" = cuda ] && bench_models=(--models smollm2-shape,qwen-shape) || bench_models=(--models smollm2-shape)
  bench_models+=(--shapes-dir "$work")
fi

# 1. the gpu-marked tests, on the device
step "gpu-marked tests on $device" "${limits[0]}" "$out/tests.log" env "GRPO_TEST_DEVICE=$device" \
  "${py[@]}" -m pytest -q -m gpu -p no:cacheprovider tests

# 2. a few bf16 steps; the step-0 self-check must pass
if step "$precision run, $train_steps steps (step-0 self-check)" "${limits[1]}" "$out/train.log" grpo-train \
  "${recipe[@]}" "trainer.precision=$precision" "trainer.device=$device" "trainer.max_steps=$train_steps" \
  "trainer.save_steps=$train_steps" trainer.eval_before=false "data.eval_size=$eval_size" "hydra.run.dir=$work/train"; then
  cp "$work/train/metrics.jsonl" "$out/metrics.jsonl"
  if grep -q "self-check ok" "$out/train.log"; then
    record ok "step-0 self-check passed" 0 ""
  else
    record FAILED "step-0 self-check" 0 "no 'self-check ok' line in train.log"
    failed=1
  fi
fi

# 2b. multi-turn episodes: the calculator environment, 2 steps on the built-in sampler (issue #36)
step "environment=calculator run, 2 steps (built-in sampler)" "${limits[5]}" "$out/train.log" grpo-train \
  "${recipe[@]}" environment=calculator "trainer.precision=$precision" "trainer.device=$device" trainer.max_steps=2 \
  trainer.save_steps=2 trainer.eval_before=false data.eval_size=0 "hydra.run.dir=$work/calculator"

# 3. fp16 with its real grad scaler; two processes over NCCL where there are two GPUs
if [ "$device" = cuda ]; then
  step "fp16 run with its grad scaler, 2 steps" "${limits[2]}" "$out/more.log" grpo-train "${recipe[@]}" \
    trainer.precision=fp16 trainer.device=cuda trainer.max_steps=2 trainer.save_steps=2 trainer.eval_before=false \
    data.eval_size=0 "hydra.run.dir=$work/fp16"
  gpus=$("${py[@]}" -c 'import torch; print(torch.cuda.device_count())')
  if [ "$gpus" -ge 2 ]; then
    step "2 processes over NCCL (tiny model, 2 steps)" "${limits[2]}" "$out/more.log" grpo-train model=tiny \
      trainer.num_processes=2 trainer.device=cuda trainer.max_steps=2 trainer.save_steps=2 trainer.eval_before=false \
      data.eval_size=0 "hydra.run.dir=$work/nccl"
  else
    note "2 processes over NCCL: not run" "this machine has $gpus GPU (2 needed)"
  fi
else
  note "fp16 run and NCCL: not run" "CUDA only (the CPU has no fp16 autocast)"
fi

# 4. the environment report
step "grpo-check-env --json" "${limits[3]}" "$work/check_env.out" grpo-check-env --json &&
  sed '1d' "$work/check_env.out" >"$out/check_env.json"  # (the first line is step's own header)

# 5. TRL, then the benchmark
before=$failed
if [ -n "$wheels" ]; then
  trl_ready=("${py[@]}" -c "import trl, datasets; print('trl', trl.__version__, 'datasets', datasets.__version__)")
  trl_name="TRL from the carried wheels" trl_venv=here
else
  trl_ready=("${py[@]}" -c "import sys; sys.path.insert(0, 'scripts'); import bench_vs_trl as b; from pathlib import Path; b.trl_python(Path('.bench/trl-own'))")
  trl_name="TRL's environment (.bench/trl-own)" trl_venv=".bench/trl-own"
fi
if step "$trl_name" 900 "$out/bench.log" "${trl_ready[@]}"; then
  step "benchmark vs TRL ($device)" "${limits[4]}" "$out/bench.log" "${py[@]}" scripts/bench_vs_trl.py "${bench[@]}" \
    "${bench_models[@]}" --trl-venv "$trl_venv" --trl-bf16-cases none --json "$out/bench.json"
else
  note "$trl_name could not be had (see bench.log)" "grpo-cli's rows alone"
  failed=$before  # (not a failure of grpo-cli)
  step "benchmark, grpo-cli alone ($device)" "${limits[4]}" "$out/bench.log" "${py[@]}" scripts/bench_vs_trl.py \
    "${alone[@]}" "${bench_models[@]}" --trl-bf16-cases none --json "$out/bench.json"
fi

# 6. sampler=vllm, wherever vLLM can be imported (the lent GPU machine has none, and its wheels are
#    far too large to carry: there this is one line saying so)
if "${py[@]}" -c "import vllm" >/dev/null 2>&1; then
  step "sampler=vllm run, $train_steps steps (step-0 self-check)" 300 "$work/vllm.log" grpo-train "${recipe[@]}" \
    sampler=vllm "trainer.precision=$precision" "trainer.device=$device" "trainer.max_steps=$train_steps" \
    "trainer.save_steps=$train_steps" trainer.eval_before=false "data.eval_size=$eval_size" "hydra.run.dir=$work/vllm" &&
    { grep -q "self-check ok" "$work/vllm.log" || { record FAILED "sampler=vllm self-check" 0 "no 'self-check ok' line"; failed=1; }; }
  cat "$work/vllm.log" >>"$out/more.log"
else
  note "sampler=vllm: skipped" "vLLM cannot be imported here (its wheels are too large to carry)"
fi

# The summary: every part, and the machine.
"${py[@]}" - "$parts" "$out/summary.json" "$mode" "${wheels:+offline}" $((SECONDS - started)) <<'EOF'
import json, platform, sys
import torch
parts_file, summary, mode, offline, total = sys.argv[1:6]
parts = []
for line in open(parts_file):
    status, name, seconds, note = line.rstrip("\n").split("\t")
    parts.append({"part": name, "status": status, "seconds": int(seconds), "note": note})
machine = {
    "python": platform.python_version(),
    "torch": torch.__version__,
    "cuda": torch.version.cuda,
    "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
    "cpu": platform.processor() or platform.machine(),
}
result = {"mode": mode, "offline": bool(offline), "total_s": int(total), "machine": machine, "parts": parts,
          "failed": [p["part"] for p in parts if p["status"] == "FAILED"]}
open(summary, "w").write(json.dumps(result, indent=2) + "\n")
print(f"== summary ({summary}): {mode}{', offline' if offline else ''}, {total} s, torch {machine['torch']}")
for p in parts:
    print(f"{p['status']:<8}{p['part']} ({p['seconds']} s){': ' + p['note'] if p['note'] else ''}")
EOF
rm -rf "$work"
exit $failed
