"""Serving: a changing set of requests over a paged latent cache and a fixed set of compiled programs.

    scheduler.py      host: the queue, chunked prefill, slots, preemption (what runs in each step)
    cache_manager.py  host: the page pool and each request's pages
    runner.py         device: the table and its compiled programs (programs.py: what they compute)
    request.py        what a request is: its parameters, its check, its deltas and record
    core.py           the serving engine that joins them: requests in, token deltas and final records out
    frontend.py       the async front: submit, iterate deltas, read the record
    engine_process.py the same front over the engine in its own process (the server's default)
"""
from kdtree_jax.serving.core import ServeConfig, ServingEngine, StepReport
from kdtree_jax.serving.frontend import AsyncServingEngine, RequestStream
from kdtree_jax.serving.request import (
    EngineClosedError,
    PromptTooLongError,
    QueueFullError,
    RequestError,
    RequestParams,
    RequestRecord,
    TokenDelta,
)
from kdtree_jax.serving.xla_options import enable_compilation_cache, enable_loop_graphs

__all__ = [
    "AsyncServingEngine", "EngineClosedError", "PromptTooLongError", "QueueFullError", "RequestError",
    "RequestParams", "RequestRecord", "RequestStream", "ServeConfig", "ServingEngine", "StepReport", "TokenDelta",
    "enable_compilation_cache", "enable_loop_graphs",
]
