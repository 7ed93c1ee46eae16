"""A real Ray Serve kvserve app on this machine: 2 replicas of the built-in model.

Ray starts locally (``address="local"``, loopback, no dashboard) once per module and is shut
down after it. The app is the one ``examples/ray_serve.yaml`` describes, with a small KV
cache and a small queue per replica (2 running + 2 queued), so a burst gets 429.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

import kvserve

REPO = Path(kvserve.__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "ray_serve.yaml"
APP = "kvserve"
# Overrides of the example's args for this 2-core machine
TEST_ARGS = {"num_kv_blocks": 200, "max_num_seqs": 2, "max_queued_requests": 2}
STARTUP_TIMEOUT_S = 300.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RayApp:
    url: str

    def client(self, **kw: object) -> openai.OpenAI:
        """No retries unless asked (a 429 must reach the test); every call times out."""
        options = {"max_retries": 0, "timeout": 120, **kw}
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", **options)  # type: ignore[arg-type]

    def async_client(self, **kw: object) -> openai.AsyncOpenAI:
        options = {"max_retries": 0, "timeout": 120, **kw}
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="none", **options)  # type: ignore[arg-type]

    def replica_samples(self, name: str, **labels: str) -> dict[str, float]:
        """replica -> value of the sample ``name`` with ``labels`` (summed over the other
        labels) in the ingress's /metrics."""
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                matches = all(s.labels.get(k) == v for k, v in labels.items())
                if s.name == name and "replica" in s.labels and matches:
                    out[s.labels["replica"]] = out.get(s.labels["replica"], 0.0) + s.value
        return out


def example_args() -> dict:
    config = yaml.safe_load(EXAMPLE.read_text())
    return dict(config["applications"][0]["args"])


@pytest.fixture(scope="module")
def ray_app(builtin_model_dir: Path) -> Iterator[RayApp]:
    ray = pytest.importorskip("ray")
    serve = pytest.importorskip("ray.serve")
    from kvserve.ray.app import build_openai_app

    # Replicas import kvserve from this checkout (the local raylet inherits the variable).
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), saved) if p)
    ray.init(num_cpus=4, include_dashboard=False, address="local", log_to_driver=False)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        start = time.monotonic()
        serve.run(build_openai_app({**example_args(), **TEST_ARGS}), name=APP, route_prefix="/")
        assert time.monotonic() - start < STARTUP_TIMEOUT_S
        yield RayApp(f"http://127.0.0.1:{port}")
    finally:
        serve.shutdown()
        ray.shutdown()
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved
