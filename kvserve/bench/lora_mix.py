"""Traffic over LoRA adapters: ``bench serve --lora-modules a b c`` (vLLM's flag).

Each request names one of the given modules as its ``model`` (the adapter names a server
loaded with ``--lora-modules NAME=PATH``), so one run measures a server serving that many
distinct adapters at once. vLLM's ``bench serve`` draws each request's module at random;
here every module gets the same share of the requests (``n // k`` or one more, in a seeded
random order), so a run "with 4 adapters" always has all 4 in it and two runs with the same
seed send the same adapter with the same prompt.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence


def check_modules(names: Sequence[str]) -> list[str]:
    """The names as given; an empty or repeated name is an error (before any request)."""
    out = [n.strip() for n in names]
    if not out or any(not n for n in out) or len(set(out)) != len(out):
        raise ValueError(f"--lora-modules takes distinct non-empty names, got {list(names)}")
    return out


def assign_modules(names: Sequence[str], n: int, seed: int) -> list[str]:
    """``n`` module names, each of ``names`` ``n // k`` or ``n // k + 1`` times (the first
    ``n % k`` names get the extra one), shuffled with ``seed``."""
    labels = [names[i % len(names)] for i in range(n)]
    random.Random(f"lora-modules-{seed}").shuffle(labels)  # its own stream, not priorities'
    return labels


def module_counts(labels: Sequence[str]) -> dict[str, int]:
    """Requests per module, in the order the names first appear."""
    return dict(Counter(labels))
