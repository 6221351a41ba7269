"""OpenAI-compatible HTTP API over AsyncLLM (FastAPI + uvicorn), with Prometheus metrics.

Nothing is imported here, so `tandem.server.bench` loads without FastAPI and uvicorn installed.
"""
