"""kvserve's gRPC API (``kvserve serve --grpc-port P``): ``kvserve.v1.Generation`` beside HTTP.

``kvserve.proto`` is the definition; ``kvserve_pb2*.py`` are generated from it
(``python -m kvserve.server.grpc.generate``) and checked in. ``service.py`` answers the calls,
``server.py`` runs the gRPC server on uvicorn's event loop. Nothing is imported here, so the
generator runs even while the generated modules are stale or missing.
"""
