"""Building the C++ kernels without ever hanging a start (used by ``cpu_kernels``).

torch's extension builder guards its build folder with a bare ``lock`` file that stays behind
when the building process is killed (Ctrl-C, an OOM kill, a supervisor's timeout); every later
build of that name then waits on it forever, silently. Here instead:

* **The folder is named by a hash** of every file in the sources' folder, the flags and the
  torch version, so two checkouts (or an edited source) never rebuild one library under each
  other, and a finished build (its ``built`` stamp) is loaded with no lock at all.
* **The build lock knows its owner**: an ``flock`` on ``kvserve-build.lock`` holding the owner's
  pid. The kernel drops an ``flock`` when its process dies, so a lock left by a killed build is
  simply free (stale); a live owner is waited for with a log line naming its pid. Holding it
  also proves that torch's own ``lock`` file in the folder is stale, so it is removed.
* **Waiting and building are bounded** by ``$KVSERVE_KERNEL_BUILD_TIMEOUT`` seconds; after it
  the caller runs on the PyTorch paths with a warning.
* **The compilers never outlive their starter**: the build runs in a child process (a small
  Python builder running torch's ``cpp_extension.load``, then ninja, then the compilers) whose
  whole process tree ``cancel_builds`` (SIGTERM or Ctrl-C while loading) and the timeout
  kill, and which kills its own tree when the process that started it dies.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("kvserve.ops.cpu_kernels")

BUILD_TIMEOUT_ENV = "KVSERVE_KERNEL_BUILD_TIMEOUT"
DEFAULT_BUILD_TIMEOUT_S = 300.0
LOCK_NAME = "kvserve-build.lock"
STAMP_NAME = "built"
TORCH_LOCK_NAME = "lock"  # torch's FileBaton in the build folder
POLL_S = 0.1
# Only these files of the sources' folder count for the build's hash (not editors' temp files).
SOURCE_SUFFIXES = (".c", ".cc", ".cpp", ".h", ".hpp", ".inc")
_RUN_BUILDER = "import runpy, sys; runpy.run_path(sys.argv[1], run_name='__main__')"


def build_timeout() -> float:
    """``$KVSERVE_KERNEL_BUILD_TIMEOUT`` (seconds), else the default; a bad value is an error."""
    raw = os.environ.get(BUILD_TIMEOUT_ENV)
    if raw is None or raw.strip() == "":
        return DEFAULT_BUILD_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:  # also nan
        raise ValueError(f"${BUILD_TIMEOUT_ENV} must be a number of seconds >= 0, got {raw!r}")
    return value


class BuildLock:
    """An exclusive ``flock`` on ``path`` whose file holds the owner's pid.

    The kernel releases an ``flock`` when its holder dies, however it dies, so there is no
    stale state to detect: a lock file whose owner is dead can be taken at once.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def try_acquire(self) -> bool:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return True

    def owner(self) -> int | None:
        """The pid recorded by the current (or last) holder; None if unreadable."""
        try:
            return int(self.path.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock
            self._fd = None

    def acquire(self, deadline: float, on_wait: Callable[[int | None], None] | None = None) -> bool:
        """Take the lock, polling until ``deadline`` (``time.monotonic``); False at the
        deadline. ``on_wait(owner_pid)`` is called once, when the lock is found held."""
        told = False
        while not self.try_acquire():
            if not told and on_wait is not None:
                on_wait(self.owner())
            told = True
            if time.monotonic() >= deadline:
                return False
            time.sleep(POLL_S)
        return True


@dataclass(frozen=True)
class KernelBuild:
    """What to build (torch's ``cpp_extension.load`` arguments) and where."""

    name: str
    sources: tuple[Path, ...]
    cflags: tuple[str, ...]
    ldflags: tuple[str, ...]
    root: Path  # $TORCH_EXTENSIONS_DIR or torch's default

    @property
    def digest(self) -> str:
        """Hash of every C/C++ file beside the sources (headers too), the flags and torch."""
        import torch

        h = hashlib.sha256(f"{torch.__version__}\0{self.cflags}\0{self.ldflags}".encode())
        folders = sorted({s.parent for s in self.sources})
        files = (p for d in folders for p in d.iterdir() if p.suffix in SOURCE_SUFFIXES)
        for path in sorted(p for p in files if p.is_file()):
            h.update(f"\0{path.name}\0".encode())
            h.update(path.read_bytes())
        h.update(str([s.name for s in self.sources]).encode())  # their order is the link order
        return h.hexdigest()[:12]

    @functools.cached_property
    def ext_name(self) -> str:
        return f"{self.name}_{self.digest}"

    @property
    def directory(self) -> Path:
        return self.root / self.ext_name

    @property
    def library(self) -> Path:
        return self.directory / f"{self.ext_name}.so"

    @property
    def stamp(self) -> Path:
        return self.directory / STAMP_NAME

    def is_built(self) -> bool:
        return self.stamp.is_file() and self.library.is_file()


def default_root() -> Path:
    """torch's extension folder: ``$TORCH_EXTENSIONS_DIR``, else its per-Python default."""
    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    if env:
        return Path(env).expanduser()
    import torch
    from torch.utils import cpp_extension

    cuda = torch.version.cuda
    flavor = f"cu{cuda.replace('.', '')}" if cuda else "cpu"
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    return Path(cpp_extension.get_default_build_root()) / f"{py}_{flavor}"


# Builder processes running now (the group of each: the builder, ninja, the compilers).
_active: set[subprocess.Popen[bytes]] = set()
_active_lock = threading.Lock()
_cancelled = threading.Event()


def cancel_builds() -> int:
    """Kill every build this process started, compilers included (SIGTERM / Ctrl-C during
    loading); later builds in this process are refused. Returns how many were killed."""
    _cancelled.set()
    with _active_lock:
        procs = list(_active)
    for proc in procs:
        kill_tree(proc.pid)
    return len(procs)


def kill_tree(root: int, include_root: bool = True) -> None:
    """SIGKILL ``root`` and every process descended from it (Linux ``/proc``).

    A process group would not do: ninja starts each compiler in a group of its own. Each
    process is stopped first, and the tree read again until no new one appears, since a
    stopped process cannot start another (ninja its next compiler) before the kills come.
    """
    stopped: list[int] = [] if include_root else [root]
    while True:
        new = [p for p in _tree(root) if p not in stopped]
        if not new:
            break
        for pid in new:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGSTOP)
        stopped += new
    for pid in stopped if include_root else stopped[1:]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def _tree(root: int) -> list[int]:
    """``root`` and its descendants, parents first."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        children.setdefault(ppid, []).append(int(stat.parent.name))
    out = [root]
    for pid in out:  # grows while iterated: breadth first
        out.extend(children.get(pid, []))
    return out


def load(build: KernelBuild, timeout: float) -> str | None:
    """Load ``build``'s library into this process, building it first if needed.

    Returns None when loaded, else why not (the caller warns and uses the PyTorch paths):
    the build failed, or was cancelled, or waiting and building took over ``timeout`` s.
    """
    import torch

    if build.is_built():  # finished builds never change (the folder is named by a hash)
        torch.ops.load_library(str(build.library))
        return None
    deadline = time.monotonic() + timeout
    build.directory.mkdir(parents=True, exist_ok=True)
    lock = BuildLock(build.directory / LOCK_NAME)

    def waiting(pid: int | None) -> None:
        who = f"pid {pid}" if pid is not None else "another process"
        logger.info("waiting for %s to finish building C++ kernels in %s (up to %.0f s, $%s)",
                    who, build.directory, timeout, BUILD_TIMEOUT_ENV)  # fmt: skip

    if not lock.acquire(deadline, waiting):
        return (f"pid {lock.owner()} did not finish building them in {build.directory} "
                f"within {timeout:.0f} s (${BUILD_TIMEOUT_ENV})")  # fmt: skip
    try:
        if not build.is_built():
            error = _build_locked(build, deadline, timeout)
            if error is not None:
                return error
        torch.ops.load_library(str(build.library))
    finally:
        lock.release()
    return None


def _build_locked(build: KernelBuild, deadline: float, timeout: float) -> str | None:
    """Run the build in a child process group (we hold the lock); None on success."""
    torch_lock = build.directory / TORCH_LOCK_NAME
    if torch_lock.exists():  # only a lock holder builds here: this one is a killed build's
        logger.warning("removing %s, left behind by a killed build", torch_lock)
        torch_lock.unlink(missing_ok=True)
    logger.info("building C++ kernels (first start, ~20 s; up to %.0f s, $%s) in %s",
                timeout, BUILD_TIMEOUT_ENV, build.directory)  # fmt: skip
    spec = json.dumps({"name": build.ext_name, "sources": [str(s) for s in build.sources],
                       "cflags": list(build.cflags), "ldflags": list(build.ldflags),
                       "directory": str(build.directory), "parent": os.getpid()})  # fmt: skip
    log = build.directory / "build.log"
    t0 = time.monotonic()
    with _active_lock:
        if _cancelled.is_set():
            return "the build was cancelled (the process is shutting down)"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                # This file by its path (it needs only stdlib and torch): importing kvserve
                # would cost seconds, and running it as a script would put its folder first
                # on the path, shadowing modules with the names of its neighbours.
                [sys.executable, "-c", _RUN_BUILDER, __file__, spec],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,  # a terminal's Ctrl-C is ours to pass on (kill_tree)
            )  # fmt: skip
        _active.add(proc)
    try:
        rc = _wait(proc, deadline)
    finally:
        with _active_lock:
            _active.discard(proc)
    if rc is None:
        kill_tree(proc.pid)
        proc.wait()
        return f"building them took over {timeout:.0f} s (${BUILD_TIMEOUT_ENV})"
    if _cancelled.is_set():
        return "the build was cancelled (the process is shutting down)"
    if rc != 0 or not build.library.is_file():
        tail = log.read_text(errors="replace")[-2000:]
        return f"the build failed (exit code {rc}); {log}:\n{tail}"
    build.stamp.write_text(build.ext_name + "\n")
    logger.info("built C++ kernels in %.1f s", time.monotonic() - t0)
    return None


def _wait(proc: subprocess.Popen[bytes], deadline: float) -> int | None:
    """The builder's exit code, or None at the deadline."""
    try:
        return proc.wait(max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return None


def _builder_main(spec_json: str) -> None:
    """The child: build with torch's ``cpp_extension.load``; die with the parent."""
    spec = json.loads(spec_json)
    parent = int(spec["parent"])

    def watch_parent() -> None:
        while os.getppid() == parent:
            time.sleep(0.2)
        kill_tree(os.getpid(), include_root=False)  # the starter is gone: ninja, compilers
        os._exit(1)

    threading.Thread(target=watch_parent, daemon=True).start()
    from torch.utils import cpp_extension

    cpp_extension.load(
        name=spec["name"], sources=spec["sources"], extra_cflags=spec["cflags"],
        extra_ldflags=spec["ldflags"], build_directory=spec["directory"],
        is_python_module=False, verbose=True,
    )  # fmt: skip


if __name__ == "__main__":
    _builder_main(sys.argv[-1])
