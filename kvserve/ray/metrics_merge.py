"""Several replicas' Prometheus scrapes as one exposition, each sample labelled ``replica``.

Every replica runs kvserve's own metrics (``kvserve/server/metrics.py``, vLLM's names), so
their scrapes hold the same families; a family must appear once in an exposition, with the
samples of every replica under it, told apart by the added ``replica`` label.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry
from prometheus_client import generate_latest as _generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

REPLICA_LABEL = "replica"


class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        yield from self.families


def merge_scrapes(scrapes: Mapping[str, str]) -> str:
    """``scrapes`` (replica id -> exposition text) as one exposition text."""
    merged: dict[str, Metric] = {}
    for replica, text in sorted(scrapes.items()):
        for family in text_string_to_metric_families(text):
            into = merged.get(family.name)
            if into is None:
                into = merged[family.name] = Metric(family.name, family.documentation, family.type)
            into.samples.extend(
                Sample(s.name, {**s.labels, REPLICA_LABEL: replica}, s.value, s.timestamp,
                       s.exemplar)
                for s in family.samples
            )  # fmt: skip
    if not merged:
        return ""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(merged.values())))
    return _generate_latest(registry).decode()
