"""The runs a ``kvserve bench report`` shows: result files and directories of the bench lab,
read into series of points (one line on a plot each).

A RUN is ``[NAME=]PATH``, where PATH is one of

* a ``bench serve`` result (``--save-result``): one point;
* a ``bench sweep`` point (``point-*.json``): one point, repeat-averaged (``runs`` holds the
  repeats, ``output_throughput_std`` their spread);
* a ``bench throughput --output-json`` file: one offline point (its keys read as the serve
  names: ``output_tokens_per_second`` as ``output_throughput``...);
* a study ``results.json`` (``benchmarks/study``): ``points``, the ``machine`` and settings;
  points with a ``part`` (experiment 5's ``kv`` and ``batch``) become one run per part;
* a directory: its ``results.json``; else every ``*.json`` in it as one run (a sweep's
  ``--result-dir``, or several ``bench serve --result-dir`` results); else each subdirectory
  as its own run (``docs/study`` gives exp1 ... exp5).

Within a run, the settings that vary between points (string or integer values, e.g.
``request_rate``, ``max_num_seqs``, ``policy``, ``engine``) pick the x axis, the load
(``request_rate``, else ``max_concurrency``, else the first other varying setting, in
``X_PREFERENCE`` order), and split the rest into series.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The x axis, first varying one wins: the load, then the engine settings the study sweeps.
X_PREFERENCE = (
    "request_rate",
    "max_concurrency",
    "max_num_seqs",
    "kv_cache_memory",
    "kv_cache",
    "num_kv_blocks",
    "num_prompts",
)
# Series keys in the order their labels list them; any other varying string key is a setting
# too (new experiments' own settings: engine, transport, quantization...), listed after these.
SERIES_PREFERENCE = (
    "engine",
    "server",
    "label",
    "backend",
    "mode",
    "model",
    "model_id",
    "policy",
    "kv_policy",
    "preemption_mode",
    *X_PREFERENCE,
)
# String-valued keys that describe a result rather than set it up.
NOT_SETTINGS = frozenset(
    {
        "date",
        "result_file",
        "error",
        "server_metrics_source",
        "tokenizer_id",
        "endpoint_type",
        "part",
        "command",
        "title",
    }
)
# bench throughput's names -> bench serve's, so offline and served runs share plots.
ALIASES = {
    "output_tokens_per_second": "output_throughput",
    "requests_per_second": "request_throughput",
    "tokens_per_second": "total_token_throughput",
    "elapsed_time": "duration",
}
# Top-level keys of a result document that record where and how it ran.
RECORD_KEYS = (
    "title",
    "command",
    "kvserve_commit",
    "commit",
    "date",
    "wall_time_s",
    "machine",
    "roofline",
    "model_size",
    "builtin_model_size",
)
NO_X = "-"  # the x of a run whose points share every setting (one serve result, say)


@dataclass(frozen=True)
class Point:
    """One measured point: its values (aliases applied) and where it came from.

    ``source`` is the file and ``index`` its position in that file's ``points`` (-1: the file
    is the point), so a reader can find the exact input number behind every plotted one."""

    values: dict[str, Any]
    source: str
    index: int

    def get(self, key: str) -> Any:
        return self.values.get(key)

    def source_key(self, key: str) -> str:
        """The key ``key`` has in the input file (before ``ALIASES``)."""
        for original, alias in ALIASES.items():
            if alias == key and key not in self.values.get("_raw_keys", ()):
                return original
        return key


@dataclass(frozen=True)
class Series:
    """The points of one run that share every setting but the x axis."""

    run: str
    settings: tuple[tuple[str, Any], ...]  # the varying settings, (key, value) in label order
    points: tuple[Point, ...]

    @property
    def label(self) -> str:
        parts = [f"{k}={fmt_value(v)}" for k, v in self.settings]
        return " ".join([self.run, *parts]) if parts else self.run


@dataclass(frozen=True)
class Run:
    """A named group of points and the record of the machine and code they ran on."""

    name: str
    path: str
    points: tuple[Point, ...]
    record: dict[str, Any] = field(default_factory=dict)

    def x_key(self) -> str:
        varying = varying_settings(self.points)
        for key in X_PREFERENCE:
            if key in varying:
                return key
        for key in ("request_rate", "max_concurrency"):  # one load for every point
            if all(p.get(key) is not None for p in self.points):
                return key
        return NO_X

    def series(self) -> list[Series]:
        """The run's points split by every varying setting but the x axis (and settings
        that follow from another one already chosen, like ``kv_policy`` from ``policy``)."""
        x = self.x_key()
        keys: list[str] = []
        for key in varying_settings(self.points):
            if key != x and not _determined(self.points, [*keys, x], key):
                keys.append(key)
        groups: dict[tuple[Any, ...], list[Point]] = {}
        for p in self.points:
            groups.setdefault(tuple(_hashable(p.get(k)) for k in keys), []).append(p)
        return [
            Series(
                self.name, tuple(zip(keys, [pts[0].get(k) for k in keys], strict=True)), tuple(pts)
            )
            for pts in groups.values()
        ]


def fmt_value(value: Any) -> str:
    """A setting as the report prints it: ``2.0`` -> ``2``, ``"inf"`` stays, None -> ``-``."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (int, float)):
        return f"{value:g}"
    return str(value)


_UNITS = {
    "": 1,
    "k": 1e3,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "kb": 1e3,
    "mb": 1e6,
    "gb": 1e9,
    "blocks": 1,
}


