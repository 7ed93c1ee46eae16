"""The replica's ASGI bridge (``KVServeReplica.handle``) on a small ASGI app, without Ray:
batches, the held-back response start, stream batching and disconnects."""

from __future__ import annotations

import asyncio

from starlette.types import Message, Receive, Scope, Send

from kvserve.ray.replica import REPLICA_HEADER, ForwardedRequest, KVServeReplica, is_final


class StreamingApp:
    """Echoes the request body, then sends ``n`` chunks ``gap`` seconds apart; records
    whether it saw a disconnect."""

    def __init__(self, n: int, gap: float) -> None:
        self.n, self.gap = n, gap
        self.disconnected = asyncio.Event()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = (await receive())["body"]
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": body, "more_body": True})
        watcher = asyncio.ensure_future(receive())
        watcher.add_done_callback(lambda _: self.disconnected.set())
        for i in range(self.n):
            await asyncio.sleep(self.gap)
            await send({"type": "http.response.body", "body": b"%d," % i, "more_body": True})
        await send({"type": "http.response.body", "body": b"end", "more_body": False})


def replica(app: StreamingApp, interval_s: float) -> KVServeReplica:
    r = KVServeReplica.__new__(KVServeReplica)  # no engine: only the bridge is under test
    r.app, r.replica_id, r.batch_interval_s = app, "r1", interval_s
    return r


async def collect(r: KVServeReplica) -> list[list[Message]]:
    request = ForwardedRequest(method="POST", path="/x", body=b"hi|")
    return [batch async for batch in r.handle(request)]


def test_every_message_arrives_in_order_and_the_start_waits_for_a_body() -> None:
    batches = asyncio.run(collect(replica(StreamingApp(n=5, gap=0.03), interval_s=0.0)))
    first = batches[0]
    assert first[0]["type"] == "http.response.start" and first[0]["status"] == 201
    assert (REPLICA_HEADER.encode(), b"r1") in first[0]["headers"]
    assert first[1] == {"type": "http.response.body", "body": b"hi|", "more_body": True}
    messages = [m for b in batches for m in b]
    assert b"".join(m.get("body", b"") for m in messages) == b"hi|0,1,2,3,4,end"
    assert is_final(messages[-1]) and not any(is_final(m) for m in messages[:-1])
    # start + echo, then chunks 30 ms apart one batch each ("end" follows "4," at once);
    # a stalled event loop may merge some, never split them
    assert [len(b) for b in batches[:1]] == [2] and 4 <= len(batches) <= 6


def test_stream_batching_interval_gathers_chunks_after_the_first() -> None:
    batches = asyncio.run(collect(replica(StreamingApp(n=10, gap=0.01), interval_s=0.06)))
    messages = [m for b in batches for m in b]
    assert b"".join(m.get("body", b"") for m in messages) == b"hi|0,1,2,3,4,5,6,7,8,9,end"
    assert [m["type"] for m in batches[0]] == ["http.response.start", "http.response.body"]
    assert len(batches) <= 4  # ~100 ms of chunks in 60 ms windows, not 11 batches


def test_closing_the_stream_is_a_disconnect_for_the_app() -> None:
    app = StreamingApp(n=100, gap=0.01)

    async def first_then_close() -> None:
        stream = replica(app, 0.0).handle(ForwardedRequest(method="POST", path="/x"))
        await stream.__anext__()
        await stream.aclose()  # what cancelling the Serve handle call does
        await asyncio.wait_for(app.disconnected.wait(), 5)

    asyncio.run(first_then_close())
