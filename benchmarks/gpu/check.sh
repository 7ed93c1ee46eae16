#!/usr/bin/env bash
# The Triton kernels' GPU check (issue 29), for a fresh CUDA machine without network that has
# Python 3.12, torch, triton, transformers, tokenizers and safetensors. Run from anywhere:
#
#     benchmarks/gpu/fetch_wheels.sh     # here, with network: fills benchmarks/gpu/wheels/
#     benchmarks/gpu/check.sh            # there: about 2-3 minutes, most of it Triton compiling
#
# The wheel folder is git-ignored: a device run must carry it (carry: benchmarks/gpu/wheels).
#
# It installs the missing wheels into a private folder (nothing in the machine's environment
# changes), runs the CUDA cases of the tests (`pytest -m cuda`: the kernels compiled, bf16
# included), then benchmarks/gpu/check.py (kernels against the reference in fp32/fp16/bf16,
# decode timed at batch 1 and 64, prefill), writing benchmarks/results/gpu_kernels-<date>.json.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
cd "$repo"
wheels=benchmarks/gpu/wheels
site=$(mktemp -d)/site
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
python -c 'import sys, torch, triton; print(sys.version.split()[0], "torch", torch.__version__,
  "cuda", torch.version.cuda, "triton", triton.__version__)'
if compgen -G "$wheels/*.whl" >/dev/null; then
  python -m pip install --quiet --no-index --no-deps --target "$site" "$wheels"/*.whl
else
  echo "no wheels in $wheels (run benchmarks/gpu/fetch_wheels.sh where there is network)" >&2
fi
export PYTHONPATH="$repo:$site${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET  # compiled kernels: the tests' CPU cases skip, the cuda ones run
timeout 240 python -m pytest -p no:cacheprovider -m cuda -q -x tests/ops
timeout 240 python benchmarks/gpu/check.py \
  --out "benchmarks/results/gpu_kernels-$(date -u +%Y-%m-%d).json"
