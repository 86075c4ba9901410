"""The OpenAI-compatible HTTP server over the serving engine (`python -m kdtree_jax.serve` runs it).

    protocol.py  request bodies (pydantic) and OpenAI's error shape
    text.py      incremental detokenization and stop strings
    metrics.py   Prometheus metrics, named as vLLM names them
    app.py       the FastAPI app: endpoints, streaming, errors, disconnects, shutdown
    constraints.py  response_format, structured_outputs and forced tool choice -> the output's constraint
"""
from kdtree_jax.server.app import OpenAIServer, ServerSettings, build_app

__all__ = ["OpenAIServer", "ServerSettings", "build_app"]
