"""`python -m kdtree_jax.serve` (or `kdtree-serve`): an OpenAI-compatible HTTP server over the serving engine.

With no arguments it serves the shipped pair in `checkpoints/kdtree-mini/` at http://127.0.0.1:8000/v1. Flags follow
vLLM / SGLang names where they have one. Startup loads the checkpoints, compiles every program the serving engine can
run (progress bars while compiling; JAX's persistent compilation cache makes a restart load them instead, see
$KDTREE_COMPILATION_CACHE) and only then opens the port, so no request waits on a compile.

By default (--engine-process) the serving engine runs in a process of its own that loads the checkpoint and steps
the engine, while this one serves HTTP, tokenizes and detokenizes (serving/engine_process.py); --no-engine-process
runs the engine in a thread of this process.

SIGTERM (or Ctrl-C): the port closes at once, running requests get --shutdown-timeout seconds to finish, what is
left is cancelled (finish_reason "abort"), the engine process stops, and the process exits 0.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import importlib.metadata
import importlib.util
import inspect
import logging
import os
import pkgutil
import signal
import time

import jax
import uvicorn

from kdtree_jax.checkpoint.io import load_tokenizer_any
from kdtree_jax.cli import (
    CACHE_HELP,
    DEFAULT_DIR,
    DEFAULT_DRAFTER,
    DEFAULT_TARGET,
    HelpFormatter,
    Parser,
    UsageError,
    add_mode_flags,
    add_model_flags,
    configure_logging,
    default_budget,
    parse_budget,
    parse_budget_table,
    parse_sizes,
    run_main,
)
from kdtree_jax.decode.engine import Engine
from kdtree_jax.parallel.sharding import parse_mesh
from kdtree_jax.server import ServerSettings, build_app
from kdtree_jax.server.serving_common import REASONING_PARSERS, TOOL_CALL_PARSERS
from kdtree_jax.serving import (
    AsyncServingEngine,
    ServeConfig,
    ServingEngine,
    enable_compilation_cache,
    enable_loop_graphs,
)
from kdtree_jax.serving.engine_process import DEFAULT_STEP_TIMEOUT_S, EngineProcessClient

log = logging.getLogger("kdtree_jax.serve")

# the serving engine's defaults, as --help states them: ServeConfig's own, which it applies to every flag left unset
SERVE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ServeConfig)}
ENGINE_PREFILL_CHUNK = inspect.signature(Engine).parameters["prefill_chunk"].default
API_KEY_ENV = "KDTREE_API_KEY"

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_SHUTDOWN_TIMEOUT_S = 10.0
SHUTDOWN_MARGIN_S = 5.0  # after the engine cancelled what was left: time for those responses to end, then uvicorn
# cancels their handlers


def _serve_budget(text: str):
    """--budget: an integer B, 'auto', or a table by active slots such as '1:64,4:32,8:ar'."""
    return parse_budget_table(text) if ":" in text else parse_budget(text)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m kdtree_jax.serve", description="Serve the OpenAI API (completions, chat) with DDTree "
                "speculative decoding over a paged latent cache.", formatter_class=HelpFormatter,
                epilog=CACHE_HELP)
    m = p.add_argument_group("model")
    m.add_argument("--served-model-name", nargs="+", default=None,
                   help="the names requests may give as 'model' (responses use the first); default: the --model "
                        "value as given, or 'kdtree-mini' for the shipped pair")
    add_model_flags(m, mesh_help="; data > 1 splits the slots and the page pool into that many groups, one per "
                                 "data shard (--max-slots, --num-pages and --step-widths must be multiples of it)")
    m.add_argument("--loop-graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="GPU: XLA captures the step's round loop in its CUDA graphs, so a step call returns before "
                        "the step ends and the host prepares the next one meanwhile (no effect when XLA_FLAGS sets "
                        "--xla_gpu_enable_command_buffer)")
    d = p.add_argument_group("decoding")
    add_mode_flags(d)
    d.add_argument("--budget", "--speculative-num-draft-tokens", dest="budget", type=_serve_budget, default=None,
                   help="DDTree node budget: B, 'auto' (per step, from the budget profile and the number of active "
                        "slots), or a table by active slots such as 1:64,4:32,8:ar; default: auto where a budget "
                        "profile measured on this device applies, else 32")
    d.add_argument("--rounds-per-step", type=int, default=None,
                   help="rounds per step: tokens reach the host (and clients) once per step; default: "
                        f"{SERVE_DEFAULTS['rounds_per_step']}")
    d.add_argument("--max-logprobs", type=int, default=None,
                   help="the most top log-probabilities a request may ask for (chat top_logprobs, completions "
                        "logprobs, echo's prompt logprobs), 0..20; every program then keeps each token's "
                        "log-probability and this many alternatives; default: none (such requests are refused)")
    s = p.add_argument_group("scheduling")
    s.add_argument("--max-slots", "--max-num-seqs", "--max-running-requests", dest="max_slots", type=int,
                   default=None,
                   help=f"requests decoded together (slots in the table); default: {SERVE_DEFAULTS['max_slots']}")
    s.add_argument("--max-context", "--max-model-len", "--context-length", dest="max_context", type=int,
                   default=None,
                   help=f"prompt + completion tokens of one request; default: {SERVE_DEFAULTS['max_context']}")
    s.add_argument("--max-queue", "--max-queued-requests", dest="max_queue", type=int, default=None,
                   help=f"waiting requests beyond this are refused with 503; default: {SERVE_DEFAULTS['max_queue']}")
    s.add_argument("--step-widths", "--cuda-graph-sizes", dest="step_widths", type=parse_sizes, default=None,
                   help="slot counts a step program is compiled for, e.g. 1,4,16 (must include --max-slots); a "
                        "step runs over the narrowest that holds the running requests; default: powers of two")
    s.add_argument("--prefill-batch", type=int, default=None,
                   help="requests of one prompt bucket that join together prefill in one program of this many rows; "
                        f"default: {SERVE_DEFAULTS['prefill_batch']}")
    s.add_argument("--min-prompt-bucket", type=int, default=None,
                   help="shortest padded prefill chunk: one prefill program per power of two from here up to "
                        f"--max-num-batched-tokens; default: {SERVE_DEFAULTS['min_prompt_bucket']}")
    s.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="prompt tokens prefilled per step: a longer prompt joins in chunks of this many, between "
                        f"decode steps; default: the engine's prefill chunk ({ENGINE_PREFILL_CHUNK})")
    c = p.add_argument_group("cache")
    c.add_argument("--page-size", "--block-size", dest="page_size", type=int, choices=(16, 32, 64, 128),
                   default=None, help=f"tokens per page of the latent cache; default: {SERVE_DEFAULTS['page_size']}")
    c.add_argument("--num-pages", "--num-gpu-blocks-override", dest="num_pages", type=int, default=None,
                   help="pages in the pool; default: what --gpu-memory-utilization of the device leaves after the "
                        "weights, or on a CPU --max-slots requests of --max-context")
    c.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="share of device memory weights, activations and pages may use; default: "
                        f"{SERVE_DEFAULTS['gpu_memory_utilization']}")
    c.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="share the full pages of a prompt (and of the replies) with later requests that start with "
                        "the same tokens, so they skip prefilling them (--no-enable-prefix-caching: every request "
                        "computes its whole prompt)")
    h = p.add_argument_group("server")
    h.add_argument("--host", default=DEFAULT_HOST, help="address to listen on")
    h.add_argument("--port", type=int, default=DEFAULT_PORT, help="port to listen on")
    h.add_argument("--api-key", default=None,
                   help="every /v1/* request must carry 'Authorization: Bearer <key>' (401 otherwise; /health and "
                        f"/metrics stay open); default: ${API_KEY_ENV}, else none required")
    h.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the serving engine (scheduler, device loop, checkpoint) in a process of its own, apart "
                        "from HTTP and (de)tokenizing; --no-engine-process: in a thread of the server's process")
    h.add_argument("--engine-step-timeout", type=float, default=DEFAULT_STEP_TIMEOUT_S, metavar="SECONDS",
                   help="with --engine-process: an engine process that sends nothing for this long while requests "
                        "are open is hung; the server kills it and answers 503 (0: never; default %(default)g)")
    t = p.add_argument_group("agent API")
    t.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="allow tool_choice 'auto' (the default when a request declares tools): the model decides "
                        "whether to call them; needs --tool-call-parser")
    t.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                   help="parse the model's tool-call sections into OpenAI tool_calls (finish_reason 'tool_calls')")
    t.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                   help="move the model's <think> text into reasoning_content (and its own stream deltas)")
    t.add_argument("--constraint-states", type=int, default=None,
                   help="budget of the device's constraint tables in automaton states (V / 8 bytes each), shared by "
                        "the structured-output requests running at once: a schema past it is a 400; default: "
                        f"{SERVE_DEFAULTS['constraint_states']}")
    t.add_argument("--constraint-exceptions", type=int, default=None,
                   help="budget of the constraint tables in transition exceptions (8 bytes each); default: "
                        f"{SERVE_DEFAULTS['constraint_exceptions']}")
    h.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT_S,
                   help="seconds running requests get to finish after SIGTERM before they are cancelled")
    h.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info", help="log level")
    return p


def jax_plugin_names() -> set[str]:
    """The PJRT plugins installed, found where JAX looks for them when it starts its backends (modules of the
    `jax_plugins` namespace package, entry points of that group), without starting any."""
    names = {entry.value for entry in importlib.metadata.entry_points(group="jax_plugins")}
    spec = importlib.util.find_spec("jax_plugins")
    if spec is None or spec.submodule_search_locations is None:  # no plugin installed as a module of the namespace
        return names
    return names | {module.name for module in pkgutil.iter_modules(spec.submodule_search_locations)}


def gpu_plugin_installed() -> bool:
    """Whether JAX can start a GPU backend, known without starting a backend: a CUDA or ROCm plugin is installed and
    $JAX_PLATFORMS, where set, names a GPU platform."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms and not any(name in platforms for name in ("cuda", "gpu", "rocm")):
        return False
    return any("cuda" in name or "rocm" in name for name in jax_plugin_names())