def factor_order(factor: str) -> tuple[int, float, str]:
    """Sort key of an x value: numbers (with a size unit) by size, then ``inf``, then text."""
    m = re.fullmatch(r"\s*([-+]?[0-9.]+(?:e[-+]?[0-9]+)?)\s*([a-zA-Z]*)\s*", factor)
    if m and m.group(2).lower() in _UNITS:
        return (0, float(m.group(1)) * _UNITS[m.group(2).lower()], factor)
    if factor in ("inf", "Infinity"):
        return (1, math.inf, factor)
    return (2, 0.0, factor)


def _hashable(value: Any) -> Any:
    return json.dumps(value, sort_keys=True) if isinstance(value, (list, dict)) else value


def _is_setting(key: str, values: list[Any]) -> bool:
    if key.startswith("_") or key in NOT_SETTINGS:
        return False
    if key in SERIES_PREFERENCE:
        return True
    # Unknown keys: strings (and bools) are settings; numbers are measurements.
    return all(v is None or isinstance(v, (str, bool)) for v in values)


def varying_settings(points: tuple[Point, ...] | list[Point]) -> list[str]:
    """Settings with more than one value among ``points``, in ``SERIES_PREFERENCE`` order."""
    keys: dict[str, None] = {}
    for p in points:
        keys.update(dict.fromkeys(p.values))
    found = []
    for key in keys:
        values = [p.get(key) for p in points]
        if _is_setting(key, values) and len({_hashable(v) for v in values}) > 1:
            found.append(key)
    rank = {k: i for i, k in enumerate(SERIES_PREFERENCE)}
    return sorted(found, key=lambda k: (rank.get(k, len(rank)), k))


def _determined(points: tuple[Point, ...], keys: list[str], key: str) -> bool:
    """Whether ``key``'s value follows from the values of ``keys`` at every point."""
    seen: dict[tuple[Any, ...], Any] = {}
    for p in points:
        group = tuple(_hashable(p.get(k)) for k in keys)
        if seen.setdefault(group, _hashable(p.get(key))) != _hashable(p.get(key)):
            return False
    return True


def _point(doc: dict[str, Any], source: str, index: int) -> Point:
    values = {k: v for k, v in doc.items() if not isinstance(v, (list, dict))}
    for original, alias in ALIASES.items():
        if original in values and alias not in values:
            values[alias] = values[original]
    values["_raw_keys"] = tuple(doc)
    return Point(values, source, index)


def _record(doc: dict[str, Any]) -> dict[str, Any]:
    """Where and how a result ran: the study's ``machine`` and commit, benchmarks' roofline,
    the model size (a study's ``settings.model_size``), and for served results the model."""
    record = {k: doc[k] for k in RECORD_KEYS if doc.get(k) is not None}
    settings = doc.get("settings")
    if isinstance(settings, dict) and isinstance(settings.get("model_size"), dict):
        record["model_size"] = settings["model_size"]
    for key in ("model_id", "backend", "dataset_name", "num_prompts"):
        if doc.get(key) is not None and "points" not in doc:
            record[key] = doc[key]
    return record


def _is_result(doc: Any) -> bool:
    return isinstance(doc, dict) and (
        "output_throughput" in doc or "tokens_per_second" in doc or "points" in doc
    )


def _load_json(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable JSON result ({e}).") from e
    if not _is_result(doc):
        raise ValueError(
            f"{path}: not a bench result (no output_throughput, tokens_per_second or points)."
        )
    return doc


def _runs_of_file(name: str, path: Path) -> list[Run]:
    doc = _load_json(path)
    if "points" not in doc:
        return [Run(name, str(path), (_point(doc, str(path), -1),), _record(doc))]
    points = [_point(p, str(path), i) for i, p in enumerate(doc["points"]) if isinstance(p, dict)]
    record = _record(doc)
    parts = list(dict.fromkeys(p.get("part") for p in points))
    if parts == [None]:
        return [Run(name, str(path), tuple(points), record)]
    return [
        Run(f"{name}/{part}", str(path), tuple(p for p in points if p.get("part") == part), record)
        for part in parts
    ]


def natural_key(name: str) -> list[Any]:
    """Sort key reading digit runs as numbers: exp2 before exp10."""
    return [(0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", name)]


def _runs_of_dir(name: str, path: Path) -> list[Run]:
    if (path / "results.json").is_file():
        return _runs_of_file(name, path / "results.json")
    files = sorted(f for f in path.glob("*.json") if f.is_file())
    if files:
        docs = [(f, _load_json(f)) for f in files]
        points = [_point(doc, str(f), -1) for f, doc in docs if "points" not in doc]
        runs = [Run(name, str(path), tuple(points), _record(docs[0][1]))] if points else []
        for f, doc in docs:
            if "points" in doc:
                runs += _runs_of_file(f"{name}/{f.stem}", f)
        return runs
    runs = []
    for sub in sorted((d for d in path.iterdir() if d.is_dir()), key=lambda d: natural_key(d.name)):
        if (sub / "results.json").is_file() or any(sub.glob("*.json")):
            runs += _runs_of_dir(sub.name, sub)
    if not runs:
        raise ValueError(f"{path}: no bench results (*.json) in it or its subdirectories.")
    return runs


def load_runs(specs: list[str]) -> list[Run]:
    """Every RUN (``[NAME=]PATH``) as runs; names default to the file or directory name."""
    runs: list[Run] = []
    for spec in specs:
        name, eq, rest = spec.partition("=")
        path = Path(rest if eq and not Path(spec).exists() else spec)
        if not (eq and not Path(spec).exists()):
            name = path.stem if path.is_file() else path.name
            if path.name == "results.json":
                name = path.parent.name
        if not path.exists():
            raise ValueError(f"{path}: no such file or directory.")
        runs += _runs_of_dir(name, path) if path.is_dir() else _runs_of_file(name, path)
    if not runs:
        raise ValueError("no runs to report.")
    return runs
