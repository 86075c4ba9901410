"""Serving: a changing set of requests over a paged latent cache and a fixed set of compiled programs.

    config.py         what the engine is compiled for (ServeConfig)
    plan.py           a request's host state, a step's plan and its output (what the three roles below exchange)
    scheduler.py      host: the queue, chunked prefill, slots, preemption: schedule() a step, update() from it
    cache_manager.py  host: the page pool and each request's pages
    runner.py         device: the table and its compiled programs (programs.py: what they compute)
    automata.py       constrained requests: their automata compiled, then placed in the device's tables
    memory_plan.py    the pool's size from what the device leaves after the weights and the programs
    request.py        what a request is: its parameters, its check, its deltas and record
    core.py           the serving engine that joins them: schedule -> run -> update, requests in, deltas out
    engine_loop.py    the loop that owns an engine: messages in, steps, what each pass did out (both fronts run it)
    frontend.py       the async front: submit, iterate deltas, read the record
    engine_process.py the same front over the engine in its own process (the server's default)
"""
from kdtree_jax.serving.config import ServeConfig
from kdtree_jax.serving.core import ServingEngine, StepReport
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
