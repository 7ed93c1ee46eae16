"""The grammar compile worker: a process that compiles one grammar at a time and can be killed.

xgrammar's compiler is C++ and cannot be interrupted from another thread, and a small input
can ask for a huge grammar (the 30-byte regex ``[a-z]{1,20000}`` compiles for 1.5 s into
2 MB; 10,000 tools took 104 s and 12 GB). So every compile runs here, in a process the
server kills when it runs past its time or memory limit or when nobody waits for it any
more; the OS then frees all it built. The result crosses back as xgrammar's own
serialization (``CompiledGrammar.serialize_json``).

Workers are forked by a zygote (``python -m kvserve.structured_output.compile_worker FD``),
a process that imports xgrammar (and so torch, ~6 s on a busy 2-core machine) once and forks
a worker per request on its control socket, handing back the worker's pid and socket: a new
worker is ready in well under a second, sharing those pages. (multiprocessing's fork server
would re-import the server's ``__main__`` in every worker.) A worker dies with the zygote,
and the zygote when the server closes its socket, so nothing outlives the server.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import struct
import sys
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

from kvserve.structured_output.params import StructuredOutputsParams

# JSON: the most whitespace characters in a row between two tokens. Unbounded, the built-in
# 135M model at temperature 0.8 wrote newlines until max_tokens (3 of 8 outputs in one run:
# vLLM's known "endless whitespace" failure); with 24, 2 of 64 outputs of the benchmark's
# schema still ran out of max_tokens=256 in 24-newline gaps; with 12, 0 of 128. 12 still allows
# a newline and 5 levels of 2-space indentation.
MAX_WHITESPACE = 12
# A compile that took less than this in the worker is compiled again in the server's lane
# thread instead of crossing as xgrammar's serialization: a small JSON schema (with the
# whitespace limit, 2.2 MB compiled) compiles in ~50 ms but takes ~250 ms to serialize and
# ~100 ms to read back. A replay is safe: it just ran within the limits.
REPLAY_SECONDS = 0.2
# xgrammar prefixes its errors with a time stamp and a C++ source location.
_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


def reason(exc: BaseException) -> str:
    """xgrammar's message without its time stamp and source location."""
    return _LOCATION.sub("", str(exc).strip())


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose sentences are exactly ``choices`` (JSON string escapes are valid
    EBNF string escapes)."""
    import json

    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def compile_params(compiler: Any, params: StructuredOutputsParams) -> Any:
    """``params``'s constraint compiled by an ``xgrammar.GrammarCompiler`` (raises its error)."""
    kind = params.kind
    if kind in ("json", "json_object"):
        # OpenAI's json_object is an object; xgrammar's built-in JSON grammar would also
        # allow `[true]` or `3`.
        schema = params.json if kind == "json" else '{"type": "object"}'
        return compiler.compile_json_schema(
            schema,
            any_whitespace=not params.disable_any_whitespace,
            max_whitespace_cnt=MAX_WHITESPACE,
        )
    if kind == "regex":
        return compiler.compile_regex(params.regex)
    if kind == "choice":
        return compiler.compile_grammar(choice_grammar(list(params.choice or [])))
    if kind == "grammar":
        text = params.grammar or ""
        # vLLM's rule: EBNF (GBNF) uses ``::=``; anything else is read as Lark.
        if "::=" in text:
            return compiler.compile_grammar(text)
        return compiler.compile_lark(text)
    return compiler.compile_structural_tag(params.structural_tag)


def worker_main(conn: Connection) -> None:
    """Serve compiles over ``conn``: first the tokenizer info (xgrammar's JSON), answered with
    ``("ready", pid)``; then each ``StructuredOutputsParams`` is answered with ``("ok",
    serialized grammar)``, ``("replay", seconds)`` (compiled fast: the server compiles it
    again rather than read it) or ``("error", reason)``, until the pipe closes."""
    import xgrammar  # already imported: the fork server preloads it

    try:
        first = conn.recv()
    except (EOFError, OSError):
        return  # the server closed the pipe before the handshake (it is shutting down)
    info = xgrammar.TokenizerInfo.deserialize_json(first)
    # One thread: the engine's forward passes need the cores; no cache: the server keeps one.
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    conn.send(("ready", os.getpid()))
    while True:
        try:
            params = conn.recv()
        except (EOFError, OSError):
            return  # the server closed the pipe (or exited)
        try:
            start = time.perf_counter()
            grammar = compile_params(compiler, params)
            took = time.perf_counter() - start
            reply = ("replay", took) if took < REPLAY_SECONDS else ("ok", grammar.serialize_json())
            del grammar
        except Exception as e:  # the compiler's verdict on this input: the request's 400
            reply = ("error", f"invalid {params.kind} for structured outputs: {reason(e)}")
        conn.send(reply)


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent (the zygote) dies."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _next_fork(control: socket.socket) -> bool:
    """Whether the server asks for another worker (False: it closed or reset ``control``, as
    a server shutting down does, possibly mid-request)."""
    try:
        return bool(control.recv(1))
    except OSError:  # ConnectionResetError
        return False


def zygote_main(control: socket.socket) -> None:
    """Fork a worker for every byte read on ``control``; send back its pid (an int32) with
    its end of a new socket pair. Returns when the server closes ``control``."""
    import xgrammar  # noqa: F401 - imported once here, shared by every forked worker

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps killed workers
    while _next_fork(control):
        ours, theirs = socket.socketpair()
        pid = os.fork()
        if pid == 0:  # the worker
            code = 0
            try:
                control.close()
                ours.close()
                _die_with_parent()
                worker_main(Connection(theirs.detach()))
            except BaseException:
                traceback.print_exc()
                code = 1
            finally:
                os._exit(code)
        theirs.close()
        try:
            socket.send_fds(control, [struct.pack("i", pid)], [ours.fileno()])
        except OSError:  # the server closed control while we forked (it is shutting down)
            os.kill(pid, signal.SIGKILL)  # the worker nobody will ever talk to
            return
        finally:
            ours.close()


def main() -> None:
    """The zygote's entry point (``python -c``, so runpy never imports this module twice)."""
    zygote_main(socket.socket(fileno=int(sys.argv[1])))
    sys.stdout.flush()
    os._exit(0)  # no C++ destructors of what the imports started: nothing to clean up
