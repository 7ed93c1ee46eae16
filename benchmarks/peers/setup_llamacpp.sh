#!/usr/bin/env bash
# Build llama.cpp's llama-server and llama-quantize (CPU only) for the side-by-side benchmarks
# (issue 16), from the llama.cpp sources vendored in the llama-cpp-python sdist on PyPI: PyPI is
# the only source this machine may download from, and the sdist pins one llama.cpp commit.
#
#   bash benchmarks/peers/setup_llamacpp.sh [DIR]          # default DIR: .peers/llamacpp
#   LLAMA_CPP_PYTHON_VERSION=0.3.36 bash benchmarks/peers/setup_llamacpp.sh
#
# Layout under DIR:  sdist/ (the tar.gz), src/ (unpacked; llama.cpp at src/vendor/llama.cpp,
# with convert_hf_to_gguf.py and gguf-py), build/bin/{llama-server,llama-quantize}, and
# convert-venv/: a venv that sees the project venv's packages (a .pth line) and adds the one
# package convert_hf_to_gguf.py needs beyond them (sentencepiece, imported for every Llama),
# so the project venv stays as it is.
# Nothing is fetched at build or run time: the web UI is neither built (npm) nor downloaded
# (LLAMA_USE_PREBUILT_UI would pull it from a Hugging Face bucket), and HTTPS support is off
# (the server only listens on 127.0.0.1). LLAMA_CURL is deprecated in this llama.cpp (a warning).
# Static libraries so the binaries do not depend on the build tree's .so files.
set -euo pipefail
DIR=${1:-.peers/llamacpp}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}   # newest on PyPI when this was written
JOBS=${JOBS:-2}
if [ -x .venv/bin/pip ]; then PIP=".venv/bin/pip"; else PIP="python3 -m pip"; fi

mkdir -p "$DIR/sdist"
SDIST="$DIR/sdist/llama_cpp_python-$VERSION.tar.gz"
if [ ! -f "$SDIST" ]; then
    $PIP download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$DIR/sdist"
fi
if [ ! -f "$DIR/src/.unpacked-$VERSION" ]; then
    rm -rf "$DIR/src" && mkdir -p "$DIR/src"
    tar -xzf "$SDIST" -C "$DIR/src" --strip-components=1
    touch "$DIR/src/.unpacked-$VERSION"
fi
LLAMA="$DIR/src/vendor/llama.cpp"

cmake -S "$LLAMA" -B "$DIR/build" -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON -DGGML_CUDA=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF
cmake --build "$DIR/build" --config Release -j "$JOBS" --target llama-server llama-quantize

# The converter's python: the project venv (torch, transformers, gguf) plus sentencepiece.
if [ -x .venv/bin/python ] && [ ! -x "$DIR/convert-venv/bin/python" ]; then
    python3 -m venv "$DIR/convert-venv"
    SITE=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    CSITE=$("$DIR/convert-venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    echo "$SITE" > "$CSITE/kvserve-venv.pth"
    "$DIR/convert-venv/bin/pip" install -q "sentencepiece>=0.1.98,<0.3.0"
fi

"$DIR/build/bin/llama-server" --version 2>&1 | head -n 2
echo "llama-server:   $DIR/build/bin/llama-server"
echo "llama-quantize: $DIR/build/bin/llama-quantize"
echo "convert script: $LLAMA/convert_hf_to_gguf.py (run by $DIR/convert-venv/bin/python)"
