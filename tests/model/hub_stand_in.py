"""A local HTTP stand-in for the Hugging Face Hub, for ``HF_ENDPOINT=http://127.0.0.1:PORT``.

It answers the few endpoints ``huggingface_hub`` (2.x) calls for ``snapshot_download`` and
``hf_hub_download``, read from its source:

* ``GET /api/models/{repo}/revision/{rev}`` (``HfApi.repo_info``): ``id``, ``sha`` (the commit)
  and ``siblings``;
* ``GET /api/models/{repo}/tree/{rev}`` (``HfApi.list_repo_tree``): one entry per file with its
  ``path``, ``size`` and ``oid``;
* ``HEAD`` / ``GET /{repo}/resolve/{rev}/{file}`` (``get_hf_file_metadata`` and the download):
  ``X-Repo-Commit``, ``ETag`` (the content's sha256: the blob's name in the cache) and
  ``Content-Length``.

Unknown repos get 404 with ``X-Error-Code: RepoNotFound``, unknown revisions
``RevisionNotFound`` and unknown files ``EntryNotFound``, the codes ``hf_raise_for_status``
maps to its exceptions. Every request path is recorded, so a test can tell what was fetched.
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class HubStandIn:
    """Serves ``repos`` (repo id -> {file name -> path on disk}) on a free local port."""

    def __init__(self, repos: dict[str, dict[str, Path]]) -> None:
        self.repos = repos
        self.requests: list[str] = []  # "METHOD path" of every request, in order
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                hub._handle(self, body=True)

            def do_HEAD(self) -> None:
                hub._handle(self, body=False)

            def log_message(self, *args: Any) -> None:  # quiet
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> HubStandIn:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def fetched(self) -> list[str]:
        """The files downloaded (GET .../resolve/...), as ``repo/file``."""
        out = []
        for r in self.requests:
            method, path = r.split(" ", 1)
            if method == "GET" and "/resolve/" in path:
                repo, _, rest = path.lstrip("/").partition("/resolve/")
                out.append(f"{repo}/{rest.partition('/')[2]}")
        return out

    # -- the endpoints ---------------------------------------------------------------------
    def _handle(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlsplit(h.path).path)
        self.requests.append(f"{h.command} {path}")
        if path.startswith("/api/models/"):
            self._api(h, path.removeprefix("/api/models/"))
        elif "/resolve/" in path:
            repo, _, rest = path.lstrip("/").partition("/resolve/")
            rev, _, name = rest.partition("/")
            self._file(h, repo, rev, name, body)
        else:
            self._error(h, 404, "EntryNotFound")

    def _api(self, h: BaseHTTPRequestHandler, rest: str) -> None:
        for kind in ("/revision/", "/tree/"):
            if kind in rest:
                repo, _, rev = rest.partition(kind)
                break
        else:
            repo, kind, rev = rest, "/revision/", "main"
        files = self.repos.get(repo)
        if files is None:
            return self._error(h, 404, "RepoNotFound")
        if rev.partition("/")[0] not in ("main", COMMIT):
            return self._error(h, 404, "RevisionNotFound")
        if kind == "/tree/":
            data: Any = [
                {"type": "file", "path": n, "size": p.stat().st_size, "oid": _sha(p)[:40]}
                for n, p in sorted(files.items())
            ]
        else:
            data = {"id": repo, "sha": COMMIT, "siblings": [{"rfilename": n} for n in files]}
        raw = json.dumps(data).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(raw)))
        h.end_headers()
        h.wfile.write(raw)

    def _file(self, h: BaseHTTPRequestHandler, repo: str, rev: str, name: str, body: bool) -> None:
        files = self.repos.get(repo)
        if files is None:
            return self._error(h, 404, "RepoNotFound")
        if rev not in ("main", COMMIT):
            return self._error(h, 404, "RevisionNotFound")
        if name not in files:
            return self._error(h, 404, "EntryNotFound")
        data = files[name].read_bytes()
        h.send_response(200)
        h.send_header("X-Repo-Commit", COMMIT)
        h.send_header("ETag", f'"{_sha(files[name])}"')
        h.send_header("Content-Length", str(len(data)))
        h.send_header("Content-Type", "application/octet-stream")
        h.end_headers()
        if body:
            h.wfile.write(data)

    @staticmethod
    def _error(h: BaseHTTPRequestHandler, status: int, code: str) -> None:
        raw = json.dumps({"error": code}).encode()
        h.send_response(status)
        h.send_header("X-Error-Code", code)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(raw)))
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(raw)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def repo_of(folder: Path) -> dict[str, Path]:
    """A repo's files from a local folder (every file, by its name relative to ``folder``)."""
    return {str(p.relative_to(folder)): p for p in sorted(folder.rglob("*")) if p.is_file()}


CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def make_tiny_repo(folder: Path) -> Path:
    """A tiny random Llama (float32, byte tokenizer, chat template) saved by transformers,
    plus the files a Hub repo carries that kvserve must not fetch: a pickle checkpoint, an
    original-format one and a README."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.model.tiny_hf import COMMON, byte_tokenizer

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**COMMON)).save_pretrained(folder)
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    (folder / "pytorch_model.bin").write_bytes(b"a pickle kvserve must never fetch")
    (folder / "original").mkdir()
    (folder / "original" / "consolidated.00.pth").write_bytes(b"another pickle")
    (folder / "README.md").write_text("# tiny-llama\n")
    return folder
