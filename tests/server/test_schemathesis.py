"""Schemathesis fuzzes a live server from its own ``/openapi.json``: no request gets a 5xx.

Its own ``kvserve serve`` with the tiny random model only and small limits, so that the
thousand-odd generated requests (valid ones and deliberately invalid ones) stay cheap. Besides
``not_a_server_error``, every answer must be a status, content type and body the document
states: the document is checked against the server, not only the server against crashes.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from kvserve.server.app import ServerState, build_app
from tests.server.conftest import API_KEY, TINY, Server, start_server

pytestmark = pytest.mark.slow

MAX_EXAMPLES = 50  # fuzzing examples per operation; the coverage phase adds its boundary cases
REQUEST_TIMEOUT = 30.0  # seconds; a generated request runs at most 2 x 4 tokens of a tiny model
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]

calls: collections.Counter[str] = collections.Counter()  # operation -> requests sent


@pytest.fixture(scope="module")
def fuzz_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("logs") / "fuzz_server.log"
    srv = start_server(
        [
            str(tiny_model_dir), "--served-model-name", TINY,
            "--num-kv-blocks", "96", "--max-num-seqs", "8",
            "--max-tokens-limit", "4", "--max-n", "2", "--max-prompts-per-request", "4",
            "--max-request-body-bytes", "65536",
        ],
        log,
        api_key=API_KEY,
    )  # fmt: skip
    started = time.monotonic()
    yield srv
    srv.stop()
    print(f"\nschemathesis: {time.monotonic() - started:.1f}s, requests per operation: {calls}")
    errors = [line for line in log.read_text().splitlines() if "Traceback" in line]
    assert not errors, f"the server logged tracebacks; see {log}"


# The plugin needs the document at collection time, before any fixture has started a server
# (its lazy loader, ``schemathesis.pytest.from_fixture``, fails on pytest 9: it sets
# ``request.node._nodeid``, which pytest 9 removed). So the document is built in-process, the
# way the server builds it, and ``test_the_live_document_is_the_fuzzed_one`` checks that the
# live server serves exactly this document.
DOCUMENT = build_app(ServerState(api_key=API_KEY)).openapi()
schema = schemathesis.openapi.from_dict(DOCUMENT)


def test_the_live_document_is_the_fuzzed_one(fuzz_server: Server) -> None:
    r = httpx.get(f"{fuzz_server.url}/openapi.json", timeout=10)  # no API key needed
    assert r.status_code == 200
    assert r.json() == DOCUMENT


@schema.parametrize()
@settings(
    max_examples=MAX_EXAMPLES,
    deadline=REQUEST_TIMEOUT * 1000,  # ms per example: a hang fails instead of stalling CI
    database=None,  # no .hypothesis/ folder in the tree
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
def test_no_generated_request_gets_a_5xx(case: schemathesis.Case, fuzz_server: Server) -> None:
    calls[case.operation.label] += 1
    case.call_and_validate(
        base_url=fuzz_server.url,
        headers=fuzz_server.headers(),
        checks=CHECKS,
        timeout=REQUEST_TIMEOUT,
    )
