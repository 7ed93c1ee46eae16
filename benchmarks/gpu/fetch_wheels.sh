#!/usr/bin/env bash
# Fill a wheel folder (default benchmarks/gpu/wheels/, git-ignored) with what a GPU machine
# lacks to run benchmarks/gpu/check.sh offline: the server's pure-Python stack, gguf, xgrammar
# and pytest, for CPython 3.12 on x86_64 Linux. The GPU machine brings torch, triton,
# transformers, tokenizers, safetensors, numpy (and their dependencies), so everything here is
# fetched with --no-deps (xgrammar would otherwise pull torch and triton). Versions are the ones
# the shared development venv runs. The folder must stay well under the 64 MiB a device run
# carries (9 MiB measured, 10.4 with peft's 1.4).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
dest=${1:-$here/wheels}
mkdir -p "$dest"
pkgs=(
  # the server (kvserve/server/): FastAPI on uvicorn
  fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5
  annotated-types==0.8.0 annotated-doc==0.0.7 typing-inspection==0.4.5 typing-extensions==4.16.0
  opentelemetry-api==1.45.2 anyio==4.16.0 sniffio==1.3.1 idna==3.20
  uvicorn==0.54.0 httptools==0.9.0 click==8.5.1 h11==0.16.0 prometheus-client==0.26.0
  # GGUF checkpoints, structured outputs
  gguf==0.19.0 xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2
  # the official client the check serves (benchmarks/gpu/e2e.py)
  openai==3.57.0 jiter==0.19.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 distro==1.9.0
  # peft: the reference and the adapter files of e2e.py's lora step (e2e_lora.py)
  peft==0.21.2 accelerate==1.15.0 psutil==7.2.2
  # the tests (pytest -m cuda)
  pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 pygments==2.21.0 pytest-asyncio==1.5.0
)
pip download --no-deps --only-binary=:all: --dest "$dest" \
  --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 --platform any \
  "${pkgs[@]}"
kib=$(du -sk "$dest" | cut -f1)
echo "$dest: $(ls "$dest" | wc -l) wheels, $((kib / 1024)) MiB"
if ((kib > 40 * 1024)); then
  echo "more than 40 MiB: a device run carries 64 MiB in all" >&2
  exit 1
fi
