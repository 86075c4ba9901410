"""The public `Engine` API: load a target (+ drafter), compile, and generate for a batch of prompts.

A whole generation is one compiled computation (`programs`: chunked prefill, then `lax.while_loop` over speculative
rounds until every request has hit a stop token or `max_new_tokens`). The streaming variant runs the same loop body
`stream_every` rounds per call and hands the new tokens back in between.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from kdtree_jax.checkpoint.io import load_drafter_any, load_target_any, load_tokenizer_any
from kdtree_jax.constrain import device as cd
from kdtree_jax.constrain.automaton import ConstraintCompiler, ConstraintSpec, ConstraintVocabulary, TokenAutomaton
from kdtree_jax.decode import budget as budget_mod
from kdtree_jax.decode import logprobs as lp_mod
from kdtree_jax.decode import sampling
from kdtree_jax.decode.memory_fit import check_fits
from kdtree_jax.decode.params import RequestParams
from kdtree_jax.decode.programs import decode_loop, generate_device, prefill
from kdtree_jax.decode.speculative import CACHE_ROW_ALIGN, FINISH_REASONS, DecodeSpec, DecodeState, RequestRows
from pallas_kernels import verify_attn_mgpu
from pallas_kernels.verify_attn import BACKENDS as ATTN_BACKENDS


@dataclasses.dataclass
class GenerationStats:
    rounds: int  # rounds run (max over the batch)
    mean_acceptance_length: float  # tokens committed per target forward, over all requests' rounds
    generated_tokens: int
    tokens_per_s: float  # decode throughput (compile excluded)
    wall_s: float  # prefill + decode, compile excluded
    compile_s: float
    budget: int | None = None  # the DDTree budget B this generation ran with (None: ar / chain)
    budget_source: str | None = None  # "fixed" (given), "auto" (from the budget profile), "auto-default" (no profile),
    # "auto-ar" (the profile measured AR faster than any budget: ran as ar)
    mode: str | None = None  # the mode that ran (ddtree asked with budget "auto" may run as ar)


@dataclasses.dataclass
class RequestOutput:
    token_ids: list[int]
    text: str | None
    finish_reason: str | None
    rounds: int
    mean_acceptance_length: float
    accept_lengths: list[int]
    # with `logprobs=k`: each token's raw log-probability and the top k at its position (`decode/logprobs.py`)
    logprobs: list[lp_mod.TokenLogprob] | None = None


@dataclasses.dataclass
class GenerationResult:
    outputs: list[RequestOutput]
    stats: GenerationStats

    @property
    def token_ids(self) -> list[list[int]]:
        return [o.token_ids for o in self.outputs]

    @property
    def texts(self) -> list[str | None]:
        return [o.text for o in self.outputs]


@dataclasses.dataclass(frozen=True)
class DecodeOptions:
    """How to decode a batch, from the keyword arguments `Engine.generate` and `Engine.generate_stream` share (`of`).

    `request` gives every prompt its token limit and sampling rule. Seeds and constraints are the batch's own (one
    for all prompts or one per prompt), so `request.seed` and `request.constraint` are unused."""

    request: RequestParams = dataclasses.field(default_factory=RequestParams)
    mode: str = "ddtree"
    budget: int | str = budget_mod.DEFAULT_BUDGET  # DDTree node budget B, or "auto"
    seed: int | Sequence[int] = 0  # one seed (request i draws from fold_in(seed, i)) or one per request
    chat: bool = False  # wrap each text prompt in the chat template as a user turn
    # structured output: a ConstraintSpec or TokenAutomaton for every prompt, or a list of them (None: that prompt
    # is free); the tables are data of the run (`constrain_device`), so no schema compiles a program
    constraint: Any = None

    @classmethod
    def of(cls, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
           logprobs: int | None = None, **batch) -> DecodeOptions:
        """From the keyword arguments of `Engine.generate`; `batch` holds the fields other than `request`."""
        return cls(RequestParams(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                 logprobs=logprobs), **batch)


@dataclasses.dataclass(frozen=True)
class _PreparedRun:
    spec: DecodeSpec
    inputs: tuple  # (prompts, prompt_len, keys, RequestRows[, AutomatonTables, start states]) on the device
    budget_source: str


class GenerationStream:
    """Each request's newly committed token ids, one list per request per step; `result` once exhausted."""

    def __init__(self):
        self.result: GenerationResult | None = None
        self._chunks: Iterator[list[list[int]]] = iter(())

    def __iter__(self) -> "GenerationStream":
        return self

    def __next__(self) -> list[list[int]]:
        return next(self._chunks)


