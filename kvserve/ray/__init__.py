"""kvserve on Ray Serve: engine replicas behind one OpenAI endpoint (docs/scaling.md).

* ``options.py`` — the Ray flags of ``kvserve serve`` and ``RayServeOptions`` (no Ray import:
  the CLI parses and validates them on machines without Ray).
* ``routing.py`` — the routing policy as pure functions (prefix owner, replica ranking) and
  the prefix key of an OpenAI request body.
* ``router.py`` — ``KVServeRouter``, the Serve request router that applies the policy.
* ``replica.py`` — ``KVServeReplica``: one engine and the unchanged kvserve FastAPI app,
  driven by ASGI messages that travel through a Serve handle.
* ``ingress.py`` — ``OpenAIIngress``: the HTTP entry point; it picks the model's deployment,
  forwards each request and replays the replica's ASGI messages (status, headers, SSE).
* ``app.py`` — ``build_openai_app(args)``: the Serve application (the ``import_path`` of a
  ``serve run`` config) and ``run_ray_serve`` for ``kvserve serve --ray``.
* ``build_config.py`` — ``python -m kvserve.ray.build_config [serve flags]``: a Serve config.

Ray is an optional dependency (``pip install -e ".[ray]"``); only ``options`` and ``routing``
import without it.
"""
