"""Hugging Face Hub ids (``kvserve/model/hub.py``) against a local stand-in for the Hub
(``HF_ENDPOINT``) and a cache that ``huggingface_hub`` itself lays out in a temporary
``HF_HOME``: the download path runs for real, and nothing reaches the internet."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from kvserve.engine.arg_utils import EngineArgs
from kvserve.model.hub import HubModel, parse_hub_model, resolve_hub_model
from tests.model.hub_stand_in import COMMIT, HubStandIn, make_tiny_repo, repo_of
from tests.model.test_gguf import PROMPT_IDS, gguf_path, tiny_llama  # noqa: F401 (fixtures)

REPO = "tiny-org/tiny-llama"
LOADED = [
    "chat_template.jinja",
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
]
# kvserve's options for a tiny float32 model that builds no C++ kernel
FAST = {
    "dtype": "float32",
    "num_kv_blocks": 64,
    "attention_backend": "TORCH_SDPA",
    "fused_ops": False,
    "prepack_weights": False,
    "warmup": False,
}


@pytest.fixture(scope="module")
def tiny_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_repo(tmp_path_factory.mktemp("repo") / "tiny-llama")


@pytest.fixture
def hf_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh, empty Hugging Face home; online (HF_HUB_OFFLINE unset) by default."""
    for var in ("HF_HUB_CACHE", "HF_HUB_OFFLINE", "HF_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "kvserve"))  # GGUF conversions
    return tmp_path / "hf"


@pytest.fixture
def hub(tiny_repo: Path, monkeypatch: pytest.MonkeyPatch, hf_home: Path) -> Iterator[HubStandIn]:
    pickles = tiny_repo.parent / "pickles"
    pickles.mkdir(exist_ok=True)
    shutil.copy(tiny_repo / "config.json", pickles / "config.json")
    shutil.copy(tiny_repo / "pytorch_model.bin", pickles / "pytorch_model.bin")
    repos = {REPO: repo_of(tiny_repo), "tiny-org/pickles": repo_of(pickles)}
    with HubStandIn(repos) as stand_in:
        monkeypatch.setenv("HF_ENDPOINT", stand_in.url)
        yield stand_in


def test_parse_hub_model(tmp_path: Path) -> None:
    assert parse_hub_model("Qwen/Qwen3-0.6B") == HubModel("Qwen/Qwen3-0.6B")
    assert parse_hub_model("org/m-GGUF:m-Q4_K_M.gguf") == HubModel("org/m-GGUF", "m-Q4_K_M.gguf")
    assert parse_hub_model("org/m-GGUF:Q4_K_M") == HubModel("org/m-GGUF", "Q4_K_M")
    (tmp_path / "org" / "local").mkdir(parents=True)
    for local_or_not_an_id in (
        str(tmp_path / "org" / "local"),
        "./org/x",
        "/abs/x",
        "~/x",
        "gpt2",
        "a/b/c",
        "org/--x",
        "org/x..y",
        "model.gguf",
        "",
    ):
        assert parse_hub_model(local_or_not_an_id) is None, local_or_not_an_id


def test_a_model_that_is_no_path_and_no_hub_id(tmp_path: Path) -> None:
    for model in ("gpt2", str(tmp_path / "missing")):
        with pytest.raises(ValueError) as e:
            EngineArgs(model=model).create_engine_config()
        assert str(e.value) == (
            f"model {model!r} is neither a local model folder, a .gguf file nor a Hugging Face "
            "Hub id (org/name, org/name:file.gguf)"
        )


def test_download_fetches_only_what_kvserve_loads_then_reads_the_cache(
    hub: HubStandIn, hf_home: Path
) -> None:
    folder = resolve_hub_model(parse_hub_model(REPO))  # type: ignore[arg-type]
    snapshot = hf_home / "hub" / "models--tiny-org--tiny-llama" / "snapshots" / COMMIT
    assert folder == snapshot
    assert sorted(p.name for p in folder.iterdir()) == LOADED  # no pickles, no README
    assert sorted(hub.fetched()) == [f"{REPO}/{name}" for name in LOADED]
    seen = len(hub.requests)
    assert resolve_hub_model(parse_hub_model(REPO)) == folder  # type: ignore[arg-type]
    assert hub.requests[seen:] == []  # the cache first: no request at all


def test_sharded_repo_fetches_the_shards_its_index_names(
    tmp_path: Path, hf_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not a second copy of the weights in another layout (Mistral's consolidated file)."""
    from transformers import LlamaConfig

    from tests.model.tiny_hf import COMMON

    folder = tmp_path / "sharded"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**COMMON)).save_pretrained(folder, max_shard_size="100KB")
    shards = sorted(p.name for p in folder.glob("model-*.safetensors"))
    assert len(shards) > 1
    shutil.copy(folder / shards[0], folder / "consolidated.safetensors")
    with HubStandIn({"tiny-org/sharded": repo_of(folder)}) as stand_in:
        monkeypatch.setenv("HF_ENDPOINT", stand_in.url)
        resolve_hub_model(HubModel("tiny-org/sharded"))
        names = [f.removeprefix("tiny-org/sharded/") for f in stand_in.fetched()]
    assert sorted(names) == sorted(
        ["config.json", "generation_config.json", "model.safetensors.index.json", *shards]
    )


def test_pickle_only_repo_is_refused_before_any_download(hub: HubStandIn) -> None:
    with pytest.raises(ValueError) as e:
        resolve_hub_model(HubModel("tiny-org/pickles"))
    assert str(e.value) == (
        "'tiny-org/pickles' has only pickle checkpoints (pytorch_model.bin): kvserve loads "
        "safetensors or GGUF only, since loading a pickle can run arbitrary code; convert it "
        "to safetensors or pick a repo that has them"
    )
    assert hub.fetched() == []


def test_hub_errors_name_the_model(hub: HubStandIn) -> None:
    with pytest.raises(ValueError, match=r"'tiny-org/nope' was not found on the Hub"):
        resolve_hub_model(HubModel("tiny-org/nope"))
    with pytest.raises(
        ValueError,
        match=r"'tiny-org/tiny-llama' \(revision v9\) has no "
        r"revision 'v9'",
    ):
        resolve_hub_model(HubModel(REPO), revision="v9")
    with pytest.raises(
        ValueError, match=r"^Hugging Face model 'tiny-org/tiny-llama' has no file 'x.gguf'$"
    ):
        resolve_hub_model(HubModel(REPO, "x.gguf"))


def test_offline_and_not_cached_is_a_clear_error_with_no_request(
    hub: HubStandIn, hf_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError) as e:
        EngineArgs(model=REPO).create_engine_config()
    assert str(e.value).startswith(
        f"Hugging Face model '{REPO}' is not in the Hugging Face cache {hf_home / 'hub'} and "
        "HF_HUB_OFFLINE is set, so nothing is downloaded"
    )
    assert hub.requests == []


def test_serve_offline_and_not_cached_exits_2_before_serving(
    hub: HubStandIn,
    hf_home: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from kvserve.server.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main([REPO, "--port", "1"]) == 2  # port 1: it never gets as far as listening
    assert capsys.readouterr().err == (
        f"kvserve: error: Hugging Face model '{REPO}' is not in the Hugging Face cache "
        f"{hf_home / 'hub'} and HF_HUB_OFFLINE is set, so nothing is downloaded; download it "
        "once while online (unset HF_HUB_OFFLINE), point --download-dir / HF_HOME at the cache "
        "that has it, or give a local model folder or .gguf file (no such local path exists "
        "either)\n"
    )
    assert hub.requests == []


@pytest.mark.slow
def test_offline_cache_gives_the_folders_tokens(
    hub: HubStandIn, tiny_repo: Path, hf_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cache, laid out by huggingface_hub's own download, serves the model offline with
    the same greedy tokens as the folder it came from."""
    from kvserve import LLM, SamplingParams

    resolve_hub_model(HubModel(REPO))  # populate the cache for real
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: no fallback
    seen = len(hub.requests)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = ["The hub", "kvserve serves"]
    by_id = LLM(model=REPO, **FAST)
    assert by_id.engine.model_name == REPO  # served under the Hub id, as vLLM does
    got = [o.outputs[0].token_ids for o in by_id.generate(prompts, params, use_tqdm=False)]
    by_id.engine.close()
    # the folder's weights with the tokenizer of the Hub id (vLLM's --tokenizer), offline too
    direct = LLM(model=str(tiny_repo), tokenizer=REPO, **FAST)
    assert direct.engine.config.model.tokenizer == str(by_id.engine.config.model.path)
    want = [o.outputs[0].token_ids for o in direct.generate(prompts, params, use_tqdm=False)]
    direct.engine.close()
    assert got == want and all(len(t) == 12 for t in got)
    assert hub.requests[seen:] == []


def test_tokenizer_hub_id_fetches_the_tokenizer_first(
    hub: HubStandIn, tiny_repo: Path, hf_home: Path
) -> None:
    config = EngineArgs(model=str(tiny_repo), tokenizer=REPO).create_engine_config()
    tokenizer = Path(config.model.tokenizer or "")
    assert tokenizer.parent.name == "snapshots" or tokenizer.name == COMMIT
    assert sorted(p.name for p in tokenizer.iterdir()) == [
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    # A bad tokenizer id fails before the model (here a Hub id too) is looked at.
    seen = len(hub.requests)
    with pytest.raises(ValueError) as e:
        EngineArgs(model="tiny-org/pickles", tokenizer="tiny-org/no-tok").create_engine_config()
    assert str(e.value).startswith(
        "tokenizer 'tiny-org/no-tok' (--tokenizer): Hugging Face model 'tiny-org/no-tok' was "
        "not found on the Hub"
    )
    assert all("pickles" not in r for r in hub.requests[seen:])
    with pytest.raises(
        ValueError,
        match=r"tokenizer '/tok' \(--tokenizer\) is neither a local "
        r"folder nor a Hugging Face Hub id",
    ):
        EngineArgs(model=str(tiny_repo), tokenizer="/tok")


def test_gguf_repo_picks_one_file(
    tmp_path: Path, hf_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = {}
    for name in ("m-Q4_K_M.gguf", "m-Q8_0.gguf"):
        (tmp_path / name).write_bytes(name.encode())
        files[name] = tmp_path / name
    with HubStandIn(
        {"org/m-GGUF": files, "org/one-GGUF": {"m-Q8_0.gguf": files["m-Q8_0.gguf"]}}
    ) as stand_in:
        monkeypatch.setenv("HF_ENDPOINT", stand_in.url)
        with pytest.raises(ValueError) as e:
            resolve_hub_model(HubModel("org/m-GGUF"))
        assert str(e.value) == (
            "'org/m-GGUF' holds 2 GGUF files; name one as org/m-GGUF:<file>.gguf (or :<quant "
            "type>, e.g. :Q4_K_M): ['m-Q4_K_M.gguf', 'm-Q8_0.gguf']"
        )
        got = resolve_hub_model(HubModel("org/m-GGUF", "m-Q8_0.gguf"))
        assert got.name == "m-Q8_0.gguf" and got.read_bytes() == b"m-Q8_0.gguf"
        assert resolve_hub_model(HubModel("org/m-GGUF", "q4_k_m")).name == "m-Q4_K_M.gguf"
        assert resolve_hub_model(HubModel("org/one-GGUF")).name == "m-Q8_0.gguf"
        assert sorted(stand_in.fetched()) == [
            "org/m-GGUF/m-Q4_K_M.gguf",
            "org/m-GGUF/m-Q8_0.gguf",
            "org/one-GGUF/m-Q8_0.gguf",
        ]


def test_split_gguf_fetches_every_shard(
    tmp_path: Path, hf_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A split model (``-00001-of-00002.gguf``), picked by quant type, by any shard's name or
    as the repo's only model, comes with all its shards, beside each other in the cache."""
    names = ["m-Q4_K_M-00001-of-00002.gguf", "m-Q4_K_M-00002-of-00002.gguf", "m-Q8_0.gguf"]
    files = {}
    for name in names:
        (tmp_path / name).write_bytes(name.encode())
        files[name] = tmp_path / name
    only = {n: files[n] for n in names[:2]}
    with HubStandIn({"org/m-GGUF": files, "org/split-GGUF": only}) as stand_in:
        monkeypatch.setenv("HF_ENDPOINT", stand_in.url)
        got = resolve_hub_model(HubModel("org/m-GGUF", "Q4_K_M"))
        assert got.name == names[0] and (got.parent / names[1]).read_bytes() == names[1].encode()
        assert resolve_hub_model(HubModel("org/m-GGUF", names[1])).name == names[1]
        assert resolve_hub_model(HubModel("org/split-GGUF")).name == names[0]
        assert sorted(stand_in.fetched()) == sorted(
            [f"org/m-GGUF/{n}" for n in names[:2]] + [f"org/split-GGUF/{n}" for n in names[:2]]
        )


@pytest.mark.slow
def test_gguf_file_download_loads_through_the_gguf_path(
    tiny_llama: tuple[LlamaForCausalLM, Path],  # noqa: F811
    hf_home: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``org/name:file.gguf`` downloads that file alone and loads it through the GGUF path:
    the greedy tokens of the model the GGUF was written from."""
    from kvserve import LLM, SamplingParams

    original, gguf_file = tiny_llama
    repo = {"tiny-llama.gguf": gguf_file, "README.md": gguf_file}
    with HubStandIn({"tiny-org/tiny-gguf": repo}) as stand_in:
        monkeypatch.setenv("HF_ENDPOINT", stand_in.url)
        llm = LLM(model="tiny-org/tiny-gguf:tiny-llama.gguf", **FAST)
        assert stand_in.fetched() == ["tiny-org/tiny-gguf/tiny-llama.gguf"]
    assert llm.engine.model_name == "tiny-org/tiny-gguf:tiny-llama.gguf"
    assert llm.engine.config.model.gguf_file is not None
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": PROMPT_IDS}, params, use_tqdm=False)
    llm.engine.close()
    with torch.no_grad():
        want = original.generate(
            torch.tensor([PROMPT_IDS]), max_new_tokens=8, do_sample=False, min_new_tokens=8
        )[0, len(PROMPT_IDS) :]
    assert list(out[0].outputs[0].token_ids) == want.tolist()
