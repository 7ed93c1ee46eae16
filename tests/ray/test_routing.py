"""The routing policy, the Ray options and the metrics merge: pure functions, no Ray."""

from __future__ import annotations

import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvserve.ray.metrics_merge import merge_scrapes
from kvserve.ray.options import RayServeOptions, serve_namespace
from kvserve.ray.routing import (
    RoutingPolicy,
    pinned,
    prefix_owner,
    rank_replicas,
    request_model_and_prompt,
    routing_key,
)

IDS = ["a", "b", "c"]


def test_least_loaded_and_keyless_requests_rank_every_replica_together() -> None:
    loads = {"a": 5, "b": 0, "c": 2}
    assert rank_replicas(IDS, loads, "k", RoutingPolicy.LEAST_LOADED, 8) == [IDS]
    assert rank_replicas(IDS, loads, None, RoutingPolicy.PREFIX_AWARE, 8) == [IDS]
    assert rank_replicas(["a"], loads, "k", RoutingPolicy.PREFIX_AWARE, 8) == [["a"]]
    assert rank_replicas([], loads, "k", RoutingPolicy.PREFIX_AWARE, 8) == []


def test_prefix_owner_first_unless_it_is_overloaded() -> None:
    owner = prefix_owner("k", IDS)
    rest = [r for r in IDS if r != owner]
    balanced = {r: 3 for r in IDS}
    assert rank_replicas(IDS, balanced, "k", RoutingPolicy.PREFIX_AWARE, 8) == [[owner], rest]
    at_threshold = {**balanced, owner: 3 + 8}  # 8 more than the least loaded: still the owner
    assert rank_replicas(IDS, at_threshold, "k", RoutingPolicy.PREFIX_AWARE, 8)[0] == [owner]
    over = {**balanced, owner: 3 + 9}
    assert rank_replicas(IDS, over, "k", RoutingPolicy.PREFIX_AWARE, 8) == [IDS]
    unknown = {owner: None}  # never probed: counts as idle
    assert rank_replicas(IDS, unknown, "k", RoutingPolicy.PREFIX_AWARE, 0)[0] == [owner]


def test_rendezvous_hashing_moves_only_the_leavers_prefixes() -> None:
    keys = [f"prompt {i}" for i in range(300)]
    before = {k: prefix_owner(k, IDS) for k in keys}
    after = {k: prefix_owner(k, ["a", "b"]) for k in keys}
    moved = {k for k in keys if before[k] != after[k]}
    assert moved == {k for k in keys if before[k] == "c"}
    counts = [list(before.values()).count(r) for r in IDS]
    assert all(60 < c < 140 for c in counts), counts  # spread, not all on one
    with pytest.raises(ValueError, match="at least one replica"):
        prefix_owner("k", [])


def test_pinned_requests_go_to_their_replica_or_are_routed_normally() -> None:
    assert pinned(IDS, "b") == [["b"]]
    assert pinned(IDS, "gone") is None
    assert pinned(IDS, None) is None


def test_prompt_text_of_each_route() -> None:
    parts = [{"type": "text", "text": "hi"}]
    chat = {"model": "m", "messages": [{"role": "system", "content": "S"},
                                       {"role": "user", "content": parts}]}  # fmt: skip
    assert request_model_and_prompt("/v1/chat/completions", json.dumps(chat).encode()) == (
        "m",
        "system:S\nuser:hi",
    )
    anthropic = {**chat, "messages": chat["messages"][1:]}  # Anthropic's text blocks
    assert request_model_and_prompt("/v1/messages", json.dumps(anthropic).encode()) == (
        "m",
        "user:hi",
    )
    body = json.dumps({"model": "m", "prompt": ["first", "second"]}).encode()
    assert request_model_and_prompt("/v1/completions", body) == ("m", "first")
    body = json.dumps({"prompt": [1, 2, 3]}).encode()
    assert request_model_and_prompt("/v1/completions", body) == (None, "1,2,3")
    assert request_model_and_prompt("/v1/completions", b"{not json") == (None, None)
    assert request_model_and_prompt("/v1/completions", b"[1]") == (None, None)
    assert request_model_and_prompt("/v1/models", b"") == (None, None)
    assert routing_key("m", "abcdef", 3) == "m\x00abc"
    assert routing_key("m", None, 3) is None


def test_ray_options_validation_and_serve_options() -> None:
    with pytest.raises(ValueError, match="not both"):
        RayServeOptions(num_replicas=2, max_replicas=3)
    with pytest.raises(ValueError, match="needs --max-replicas"):
        RayServeOptions(min_replicas=2)
    with pytest.raises(ValueError, match="min-replicas <= --max-replicas"):
        RayServeOptions(min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError, match="target-ongoing-requests must be > 0"):
        RayServeOptions(max_replicas=2, target_ongoing_requests=0)
    with pytest.raises(ValueError, match="num-replicas must be >= 1"):
        RayServeOptions(num_replicas=0)
    fixed = RayServeOptions(num_replicas=3).engine_deployment_options(num_threads=2)
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed
    assert fixed["ray_actor_options"]["num_cpus"] == 2
    assert fixed["ray_actor_options"]["runtime_env"]["env_vars"]["OMP_NUM_THREADS"] == "2"
    assert "num_gpus" not in fixed["ray_actor_options"]  # a CPU replica asks for no GPU
    on_gpu = RayServeOptions().engine_deployment_options(1, tensor_parallel_size=2, device="cuda:0")
    assert (on_gpu["ray_actor_options"]["num_cpus"], on_gpu["ray_actor_options"]["num_gpus"]) == (
        2,
        2,
    )
    auto = RayServeOptions(max_replicas=4, target_ongoing_requests=16)
    assert auto.engine_deployment_options(1)["autoscaling_config"] == {
        "min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 16,
    }  # fmt: skip
    assert RayServeOptions().engine_deployment_options(1)["num_replicas"] == 1


def test_config_args_are_serve_options_by_name() -> None:
    args = serve_namespace(
        {"max_request_body_bytes": "2MiB", "models": "/m", "routing_policy": "least_loaded"}
    )
    assert args.max_request_body_bytes == 2 * 2**20
    assert args.models == ["/m"]
    assert RayServeOptions.from_args(args).routing_policy is RoutingPolicy.LEAST_LOADED
    with pytest.raises(ValueError, match="did you mean 'max_num_seqs'"):
        serve_namespace({"max_num_seq": 4})
    with pytest.raises(ValueError, match="routing_policy must be one of"):
        serve_namespace({"routing_policy": "random"})


def test_merged_scrapes_keep_one_family_with_a_replica_label_per_sample() -> None:
    one = '# HELP x_total X.\n# TYPE x_total counter\nx_total{model_name="m"} 3.0\n'
    two = '# HELP x_total X.\n# TYPE x_total counter\nx_total{model_name="m"} 5.0\n'
    text = merge_scrapes({"r1": one, "r2": two})
    families = list(text_string_to_metric_families(text))
    assert [f.name for f in families] == ["x"]
    values = {s.labels["replica"]: s.value for s in families[0].samples}
    assert values == {"r1": 3.0, "r2": 5.0}
    assert merge_scrapes({}) == ""
