"""Hugging Face Hub ids: ``kvserve serve Qwen/Qwen3-0.6B`` as ``vllm serve`` takes it.

A model string that is not an existing local path and has the shape ``org/name`` is a Hub id,
resolved with ``huggingface_hub`` into its cache: the cache first (no network at all when the
files are there), then a download with progress bars when online; ``HF_HUB_OFFLINE=1`` keeps it
to the cache. Only the files kvserve reads are fetched (config, tokenizer, safetensors, JSON);
a repository with only pickle checkpoints (``.bin``, ``.pt``, ``.pth``) is refused, since
loading them can run arbitrary code. GGUF repositories: ``org/name:file.gguf`` (or
``org/name:Q4_K_M``, a file named by its quant type) fetches that one file, and a repository
whose only weights are one ``.gguf`` file needs no suffix.

The environment is read at call time (``HF_ENDPOINT``, ``HF_HUB_OFFLINE``, ``HF_HUB_CACHE`` /
``HF_HOME``), not when ``huggingface_hub`` was imported, so a process that sets them late (or
a test) gets what it set.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

# What a model folder needs: config, tokenizer (JSON, SentencePiece .model, tiktoken, BPE
# vocab/merges .txt), chat templates and the safetensors weights with their index.
ALLOW_PATTERNS = ("*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja")
# The tokenizer alone (--tokenizer naming a Hub id).
TOKENIZER_PATTERNS = ("tokenizer*", "*.model", "*.tiktoken", "vocab*", "merges.txt",
                      "special_tokens_map.json", "added_tokens.json", "*.jinja",
                      "generation_config.json", "config.json")  # fmt: skip
INDEX = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# huggingface_hub's own rule for a repo id (validate_repo_id): [\w.-]+ per part, at most 96.
_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9_]")
_TRUTHY = {"1", "on", "yes", "true"}


@dataclass(frozen=True)
class HubModel:
    """A parsed Hub model string: the repository and, for GGUF repos, the file (or a quant
    type such as ``Q4_K_M`` that names one)."""

    repo_id: str
    gguf: str | None = None  # "model-Q4_K_M.gguf" or "Q4_K_M"; None: the repo's weights


def parse_hub_model(model: str) -> HubModel | None:
    """``model`` as a Hub id, or None when it is a local path or not shaped like one."""
    if not model or Path(model).expanduser().exists():
        return None
    if model.startswith((".", "/", "~")) or "\\" in model:
        return None
    repo, _, gguf = model.partition(":")
    if not _ID.fullmatch(repo) or len(repo) > 96 or "--" in repo or ".." in repo:
        return None
    if gguf and ("/" in gguf.strip("/") and not gguf.lower().endswith(".gguf")):
        return None
    return HubModel(repo, gguf or None)


def is_offline() -> bool:
    """``HF_HUB_OFFLINE`` (vLLM and transformers honour it too) as set now."""
    from huggingface_hub import constants

    env = os.environ.get("HF_HUB_OFFLINE")
    return env.strip().lower() in _TRUTHY if env is not None else bool(constants.HF_HUB_OFFLINE)


def hub_cache_dir(download_dir: str | None = None) -> Path:
    """The cache ``huggingface_hub`` uses: ``download_dir`` (vLLM's ``--download-dir``), else
    ``HF_HUB_CACHE``, else ``HF_HOME``/hub, else ``~/.cache/huggingface/hub``."""
    if download_dir:
        return Path(download_dir).expanduser()
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface"
    )
    return Path(home).expanduser() / "hub"


def _endpoint() -> str | None:
    return os.environ.get("HF_ENDPOINT") or None


def _where(model: HubModel, revision: str | None) -> str:
    rev = f" (revision {revision})" if revision else ""
    return f"Hugging Face model {model.repo_id!r}{rev}"


def _not_cached(model: HubModel, revision: str | None, cache: Path) -> ValueError:
    return ValueError(
        f"{_where(model, revision)} is not in the Hugging Face cache {cache} and "
        "HF_HUB_OFFLINE is set, so nothing is downloaded; download it once while online "
        "(unset HF_HUB_OFFLINE), point --download-dir / HF_HOME at the cache that has it, or "
        "give a local model folder or .gguf file (no such local path exists either)"
    )


def _hub_error(
    model: HubModel, revision: str | None, cache: Path, e: Exception, file: str | None = None
) -> ValueError:
    """A clear ValueError for what ``huggingface_hub`` raised."""
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    what = _where(model, revision)
    if isinstance(e, GatedRepoError):
        why = "is gated: accept its terms on the Hub and set HF_TOKEN"
    elif isinstance(e, RepositoryNotFoundError):
        why = ("was not found on the Hub (nor as a local path); if it is private or gated, "
               "set HF_TOKEN")  # fmt: skip
    elif isinstance(e, RevisionNotFoundError):
        why = f"has no revision {revision!r}"
    elif isinstance(e, EntryNotFoundError) and file is not None:
        why = f"has no file {file!r}"
    else:
        why = f"could not be fetched into {cache} ({type(e).__name__}: {e})"
    return ValueError(f"{what} {why}")


def _repo_files(model: HubModel, revision: str | None, cache: Path) -> list[str]:
    """The repository's file names: from the cache's tree listing when the revision is
    cached, else from the Hub (offline: the cached snapshot's files, or a ValueError)."""
    from huggingface_hub import HfApi, get_cached_repo_tree
    from huggingface_hub.errors import CachedRepoTreeNotFoundError

    try:
        return [f.path for f in get_cached_repo_tree(model.repo_id, revision=revision,
                                                     cache_dir=cache)]  # fmt: skip
    except CachedRepoTreeNotFoundError:
        pass
    if is_offline():
        # Single-file (GGUF) downloads cache no tree listing: what the snapshot holds. Online,
        # that could be part of the repo, so the Hub is asked instead.
        snapshot = _cached_snapshot(model.repo_id, revision, cache)
        if snapshot is None:
            raise _not_cached(model, revision, cache)
        return [str(p.relative_to(snapshot)) for p in snapshot.rglob("*") if not p.is_dir()]
    try:
        api = HfApi(endpoint=_endpoint())
        tree = api.list_repo_tree(model.repo_id, revision=revision, recursive=True)
        return [f.path for f in tree if getattr(f, "size", None) is not None]
    except Exception as e:
        raise _hub_error(model, revision, cache, e) from e


def _cached_snapshot(repo_id: str, revision: str | None, cache: Path) -> Path | None:
    storage = cache / ("models--" + repo_id.replace("/", "--"))
    rev = revision or "main"
    ref = storage / "refs" / rev
    commit = ref.read_text().strip() if ref.is_file() else rev
    snapshot = storage / "snapshots" / commit
    return snapshot if snapshot.is_dir() else None


def _first_shard(file: str) -> bool:
    """Whether ``file`` is an unsplit GGUF or the first shard of a split one."""
    from kvserve.model.gguf_names import shard_names

    name = PurePosixPath(file).name
    return shard_names(name)[0] == name


def pick_weights(model: HubModel, files: list[str]) -> str | None:
    """The GGUF file to fetch, or None for a safetensors repo; ValueError when the repo has
    no loadable weights, only pickles, or several GGUF files and none was named."""
    names = [f for f in files if "/" not in f or f.lower().endswith(".gguf")]
    ggufs = sorted(f for f in files if f.lower().endswith(".gguf"))
    if model.gguf is not None:
        wanted = model.gguf
        if wanted.lower().endswith(".gguf"):
            if wanted not in ggufs:
                raise ValueError(
                    f"{model.repo_id!r} has no file {wanted!r}; its GGUF files: {ggufs or 'none'}"
                )
            return wanted
        # a quant type (vLLM's and llama.cpp's -hf repo:Q4_K_M): the one file whose name has it
        pattern = re.compile(rf"(^|[^A-Za-z0-9]){re.escape(wanted)}([^A-Za-z0-9_]|$)", re.I)
        hits = [f for f in ggufs if pattern.search(Path(f).name)]
        hits = [f for f in hits if _first_shard(f)]  # a split model: its first shard
        if len(hits) != 1:
            raise ValueError(
                f"{model.repo_id}:{wanted}: {len(hits)} GGUF files match {wanted!r} "
                f"({hits or ggufs}); name the file: {model.repo_id}:<file>.gguf"
            )
        return hits[0]
    if any(f.endswith(".safetensors") for f in names):
        return None
    if len(ggufs) == 1 or len(firsts := [f for f in ggufs if _first_shard(f)]) == 1:
        return ggufs[0] if len(ggufs) == 1 else firsts[0]  # one model, maybe split
    if ggufs:
        raise ValueError(
            f"{model.repo_id!r} holds {len(ggufs)} GGUF files; name one as "
            f"{model.repo_id}:<file>.gguf (or :<quant type>, e.g. :Q4_K_M): {ggufs}"
        )
    pickles = [f for f in names if f.lower().endswith(PICKLE_SUFFIXES)]
    if pickles:
        raise ValueError(
            f"{model.repo_id!r} has only pickle checkpoints ({', '.join(sorted(pickles)[:3])}): "
            "kvserve loads safetensors or GGUF only, since loading a pickle can run arbitrary "
            "code; convert it to safetensors or pick a repo that has them"
        )
    raise ValueError(f"{model.repo_id!r} has no model weights (*.safetensors or *.gguf)")


def _fetch(model: HubModel, file: str | None, patterns: tuple[str, ...], revision: str | None,
           cache: Path, files: list[str] | None = None) -> Path:  # fmt: skip
    """The cached copy (no network), else a download unless offline. ``files``: the repo's
    files when known, to tell a partial snapshot (a single-file download leaves one, which
    huggingface_hub cannot check without its tree listing) from a complete one."""
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    def get(local: bool) -> str:
        common = {"revision": revision, "cache_dir": cache, "local_files_only": local,
                  "endpoint": _endpoint()}  # fmt: skip
        if file is not None:
            return hf_hub_download(model.repo_id, file, **common)  # type: ignore[arg-type]
        return snapshot_download(model.repo_id, allow_patterns=list(patterns), **common)  # type: ignore[arg-type]

    try:
        local = Path(get(local=True))
        if file is not None or not _missing(local, patterns, files):
            return local
    except LocalEntryNotFoundError:  # not cached, or an incomplete snapshot
        pass
    if is_offline():
        raise _not_cached(model, revision, cache)
    try:
        return Path(get(local=False))
    except Exception as e:
        raise _hub_error(model, revision, cache, e, file) from e


def _missing(folder: Path, patterns: tuple[str, ...], files: list[str] | None) -> list[str]:
    """The files of ``files`` that ``patterns`` select and ``folder`` lacks."""
    from huggingface_hub.utils import filter_repo_objects

    wanted = filter_repo_objects(files or [], allow_patterns=list(patterns))
    return [f for f in wanted if not (folder / f).exists()]


def resolve_hub_model(
    model: HubModel, revision: str | None = None, download_dir: str | None = None
) -> Path:
    """The local path of a Hub model: a snapshot folder (config, tokenizer, safetensors) or
    one ``.gguf`` file in the cache."""
    cache = hub_cache_dir(download_dir)
    gguf = model.gguf if model.gguf and model.gguf.lower().endswith(".gguf") else None
    if gguf is not None:
        return _fetch_gguf(model, gguf, revision, cache)
    files = _repo_files(model, revision, cache)
    gguf = pick_weights(model, files)
    if gguf is not None:
        return _fetch_gguf(model, gguf, revision, cache)
    patterns = _weight_patterns(model, files, revision, cache)
    folder = _fetch(model, None, patterns, revision, cache, files)
    _check_folder(model, folder)
    return folder


def _fetch_gguf(model: HubModel, file: str, revision: str | None, cache: Path) -> Path:
    """``file``, and when it is a shard of a split model (``-00001-of-00003.gguf``) the other
    shards too: each lands beside it in the snapshot folder, where the loader finds them."""
    from kvserve.model.gguf_names import shard_names

    path = _fetch(model, file, (), revision, cache)
    folder = PurePosixPath(file).parent
    for name in shard_names(PurePosixPath(file).name):
        if name != PurePosixPath(file).name:
            _fetch(model, str(folder / name), (), revision, cache)
    return path


def _weight_patterns(
    model: HubModel, files: list[str], revision: str | None, cache: Path
) -> tuple[str, ...]:
    """ALLOW_PATTERNS, with the safetensors narrowed to those the index names when there is
    one: some repos also carry the same weights in another layout (Mistral's
    ``consolidated.safetensors`` beside the shards), which would double the download."""
    if INDEX not in files:
        return ALLOW_PATTERNS
    index = _fetch(model, INDEX, (), revision, cache)
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    return (*(p for p in ALLOW_PATTERNS if p != "*.safetensors"), *shards)


def _check_folder(model: HubModel, folder: Path) -> None:
    if not (folder / "config.json").is_file():
        raise ValueError(f"Hugging Face model {model.repo_id!r} has no config.json ({folder})")


def resolve_hub_tokenizer(
    model: HubModel, revision: str | None = None, download_dir: str | None = None
) -> Path:
    """The tokenizer files of a Hub repo (``--tokenizer org/name``), as a snapshot folder."""
    cache = hub_cache_dir(download_dir)
    folder = _fetch(model, None, TOKENIZER_PATTERNS, revision, cache)
    if not any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        raise ValueError(
            f"--tokenizer {model.repo_id!r}: the repository has no tokenizer.json or "
            "tokenizer_config.json"
        )
    return folder
