"""OpenAI-compatible server (``verispec serve``): app.py (HTTP routes, errors, uvicorn), handler.py
(the request path of both endpoints; endpoints.py what differs between them), state.py (start-up),
worker.py (engine thread), schemas.py (request bodies), metrics.py (Prometheus); ray_serve.py
(Ray Serve replicas). The batched engine is engine/batch.py."""
