"""C++ kernel builds that cannot hang a start (issue 28, finding 6).

A build killed halfway used to leave torch's bare ``lock`` file behind, and every later start
waited on it forever, silently. Most tests build a one-function C++ file (about a second of
compiling, plus the builder's torch import) or one whose compiler blocks on a FIFO (a build
that never ends); none builds the real kernels: the ``kvserve serve`` tests stop the real
build by its timeout or by SIGTERM after a few seconds.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvserve.ops import cpu_kernels, kernel_build
from kvserve.ops.kernel_build import BuildLock, KernelBuild
from tests.server.conftest import start_server, tiny_model_dir

__all__ = ["tiny_model_dir"]  # the fixture, for the kvserve serve tests

LOGGER = "kvserve.ops.cpu_kernels"
# Helper processes load kernel_build.py by its path: importing the kvserve package (torch,
# transformers) would take them 10 s or more on a busy machine.
LOAD_KERNEL_BUILD = (
    "import importlib.util, sys; from pathlib import Path\n"
    f"spec = importlib.util.spec_from_file_location('kernel_build', {kernel_build.__file__!r})\n"
    "kb = sys.modules['kernel_build'] = importlib.util.module_from_spec(spec)\n"
    "spec.loader.exec_module(kb)\n"
)


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def processes_in(folder: Path) -> list[int]:
    """Processes whose working directory is ``folder`` (ninja and the compilers run there)."""
    out = []
    for cwd in Path("/proc").glob("[0-9]*/cwd"):
        try:
            if Path(os.readlink(cwd)) == folder:
                out.append(int(cwd.parent.name))
        except OSError:
            continue  # gone meanwhile, or not ours to read
    return out


def wait_until(check: object, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    """Another live process holding a build lock (``holder(lock_path)``)."""
    procs: list[subprocess.Popen[str]] = []

    def start(lock: Path) -> subprocess.Popen[str]:
        code = LOAD_KERNEL_BUILD + (
            "assert kb.BuildLock(Path(sys.argv[1])).try_acquire(); print('held', flush=True)\n"
            "sys.stdin.read()\n"  # until the test closes our stdin
        )
        lock.parent.mkdir(parents=True, exist_ok=True)
        proc = subprocess.Popen([sys.executable, "-c", code, str(lock)], text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE)  # fmt: skip
        assert proc.stdout is not None and proc.stdout.readline() == "held\n"
        procs.append(proc)
        return proc

    yield start  # type: ignore[misc]
    for proc in procs:
        proc.kill()
        proc.wait()


def tiny_build(tmp_path: Path, source: str = "") -> KernelBuild:
    src = tmp_path / "src" / "tiny.cpp"
    src.parent.mkdir(exist_ok=True)
    src.write_text(source or 'extern "C" int kvserve_tiny() { return 7; }\n')
    return KernelBuild("kvserve_tiny", (src,), ("-O0",), (), tmp_path / "ext")


def test_a_lock_whose_owner_died_is_free(tmp_path: Path) -> None:
    lock = BuildLock(tmp_path / "kvserve-build.lock")
    lock.path.write_text(f"{dead_pid()}\n")  # what a killed owner leaves behind
    assert lock.try_acquire()
    assert lock.owner() == os.getpid()
    other = BuildLock(lock.path)
    assert not other.try_acquire()  # held now, by a live owner (this process)
    lock.release()
    assert other.try_acquire()
    other.release()


def test_a_live_owner_is_waited_for_and_named(tmp_path: Path, holder: object) -> None:
    path = tmp_path / "kvserve-build.lock"
    proc = holder(path)  # type: ignore[operator]
    told: list[int | None] = []
    t0 = time.monotonic()
    assert not BuildLock(path).acquire(time.monotonic() + 0.5, told.append)
    assert time.monotonic() - t0 >= 0.5
    assert told == [proc.pid]  # once, with the owner's pid
    proc.kill()  # the owner dies: its lock is free at once, nothing to clean up
    proc.wait()
    lock = BuildLock(path)
    assert lock.acquire(time.monotonic() + 0.5)
    lock.release()


def test_a_killed_builds_locks_do_not_stop_the_next_build(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    build = tiny_build(tmp_path)
    build.directory.mkdir(parents=True)
    (build.directory / "lock").touch()  # torch's FileBaton, as a killed build leaves it
    (build.directory / "kvserve-build.lock").write_text(f"{dead_pid()}\n")
    with caplog.at_level(logging.INFO, LOGGER):
        assert kernel_build.load(build, timeout=120) is None
    assert f"removing {build.directory / 'lock'}, left behind by a killed build" in caplog.text
    assert "building C++ kernels (first start, ~20 s" in caplog.text
    assert build.is_built() and not (build.directory / "lock").exists()
    caplog.clear()
    with caplog.at_level(logging.INFO, LOGGER):
        assert kernel_build.load(build, timeout=0) is None  # built: no lock, no build
    assert caplog.text == ""


def test_the_name_carries_a_hash_of_sources_and_flags(tmp_path: Path) -> None:
    build = tiny_build(tmp_path)
    name = build.ext_name
    assert name.startswith("kvserve_tiny_") and len(name) == len("kvserve_tiny_") + 12
    flags = KernelBuild(build.name, build.sources, ("-O1",), (), build.root)
    assert flags.ext_name != name
    (build.sources[0].parent / "tiny.h").write_text("// a header beside the sources\n")
    assert tiny_build(tmp_path).ext_name != name  # (tiny_build rewrites the same source)


def test_waiting_on_a_live_build_times_out_then_builds_once_free(
    tmp_path: Path, holder: object, caplog: pytest.LogCaptureFixture
) -> None:
    build = tiny_build(tmp_path)
    proc = holder(build.directory / "kvserve-build.lock")  # type: ignore[operator]
    with caplog.at_level(logging.INFO, LOGGER):
        error = kernel_build.load(build, timeout=1.0)
    assert error == (f"pid {proc.pid} did not finish building them in {build.directory} "
                     "within 1 s ($KVSERVE_KERNEL_BUILD_TIMEOUT)")  # fmt: skip
    assert f"waiting for pid {proc.pid} to finish building C++ kernels" in caplog.text
    threading.Timer(1.0, proc.kill).start()  # the owner goes while we wait
    assert kernel_build.load(build, timeout=120) is None
    assert build.is_built()


def test_a_build_over_the_timeout_is_killed_compilers_included(tmp_path: Path) -> None:
    fifo = tmp_path / "never-written.h"
    os.mkfifo(fifo)  # the compiler blocks opening it: a build that never ends
    build = tiny_build(tmp_path, f'#include "{fifo}"\n')
    t0 = time.monotonic()
    error = kernel_build.load(build, timeout=8.0)
    assert error == "building them took over 8 s ($KVSERVE_KERNEL_BUILD_TIMEOUT)"
    assert time.monotonic() - t0 < 20
    assert wait_until(lambda: not processes_in(build.directory), 5), processes_in(build.directory)
    assert not build.is_built()


def test_the_compilers_die_with_the_process_that_started_them(tmp_path: Path) -> None:
    fifo = tmp_path / "never-written.h"
    os.mkfifo(fifo)
    build = tiny_build(tmp_path, f'#include "{fifo}"\n')
    code = LOAD_KERNEL_BUILD + (
        f"kb.load(kb.KernelBuild('kvserve_tiny', (Path({str(build.sources[0])!r}),), ('-O0',), (), "
        f"Path({str(build.root)!r})), 600)\n"
    )
    starter = subprocess.Popen([sys.executable, "-c", code])
    try:
        # ninja runs in the build folder once the builder has imported torch
        assert wait_until(lambda: len(processes_in(build.directory)) >= 2, 120)
        starter.kill()  # SIGKILL: no handler runs; the builder notices its parent is gone
        starter.wait()
        assert wait_until(lambda: not processes_in(build.directory), 5), processes_in(
            build.directory
        )
    finally:
        starter.kill()
        starter.wait()
    lock = BuildLock(build.directory / "kvserve-build.lock")
    assert lock.try_acquire()  # and the lock is free
    lock.release()


def test_the_timeout_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(kernel_build.BUILD_TIMEOUT_ENV, raising=False)
    assert kernel_build.build_timeout() == kernel_build.DEFAULT_BUILD_TIMEOUT_S
    monkeypatch.setenv(kernel_build.BUILD_TIMEOUT_ENV, "2.5")
    assert kernel_build.build_timeout() == 2.5
    for bad in ("-1", "soon", "nan"):
        monkeypatch.setenv(kernel_build.BUILD_TIMEOUT_ENV, bad)
        with pytest.raises(ValueError, match=r"^\$KVSERVE_KERNEL_BUILD_TIMEOUT must be"):
            kernel_build.build_timeout()


def real_build(root: Path, monkeypatch: pytest.MonkeyPatch) -> KernelBuild:
    """The kernels' own build under a fresh ``$TORCH_EXTENSIONS_DIR`` (also the servers')."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(root))
    monkeypatch.delenv("KVSERVE_DISABLE_CPU_KERNELS", raising=False)
    return cpu_kernels.kernel_build_spec()


