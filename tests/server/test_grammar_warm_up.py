"""``--no-grammar-warm-up``: no compile process until the first grammar, then only its lane's.

The server's default (``--grammar-warm-up``) forks both lanes' workers at start
(``test_grammar_limits.py`` waits for them); this server starts without them, as every
other server of the suite does (``conftest.start_server``).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import psutil
import pytest

from tests.server.conftest import BUILTIN, Server, start_server

STARTED = re.compile(r"grammar compile worker pid (\d+) started \((\w+) lane\)")


@pytest.fixture(scope="module")
def lazy_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("logs") / "lazy_grammar.log"
    srv = start_server(["--num-kv-blocks", "64", "--no-grammar-warm-up"], log)
    yield srv
    srv.stop()


def compile_processes(srv: Server) -> list[psutil.Process]:
    """The server's child processes that run grammar compiles (the zygote and its workers)."""
    out = []
    for child in psutil.Process(srv.proc.pid).children(recursive=True):
        try:
            if any("compile_worker" in part for part in child.cmdline()):
                out.append(child)
        except psutil.NoSuchProcess:
            continue
    return out


def test_workers_start_with_the_first_grammar(lazy_server: Server) -> None:
    time.sleep(2.0)  # a warm-up, were there one, forks the zygote within this
    assert compile_processes(lazy_server) == []
    assert STARTED.findall(lazy_server.log.read_text(errors="replace")) == []

    out = lazy_server.client().chat.completions.create(
        model=BUILTIN,
        messages=[{"role": "user", "content": "Is the sky blue?"}],
        max_tokens=8,
        temperature=0.0,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert out.choices[0].message.content in ("yes", "no")
    # the small lane's worker only (the zygote's process and the worker it forked)
    lanes = [lane for _, lane in STARTED.findall(lazy_server.log.read_text(errors="replace"))]
    assert lanes == ["small"]
    assert len(compile_processes(lazy_server)) == 2
