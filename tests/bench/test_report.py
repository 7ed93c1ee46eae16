"""``kvserve bench report`` opened in a real headless Chromium (Debian's ``chromium``, driven
by Playwright): the page renders with no script error and no network request, every plot's
points are the input files' numbers exactly (read back from Bokeh's data sources in the page),
the tables and machine record are there, a screenshot is written, and a real mouse click on a
legend entry hides its series.

Inputs are real results of the lab's three formats: a study ``results.json`` (experiment 4's
machine and first points), a ``bench sweep`` directory (experiment 3's server points, as the
sweep wrote them) and a ``bench serve --result-dir`` (the single runs inside those points).
Without Chromium the test fails, never skips: CI installs it (README's test command).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from PIL import Image
from playwright.sync_api import Browser, Page, sync_playwright

from kvserve.bench import report_browser
from kvserve.bench.cli import main as bench_main
from kvserve.bench.report_runs import fmt_value, load_runs

STUDY = Path(__file__).resolve().parents[2] / "docs" / "study"

# The plotted metrics of each figure and the x key of each input kind.
FIGURE_KEYS = {
    "output_throughput": ["output_throughput"],
    "request_throughput": ["request_throughput", "request_goodput"],
    "ttft": ["median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms"],
    "tpot": ["median_tpot_ms", "p90_tpot_ms", "p99_tpot_ms"],
    "e2el": ["median_e2el_ms", "p90_e2el_ms", "p99_e2el_ms"],
    "num_preemptions": ["num_preemptions"],
}

READ_POINTS = """() => {
  const out = [];
  for (const doc of Bokeh.documents) {
    for (const m of doc.all_models) {
      if (m.name !== "points") continue;
      const d = m.data_source.data;
      const col = (k) => Array.from(d instanceof Map ? d.get(k) : d[k]);
      const spread = (d instanceof Map ? d.has("lower") : "lower" in d)
        ? {lower: col("lower"), upper: col("upper")} : {};
      out.push({tags: m.tags, x: col("x"), y: col("y"), source: col("source"), key: col("key"),
                ...spread});
    }
  }
  return out;
}"""

# The first section's throughput figure: its legend's box on the page and each entry's lines.
LEGEND = """() => {
  const v = Object.values(Bokeh.index).find((v) => v.model.name === "fig:output_throughput");
  const legend = [...v.renderer_views.values()].find((r) => r.model.type === "Legend");
  const canvas = v.canvas_view.el.getBoundingClientRect();
  return {x: canvas.x + legend.bbox.x, y: canvas.y + legend.bbox.y,
          visible: legend.model.items.map((i) => i.renderers.map((r) => r.visible))};
}"""

READ_VIEWS = """() => Object.values(Bokeh.index)
  .filter((v) => v.model && typeof v.model.name === "string" && v.model.name.startsWith("fig:"))
  .map((v) => ({name: v.model.name, height: v.el.getBoundingClientRect().height,
                width: v.el.getBoundingClientRect().width}))"""


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("report-inputs")
    exp4 = json.loads((STUDY / "exp4" / "results.json").read_text())
    exp4["points"] = exp4["points"][:6]  # 20 and 40 MiB x three policies: preemptions > 0
    (root / "study").mkdir()
    (root / "study" / "results.json").write_text(json.dumps(exp4))
    exp3 = json.loads((STUDY / "exp3" / "results.json").read_text())
    served = [p for p in exp3["points"] if p["mode"] == "server" and p["engine"] == "kvserve"][:3]
    (root / "sweep").mkdir()
    (root / "serve").mkdir()
    for i, p in enumerate(served):
        p["output_throughput_std"] = 1.25 * (i + 1)  # as if repeated: drawn as whiskers
        (root / "sweep" / p["result_file"]).write_text(json.dumps(p))
        run = {**p["runs"][0], "label": "kvserve"}
        (root / "serve" / f"kvserve-{run['request_rate']}qps.json").write_text(json.dumps(run))
    return {"study": root / "study", "sweep": root / "sweep", "serve": root / "serve"}


@pytest.fixture(scope="module")
def report(inputs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("report") / "report.html"
    specs = [str(inputs["study"]), f"sweep={inputs['sweep']}", f"serve={inputs['serve']}"]
    assert bench_main(["report", *specs, "-o", str(out), "--title", "test report"]) == 0
    return out


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    chromium = report_browser.find_chromium()
    if chromium is None:  # a missing browser must fail the suite, not skip the check
        pytest.fail(report_browser.INSTALL_HINT)
    flags = [f for f in report_browser.FLAGS if f != "--headless"]
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=chromium, headless=True, args=flags)
        yield b
        b.close()


@pytest.fixture(scope="module")
def page(browser: Browser, report: Path) -> Iterator[tuple[Page, list[str], list[str]]]:
    page = browser.new_page(viewport={"width": 1280, "height": 1800})
    errors: list[str] = []
    requests: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)

    def route(r: Any) -> None:
        if not r.request.url.startswith("file:"):
            requests.append(r.request.url)
            r.abort()
        else:
            r.continue_()

    page.route("**/*", route)
    page.goto(report.as_uri())
    page.wait_for_function("() => window.Bokeh && Bokeh.documents.length > 0", timeout=60_000)
    yield page, errors, requests
    page.close()


def _expected(path: str, index: int, key: str, cache: dict[str, Any]) -> Any:
    doc = cache.setdefault(path, json.loads(Path(path).read_text()))
    return (doc["points"][index] if index >= 0 else doc).get(key)


def test_report_renders_the_runs_points_exactly(
    page: tuple[Page, list[str], list[str]], inputs: dict[str, Path], tmp_path: Path
) -> None:
    pg, errors, requests = page
    views = pg.evaluate(READ_VIEWS)
    names = [v["name"] for v in views]
    # two sections (x = kv_cache_memory, x = request_rate): 6 + 5 figures (no preemptions
    # at the served points), each drawn with a real size
    assert sorted(names) == sorted(
        [f"fig:{f}" for f in FIGURE_KEYS] + [f"fig:{f}" for f in FIGURE_KEYS if f[0] != "n"]
    )
    assert all(v["height"] > 200 and v["width"] > 600 for v in views), views

    cache: dict[str, Any] = {}
    spreads = 0
    plotted: dict[tuple[str, str], list[str]] = {}
    for r in pg.evaluate(READ_POINTS):
        fig = r["tags"][0]
        for x, y, source, key in zip(r["x"], r["y"], r["source"], r["key"], strict=True):
            path, _, index = source.rpartition("#")
            assert key in FIGURE_KEYS[fig]
            assert y == _expected(path, int(index), key, cache)  # the input's number, exactly
            x_key = "kv_cache_memory" if "study" in path else "request_rate"
            assert x == fmt_value(_expected(path, int(index), x_key, cache))
            plotted.setdefault((fig, key), []).append(source)
        if "lower" in r:  # a repeat spread around the output throughput (± std)
            std = [
                _expected(src, int(i), "output_throughput_std", cache)
                for src, _, i in (s.rpartition("#") for s in r["source"])
            ]
            assert r["lower"] == [y - d for y, d in zip(r["y"], std, strict=True)]
            assert r["upper"] == [y + d for y, d in zip(r["y"], std, strict=True)]
            spreads += 1
    assert spreads == 4  # the sweep's series and the study's 3 policies (3 repeats each)
    # every input point in every figure once: 6 study + 3 sweep + 3 serve points; the
    # preemptions figure only where some point preempted (the study's section), goodput only
    # where the run had an SLO
    runs = load_runs([str(p) for p in inputs.values()])
    sources = sorted(f"{p.source}#{p.index}" for run in runs for p in run.points)
    assert len(sources) == 12
    for fig, keys in FIGURE_KEYS.items():
        want = [s for s in sources if fig != "num_preemptions" or "study" in s]
        for key in keys:
            # goodput where the run had an SLO: the served points (experiment 3), not exp 4's
            expected = [s for s in want if key != "request_goodput" or "study" not in s]
            assert sorted(plotted[(fig, key)]) == expected, (fig, key)
    # tables: one row per point in the two percentile tables; the machine record
    assert pg.locator("table.pct tbody tr").count() == 12
    record = pg.locator("table.rec").inner_text()
    exp4 = json.loads((inputs["study"] / "results.json").read_text())
    assert exp4["machine"]["cpu"] in record and exp4["kvserve_commit"] in record
    assert errors == [] and requests == []

    shot = tmp_path / "report.png"
    pg.screenshot(path=str(shot))
    with Image.open(shot) as img:
        assert img.size == (1280, 1800)
        assert len(img.convert("RGB").getcolors(1 << 20) or []) > 50  # plots, not a blank page

    # interactive: a real click on the first legend entry hides its line and its points
    legend = pg.evaluate(LEGEND)
    assert legend["visible"] == [[True, True]] * 3  # the study's 3 policies
    pg.mouse.click(legend["x"] + 12, legend["y"] + 10)  # the entry's glyph (padding 4)
    pg.wait_for_function(f"() => !({LEGEND})().visible[0][0]", timeout=10_000)
    assert pg.evaluate(LEGEND)["visible"] == [[False, False]] + [[True, True]] * 2
    assert errors == []