def test_a_live_lock_on_the_kernels_falls_back_to_pytorch_with_a_warning(
    tmp_path: Path, holder: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    build = real_build(tmp_path / "ext", monkeypatch)
    proc = holder(build.directory / "kvserve-build.lock")  # type: ignore[operator]
    monkeypatch.setenv(kernel_build.BUILD_TIMEOUT_ENV, "1")
    code = "from kvserve.ops import cpu_kernels; print(cpu_kernels.available())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout == "False\n"
    assert f"waiting for pid {proc.pid} to finish building C++ kernels" in out.stderr
    warning = (
        f"{LOGGER}: CPU kernels unavailable, using the PyTorch paths: "
        f"pid {proc.pid} did not finish building them in {build.directory} within 1 s"
    )
    lines = [line for line in out.stderr.splitlines() if warning in line]
    assert len(lines) == 1 and lines[0].startswith("WARNING "), out.stderr


@pytest.mark.slow
def test_serve_starts_past_a_killed_builds_locks(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The issue's reproducer: a build killed earlier left both locks; the next start takes
    them over and builds. Its build is cut by a 5 s timeout (the real one takes 20-150 s), so
    the server starts on the PyTorch paths and says so; no compiler is left running."""
    build = real_build(tmp_path / "ext", monkeypatch)
    build.directory.mkdir(parents=True)
    (build.directory / "lock").touch()
    (build.directory / "kvserve-build.lock").write_text(f"{dead_pid()}\n")
    monkeypatch.setenv(kernel_build.BUILD_TIMEOUT_ENV, "5")
    srv = start_server([str(tiny_model_dir), "--num-kv-blocks", "64"], tmp_path / "server.log")
    try:
        out = srv.client().completions.create(model="tiny-random", prompt="Hi", max_tokens=3)
        assert out.usage is not None and out.usage.completion_tokens == 3
    finally:
        srv.stop()
    log = srv.log.read_text()
    assert f"removing {build.directory / 'lock'}, left behind by a killed build" in log
    assert "building C++ kernels (first start, ~20 s; up to 5 s" in log
    assert ("CPU kernels unavailable, using the PyTorch paths: building them took over 5 s "
            "($KVSERVE_KERNEL_BUILD_TIMEOUT)") in log  # fmt: skip
    assert not processes_in(build.directory)


@pytest.mark.slow
def test_sigterm_during_the_build_exits_cleanly_and_stops_the_compilers(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It used to abort ("terminate called without an active exception", exit code 134) and
    leave the compilers running; now the build is killed and the process exits with 0."""
    build = real_build(tmp_path / "ext", monkeypatch)
    log = tmp_path / "server.log"
    cmd = [sys.executable, "-m", "kvserve.cli", "serve", str(tiny_model_dir), "--port", "0"]
    with log.open("wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    try:
        # ninja and a compiler at work in the build folder
        assert wait_until(lambda: len(processes_in(build.directory)) >= 2, 180), log.read_text()
        proc.terminate()
        rc = proc.wait(30)
    finally:
        proc.kill()
        proc.wait()
    text = log.read_text()
    assert rc == 0, text[-3000:]
    assert "terminate called" not in text
    assert (
        "stopped while loading the models (1 C++ kernel build(s) killed); exiting with code 0"
        in text
    )
    assert wait_until(lambda: not processes_in(build.directory), 5), processes_in(build.directory)


# Run in a fresh interpreter (``available`` is cached in this one): four threads ask at once,
# the build (a stand-in that takes 0.3 s) runs once and every thread gets its answer.
ONCE = """
import threading, time
from kvserve.ops import cpu_kernels, kernel_build
calls = []
def slow(spec, timeout):
    calls.append(threading.get_ident())
    time.sleep(0.3)
    return None
kernel_build.load = slow
got = []
threads = [threading.Thread(target=lambda: got.append(cpu_kernels.available())) for _ in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(len(calls), got)
"""


def test_threads_asking_at_once_build_the_kernels_once() -> None:
    """Quantized layers are built on several threads at load, and the first may ask for the
    kernels there: ``available`` loads them once, the other threads wait for its answer."""
    env = {k: v for k, v in os.environ.items() if k != "KVSERVE_DISABLE_CPU_KERNELS"}
    out = subprocess.run([sys.executable, "-c", ONCE], env=env, capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "1 [True, True, True, True]"
