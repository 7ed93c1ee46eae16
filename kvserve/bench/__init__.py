"""kvserve's benchmark lab: ``bench serve`` (online, any OpenAI-compatible server),
``bench throughput`` (offline engine) and ``bench sweep`` (grids of server settings).

Flags and result keys follow ``vllm bench serve`` so that people and tools that know vLLM's
benchmark can read ours. Entry points for the top-level CLI:
:func:`kvserve.bench.cli.add_bench_parser` and :func:`kvserve.bench.cli.run_bench`.
"""

# The top-level ``bench`` entry's help, here (no imports) so that ``kvserve.cli`` can name the
# command without building its parsers.
BENCH_HELP = "Benchmarks: serve, throughput, sweep, report."
