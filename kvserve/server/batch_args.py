"""The Batch API's ``serve`` flags (vLLM has none: its batch API is ``run-batch`` only)."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvserve.config import parse_bytes
from kvserve.server.batch_files import BatchLimits
from kvserve.server.batch_service import BatchService

_POSITIVE = (
    ("batch_max_concurrency", "--batch-max-concurrency"),
    ("max_batch_file_bytes", "--max-batch-file-bytes"),
    ("max_batch_file_lines", "--max-batch-file-lines"),
    ("max_batch_jobs", "--max-batch-jobs"),
    ("batch_completion_window_seconds", "--batch-completion-window-seconds"),
)


def add_batch_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("the Batch API (/v1/files, /v1/batches)")
    g.add_argument(
        "--batch-dir", default=None,
        help="folder of the batch files and jobs; a job there survives a restart (kill -9 "
             "included) and resumes where it was. Default: a new temporary folder, made on "
             "first use, whose jobs a restarted server does not see",
    )  # fmt: skip
    g.add_argument(
        "--batch-max-concurrency", type=int, default=BatchLimits.max_concurrency,
        help="most batch requests in flight at once (all jobs together); each is sent only "
             "while no request waits in its engine's queue",
    )  # fmt: skip
    g.add_argument(
        "--max-batch-file-bytes", type=parse_bytes, default=BatchLimits.max_file_bytes,
        help="largest file POST /v1/files takes; above: 413. Accepts e.g. 64MiB",
    )  # fmt: skip
    g.add_argument(
        "--max-batch-file-lines", type=int, default=BatchLimits.max_file_lines,
        help="most requests (non-blank lines) in a batch input file; above: 400",
    )  # fmt: skip
    g.add_argument(
        "--max-batch-jobs", type=int, default=BatchLimits.max_jobs,
        help="most batch jobs not yet completed, failed, cancelled or expired; above: 429",
    )  # fmt: skip
    g.add_argument(
        "--batch-completion-window-seconds", type=int,
        default=BatchLimits.completion_window_seconds,
        help="how long a job's completion_window (\"24h\", OpenAI's only value) lasts here, "
             "from its creation; a job not finished by then is expired: its finished lines "
             "are in the output file, the others in the error file as batch_expired",
    )  # fmt: skip


def batch_limits_from_args(args: argparse.Namespace) -> BatchLimits:
    defaults = BatchLimits()
    for attr, flag in _POSITIVE:
        value = getattr(args, attr, None)
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    return BatchLimits(
        max_file_bytes=getattr(args, "max_batch_file_bytes", defaults.max_file_bytes),
        max_file_lines=getattr(args, "max_batch_file_lines", defaults.max_file_lines),
        max_jobs=getattr(args, "max_batch_jobs", defaults.max_jobs),
        max_concurrency=getattr(args, "batch_max_concurrency", defaults.max_concurrency),
        completion_window_seconds=getattr(
            args, "batch_completion_window_seconds", defaults.completion_window_seconds
        ),
    )


def batch_service_from_args(args: argparse.Namespace) -> BatchService:
    """The service; with ``--batch-dir`` its folder is locked and read now (ValueError if
    another server holds it: exit code 2 before any model loads)."""
    folder = getattr(args, "batch_dir", None)
    service = BatchService(None if folder is None else Path(folder).expanduser(),
                           batch_limits_from_args(args))  # fmt: skip
    if folder is not None:
        service.open()
    return service
