#!/usr/bin/env bash
# The GPU check (issues 29 and 35), for a fresh CUDA machine without network that has
# Python 3.12, torch, triton, transformers, tokenizers and safetensors. Run from anywhere:
#
#     benchmarks/gpu/fetch_wheels.sh     # here, with network: fills benchmarks/gpu/wheels/
#     benchmarks/gpu/tokenizer.sh        # here: SmolLM2's tokenizer files into .gpu/tok/
#     benchmarks/gpu/check.sh [OUTDIR]   # there: about 5 minutes, much of it Triton compiling
#
# The wheel and tokenizer folders are git-ignored: a device run carries them
# (carry: benchmarks/gpu/wheels, .gpu). CHECK_STAGES (default "pytest kernels e2e") and
# E2E_ARGS (passed to e2e.py, e.g. "--modes eager") narrow a run.
#
# It installs the missing wheels into a private folder (nothing in the machine's environment
# changes), runs the CUDA cases of the tests (`pytest -m cuda`), benchmarks/gpu/check.py (the
# Triton kernels against the reference in fp32/fp16/bf16, one layer timed) and
# benchmarks/gpu/e2e.py (tokens against transformers, the server with the openai client, the
# Llama-3.2-1B shape timed beside transformers and the memory floor), writing JSON to OUTDIR
# (default benchmarks/results). A stage that fails is reported and the next one still runs.
set -uo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
cd "$repo"
out=${1:-benchmarks/results}
mkdir -p "$out"
wheels=benchmarks/gpu/wheels
site=$(mktemp -d)/site
day=$(date -u +%Y-%m-%d)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
python -c 'import sys, torch, triton; print(sys.version.split()[0], "torch", torch.__version__,
  "cuda", torch.version.cuda, "triton", triton.__version__)'
if compgen -G "$wheels/*.whl" >/dev/null; then
  python -m pip install --quiet --no-index --no-deps --target "$site" "$wheels"/*.whl
else
  echo "no wheels in $wheels (run benchmarks/gpu/fetch_wheels.sh where there is network)" >&2
fi
export PYTHONPATH="$repo:$site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET  # compiled kernels: the tests' CPU cases skip, the cuda ones run
stage() {  # stage NAME SECONDS CMD...: run, report, go on
  local name=$1 secs=$2 t=$SECONDS rc
  shift 2
  echo "=== $name"
  timeout "$secs" "$@"
  rc=$?
  echo "=== $name: exit $rc after $((SECONDS - t)) s"
}
for s in ${CHECK_STAGES:-pytest kernels e2e}; do
  case $s in
    pytest) stage pytest 240 python -m pytest -p no:cacheprovider -m cuda -q -rs \
      --continue-on-collection-errors tests/ops tests/sample tests/worker tests/attention \
      tests/engine/test_preemption.py ;;
    kernels) stage kernels 200 python benchmarks/gpu/check.py --out "$out/gpu_kernels-$day.json" ;;
    e2e) stage e2e 600 python benchmarks/gpu/e2e.py --tokenizer .gpu/tok \
      --out "$out/gpu_e2e-$day.json" ${E2E_ARGS:-} ;;
  esac
done
