"""Schemathesis fuzzes a live server from its own ``/openapi.json``: no request gets a 5xx,
and no request the document calls valid gets a 400.

Its own ``kvserve serve`` with the tiny random model only and small limits, so that the
thousand-odd generated requests (valid ones and deliberately invalid ones) stay cheap. Besides
``not_a_server_error``, every answer must be a status, content type and body the document
states, and a generated valid request must be accepted (``positive_data_acceptance``): the
document is checked against the server, not only the server against crashes. The rules JSON
Schema cannot state (``kvserve/server/openapi_limits.py``, docs/server.md) are the only 400s a
valid request may get, each matched by its exact message in ``INEXPRESSIBLE``.
"""

from __future__ import annotations

import argparse
import collections
import re
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
    positive_data_acceptance,
    response_schema_conformance,
    status_code_conformance,
)

from kvserve.engine.arg_utils import EngineArgs
from kvserve.server.app import build_app
from kvserve.server.cli import add_serve_parser, build_state
from tests.server.conftest import API_KEY, TINY, Server, start_server

pytestmark = pytest.mark.slow

# Examples per operation (the coverage phase adds its boundary cases). 50 until the Batch API
# added its operations (~70 s more at 50 on the loaded box); 25 keeps the suite's budget.
MAX_EXAMPLES = 25
REQUEST_TIMEOUT = 30.0  # seconds; a generated request runs at most 2 x 4 tokens of a tiny model
FLAGS = [
    "--num-kv-blocks", "96", "--max-num-seqs", "8",
    "--max-tokens-limit", "4", "--max-n", "2", "--max-prompts-per-request", "4",
    "--max-request-body-bytes", "65536",
]  # fmt: skip
# The 400s a request valid by the document may still get: what JSON Schema cannot state
# (docs/server.md, "What the document cannot say"). Anything else is a mismatch.
INEXPRESSIBLE = [
    re.compile(p)
    for p in (
        # relations between fields
        r"min_tokens \(\d+\) must not exceed max_tokens",
        r"max_tokens must be at least 1, got 0",  # completions: 0 only with echo
        r"Cannot set both `continue_final_message` and `add_generation_prompt` to True",
        r"only one structured output constraint is allowed",
        r"ignore_eos cannot be combined with structured_outputs",
        r"When using `tool_choice`, `tools` must be set",
        # tools with tool_choice unset mean "auto", which needs the server's
        # --enable-auto-tool-choice --tool-call-parser (without them "auto" itself is unpublished)
        r'"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
        r"continue_final_message and add_generation_prompt are not compatible",
        r"structured outputs need exactly one of json, regex, choice, grammar",
        r"stream_options is only allowed when stream is true",
        r"logprobs must be true when top_logprobs is set",
        r"`prompt_logprobs` are not available when `stream=True`",
        # /v1/responses: input of reasoning items only, with neither instructions nor history
        r"input has nothing to answer: give instructions, a previous_response_id or an item",
        # the server's state: previous_response_id must name a response it has stored
        r"Previous response with id '.*' not found",
        r"This model's maximum context length is \d+ tokens",  # the model's context
        r"\(its hidden size\) and cannot be shortened",  # embeddings: the model's size
        r"is out of the vocabulary \(size \d+\)",  # the model's vocabulary
        r"seed \+ n - 1 must be at most",
        r"The tool specified in `tool_choice` does not match any of the specified `tools`",
        r"tools: the function name '.*' is given twice",  # uniqueItems compares whole items
        r"function\.arguments is not a JSON object",  # a string holding a JSON object
        # text that must parse: a JSON schema given as text, a regex, an EBNF grammar
        r"the JSON schema is not valid JSON",
        r"invalid (json|regex|grammar|structural_tag) for structured outputs",
        # the grammar, allowed_token_ids, bad_words and min_tokens exclude every token
        r"no token is allowed at this position",
        # the server's state: runtime LoRA updating is off on this server (403); with it on,
        # lora_path must be an adapter folder on disk and an unloaded name must be loaded
        r"loading and unloading LoRA adapters at run time is off",
        # the server's state: a batch's input_file_id must name an uploaded file; a batch
        # that has finished cannot be cancelled
        r"No such file: '.*'",
        r"batch .* is (completed|failed|cancelled|finalizing); it cannot be cancelled",
        # beam search (server/beam.py): fields it does not apply, and its relations
        r"is not supported with use_beam_search",
        r"use_beam_search scores beams by the model's raw log-probabilities",
        r"n \(\d+\) must not exceed best_of",
        r"best_of must be unset or equal to n",
        r"above the engine's limit of \d+ \(max_beam_width, --max-beam-width\)",
        r"beam search with beam_width \d+ and \d+ output tokens",
        # /score: text_1 and text_2 of lengths neither 1 nor equal; the prompts' tokens in all
        r"the pairs must be 1:1, 1:N or N:N",
        r"limit \(--max-score-tokens-per-request\)",
        # the server's state: sleep mode off (404); vLLM's partial wake_up tags
        r"sleep mode is off",
        r"kvserve wakes a model whole",
    )
]


def accepted_or_inexpressible(ctx: object, response: object, case: schemathesis.Case) -> None:
    """``positive_data_acceptance``, except the documented rules the schema cannot state.
    ``/v1/messages*`` too: its document states each role's content blocks and their required
    fields (``kvserve/server/anthropic/published.py``)."""
    try:
        positive_data_acceptance(ctx, response, case)
    except AssertionError:
        message = str(response.json().get("error", {}).get("message", ""))  # type: ignore[attr-defined]
        if not any(p.search(message) for p in INEXPRESSIBLE):
            raise


CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    schemathesis.check(accepted_or_inexpressible),
]

calls: collections.Counter[str] = collections.Counter()  # operation -> requests sent


@pytest.fixture(scope="module")
def fuzz_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("logs") / "fuzz_server.log"
    srv = start_server(
        [str(tiny_model_dir), "--served-model-name", TINY, *FLAGS], log, api_key=API_KEY
    )
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
# live server serves exactly this document (the server's limits are in it: the same flags).
def _state_of(flags: list[str]) -> object:
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "--api-key", API_KEY, *flags])
    return build_state(args, EngineArgs.from_cli_args(args))


DOCUMENT = build_app(_state_of(FLAGS)).openapi()  # type: ignore[arg-type]
schema = schemathesis.openapi.from_dict(DOCUMENT)
schema.config.output.sanitization.update(enabled=False)  # failures show the real request


def test_the_live_document_is_the_fuzzed_one(fuzz_server: Server) -> None:
    r = httpx.get(f"{fuzz_server.url}/openapi.json", timeout=10)  # no API key needed
    assert r.status_code == 200
    assert r.json() == DOCUMENT


@schema.parametrize()
@settings(
    max_examples=MAX_EXAMPLES,
    deadline=REQUEST_TIMEOUT * 1000,  # ms per example: a hang fails instead of stalling CI
    database=None,  # no .hypothesis/ folder in the tree
    derandomize=True,  # the same requests on every run: CI cannot flake on a new find
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
