"""LoRA adapters over HTTP on a real ``kvserve serve``: `/v1/models` lists them under their
base model, a request's ``model`` picks one (tokens equal peft's merged model), and
``/v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` change them at run time (requests in
flight finish); bad adapters and unknown names get 400 and 404 in the API's error shape."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.lora.utils import SPECS, AdapterSpec, hf_greedy, make_adapter, merged_model
from tests.server.conftest import TINY, Server, start_server

pytestmark = pytest.mark.slow

MAX_TOKENS = 8
LONG = 600  # tokens of the request an unload must let finish
MESSAGES = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def lora_dirs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("http_adapters")
    specs = {"a1": SPECS["all8"], "a2": SPECS["qv4"], "a3": SPECS["mixed2"],
             "big": AdapterSpec(32, 32, ("q_proj",))}  # fmt: skip
    return {n: make_adapter(tiny_model_dir, root / n, s, seed=10 + i)
            for i, (n, s) in enumerate(specs.items())}  # fmt: skip


@pytest.fixture(scope="module")
def lora_server(
    tiny_model_dir: Path, lora_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("logs") / "lora_server.log"
    a2 = {"name": "a2", "path": str(lora_dirs["a2"]), "base_model_name": TINY}
    os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"  # vLLM's variable turns the routes on
    try:
        srv = start_server(
            [str(tiny_model_dir), "--served-model-name", TINY, "--enable-lora", "--max-loras",
             "2", "--num-kv-blocks", "200", "--dtype", "float32",  # peft's reference
             "--lora-modules", f"a1={lora_dirs['a1']}",
             json.dumps(a2)],
            log,
        )  # fmt: skip
    finally:
        del os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"]
    yield srv
    srv.stop()


def chat_tokens(client: openai.OpenAI, model: str, max_tokens: int = MAX_TOKENS) -> tuple:
    resp = client.chat.completions.create(
        model=model, messages=MESSAGES, temperature=0, max_tokens=max_tokens,  # type: ignore[arg-type]
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    assert resp.model == model
    extra = resp.model_extra or {}
    return extra["prompt_token_ids"], resp.choices[0].model_extra["token_ids"]  # type: ignore[index]


def expected(base: Path, adapter: Path | None, prompt: list[int], n: int = MAX_TOKENS) -> list:
    return hf_greedy(merged_model(base, adapter), prompt, n)


def lora_info(server: Server) -> dict[str, str]:
    """vLLM's ``lora_requests_info`` labels (without model_name/engine); its value is the time
    it was last updated: checked to be a wall-clock time of this run."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    (sample,) = [s for f in text_string_to_metric_families(text) for s in f.samples
                 if s.name == "kvserve:lora_requests_info"]  # fmt: skip
    assert abs(sample.value - time.time()) < 600
    assert (sample.labels.pop("model_name"), sample.labels.pop("engine")) == (TINY, "0")
    return sample.labels


