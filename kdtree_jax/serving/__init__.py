"""Serving: a changing set of requests over a fixed table of slots and a fixed set of compiled programs.

    programs.py  the device programs (prefill into a slot, k rounds for every slot, release a slot)
    slots.py     the host side: queue, slots, budget per step, token deltas and final records
    frontend.py  the async front: submit, iterate deltas, read the record
"""
from kdtree_jax.serving.frontend import AsyncServingEngine, RequestStream
from kdtree_jax.serving.slots import (
    EngineClosedError,
    PromptTooLongError,
    QueueFullError,
    RequestError,
    RequestParams,
    RequestRecord,
    ServeConfig,
    ServingEngine,
    StepReport,
    TokenDelta,
    enable_compilation_cache,
    enable_loop_graphs,
)

__all__ = [
    "AsyncServingEngine", "EngineClosedError", "PromptTooLongError", "QueueFullError", "RequestError",
    "RequestParams", "RequestRecord", "RequestStream", "ServeConfig", "ServingEngine", "StepReport", "TokenDelta",
    "enable_compilation_cache", "enable_loop_graphs",
]
