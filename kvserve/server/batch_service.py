"""The Batch API's owner: the file store, the jobs, and the loop that advances them.

One loop task (started with the app, on its event loop) takes the oldest unfinished job
through OpenAI's states: ``validating`` (the input file's lines checked) -> ``in_progress``
(lines run by ``batch_runner``) -> ``finalizing`` (output and error files written) ->
``completed``; ``cancelling`` -> ``cancelled`` keeps the lines finished so far. Every state
change is on disk before it is reported, so a restarted server with the same ``--batch-dir``
picks each job up where it was (see ``batch_jobs``). One job runs at a time; the
``--batch-max-concurrency`` slots are the server's, whatever the number of jobs.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import IO, Any

from starlette.types import ASGIApp

from kvserve.server.batch_files import OUTPUT_PURPOSE, BatchLimits, FileStore, not_found
from kvserve.server.batch_jobs import (
    TERMINAL,
    BatchLine,
    Job,
    JobStore,
    Status,
    expired_record,
    new_batch_object,
    parse_lines,
    status_code,
)
from kvserve.server.batch_runner import LineSender, run_lines
from kvserve.server.errors import APIError, bad_request

logger = logging.getLogger("kvserve.server")

READY_POLL_SECONDS = 0.1
RAY_BATCH_OFF = (
    "the Batch API is off on this server (--ray): its engine replicas share no disk, so a "
    "file or a job could not be found again by a later request; use kvserve run-batch"
)


class BatchService:
    """Files and jobs under one ``--batch-dir`` (default: a temporary folder made on first
    use, which does not outlive the server: give ``--batch-dir`` for jobs that survive a
    restart). The folder is locked: two servers cannot share it."""

    def __init__(
        self,
        root: Path | None = None,
        limits: BatchLimits | None = None,
        disabled_reason: str | None = None,
    ) -> None:
        self.limits = limits or BatchLimits()
        self.disabled_reason = disabled_reason  # set (Ray replicas): every route is a 400
        self._root = root
        self._lock_file: IO[bytes] | None = None
        self._owns_root = False
        self._files: FileStore | None = None
        self._store: JobStore | None = None
        self.jobs: dict[str, Job] = {}
        self._wake: asyncio.Event | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._active: tuple[str, asyncio.Task[None]] | None = None
        self._slots: asyncio.Semaphore | None = None

    # -- storage ---------------------------------------------------------------------------------
    def open(self) -> None:
        """Lock the folder and load its jobs (``serve`` calls it at start-up with --batch-dir;
        otherwise the first use does, in a new temporary folder)."""
        if self._store is not None:
            return
        if self.disabled_reason is not None:
            raise APIError(400, self.disabled_reason)
        root = self._root or Path(tempfile.mkdtemp(prefix="kvserve-batch-"))
        root.mkdir(parents=True, exist_ok=True)
        lock = (root / ".lock").open("ab")
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as e:
            lock.close()
            raise ValueError(f"--batch-dir {root} is in use by another kvserve server") from e
        self._owns_root = self._root is None  # a temporary folder: removed at stop()
        self._lock_file, self._root = lock, root
        self._files, self._store = FileStore(root), JobStore(root)
        self.jobs = {job.id: job for job in self._store.load_all()}
        unfinished = [j.id for j in self.jobs.values() if j.status not in TERMINAL]
        if unfinished:
            logger.info("batch: resuming %d job(s) from %s: %s", len(unfinished), root, unfinished)

    @property
    def files(self) -> FileStore:
        self.open()
        assert self._files is not None
        return self._files

    @property
    def store(self) -> JobStore:
        self.open()
        assert self._store is not None
        return self._store

    # -- the API ---------------------------------------------------------------------------------
    def create(self, body: dict[str, Any]) -> dict[str, Any]:
        """``POST /v1/batches``: a new job in ``validating`` (checked by the loop)."""
        from kvserve.server.batch_jobs import COMPLETION_WINDOWS, ENDPOINTS

        file_id, endpoint = body.get("input_file_id"), body.get("endpoint")
        window, metadata = body.get("completion_window"), body.get("metadata")
        if endpoint not in ENDPOINTS:
            raise bad_request(f"endpoint must be one of {list(ENDPOINTS)}, got {endpoint!r}",
                              "endpoint")  # fmt: skip
        if window not in COMPLETION_WINDOWS:
            raise bad_request(f"completion_window must be one of {list(COMPLETION_WINDOWS)}, "
                              f"got {window!r}", "completion_window")  # fmt: skip
        if metadata is not None and not isinstance(metadata, dict):
            raise bad_request("metadata must be an object", "metadata")
        if not isinstance(file_id, str):
            raise bad_request("input_file_id is required", "input_file_id")
        try:
            purpose = self.files.get(file_id)["purpose"]
        except APIError as e:
            raise bad_request(e.message, "input_file_id") from e
        if purpose != "batch":
            raise bad_request(f"file {file_id} has purpose {purpose!r}, not 'batch'",
                              "input_file_id")  # fmt: skip
        unfinished = sum(1 for j in self.jobs.values() if j.status not in TERMINAL)
        if unfinished >= self.limits.max_jobs:
            raise APIError(
                429, f"this server already has {unfinished} unfinished batch jobs, its limit "
                f"(--max-batch-jobs); wait for one to finish or cancel one",
                code="batch_limit_exceeded",
            )  # fmt: skip
        obj = new_batch_object(file_id, endpoint, window, metadata,
                               self.limits.completion_window_seconds)  # fmt: skip
        job = self.store.create(obj)
        self.jobs[job.id] = job
        self._poke()
        return job.to_openai()

    def get(self, batch_id: str) -> Job:
        self.open()
        job = self.jobs.get(batch_id)
        if job is None:
            raise not_found("batch", batch_id, "batch_id")
        return job

    def cancel(self, batch_id: str) -> dict[str, Any]:
        job = self.get(batch_id)
        if job.status in TERMINAL or job.status is Status.FINALIZING:
            raise bad_request(f"batch {batch_id} is {job.status.value}; it cannot be cancelled")
        if job.status is not Status.CANCELLING:
            self.store.set_status(job, Status.CANCELLING)
            if self._active is not None and self._active[0] == batch_id:
                self._active[1].cancel()  # its lines in flight are aborted
            self._poke()
        return job.to_openai()

    def list(self, limit: int, after: str | None) -> dict[str, Any]:
        self.open()
        jobs = sorted(self.jobs.values(), key=lambda j: (j.obj["created_at"], j.id), reverse=True)
        if after is not None:
            ids = [j.id for j in jobs]
            if after not in ids:
                raise not_found("batch", after, "after")
            jobs = jobs[ids.index(after) + 1 :]
        page = [j.to_openai() for j in jobs[:limit]]
        return {
            "object": "list", "data": page, "has_more": len(jobs) > limit,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
        }  # fmt: skip

    def delete_file(self, file_id: str) -> dict[str, Any]:
        for job in self.jobs.values():
            if job.obj["input_file_id"] == file_id and job.status not in TERMINAL:
                raise bad_request(f"file {file_id} is the input of unfinished batch {job.id}",
                                  "file_id")  # fmt: skip
        return self.files.delete(file_id)

    # -- the loop --------------------------------------------------------------------------------
    def _poke(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def start(self, app: ASGIApp, state: Any) -> None:
        """Start advancing jobs (on the running loop) once ``state`` is ready."""
        if self.disabled_reason is not None:
            return
        self._wake = asyncio.Event()
        self._slots = asyncio.Semaphore(self.limits.max_concurrency)
        self._loop_task = asyncio.create_task(self._loop(app, state), name="kvserve-batch")

    async def stop(self) -> None:
        """Stop the loop; lines in flight are cancelled (they run again after a restart)."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        if self._owns_root and self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)  # its jobs could not resume anyway

    async def _loop(self, app: ASGIApp, state: Any) -> None:
        assert self._wake is not None
        while not state.ready:
            await asyncio.sleep(READY_POLL_SECONDS)
        if self._root is not None:
            self.open()
        while True:
            job = next((j for j in self.jobs.values() if j.status not in TERMINAL), None)
            if job is None:
                await self._wake.wait()
                self._wake.clear()
                continue
            try:
                await self._advance(job, app, state)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a disk error, say: this job fails, the server goes on
                logger.exception("batch %s failed", job.id)
                error = {"code": "server_error", "message": str(e), "param": None, "line": None}
                self.store.set_status(job, Status.FAILED, errors={"object": "list",
                                                                  "data": [error]})  # fmt: skip

    async def _advance(self, job: Job, app: ASGIApp, state: Any) -> None:
        status = job.status
        if status is Status.VALIDATING:
            lines, errors = await asyncio.to_thread(self._lines, job)
            if errors:
                err = {"object": "list", "data": errors}
                self.store.set_status(job, Status.FAILED, errors=err)
                return
            job.obj["request_counts"]["total"] = len(lines)
            self.store.set_status(job, Status.IN_PROGRESS)
        elif status is Status.IN_PROGRESS:
            lines, _ = await asyncio.to_thread(self._lines, job)
            task = asyncio.create_task(self._run(job, lines, app, state))
            self._active = (job.id, task)
            try:
                await asyncio.wait({task}, timeout=_seconds_left(job))
                if not task.done():  # the window closed: lines in flight are aborted
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
                    logger.info("batch %s: its completion window closed", job.id)
                    self.store.set_status(job, Status.FINALIZING)
                    return
            finally:
                self._active = None
                if not task.done():  # the loop itself was cancelled (shutdown)
                    task.cancel()
                    with contextlib.suppress(BaseException):
                        await task
            if task.cancelled() or job.status is Status.CANCELLING:
                return  # cancel(): the job is cancelling now
            task.result()  # raises its error
            self.store.set_status(job, Status.FINALIZING)
        else:  # finalizing or cancelling: write the files
            await asyncio.to_thread(self._finalize, job)

    def _lines(self, job: Job) -> tuple[list[BatchLine], list[dict[str, Any]]]:
        file_id = job.obj["input_file_id"]
        try:
            text = self.files.content(file_id).decode("utf-8")
        except APIError as e:
            return [], [{"code": "file_not_found", "message": e.message, "param": None,
                         "line": None}]  # fmt: skip
        except UnicodeDecodeError as e:
            return [], [{"code": "invalid_file", "message": f"the file is not UTF-8 text "
                         f"(byte {e.start})", "param": None, "line": None}]  # fmt: skip
        return parse_lines(text, job.obj["endpoint"])

    async def _run(self, job: Job, lines: list[BatchLine], app: ASGIApp, state: Any) -> None:
        assert self._slots is not None
        todo = [line for line in lines if line.custom_id not in job.done]
        sender = LineSender(app, state.api_key, state.priority_scheduling)

        async def commit(record: dict[str, Any]) -> None:
            await asyncio.to_thread(self.store.append_result, job, record)

        await run_lines(todo, sender, self._slots, commit, lambda line: spare(state, line))

    def _finalize(self, job: Job) -> None:
        """Write the output (2xx) and error files, in input order; idempotent (fixed ids)."""
        lines, _ = self._lines(job)
        expired = job.status is Status.FINALIZING and any(
            line.custom_id not in job.done for line in lines
        )  # finalizing with lines left: the window closed on them
        for line in lines if expired else []:
            if line.custom_id not in job.done:  # committed once, like a result
                self.store.append_result(job, expired_record(line))
        order = {line.custom_id: line.index for line in lines}
        results = sorted(self.store.results(job), key=lambda r: order.get(r["custom_id"], 0))
        ok = [r for r in results if status_code(r) == 200]
        bad = [r for r in results if status_code(r) != 200]
        ids: dict[str, str | None] = {}
        for kind, records in (("output", ok), ("error", bad)):
            ids[f"{kind}_file_id"] = None
            if records:
                data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
                file_id = f"file-{job.id.removeprefix('batch_')}-{kind}"
                name = f"{job.id}_{kind}.jsonl"
                self.files.create(data.encode(), name, OUTPUT_PURPOSE, file_id)
                ids[f"{kind}_file_id"] = file_id
        done = Status.CANCELLED if job.status is Status.CANCELLING else Status.COMPLETED
        if expired:
            done = Status.EXPIRED
        self.store.set_status(job, done, **ids)
        logger.info("batch %s %s: %s", job.id, done.value, job.to_openai()["request_counts"])


def _seconds_left(job: Job) -> float | None:
    """Seconds until ``job``'s completion window closes (None: it has none, a job made
    before windows were kept); 0 when it has closed (a restart after it)."""
    expires = job.obj.get("expires_at")
    return None if expires is None else max(0.0, expires - time.time())


def spare(state: Any, line: BatchLine) -> bool:
    """Whether the engine a line goes to has spare capacity: nothing waits in its queue."""
    if state.draining:
        return False  # shutting down: the line runs after the restart
    model = line.body.get("model")
    try:
        engine = state.engine_for(model if isinstance(model, str) else None)
    except APIError:
        return True  # the route answers the error
    stats = engine.stats()
    return not stats.get("num_waiting", 0) and not stats.get("num_pending", 0)