def post(server: Server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{path}", json=body, timeout=60)


def test_models_lists_adapters_under_their_base(
    lora_server: Server, lora_dirs: dict[str, Path]
) -> None:
    cards = {m.id: m for m in lora_server.client().models.list().data}
    assert list(cards) == [TINY, "a1", "a2"]
    for name in ("a1", "a2"):
        extra = cards[name].model_extra or {}
        assert (extra["parent"], extra["root"]) == (TINY, str(lora_dirs[name]))
    assert (cards[TINY].model_extra or {})["parent"] is None


def test_model_field_chooses_the_adapter(
    lora_server: Server, tiny_model_dir: Path, lora_dirs: dict[str, Path]
) -> None:
    client = lora_server.client()
    outs = {}
    for model, adapter in ((TINY, None), ("a1", lora_dirs["a1"]), ("a2", lora_dirs["a2"])):
        prompt, tokens = chat_tokens(client, model)
        assert tokens == expected(tiny_model_dir, adapter, prompt), model
        outs[model] = tokens
    assert len({tuple(t) for t in outs.values()}) == 3  # each adapter changes the answer
    with pytest.raises(openai.NotFoundError) as e:
        chat_tokens(client, "no-such-adapter")
    assert e.value.body["code"] == "model_not_found"  # type: ignore[index]
    assert "a1" in e.value.body["message"]  # type: ignore[index]


def test_load_use_unload(
    lora_server: Server, tiny_model_dir: Path, lora_dirs: dict[str, Path]
) -> None:
    client = lora_server.client()
    r = post(
        lora_server, "load_lora_adapter", {"lora_name": "a3", "lora_path": str(lora_dirs["a3"])}
    )
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'a3' added successfully.")
    assert [m.id for m in client.models.list().data] == [TINY, "a1", "a2", "a3"]
    # three adapters, two device slots: the LRU one leaves its slot and comes back
    for model in ("a3", "a1", "a2", "a3"):
        prompt, tokens = chat_tokens(client, model)
        assert tokens == expected(tiny_model_dir, lora_dirs[model], prompt), model
    r = post(
        lora_server, "load_lora_adapter", {"lora_name": "a3", "lora_path": str(lora_dirs["a3"])}
    )
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "The lora adapter 'a3' has already been loaded."
    r = post(lora_server, "unload_lora_adapter", {"lora_name": "a3"})
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'a3' removed successfully.")
    with pytest.raises(openai.NotFoundError):
        chat_tokens(client, "a3")
    r = post(lora_server, "unload_lora_adapter", {"lora_name": "a3"})
    assert r.status_code == 404
    assert r.json()["error"]["message"] == "The lora adapter 'a3' cannot be found."


def test_bad_adapters_are_400_with_the_reason(
    lora_server: Server, lora_dirs: dict[str, Path], tmp_path: Path
) -> None:
    r = post(
        lora_server, "load_lora_adapter", {"lora_name": "big", "lora_path": str(lora_dirs["big"])}
    )
    assert r.status_code == 400
    assert "the adapter's rank 32 is above max_lora_rank 16" in r.json()["error"]["message"]
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8}))
    (broken / "adapter_model.safetensors").write_bytes(b"\x01\x02not safetensors")
    r = post(lora_server, "load_lora_adapter", {"lora_name": "broken", "lora_path": str(broken)})
    assert r.status_code == 400
    assert "cannot read the adapter's weights" in r.json()["error"]["message"]
    r = post(
        lora_server, "load_lora_adapter", {"lora_name": TINY, "lora_path": str(lora_dirs["a3"])}
    )
    assert r.status_code == 400 and "served model's name" in r.json()["error"]["message"]
    names = [m.id for m in lora_server.client().models.list().data]
    assert names == [TINY, "a1", "a2"]  # nothing half-registered; the server serves on
    assert chat_tokens(lora_server.client(), "a1")[1]


def test_unload_lets_requests_in_flight_finish(
    lora_server: Server, tiny_model_dir: Path, lora_dirs: dict[str, Path]
) -> None:
    r = post(
        lora_server, "load_lora_adapter", {"lora_name": "a4", "lora_path": str(lora_dirs["a3"])}
    )
    assert r.status_code == 200
    stream = lora_server.client().chat.completions.create(
        model="a4", messages=MESSAGES, temperature=0, max_tokens=LONG, stream=True,  # type: ignore[arg-type]
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    tokens: list[int] = []
    unloaded = False
    for chunk in stream:
        if chunk.choices:
            tokens += (chunk.choices[0].model_extra or {}).get("token_ids") or []
        if tokens and not unloaded:
            r = post(lora_server, "unload_lora_adapter", {"lora_name": "a4"})
            assert r.status_code == 200
            unloaded = True
            # it is still running (a few ms into ~2 s of decoding): the unload waits for it
            assert lora_server.metrics(TINY)["kvserve:num_requests_running"] == 1
            assert lora_info(lora_server) == {"max_lora": "2", "running_lora_adapters": "a4",
                                              "waiting_lora_adapters": ""}  # fmt: skip
    assert unloaded and len(tokens) == LONG
    lora_server.wait_idle(TINY)
    assert lora_info(lora_server)["running_lora_adapters"] == ""
    prompt = chat_tokens(lora_server.client(), "a1", 1)[0]  # the same messages' prompt
    assert tokens == expected(tiny_model_dir, lora_dirs["a3"], prompt, LONG)


def test_runtime_updating_off_and_bad_start(
    tiny_model_dir: Path, lora_dirs: dict[str, Path], tmp_path: Path
) -> None:
    srv = start_server([str(tiny_model_dir), "--enable-lora", "--num-kv-blocks", "50"],
                       tmp_path / "off.log")  # fmt: skip
    try:
        r = post(srv, "load_lora_adapter", {"lora_name": "a1", "lora_path": str(lora_dirs["a1"])})
        assert r.status_code == 403
        assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1" in r.json()["error"]["message"]
    finally:
        srv.stop()
    with pytest.raises(RuntimeError, match="rank 32 is above max_lora_rank 16"):
        args = [str(tiny_model_dir), "--enable-lora", "--num-kv-blocks", "50"]
        start_server([*args, "--lora-modules", f"big={lora_dirs['big']}"], tmp_path / "bad.log")
