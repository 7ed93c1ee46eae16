"""kvserve's reproduction of the serving-throughput study (see ``docs/study.md``).

``python benchmarks/study/run.py expN [--quick]`` runs one experiment and writes its JSON, CSV,
PNG and markdown table under ``docs/study/expN/``.
"""
