"""Graceful drain: SIGTERM lets requests in flight finish within ``--shutdown-timeout``, answers
new ones with 503, ends the rest with an error event + ``[DONE]`` and exits with code 0.

Every test starts its own ``kvserve serve`` (the tiny random model: a few seconds) since each
one ends it. Streams use ``ignore_eos`` and a fixed ``max_tokens``, so their length is exact.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvserve.server.cli import main as serve_main
from tests.server.conftest import TINY, Server, start_server

NUM_STREAMS = 8  # = --max-num-seqs: every stream runs at once
LONG = 900  # tokens: minutes for 8 streams of the tiny model on a shared 2-core box
SHUTTING_DOWN = "the server is shutting down"


@pytest.fixture
def serve(tiny_model_dir: Path, tmp_path: Path) -> Iterator[Any]:
    """``serve(timeout)`` starts the tiny model with ``--shutdown-timeout timeout``."""
    servers: list[Server] = []

    def start(timeout: float, builtin: bool = False) -> Server:
        """``builtin``: the built-in model (under the tiny model's name), whose steps take
        long enough on any CPU for streams to outlast a short timeout; the tiny model may
        finish 8 x 900 tokens within 2 s on a fast one (seen on an AVX512-BF16 EPYC)."""
        model = [] if builtin else [str(tiny_model_dir)]
        args = [*model, "--served-model-name", TINY, "--max-num-seqs", "8"]
        args += ["--shutdown-timeout", str(timeout)]
        servers.append(start_server(args, tmp_path / f"server{len(servers)}.log"))
        return servers[-1]

    yield start
    for srv in servers:  # a failed test may leave it running
        srv.stop()


class RawStream(threading.Thread):
    """One completion (``chat``: a chat completion) read in a thread; for a stream, line by
    line: the raw SSE ``data`` payloads."""

    def __init__(
        self, srv: Server, max_tokens: int, stream: bool = True, chat: bool = False
    ) -> None:
        super().__init__(daemon=True)
        self.url = f"{srv.url}/v1/{'chat/' if chat else ''}completions"
        self.body: dict[str, Any] = {
            "model": TINY, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream,
        }  # fmt: skip
        if chat:
            self.body["messages"] = [{"role": "user", "content": "Tell me a story."}]
        else:
            self.body["prompt"] = "Once upon a time"
        self.status: int | None = None
        self.events: list[tuple[float, str]] = []  # (arrival time, data payload)
        self.body_json: Any = None  # a non-streaming response's body
        self.error: BaseException | None = None
        self.first = threading.Event()  # the first event came (or the request failed)
        self.start()

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url, json=self.body, timeout=120) as r:
                self.status = r.status_code
                if not self.body["stream"]:
                    self.body_json = json.loads(r.read())
                    return
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append((time.monotonic(), line.removeprefix("data: ")))
                        self.first.set()
        except BaseException as e:
            self.error = e
        finally:
            self.first.set()

    def payloads(self) -> list[str]:
        return [data for _, data in self.events]


def start_streams(srv: Server, n: int, max_tokens: int, chat: int = 0) -> list[RawStream]:
    """``n`` streams (the last ``chat`` of them chat completions), returned once each has sent
    its first chunk (all running)."""
    streams = [RawStream(srv, max_tokens, chat=i >= n - chat) for i in range(n)]
    for s in streams:
        assert s.first.wait(60), "no first chunk"
        assert s.error is None and s.status == 200, (s.error, s.status)
    return streams


def _num_requests(srv: Server) -> int:
    """Requests in the engine: running, waiting or being handed over."""
    m = srv.metrics(TINY)
    return int(m["kvserve:num_requests_running"] + m["kvserve:num_requests_waiting"])


def sigterm(srv: Server) -> float:
    srv.proc.send_signal(signal.SIGTERM)
    return time.monotonic()


def wait_exit(srv: Server, timeout: float) -> float:
    """Wait for the process; assert exit code 0 and that its shutdown code ran."""
    rc = srv.proc.wait(timeout)
    log = srv.log.read_text()
    assert rc == 0, log[-3000:]
    assert "draining:" in log and "engines stopped; exiting" in log, log[-3000:]
    return time.monotonic()


def assert_aborted(s: RawStream) -> None:
    """The stream ended with an error event (503, shutting down) then ``[DONE]``."""
    s.join(10)
    assert not s.is_alive() and s.error is None, s.error
    *rest, error, done = s.payloads()
    assert done == "[DONE]"
    err = json.loads(error)["error"]
    assert err["code"] == 503 and err["type"] == "service_unavailable"
    assert err["message"] == SHUTTING_DOWN
    # Cut short: no chunk finished the choice.
    assert all(json.loads(c)["choices"][0]["finish_reason"] is None for c in rest)


@pytest.mark.slow
def test_drain_completes_streams_in_flight(serve: Any) -> None:
    """Within the timeout every stream runs to its end; meanwhile new requests get 503."""
    # 32 tokens: the streams only have to outlast the two 503 checks (a few ms) after the
    # signal; 64 took ~25 s of this test's 41 s on a loaded 2-core AVX2 EPYC.
    max_tokens = 32
    # The built-in model: 8 tiny-model streams of 64 tokens once ended 4 ms before the two
    # 503 checks below did (C++ decode loop, fast EPYC), which the last assert forbids.
    # A timeout the streams cannot outlast on a slow CPU: 8 x 64 float32 tokens took over 30 s
    # on a 2-core AVX2 EPYC sharing its cores with a test suite.
    srv = serve(180, builtin=True)
    client = srv.client(max_retries=0)
    done: list[tuple[float, list[Any]]] = []  # (end time, chunks) per stream
    started = threading.Barrier(NUM_STREAMS + 1, timeout=60)

    def one() -> None:
        stream = client.completions.create(
            model=TINY, prompt="Once upon a time", max_tokens=max_tokens, temperature=0,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        chunks = [next(stream)]
        started.wait()
        chunks += list(stream)
        done.append((time.monotonic(), chunks))

    threads = [threading.Thread(target=one, daemon=True) for _ in range(NUM_STREAMS)]
    for t in threads:
        t.start()
    started.wait()
    t_signal = sigterm(srv)
    health = httpx.get(f"{srv.url}/health", timeout=10)
    new = httpx.post(
        f"{srv.url}/v1/completions", json={"model": TINY, "prompt": "hi", "max_tokens": 4},
        timeout=10,
    )  # fmt: skip
    t_rejected = time.monotonic()
    assert health.status_code == 503 and "draining" in health.json()["error"]["message"]
    assert new.status_code == 503 and new.json()["error"]["message"] == SHUTTING_DOWN
    for t in threads:
        t.join(180)
    t_exit = wait_exit(srv, 20)
    assert len(done) == NUM_STREAMS
    for _, chunks in done:
        *choices, usage = chunks
        assert choices[-1].choices[0].finish_reason == "length"
        assert usage.usage.completion_tokens == max_tokens
    # The streams did run on after the signal: the 503s came while they were in flight.
    assert max(end for end, _ in done) > t_rejected
    print(f"drained {NUM_STREAMS} streams of {max_tokens} tokens: exit {t_exit - t_signal:.1f}s")


@pytest.mark.slow
def test_zero_timeout_aborts_at_once(serve: Any) -> None:
    """``--shutdown-timeout 0``: every stream (completions and chat) gets an error event +
    [DONE] at once; a queued non-streaming request gets a 503 body."""
    srv = serve(0)
    streams = start_streams(srv, NUM_STREAMS, LONG, chat=2)
    queued = RawStream(srv, LONG, stream=False)  # the 9th: waits for a free slot
    deadline = time.monotonic() + 30
    while _num_requests(srv) < NUM_STREAMS + 1:
        assert time.monotonic() < deadline, "the 9th request was never queued"
        time.sleep(0.05)
    t_signal = sigterm(srv)
    for s in streams:
        assert_aborted(s)
    queued.join(10)
    assert queued.status == 503 and queued.body_json["error"]["message"] == SHUTTING_DOWN
    t_exit = wait_exit(srv, 15)
    assert t_exit - t_signal < 10
    print(f"aborted at once: exit {t_exit - t_signal:.1f}s after SIGTERM")


@pytest.mark.slow
def test_timeout_aborts_streams_still_running(serve: Any) -> None:
    """Streams longer than the timeout run until it passes, then end with error + [DONE]."""
    timeout = 2.0
    srv = serve(timeout, builtin=True)
    streams = start_streams(srv, NUM_STREAMS, LONG)
    t_signal = sigterm(srv)
    for s in streams:
        assert_aborted(s)
        ends = [t for t, _ in s.events]
        assert ends[-1] - t_signal > timeout - 0.5  # not before the deadline
        assert any(t > t_signal + 0.2 for t in ends[:-2])  # it kept streaming meanwhile
    t_exit = wait_exit(srv, 15)
    assert t_exit - t_signal < timeout + 10
    print(f"aborted at the {timeout}s deadline: exit {t_exit - t_signal:.1f}s after SIGTERM")


@pytest.mark.slow
def test_second_signal_forces_exit(serve: Any) -> None:
    """A second SIGTERM during a long drain exits promptly, still with code 0."""
    srv = serve(60)
    streams = start_streams(srv, 2, LONG)
    sigterm(srv)
    deadline = time.monotonic() + 10
    while "draining:" not in srv.log.read_text():
        assert time.monotonic() < deadline, "the drain did not start"
        time.sleep(0.05)
    t_signal = sigterm(srv)
    t_exit = wait_exit(srv, 15)
    assert t_exit - t_signal < 10
    log = srv.log.read_text()
    assert "second signal: exiting now" in log and "Traceback" not in log
    for s in streams:
        s.join(10)
        assert not s.is_alive()


def test_negative_shutdown_timeout_is_rejected(capsys: pytest.CaptureFixture[str]) -> None:
    assert serve_main(["--shutdown-timeout", "-1"]) == 2
    assert "--shutdown-timeout must be >= 0" in capsys.readouterr().err
