"""The OpenAI-compatible HTTP server over the serving engine (`python -m kdtree_jax.serve` runs it).

    protocol.py  request bodies (pydantic) and OpenAI's error shape
    text.py      incremental detokenization and stop strings
    metrics.py   Prometheus metrics, named as vLLM names them
    app.py       the FastAPI app: routes, API key, errors, SSE responses, shutdown
    serving_common.py      what both endpoints share: settings, tokenization, submission, the request in flight
    serving_completion.py  /v1/completions
    serving_chat.py        /v1/chat/completions: chat template, tool choice, tool calls and reasoning
    serving_responses.py   /v1/responses: the Responses API read into a chat request, its output items and events
    constraints.py  response_format, structured_outputs and forced tool choice -> the output's constraint
"""
from kdtree_jax.server.app import build_app
from kdtree_jax.server.serving_common import OpenAIServer, ServerSettings

__all__ = ["OpenAIServer", "ServerSettings", "build_app"]
