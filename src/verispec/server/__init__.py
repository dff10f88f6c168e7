"""OpenAI-compatible server (``verispec serve``): app.py (HTTP), worker.py (engine thread),
schemas.py (request bodies), metrics.py (Prometheus). The batched engine is engine/batch.py."""
