"""``kvserve serve org/name`` as vLLM's first command: the model downloaded from a local
stand-in for the Hub (``HF_ENDPOINT``), then served again offline from the cache; a copied
vLLM command line's flags; ``/version`` and ``/ping``; the periodic stats line and
``--disable-log-stats``; ``--ray`` without the extra."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import kvserve
from tests.model.hub_stand_in import HubStandIn, make_tiny_repo, repo_of
from tests.server.conftest import Server, start_server

REPO = "tiny-org/tiny-llama"
STATS = f"{REPO}: Avg prompt throughput: "
# a tiny float32 model that builds no C++ kernel
FAST = [
    "--dtype",
    "float32",
    "--attention-backend",
    "TORCH_SDPA",
    "--no-fused-ops",
    "--no-prepack-weights",
    "--no-warmup",
    "--num-kv-blocks",
    "64",
]
# flags of copied vLLM command lines: accepted (chunked prefill is always on; the rest
# change nothing here or are aliases)
VLLM_FLAGS = [
    "--enable-chunked-prefill",
    "--max-seq-len-to-capture",
    "8192",
    "--task",
    "generate",
    "--load-format",
    "safetensors",
    "--enable-prompt-tokens-details",
    "-tp",
    "1",
    "--disable-uvicorn-access-log",
    "--disable-cascade-attn",
]
MESSAGES = [{"role": "user", "content": "Hello hub"}]


@pytest.fixture(scope="module")
def tiny_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_repo(tmp_path_factory.mktemp("repo") / "tiny-llama")


@pytest.fixture(scope="module")
def hub(tiny_repo: Path) -> Iterator[HubStandIn]:
    with HubStandIn({REPO: repo_of(tiny_repo)}) as stand_in:
        yield stand_in


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hf")


def _serve(args: list[str], log: Path, env: dict[str, str]) -> Server:
    with pytest.MonkeyPatch.context() as mp:
        for var in ("HF_HUB_CACHE", "HF_HUB_OFFLINE", "HF_ENDPOINT"):
            mp.delenv(var, raising=False)
        for key, value in env.items():
            mp.setenv(key, value)
        return start_server(args, log)


@pytest.fixture(scope="module")
def online(
    hub: HubStandIn, hf_home: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("logs") / "online.log"
    env = {"HF_HOME": str(hf_home), "HF_ENDPOINT": hub.url, "VLLM_LOG_STATS_INTERVAL": "0.5"}
    server = _serve([REPO, *VLLM_FLAGS, *FAST], log, env)
    yield server
    server.stop()


def _chat(server: Server) -> str:
    reply = server.client().chat.completions.create(
        model=REPO,
        messages=MESSAGES,
        max_tokens=8,
        temperature=0.0,  # type: ignore[arg-type]
    )
    assert reply.model == REPO and reply.usage is not None
    assert reply.usage.completion_tokens == 8  # a random model: no EOS in 8 greedy steps
    return reply.choices[0].message.content or ""


def _wait_for(log: Path, text: str, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in log.read_text():
            return True
        time.sleep(0.1)
    return False


@pytest.mark.slow
def test_serve_downloads_a_hub_id_and_answers_the_openai_client(
    online: Server, hub: HubStandIn, tiny_repo: Path
) -> None:
    from kvserve import LLM, SamplingParams

    assert sorted(hub.fetched()) == sorted(
        f"{REPO}/{n}"
        for n in (
            "chat_template.jinja",
            "config.json",
            "generation_config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
        )
    )
    got = _chat(online)
    direct = LLM(
        str(tiny_repo),
        dtype="float32",
        num_kv_blocks=64,
        attention_backend="TORCH_SDPA",
        fused_ops=False,
        prepack_weights=False,
        warmup=False,
    )
    params = SamplingParams(max_tokens=8, temperature=0.0)
    want = direct.chat(MESSAGES, params, use_tqdm=False)[0].outputs[0].text  # type: ignore[arg-type]
    direct.engine.close()
    assert got == want
    # vLLM's periodic stats line, every VLLM_LOG_STATS_INTERVAL seconds while busy
    assert _wait_for(online.log, STATS), online.log.read_text()[-2000:]
    # --max-seq-len-to-capture is kvserve's own flag now (CUDA graphs); this one changes nothing
    assert "--disable-cascade-attn: accepted, no effect" in online.log.read_text()


@pytest.mark.slow
def test_version_and_ping(online: Server) -> None:
    r = httpx.get(f"{online.url}/version", timeout=10)
    assert r.status_code == 200 and r.json() == {"version": kvserve.__version__}
    for method in ("GET", "POST"):
        assert httpx.request(method, f"{online.url}/ping", timeout=10).status_code == 200
    time.sleep(0.5)
    assert '"GET /version' not in online.log.read_text()  # --disable-uvicorn-access-log


@pytest.mark.slow
def test_serve_offline_from_the_cache_without_stats(
    online: Server, hub: HubStandIn, hf_home: Path, tmp_path: Path
) -> None:
    """The cache the first server filled serves the model with HF_HUB_OFFLINE=1 and no Hub
    at all; --disable-log-stats leaves out the stats line."""
    expected = _chat(online)
    seen = len(hub.requests)
    env = {
        "HF_HOME": str(hf_home),
        "HF_HUB_OFFLINE": "1",
        "HF_ENDPOINT": "http://127.0.0.1:9",
        "VLLM_LOG_STATS_INTERVAL": "0.5",
    }
    server = _serve([REPO, "--disable-log-stats", *FAST], tmp_path / "offline.log", env)
    try:
        assert _chat(server) == expected
        time.sleep(1.5)  # three stats intervals
        assert "Avg prompt throughput" not in server.log.read_text()
    finally:
        server.stop()
    assert hub.requests[seen:] == []


def test_ray_without_the_extra_says_which_to_install(tmp_path: Path) -> None:
    """``import ray`` made to fail (as where the [ray] extra is not installed)."""
    blocker = tmp_path / "sitecustomize.py"
    blocker.write_text(
        "import sys\n"
        "class _NoRay:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'ray' or name.startswith('ray.'):\n"
        "            raise ImportError(f'No module named {name!r}')\n"
        "sys.meta_path.insert(0, _NoRay())\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    r = subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "serve", "--ray"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().endswith(
        "--ray needs Ray Serve, which is not installed (No module named 'ray'); install the "
        "extra: pip install 'kvserve[ray]'"
    ), r.stderr[-2000:]