def loop_graphs(wanted: bool) -> bool:
    """--loop-graphs: XLA's flag that keeps a step's round loop inside its CUDA graphs, set only where a GPU backend
    can start. It is a GPU-only flag, so on a CPU it would only show up in the XLA_FLAGS logged. Call before JAX
    starts a backend (the flag is read then). Returns whether it was set."""
    return wanted and gpu_plugin_installed() and enable_loop_graphs()


def _check_args(args) -> None:
    for name in ("rounds_per_step", "max_slots", "max_context", "max_num_batched_tokens", "num_pages"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.max_queue is not None and args.max_queue < 0:
        raise UsageError(f"--max-queue must be >= 0, got {args.max_queue}")
    if args.gpu_memory_utilization is not None and not 0 < args.gpu_memory_utilization <= 1:
        raise UsageError(f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}")
    if args.engine_step_timeout < 0:
        raise UsageError(f"--engine-step-timeout must be >= 0, got {args.engine_step_timeout}")
    if args.shutdown_timeout < 0:
        raise UsageError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    if not 0 <= args.port < 1 << 16:
        raise UsageError(f"--port must be in [0, 65535], got {args.port}")
    if not os.path.exists(args.checkpoint):
        raise UsageError(f"--checkpoint {args.checkpoint}: no such directory")
    shipped = os.path.abspath(args.checkpoint) == DEFAULT_TARGET
    if args.drafter is None and args.mode != "ar" and shipped:
        args.drafter = DEFAULT_DRAFTER
    if args.mode != "ar":
        if args.drafter is None:
            raise UsageError(f"--mode {args.mode} needs --drafter (or use --mode ar)")
        if not os.path.exists(args.drafter):
            raise UsageError(f"--drafter {args.drafter}: no such directory")
    if args.served_model_name is None:
        args.served_model_name = [os.path.basename(DEFAULT_DIR) if shipped else args.checkpoint]
    if args.api_key is None:
        args.api_key = os.environ.get(API_KEY_ENV) or None
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise UsageError("--enable-auto-tool-choice needs --tool-call-parser (kimi_k2)")


def load(args):
    """Start the serving engine (in its own process with --engine-process) and wait until every program is compiled;
    returns (front, tokenizer, settings)."""
    if args.engine_process:
        tokenizer = load_tokenizer_any(args.checkpoint)
        if tokenizer is None:
            raise UsageError(f"--checkpoint {args.checkpoint} has no tokenizer files; the OpenAI server needs them")
        front = EngineProcessClient(functools.partial(engine_process_core, args),
                                    step_timeout_s=args.engine_step_timeout or None)
        front.launch()
    else:
        core = load_core(args)
        front, tokenizer = AsyncServingEngine(core), core.engine.tokenizer
    settings = ServerSettings(model_names=tuple(args.served_model_name), shutdown_timeout=args.shutdown_timeout,
                              root=os.path.abspath(args.checkpoint), api_key=args.api_key,
                              enable_auto_tool_choice=args.enable_auto_tool_choice,
                              tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser)
    return front, tokenizer, settings


def engine_process_core(args) -> ServingEngine:
    """What the engine process runs first: the server's log format, then `load_core`."""
    configure_logging(args.log_level, server=True)
    return load_core(args)


def load_core(args) -> ServingEngine:
    """Load the engine and compile every program of the serving engine."""
    t0 = time.perf_counter()
    drafter = args.drafter if args.mode != "ar" else None
    log.info("loading target %s%s (%s) on %s", args.checkpoint, f" and drafter {drafter}" if drafter else "",
             args.dtype, jax.devices()[0].device_kind)
    engine = Engine.load(args.checkpoint, drafter, mesh=parse_mesh(args.mesh) if args.mesh else None,
                         dtype=args.dtype, progress=True, budget_profile=args.budget_profile,
                         attn_backend=None if args.attention_backend == "auto" else args.attention_backend)
    if engine.tokenizer is None:
        raise UsageError(f"--checkpoint {args.checkpoint} has no tokenizer files; the OpenAI server needs them")
    n_params = sum(x.size for x in jax.tree.leaves(engine.weights))
    log.info("loaded %.1fM parameters in %.1f s", n_params / 1e6, time.perf_counter() - t0)
    given = {k: getattr(args, k) for k in ("max_slots", "max_context", "rounds_per_step", "max_queue", "step_widths",
                                           "min_prompt_bucket", "prefill_batch", "page_size", "num_pages",
                                           "gpu_memory_utilization", "max_num_batched_tokens", "constraint_states",
                                           "constraint_exceptions", "max_logprobs")
             if getattr(args, k) is not None}
    budget = args.budget if args.budget is not None else default_budget(engine, args.mode)
    try:
        core = ServingEngine(engine, ServeConfig(mode=args.mode, budget=budget,
                                                 enable_prefix_caching=args.enable_prefix_caching, **given))
    except ValueError as e:
        raise UsageError(str(e)) from None
    cfg = core.config
    log.info("page pool: %s", core.capacity_summary())
    log.info("%d slots, max context %d tokens, %d prompt tokens prefilled per step, %d rounds per step; step per "
             "active slots: %s", cfg.max_slots, cfg.max_context, core.chunk_tokens, cfg.rounds_per_step,
             ", ".join(f"{a}: {k.name}" for a, k in sorted(core.scheduler.kinds.items())))
    log.info("compiling %d prefill programs (chunk buckets %s, %s requests at once) and %d step programs "
             "(widths %s)", len(core.prefill_specs), core.buckets, core.prefill_sizes, len(core.step_keys), core.widths)
    t0 = time.perf_counter()
    seconds = core.warm_up()
    log.info("compiled in %.1f s: %s", time.perf_counter() - t0, ", ".join(f"{k} {v:.1f}s" for k, v in
                                                                         seconds.items()))
    log.info("%s", core.memory_summary())
    return core


class GracefulServer(uvicorn.Server):
    """uvicorn's shutdown (close the port, wait for the connections), with the engine drained alongside: running
    requests get the shutdown timeout, then are cancelled, so their responses end well-formed ("abort") and the
    connections close."""

    def __init__(self, config: uvicorn.Config, drain):
        super().__init__(config)
        self._drain = drain

    async def shutdown(self, sockets=None):
        drain = asyncio.ensure_future(self._drain())
        await super().shutdown(sockets)
        await drain


def make_server(app, *, host: str, port: int, shutdown_timeout: float, log_level: str = "info") -> GracefulServer:
    """A uvicorn server for `build_app`'s app."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                            timeout_graceful_shutdown=shutdown_timeout + SHUTDOWN_MARGIN_S)
    return GracefulServer(config, app.state.openai.drain)


def run(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _check_args(args)
    configure_logging(args.log_level, server=True)
    cache = enable_compilation_cache()
    log.info("compilation cache: %s", cache or "off")
    loop_graphs(args.loop_graphs)
    log.info("XLA_FLAGS: %s", os.environ.get("XLA_FLAGS", "") or "(none)")
    front, tokenizer, settings = load(args)
    try:
        app = build_app(front, tokenizer, settings)
        server = make_server(app, host=args.host, port=args.port, shutdown_timeout=args.shutdown_timeout,
                             log_level=args.log_level)
        log.info("serving %s at http://%s:%d/v1%s", " / ".join(settings.model_names), args.host, args.port,
                 " (API key required)" if settings.api_key else "")
        # uvicorn handles SIGTERM / SIGINT while it runs, then re-raises the signal once it has shut down; ignoring
        # them from here on lets that graceful shutdown end the process with exit code 0 instead of the signal's
        # default
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        server.run()
    finally:
        if isinstance(front, EngineProcessClient):
            front.close()  # stopped already where the app drained it; here where it never started or failed to
    return 0 if server.started else 1


def main(argv: list[str] | None = None) -> None:
    run_main(run, argv)


if __name__ == "__main__":
    main()
