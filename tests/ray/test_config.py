"""The Serve config: examples/ray_serve.yaml against Serve's schema, the app it builds, the
flags of ``kvserve serve --ray`` and ``python -m kvserve.ray.build_config`` (no Ray started)."""

from __future__ import annotations

import io
from contextlib import redirect_stderr, redirect_stdout

import pytest
import yaml

from tests.ray.conftest import EXAMPLE

pytest.importorskip("ray.serve")

from ray.serve.schema import ServeDeploySchema

from kvserve.cli import main as kvserve_main
from kvserve.ray.app import build_openai_app
from kvserve.ray.build_config import IMPORT_PATH
from kvserve.ray.build_config import main as build_config_main


def _engine(app: object) -> object:
    """The engine deployment bound into the ingress of a built app."""
    ingress = app._bound_deployment  # type: ignore[attr-defined]
    assert ingress.name == "kvserve-ingress"
    return ingress.init_args[0][0]._bound_deployment


def test_example_config_is_a_valid_serve_config_and_builds_two_replicas() -> None:
    config = ServeDeploySchema.model_validate(yaml.safe_load(EXAMPLE.read_text()))
    app = config.applications[0]
    assert app.import_path == IMPORT_PATH and app.route_prefix == "/"
    engine = _engine(build_openai_app(app.args))
    assert engine.name == "kvserve-engine"
    assert engine.num_replicas == 2
    assert engine.max_ongoing_requests == 512
    assert engine.ray_actor_options["num_cpus"] == 1
    router = engine._deployment_config.request_router_config
    assert router.request_router_class.endswith("kvserve.ray.router.KVServeRouter")
    assert router.request_router_kwargs == {
        "routing_policy": "prefix_aware", "imbalanced_threshold": 8,
    }  # fmt: skip


def test_autoscaling_options_reach_serves_autoscaling_config() -> None:
    args = {"min_replicas": 2, "max_replicas": 5, "target_ongoing_requests": 16, "num_threads": 2}
    engine = _engine(build_openai_app(args))
    auto = engine._deployment_config.autoscaling_config
    assert (auto.min_replicas, auto.max_replicas, auto.target_ongoing_requests) == (2, 5, 16)
    assert engine.ray_actor_options["num_cpus"] == 2
    with pytest.raises(ValueError, match="did you mean 'max_replicas'"):
        build_openai_app({"max_replica": 5})


def test_build_config_writes_a_config_serve_accepts() -> None:
    out = io.StringIO()
    with redirect_stdout(out):
        code = build_config_main(
            ["--num-replicas", "3", "--max-num-seqs", "8", "--port", "9000",
             "--keep-alive-timeout", "7.5"]
        )  # fmt: skip
    assert code == 0
    config = ServeDeploySchema.model_validate(yaml.safe_load(out.getvalue()))
    assert config.http_options.port == 9000
    assert config.http_options.keep_alive_timeout_s == 8  # whole seconds, rounded up
    assert config.applications[0].args == {
        "max_num_seqs": 8, "num_replicas": 3, "keep_alive_timeout": 7.5,
    }  # fmt: skip
    err = io.StringIO()
    with redirect_stderr(err):
        assert build_config_main(["--num-replicas", "2", "--max-replicas", "4"]) == 2
    assert "not both" in err.getvalue()


def test_serve_ray_refuses_bad_flags_before_starting_ray() -> None:
    err = io.StringIO()
    with redirect_stderr(err):
        code = kvserve_main(["serve", "--ray", "--min-replicas", "3", "--max-replicas", "2"])
    assert code == 2
    assert "min-replicas <= --max-replicas" in err.getvalue()
