#!/usr/bin/env bash
# The lent GPU machine's device check, rehearsed on this CPU (CI runs it): an environment with only
# that machine's image's versions (Python 3.12, torch 2.11, transformers 5.17, ...; none of the
# packages it lacks), the wheelhouse of scripts/device_prepare.sh, and no network, running
#   bash scripts/device_check.sh --cpu --offline .whl OUT
# exactly as the real call runs it there (without --cpu). It is what makes the first real call
# likely to succeed.
#
#   bash scripts/device_dryrun.sh [OUT]      # OUT defaults to device-check-dryrun/
#
# The environment (.venv-lent/, made once, ~5 GB: PyPI's torch 2.11 is the CUDA build, which runs on
# a CPU too) is remade when the list of the image's packages below changes. No network inside: `unshare -n` where it is allowed
# (root), else the offline variables alone, said so.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:-$root/device-check-dryrun}"
venv="${GRPO_LENT_VENV:-$root/.venv-lent}"
# What the lent image has that the check touches, at its versions where they are published (KINDS.md
# of the device tool, read 2026-11-17); the rest at what PyPI serves.
image=(
  torch==2.11.0 transformers==5.17.0 accelerate==1.15.0 safetensors==0.8.0 tokenizers==0.23.2
  huggingface_hub==1.33.0 peft numpy pandas pyarrow rich psutil matplotlib pytest pytest-xdist
  xxhash aiohttp requests httpx tqdm pyyaml jinja2 filelock fsspec sympy packaging regex
  sentencepiece setuptools wheel
)

# A Python 3.12 that runs (a pyenv shim may name one that is not selected): PATH's, then pyenv's.
python312="${PYTHON312:-}"
if [ -z "$python312" ]; then
  for cand in "$(command -v python3.12 2>/dev/null)" "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12; do
    if [ -x "$cand" ] && "$cand" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
      python312="$cand"
      break
    fi
  done
fi
[ -n "$python312" ] && [ -x "$python312" ] || {
  echo "device_dryrun: needs Python 3.12 (the lent machine's; the carried wheels are cp312). Set PYTHON312=/path/to/python3.12." >&2
  exit 2
}
want="$(echo "$("$python312" --version) ${image[*]}" | sha256sum | cut -d' ' -f1)"
if [ ! -f "$venv/.lent-image" ] || [ "$(cat "$venv/.lent-image")" != "$want" ]; then
  echo "[dryrun] making the lent image's environment in $venv (first run only)" >&2
  rm -rf "$venv"
  "$python312" -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check "${image[@]}" 2>&1 | grep -v '^WARNING: Location' >&2 || true
  "$venv/bin/python" -c 'import torch, transformers, peft, accelerate, xxhash' || {
    echo "[dryrun] the environment could not be made; see pip's output above" >&2
    exit 1
  }
  echo "$want" >"$venv/.lent-image"
fi
# The image lacks these: the check must not find them but in the wheelhouse.
for missing in hydra omegaconf datasets math_verify trl grpo_cli; do
  if (cd / && "$venv/bin/python" -c "import $missing" 2>/dev/null); then
    echo "[dryrun] $missing is importable in $venv, which the lent image is not: remove $venv" >&2
    exit 1
  fi
done

bash "$root/scripts/device_prepare.sh" "$root/.whl" >/dev/null

cd "$root"
isolate=(unshare -n)
if ! unshare -n true 2>/dev/null; then
  isolate=()
  echo "[dryrun] note: unshare -n is not allowed here; the run is offline by its variables only" >&2
fi
PATH="$venv/bin:$PATH" "${isolate[@]}" bash scripts/device_check.sh --cpu --offline .whl "$out"