class ContextTooLongError(ValueError):
    """A prompt plus max_new_tokens does not fit the model's context."""



class Engine:
    """Target (+ optional drafter) with jit-compiled generation in three modes: ar, chain, ddtree."""

    def __init__(self, target, drafter=None, tokenizer=None, *, mesh=None, use_pallas: bool | None = None,
                 prefill_chunk: int = 256, matmul_precision: str = "highest", memory_limit_bytes: int | None = None,
                 progress: bool = False, budget_profile=None, attn_backend: str | None = None):
        self.target = target
        self.drafter = drafter
        self.tokenizer = tokenizer
        self.mesh = mesh
        self.use_pallas = True if use_pallas is None else use_pallas
        if attn_backend not in (None, *ATTN_BACKENDS):
            raise ValueError(f"attn_backend={attn_backend!r} must be one of {ATTN_BACKENDS} or None (auto)")
        self.attn_backend = attn_backend  # verify_attn's backend; None: chosen per call by device and shape
        tcfg = target.cfg
        if attn_backend == "mosaic" and not verify_attn_mgpu.supports(target.cache_dtype, tcfg.kv_lora_rank,
                                                                      tcfg.qk_rope_head_dim, CACHE_ROW_ALIGN):
            raise ValueError(f"attn_backend='mosaic' needs a bf16/fp16 latent cache, kv_lora_rank % 128 == 0 and "
                             f"qk_rope_head_dim % 64 == 0; this target has a {jnp.dtype(target.cache_dtype).name} "
                             f"cache, kv_lora_rank={tcfg.kv_lora_rank}, qk_rope_head_dim={tcfg.qk_rope_head_dim}")
        self.prefill_chunk = prefill_chunk
        # fp32 weights must give fp32 results: TF32 matmuls on GPU make the tree-masked verify and the AR step
        # round differently and flip near-tied argmaxes, breaking token identity with autoregressive decoding
        self.matmul_precision = matmul_precision
        self.memory_limit_bytes = memory_limit_bytes  # None: the device's free memory at generate time
        self.progress = progress  # progress bars while compiling (the CLI turns them on)
        # budget="auto": a profile path or BudgetProfile (kdtree_jax/decode/budget.py); read on first use, then kept
        self.budget_profile = budget_profile
        self.checkpoint_names: tuple[str | None, str | None] = (None, None)  # (target, drafter): set by load()
        self._auto_profile: tuple[bool, budget_mod.BudgetProfile | None] = (False, None)  # (resolved, profile)
        if drafter is not None:
            drafter.cfg.check_compatible(target.cfg)
        self._target_graph, self._target_state = nnx.split(target)
        if drafter is not None:
            self._drafter_graph, self._drafter_state = nnx.split(drafter)
        else:
            self._drafter_graph, self._drafter_state = None, None
        self._compiled: dict = {}
        self.constraint_caps = cd.TableCaps()  # device table shape of constrained runs (one compile per caps)
        self._constraint_compiler: ConstraintCompiler | None = None

    # ---- loading ------------------------------------------------------------------------------------------
    @classmethod
    def load(cls, target: str | os.PathLike, drafter: str | os.PathLike | None = None, *, mesh=None,
             dtype: str = "float32", use_pallas: bool | None = None, progress: bool = False,
             budget_profile: str | os.PathLike | None = None, attn_backend: str | None = None) -> "Engine":
        """budget_profile: for budget="auto"; default `<target dir>/../budget_profile.<device kind>.json`."""
        model = load_target_any(target, dtype=dtype, mesh=mesh, progress=progress)
        draft_model = None if drafter is None else load_drafter_any(drafter, dtype=dtype)
        if budget_profile is None:
            budget_profile = budget_mod.default_profile_path(target, jax.devices()[0].device_kind)
        engine = cls(model, draft_model, load_tokenizer_any(target), mesh=mesh, use_pallas=use_pallas,
                     progress=progress, budget_profile=budget_profile, attn_backend=attn_backend)
        engine.checkpoint_names = (budget_mod.checkpoint_name(target),
                                   None if drafter is None else budget_mod.checkpoint_name(drafter))
        return engine

    # ---- compile ------------------------------------------------------------------------------------------
    def spec_for(self, *, mode: str, batch: int, prompt_len: int, max_new_tokens: int, budget: int,
                 top_k_cap: int = sampling.TOP_K_CAP, draft_k: int = 0, logprobs: int | None = None) -> DecodeSpec:
        cfg = self.target.cfg
        if mode != "ar" and self.drafter is None:
            raise ValueError(f"mode {mode!r} needs a drafter; load one or use mode='ar'")
        chunk, prompt_cap = self.prompt_bucket(prompt_len)
        dcfg = None if self.drafter is None or mode == "ar" else self.drafter.cfg
        return DecodeSpec(
            mode=mode, batch=batch, prompt_cap=prompt_cap, max_new_tokens=max_new_tokens, budget=budget,
            block=1 if dcfg is None else dcfg.block_size, vocab=cfg.vocab_size, top_k_cap=top_k_cap,
            prefill_chunk=chunk, use_pallas=self.use_pallas, attn_backend=self.attn_backend,
            taps=() if dcfg is None else tuple(dcfg.target_layer_ids),
            mask_token_id=0 if dcfg is None else dcfg.mask_token_id, draft_k=draft_k, logprobs=logprobs,
        )

    def prompt_bucket(self, prompt_len: int) -> tuple[int, int]:
        """(prefill chunk, padded prompt length) for a prompt: powers of two up to the chunk, then whole chunks."""
        chunk = min(self.prefill_chunk, _pow2_at_least(prompt_len))
        return chunk, chunk * math.ceil(prompt_len / chunk)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The token ids that end a request unless it asks for others: the tokenizer's, else the config's eos."""
        if self.tokenizer is not None:
            return tuple(self.tokenizer.stop_token_ids)
        return tuple(self.target.cfg.eos_token_id)

    def compile(self, fn: Callable, args: tuple, key, *, desc: str, donate: tuple[int, ...] = (),
                progress: bool | None = None, options: dict[str, str] | None = None) -> tuple[Callable, float]:
        """AOT-compile `fn(*args)` once per `key` under the engine's matmul precision and mesh; returns it and the
        seconds it took (0 when cached). The one place every program of the engine and the serving engine compiles.
        `args` may be arrays or `jax.ShapeDtypeStruct`s. `progress`: a bar for this program (None: `self.progress`);
        a caller compiling several programs at once keeps one bar for all. `options`: XLA compile options. Safe to
        call from several threads: XLA compiles without the GIL."""
        if key in self._compiled:
            return self._compiled[key], 0.0
        t0 = time.perf_counter()
        bar = None
        if self.progress if progress is None else progress:
            bar = tqdm(total=2, desc=f"compiling {desc}", unit="stage", leave=False)
        with jax.default_matmul_precision(self.matmul_precision), _mesh_context(self.mesh):
            lowered = jax.jit(fn, donate_argnums=donate).lower(*args)
            if bar is not None:
                bar.update(1)
            compiled = lowered.compile(options)
        if bar is not None:
            bar.update(1)
            bar.close()
        self._compiled[key] = compiled
        return compiled, time.perf_counter() - t0

    def merged(self, t_state, d_state, uses_drafter: bool):
        """The modules again from their states (inside a traced program)."""
        target = nnx.merge(self._target_graph, t_state)
        return target, (nnx.merge(self._drafter_graph, d_state) if uses_drafter else None)

    @property
    def weights(self) -> tuple:
        return self._target_state, self._drafter_state

    def _compile(self, spec: DecodeSpec, kind: str, *args) -> tuple[Callable, float]:
        """One of the three device programs of a batch generation for `spec` (cached)."""
        uses = spec.mode != "ar"
        if kind == "generate":
            def fn(t_state, d_state, prompts, prompt_len, keys, params, *constraint):
                return generate_device(spec, *self.merged(t_state, d_state, uses), prompts, prompt_len, keys, params,
                                       *constraint)
        elif kind == "prefill":
            def fn(t_state, d_state, prompts, prompt_len, keys, params, *constraint):
                return prefill(spec, *self.merged(t_state, d_state, uses), prompts, prompt_len, keys, params,
                               *constraint)
        else:
            def fn(t_state, d_state, state, round_limit, *tables):
                return decode_loop(spec, *self.merged(t_state, d_state, uses), state, round_limit, *tables)
        tables = [a for a in args if isinstance(a, cd.AutomatonTables)]
        shapes = tuple(x.shape for x in jax.tree.leaves(tables))  # the caps: schemas are data
        return self.compile(fn, args, (spec, kind, shapes) if shapes else (spec, kind), desc=f"{kind} ({spec.mode}, batch {spec.batch})",
                            donate=(2,) if kind == "rounds" else ())

    # ---- generate -----------------------------------------------------------------------------------------
    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]], max_new_tokens: int = 64,
                 **options) -> GenerationResult:
        """Generate for a batch of prompts (text or token ids; a bare string is one prompt); one compiled computation
        for all rounds. `options` are the arguments of `DecodeOptions.of` (temperature, top_k, top_p, mode, budget,
        seed, chat, constraint, logprobs); budget "auto" is the measured best B for this device and batch size, or AR
        where the profile measured AR faster (budget.py; `stats.mode` says what ran). `logprobs=k` (0..20) compiles a
        program that also keeps each token's raw log-probability and the top k (`RequestOutput.logprobs`)."""
        run = self._prepare(prompts, DecodeOptions.of(max_new_tokens, **options))
        args = (*self.weights, *run.inputs)
        compiled, compile_s = self._compile(run.spec, "generate", *args)
        t0 = time.perf_counter()
        state = jax.block_until_ready(compiled(*args))
        wall = time.perf_counter() - t0
        return self._result(run.spec, state, wall, compile_s, run.budget_source)

    def generate_stream(self, prompts, max_new_tokens: int = 64, *, stream_every: int = 1,
                        **options) -> "GenerationStream":
        """`generate` that hands back each request's newly committed token ids every `stream_every` rounds: iterate
        the returned stream; its `result` is the `GenerationResult` once the iteration ends. Bad input is refused
        here, before anything runs."""
        if stream_every < 1:
            raise ValueError(f"stream_every must be >= 1, got {stream_every}")
        run = self._prepare(prompts, DecodeOptions.of(max_new_tokens, **options))
        stream = GenerationStream()
        stream._chunks = self._stream_chunks(run, stream_every, stream)
        return stream

    def _stream_chunks(self, run: "_PreparedRun", stream_every: int, stream: "GenerationStream"):
        spec = run.spec
        prefill_fn, compile_s = self._compile(spec, "prefill", *self.weights, *run.inputs)
        t0 = time.perf_counter()
        state = prefill_fn(*self.weights, *run.inputs)
        tables = run.inputs[4:5]  # the constraint tables, if any
        rounds_fn, more = self._compile(spec, "rounds", *self.weights, state, jnp.int32(0), *tables)
        compile_s += more
        t0 += more
        sent = np.zeros(spec.batch, np.int64)
        while True:
            new, sent = _new_tokens(state, sent)
            yield new
            if bool(jnp.all(state.done)) or int(state.round) >= spec.max_rounds:
                break
            state = rounds_fn(*self.weights, state, state.round + stream_every, *tables)
        stream.result = self._result(spec, state, time.perf_counter() - t0, compile_s, run.budget_source)

    # ---- helpers ------------------------------------------------------------------------------------------
    def encode_prompts(self, prompts, chat: bool) -> list[list[int]]:
        """Token ids per prompt. A bare string is one text prompt (as in `generate("hi")`); anything else must be a
        list whose items are each a string or a list of integer token ids (not floats, bools or bytes)."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if not isinstance(prompts, Sequence) or isinstance(prompts, (bytes, bytearray)):
            raise ValueError(f"prompts must be a string or a list of strings or of token-id lists, e.g. 'hi', ['hi'] "
                             f"or [[1, 2]]; got {type(prompts).__name__}")
        out = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise ValueError("text prompts need a tokenizer; pass token ids instead")
                if chat:
                    p = self.tokenizer.apply_chat_template([{"role": "user", "content": p}])
                    out.append(self.tokenizer.encode(p, allow_special=True))
                else:
                    out.append(self.tokenizer.encode(p))
            elif isinstance(p, Sequence) and not isinstance(p, (bytes, bytearray)) and all(
                    isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in p):
                out.append([int(t) for t in p])
            else:
                raise ValueError(f"prompt {i} must be a string or a list of integer token ids, got {p!r:.60}")
        return out

    def _prepare(self, prompts, options: "DecodeOptions") -> "_PreparedRun":
        ids = self.encode_prompts(prompts, options.chat)
        if not ids:
            raise ValueError("no prompts given")
        cfg = self.target.cfg
        request = options.request
        max_new_tokens = request.max_new_tokens
        for i, p in enumerate(ids):
            if not p:
                raise ValueError(f"prompt {i} is empty")
            bad = [t for t in p if not 0 <= t < cfg.vocab_size]
            if bad:
                raise ValueError(f"prompt {i} has token ids outside the vocabulary (0..{cfg.vocab_size - 1}): {bad[:5]}")
            if len(p) + max_new_tokens > cfg.max_position_embeddings:
                raise ContextTooLongError(
                    f"prompt {i} has {len(p)} tokens; with max_new_tokens={max_new_tokens} that exceeds the model's "
                    f"context of {cfg.max_position_embeddings} tokens"
                )
        mode = options.mode
        budget, source = self.resolve_budget(options.budget, mode, len(ids))
        if source == budget_mod.AUTO_AR:
            mode = "ar"
        if budget < 0:
            raise ValueError(f"budget must be >= 0, got {budget}")
        request.check_sampling()
        if request.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs: only the serving engine computes prompt log-probabilities")
        request.check_logprobs(lp_mod.MAX_LOGPROBS)
        spec = self.spec_for(mode=mode, batch=len(ids), prompt_len=max(map(len, ids)), max_new_tokens=max_new_tokens,
                             budget=budget, top_k_cap=max(sampling.TOP_K_CAP, _pow2_at_least(request.top_k)),
                             logprobs=request.logprobs)
        self._check_fits(spec)
        arr = np.zeros((len(ids), spec.prompt_cap), np.int32)
        for i, p in enumerate(ids):
            arr[i, : len(p)] = p
        lens = np.array([len(p) for p in ids], np.int32)
        seed = options.seed
        if isinstance(seed, (int, np.integer)):  # one seed: request i draws from fold_in(seed, i)
            keys = [jax.random.fold_in(jax.random.key(seed), i) for i in range(len(ids))]
        else:  # a seed per request: its draws do not depend on its place in the batch
            seeds = list(seed)
            if len(seeds) != len(ids):
                raise ValueError(f"got {len(seeds)} seeds for {len(ids)} prompts")
            keys = [jax.random.key(s) for s in seeds]
        keys = np.stack([np.asarray(jax.random.key_data(k)) for k in keys])
        stop = self.stop_ids
        rows = RequestRows.of([request] * len(ids), [stop] * len(ids), len(stop))
        inputs = (jnp.asarray(arr), jnp.asarray(lens), jnp.asarray(keys), jax.tree.map(jnp.asarray, rows))
        constraint = self.constraint_inputs(options.constraint, len(ids))
        return _PreparedRun(spec, inputs + constraint, source)

    def constraint_inputs(self, constraint, n: int) -> tuple:
        """() without constraints, else (device tables padded to `constraint_caps`, start state [n] per prompt)."""
        if constraint is None:
            return ()
        items = list(constraint) if isinstance(constraint, (list, tuple)) else [constraint] * n
        if len(items) != n:
            raise ValueError(f"constraint: got {len(items)} constraints for {n} prompts")
        automata: list[TokenAutomaton | None] = []
        for i, c in enumerate(items):
            if c is None or isinstance(c, TokenAutomaton):
                automata.append(c)
            elif isinstance(c, ConstraintSpec):
                automata.append(self.constraint_compiler().compile(c))
            else:
                raise ValueError(f"constraint {i} must be a ConstraintSpec, a TokenAutomaton or None, got "
                                 f"{type(c).__name__}")
        if all(a is None for a in automata):
            return ()
        distinct = list({id(a): a for a in automata if a is not None}.values())
        tables, bases = cd.pack_tables(distinct, self.target.cfg.vocab_size, self.constraint_caps)
        base_of = {id(a): b for a, b in zip(distinct, bases)}
        start = np.array([cd.FREE_STATE if a is None else base_of[id(a)] for a in automata], np.int32)
        return cd.to_device(tables), jnp.asarray(start)

    def constraint_compiler(self) -> ConstraintCompiler:
        """Compiles ConstraintSpecs over the tokenizer's vocabulary (made on first use)."""
        if self._constraint_compiler is None:
            if self.tokenizer is None:
                raise ValueError("constraint: a ConstraintSpec needs a tokenizer; pass a TokenAutomaton instead")
            self._constraint_compiler = ConstraintCompiler(ConstraintVocabulary.from_tokenizer(self.tokenizer))
        return self._constraint_compiler

    def resolve_budget(self, budget: int | str, mode: str, batch: int) -> tuple[int, str]:
        """(B, source): an integer budget as given ("fixed"); "auto" -> the profile's choice for this batch size
        ("auto"), "auto-ar" when the profile measured AR faster than every budget (the engine then runs mode ar), or
        the default budget after a one-line warning when no profile applies ("auto-default")."""
        if not isinstance(budget, str):
            return budget, "fixed"
        if budget != "auto":
            raise ValueError(f"budget must be an integer >= 0 or 'auto', got {budget!r}")
        if mode != "ddtree":  # ar / chain ignore the budget: no profile needed
            return budget_mod.DEFAULT_BUDGET, "auto-default"
        resolved, profile = self._auto_profile
        if not resolved:
            profile = budget_mod.profile_for(self.budget_profile, self.profile_key())
            self._auto_profile = (True, profile)
        if profile is None:
            return budget_mod.DEFAULT_BUDGET, "auto-default"
        if not budget_mod.speculation_pays(profile, batch):
            return budget_mod.DEFAULT_BUDGET, budget_mod.AUTO_AR
        return budget_mod.choose_budget(profile, batch), "auto"

    def profile_key(self) -> budget_mod.ProfileKey:
        """What a budget profile must have been measured on to apply to this engine."""
        return budget_mod.ProfileKey(
            device_kind=jax.devices()[0].device_kind, dtype=str(jnp.dtype(self.target.dtype)),
            n_devices=1 if self.mesh is None else int(self.mesh.size), target=self.checkpoint_names[0],
            drafter=self.checkpoint_names[1],
        )

    def _check_fits(self, spec: DecodeSpec) -> None:
        """Refuse, before anything compiles, a generation that does not fit (`memory_fit.check_fits`)."""
        check_fits(spec, self.target, self.drafter if spec.mode != "ar" else None, self.memory_limit_bytes)

    def _result(self, spec: DecodeSpec, state: DecodeState, wall: float, compile_s: float,
                budget_source: str = "fixed") -> GenerationResult:
        tokens = np.asarray(state.tokens)
        plen = np.asarray(state.prompt_len)
        ngen = np.asarray(state.n_generated)
        finish = np.asarray(state.finish)
        acc = np.asarray(state.accept_len)
        outputs = []
        for b in range(tokens.shape[0]):
            ids = tokens[b, plen[b] : plen[b] + ngen[b]].tolist()
            lens = [int(a) for a in acc[b] if a > 0]
            text = None if self.tokenizer is None else self.tokenizer.decode(ids)
            outputs.append(RequestOutput(
                token_ids=ids, text=text, finish_reason=FINISH_REASONS[int(finish[b])] or "length",
                rounds=len(lens), mean_acceptance_length=float(np.mean(lens)) if lens else 0.0, accept_lengths=lens,
                logprobs=None if state.logprobs is None else _logprobs(state.logprobs, b, ids),
            ))
        all_lens = acc[acc > 0]
        total = int(ngen.sum())
        stats = GenerationStats(
            rounds=int(state.round), mean_acceptance_length=float(all_lens.mean()) if all_lens.size else 0.0,
            generated_tokens=total, tokens_per_s=total / wall if wall > 0 else float("nan"), wall_s=wall,
            compile_s=compile_s, budget=spec.budget if spec.mode == "ddtree" else None,
            budget_source=budget_source if spec.mode == "ddtree" or budget_source == budget_mod.AUTO_AR else None,
            mode=spec.mode,
        )
        return GenerationResult(outputs, stats)


def _mesh_context(mesh):
    """Trace under the engine's mesh, so expert-parallel MoE (shard_map) and sharding rules can see it."""
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def _logprobs(rows: lp_mod.LogprobRows, b: int, ids: list[int]) -> list[lp_mod.TokenLogprob]:
    """Request b's entries for its tokens `ids` (generated indices 0..)."""
    token, top_ids, top = (np.asarray(x[b, : len(ids)]) for x in (rows.token, rows.top_ids, rows.top))
    return [lp_mod.TokenLogprob(t, float(token[i]), tuple(zip(top_ids[i].tolist(), top[i].tolist())))
            for i, t in enumerate(ids)]


def _new_tokens(state: DecodeState, sent: np.ndarray) -> tuple[list[list[int]], np.ndarray]:
    tokens = np.asarray(state.tokens)
    plen = np.asarray(state.prompt_len)
    ngen = np.asarray(state.n_generated)
    new = [tokens[b, plen[b] + sent[b] : plen[b] + ngen[b]].tolist() for b in range(tokens.shape[0])]
    return new, ngen.astype(np.int64)



def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
