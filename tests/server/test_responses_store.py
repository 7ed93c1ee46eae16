"""The /v1/responses store's bounds: entries, bytes and TTL, exact evictions (no server)."""

from __future__ import annotations

import argparse

import pytest

from kvserve.server.responses_store import (
    RAY_STORE_OFF,
    STORE_OFF,
    ResponseStore,
    StoredResponse,
    StoreLimits,
    add_responses_args,
    store_limits_from_args,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def entry(size: int) -> StoredResponse:
    return StoredResponse("{}", (), size)


def test_the_oldest_entries_go_past_the_count() -> None:
    store = ResponseStore(StoreLimits(max_entries=3, max_bytes=10**6))
    for i in range(5):
        assert store.put(f"r{i}", entry(10))
    assert [store.get(f"r{i}") is not None for i in range(5)] == [False, False, True, True, True]
    assert (len(store), store.bytes, store.evicted) == (3, 30, 2)


def test_the_oldest_entries_go_past_the_bytes() -> None:
    store = ResponseStore(StoreLimits(max_entries=100, max_bytes=100))
    for i, size in enumerate([40, 40, 30, 50]):
        store.put(f"r{i}", entry(size))
    # 40 + 40 + 30 = 110 > 100: r0 out; + 50 = 120 > 100: r1 out; 30 + 50 = 80
    assert [store.get(f"r{i}") is not None for i in range(4)] == [False, False, True, True]
    assert (len(store), store.bytes, store.evicted) == (2, 80, 2)


def test_an_entry_over_the_whole_budget_is_not_kept_and_evicts_nothing() -> None:
    store = ResponseStore(StoreLimits(max_entries=10, max_bytes=100))
    store.put("small", entry(60))
    assert not store.put("huge", entry(101))
    assert store.get("huge") is None and store.get("small") is not None
    assert store.bytes == 60


def test_entries_expire_after_the_ttl() -> None:
    clock = Clock()
    store = ResponseStore(StoreLimits(ttl_s=10.0), clock=clock)
    store.put("a", entry(5))
    clock.now += 6
    store.put("b", entry(7))
    clock.now += 4  # a is 10 s old: gone; b is 4 s old
    assert store.get("a") is None and store.get("b") is not None
    assert (len(store), store.bytes, store.evicted) == (1, 7, 1)
    clock.now += 6
    assert (len(store), store.bytes, store.evicted) == (0, 0, 2)


def test_delete_and_put_again() -> None:
    store = ResponseStore(StoreLimits(max_entries=2))
    store.put("a", entry(5))
    assert store.delete("a") and not store.delete("a")
    store.put("b", entry(5))
    store.put("b", entry(9))  # the same id again replaces it
    assert (len(store), store.bytes, store.evicted) == (1, 9, 0)


def test_a_store_that_is_off_keeps_nothing() -> None:
    off = ResponseStore(StoreLimits(max_entries=0))
    assert not off.enabled and off.limits.off_reason == STORE_OFF
    assert not off.put("a", entry(1)) and len(off) == 0
    ray = ResponseStore(StoreLimits(disabled_reason=RAY_STORE_OFF))
    assert not ray.put("a", entry(1)) and ray.limits.off_reason == RAY_STORE_OFF


def test_flags() -> None:
    parser = argparse.ArgumentParser()
    add_responses_args(parser)
    args = parser.parse_args(
        ["--responses-store-max-entries", "7", "--responses-store-max-bytes", "1KiB",
         "--responses-store-ttl", "2.5"]
    )  # fmt: skip
    assert store_limits_from_args(args) == StoreLimits(7, 1024, 2.5)
    for bad in (["--responses-store-max-entries", "-1"], ["--responses-store-max-bytes", "0"],
                ["--responses-store-ttl", "0"], ["--responses-store-ttl", "nan"]):  # fmt: skip
        with pytest.raises(ValueError, match="--responses-store"):
            store_limits_from_args(parser.parse_args(bad))


def test_behind_ray_get_delete_and_chaining_are_refused_naming_ray() -> None:
    """A Ray replica's state (kvserve/ray/replica.py) has the store off: reading a stored
    response is a 400 that says why, not a 404 that looks like an eviction."""
    from fastapi.testclient import TestClient

    from kvserve.server.app import ServerState, build_app

    state = ServerState(responses=ResponseStore(StoreLimits(disabled_reason=RAY_STORE_OFF)))
    with TestClient(build_app(state)) as http:
        for method in ("GET", "DELETE"):
            r = http.request(method, "/v1/responses/resp_1")
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert "--ray" in error["message"] and error["param"] == "response_id"
    from kvserve.server.errors import APIError
    from kvserve.server.responses import _history
    from kvserve.server.responses_protocol import ResponsesRequest

    req = ResponsesRequest(input="hi", previous_response_id="resp_1")
    with pytest.raises(APIError, match="--ray") as e:
        _history(req, state.responses)
    assert (e.value.status, e.value.param) == (400, "previous_response_id")


def test_kvserve_serve_checks_the_store_flags_before_loading() -> None:
    from kvserve.server.cli import _model_specs, add_serve_parser, build_state

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    with pytest.raises(ValueError, match="--responses-store-ttl"):
        _model_specs(parser.parse_args(["serve", "--responses-store-ttl", "0"]))
    args = parser.parse_args(["serve", "--responses-store-max-entries", "5",
                              "--responses-store-max-bytes", "2MiB"])  # fmt: skip
    from kvserve.engine.arg_utils import EngineArgs

    state = build_state(args, EngineArgs.from_cli_args(args))
    assert state.responses.limits == StoreLimits(5, 2 * 1024 * 1024, 3600.0)
