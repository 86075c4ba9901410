"""One speculative round, for the three modes of the engine, as pure functions over `DecodeState`.

Round r: tree from the last drafter pass (ddtree: best-first heap; chain: the argmax block; ar: root only)
-> one target forward over its N tokens with the ancestor mask -> the target's token at every slot -> walk
-> compact the latent cache and commit -> the next drafter pass over the accepted path's target features.
The drafter pass closes the round (instead of opening it) so that prefill can hand the first one over.
"""
from __future__ import annotations

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from kdtree_jax.constrain import device as cd
from kdtree_jax.decode import logprobs as lp_mod
from kdtree_jax.decode import sampling
from kdtree_jax.decode.params import RequestParams
from kdtree_jax.model import cache_update
from kdtree_jax.model.drafter import DrafterCache, draft
from kdtree_jax.model.target import LatentCache, forward_verify
from pallas_kernels import verify_attn_mgpu
from pallas_kernels.tree_accept import tree_accept
from pallas_kernels.tree_build import Tree, topk_logprobs, tree_build
from pallas_kernels.tree_build_masked import tree_build_masked

MODES = ("ar", "chain", "ddtree")
CACHE_ROW_ALIGN = verify_attn_mgpu.SEQ_ALIGN  # the wgmma verify kernel reads the cache by TMA in tiles of 8 rows


def aligned_rows(rows: int) -> int:
    """Cache rows as the engine allocates them: `rows` rounded up to whole TMA row tiles."""
    return -(-rows // CACHE_ROW_ALIGN) * CACHE_ROW_ALIGN

RUNNING, FINISH_STOP, FINISH_LENGTH, FINISH_NONFINITE = 0, 1, 2, 3
FINISH_REASONS = {RUNNING: None, FINISH_STOP: "stop", FINISH_LENGTH: "length", FINISH_NONFINITE: "nonfinite"}


@dataclasses.dataclass(frozen=True)
class DecodeSpec:
    """Everything that fixes the compiled shapes of a program; per-request values live in `RequestRows`."""

    mode: str  # "ar" | "chain" | "ddtree"
    batch: int
    prompt_cap: int  # padded prompt length (a multiple of prefill_chunk)
    max_new_tokens: int  # the most tokens any request may generate: cache rows and the rounds recorded
    budget: int = 0  # ddtree: non-root tree nodes B
    block: int = 1  # drafter block size L (1 for ar)
    vocab: int = 0
    top_k_cap: int = sampling.TOP_K_CAP  # the largest per-request top_k (the width of one lax.top_k)
    prefill_chunk: int = 256
    use_pallas: bool = True  # verify_attn kernel (else the jnp form); tree kernels always run
    attn_backend: str | None = None  # verify_attn backend: None = by device and shape, "triton" or "mosaic"
    taps: tuple[int, ...] = ()  # target layers whose outputs feed the drafter
    mask_token_id: int = 0
    draft_k: int = 0  # top-K kept per drafted depth; 0: what this mode needs (`top_k`). A serving table that switches
    # budgets keeps its largest budget's K, so every budget's tree is built from the same state
    # None: no log-probabilities; k: each emitted token's raw log-probability and the top k at its position, kept in
    # the state's `logprobs` buffer (`kdtree_jax/decode/logprobs.py`)
    logprobs: int | None = None

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.mode == "ddtree" and self.budget < 0:
            raise ValueError(f"budget must be >= 0, got {self.budget}")
        if self.mode != "ar" and self.block < 2:
            raise ValueError(f"mode {self.mode!r} needs a drafter block of >= 2 tokens, got {self.block}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= min(lp_mod.MAX_LOGPROBS, self.vocab or 1 << 30):
            raise ValueError(f"logprobs must be None or in [0, {lp_mod.MAX_LOGPROBS}], got {self.logprobs}")
        if self.draft_k and self.draft_k < self.tree_k:
            raise ValueError(f"draft_k={self.draft_k} is below the {self.tree_k} candidates per depth mode "
                             f"{self.mode!r} with budget {self.budget} reads")

    @property
    def depth(self) -> int:
        """D: deepest drafted position (0 for ar)."""
        return 0 if self.mode == "ar" else self.block - 1

    @property
    def n_slots(self) -> int:
        """N: tokens verified per round."""
        return {"ar": 1, "chain": self.block, "ddtree": 1 + self.budget}[self.mode]

    @property
    def tree_k(self) -> int:
        """Drafted candidates per depth the tree reads (Lemma 1: min(B, V) suffices for ddtree)."""
        return {"ar": 1, "chain": 1, "ddtree": max(1, min(self.budget, self.vocab))}[self.mode]

    @property
    def top_k(self) -> int:
        """K: drafted candidates kept per depth in the state."""
        return self.draft_k or self.tree_k

    @property
    def slack(self) -> int:
        """Rows past the last committed token that one round may write (tree slots or compaction rows)."""
        return max(self.n_slots, self.depth + 2)

    @property
    def capacity(self) -> int:
        """Cache rows: prompt + generated + one round's scratch, in whole TMA row tiles (`aligned_rows`)."""
        return aligned_rows(self.prompt_cap + self.max_new_tokens + self.slack)

    @property
    def max_rounds(self) -> int:
        return self.max_new_tokens


@flax.struct.dataclass
class RequestRows:
    """What each request asks for, as device data: changing any of it compiles nothing."""

    sampling: sampling.SamplingRows
    max_new_tokens: jax.Array  # [Bt] int32, <= the spec's max_new_tokens
    stop_ids: jax.Array  # [Bt, n_stop] int32 token ids that end the request; -1 pads

    @classmethod
    def of(cls, params: list[RequestParams], stop_ids: list[tuple[int, ...]], n_stop: int) -> "RequestRows":
        """The device rows of these requests. `stop_ids` come apart from `params`: the model's own stop ids join a
        request's unless it ignores them."""
        table = np.full((len(params), max(n_stop, 1)), -1, np.int32)
        for i, ids in enumerate(stop_ids):
            if len(ids) > n_stop:
                raise ValueError(f"request {i} has {len(ids)} stop ids; the table holds {n_stop}")
            table[i, : len(ids)] = ids
        return cls(sampling=sampling.SamplingRows.of(params),
                   max_new_tokens=np.asarray([p.max_new_tokens for p in params], np.int32), stop_ids=table)


@flax.struct.dataclass
class DecodeState:
    tokens: jax.Array  # [Bt, capacity] prompt + committed tokens; tokens[b, length[b]] is the bonus
    length: jax.Array  # [Bt] tokens whose latents are in the target cache (the bonus's position)
    prompt_len: jax.Array  # [Bt]
    n_generated: jax.Array  # [Bt] generated tokens so far, bonus included
    finish: jax.Array  # [Bt] RUNNING / FINISH_*
    cache: LatentCache  # target latent cache, valid for rows < length
    draft_cache: DrafterCache | None  # drafter context K/V, valid for rows < length
    draft_lp: jax.Array  # [Bt, D, K] top-K draft log-probs for the next tree
    draft_ids: jax.Array  # [Bt, D, K] their token ids
    keys: jax.Array  # [Bt, 2] per-request PRNG keys (raw uint32)
    params: RequestRows  # per-request decoding rule, token limit and stop ids
    round: jax.Array  # [] rounds run so far
    accept_len: jax.Array  # [Bt, max_rounds] acceptance length of each round (0 once finished)
    # [Bt] int32 automaton state after the bonus (a global state of the round's `AutomatonTables`; FREE_STATE: no
    # constraint); None: a program without constraints
    constraint_state: jax.Array | None = None
    logprobs: lp_mod.LogprobRows | None = None  # the emitted tokens' log-probabilities; None: a program without them

    @property
    def bonus(self) -> jax.Array:
        return jnp.take_along_axis(self.tokens, self.length[:, None], axis=1)[:, 0]

    @property
    def done(self) -> jax.Array:
        return self.finish != RUNNING


def root_only_tree(bonus: jax.Array) -> Tree:
    """The AR 'tree': just the root."""
    bt = bonus.shape[0]
    return Tree(
        tokens=bonus[:, None].astype(jnp.int32),
        parents=jnp.full((bt, 1), -1, jnp.int32),
        depths=jnp.zeros((bt, 1), jnp.int32),
        n_nodes=jnp.zeros((bt,), jnp.int32),
        vis=jnp.ones((bt, 1, 1), bool),
    )


def chain_tree(draft_ids: jax.Array, bonus: jax.Array) -> Tree:
    """The DFlash chain: [bonus, argmax_1 .. argmax_D], each node the child of the one before (causal mask)."""
    bt, depth = draft_ids.shape[:2]
    n = depth + 1
    tokens = jnp.concatenate([bonus[:, None], draft_ids[:, :, 0]], axis=1).astype(jnp.int32)
    slots = jnp.arange(n, dtype=jnp.int32)
    return Tree(
        tokens=tokens,
        parents=jnp.broadcast_to(slots - 1, (bt, n)),
        depths=jnp.broadcast_to(slots, (bt, n)),
        n_nodes=jnp.full((bt,), depth, jnp.int32),
        vis=jnp.broadcast_to(slots[None, :] <= slots[:, None], (bt, n, n)),
    )


def make_tree(spec: DecodeSpec, state: DecodeState, tables: cd.AutomatonTables | None = None
              ) -> tuple[Tree, jax.Array | None]:
    """The round's tree and, under constraints, each node's automaton state [Bt, N] (None without tables)."""
    if tables is None:
        return _unconstrained_tree(spec, state), None
    root_state = state.constraint_state
    if spec.mode == "ar":
        return root_only_tree(state.bonus), root_state[:, None]
    if spec.mode == "chain":
        return constrained_chain(chain_tree(state.draft_ids, state.bonus), root_state, tables)
    k = spec.tree_k

    def masked(_):
        return tree_build_masked(state.draft_lp[..., :k], state.draft_ids[..., :k], state.bonus, root_state,
                                 budget=spec.budget, allowed=functools.partial(cd.allowed_bits, tables),
                                 step=functools.partial(cd.next_state, tables),
                                 forced=functools.partial(cd.forced_token, tables))

    def free(_):  # every row in the free state: the kernel's tree, whose nodes all stay free
        return _unconstrained_tree(spec, state), jnp.full((state.bonus.shape[0], spec.n_slots), cd.FREE_STATE,
                                                           jnp.int32)

    return jax.lax.cond(cd.any_constrained(root_state), masked, free, None)


def _unconstrained_tree(spec: DecodeSpec, state: DecodeState) -> Tree:
    if spec.mode == "ar":
        return root_only_tree(state.bonus)
    if spec.mode == "chain":
        return chain_tree(state.draft_ids, state.bonus)
    k = spec.tree_k  # the state may keep more candidates than this budget reads: the top-K lists are sorted
    return tree_build(state.draft_lp[..., :k], state.draft_ids[..., :k], state.bonus, budget=spec.budget)


def constrained_chain(tree: Tree, root_state: jax.Array, tables: cd.AutomatonTables) -> tuple[Tree, jax.Array]:
    """The chain with each forced token (the one its parent's state allows) in place of the drafted one, cut before
    its first node that its parent's state does not allow -> (tree, node states)."""
    states, valid, n_nodes = [root_state], jnp.ones_like(root_state, bool), jnp.zeros_like(tree.n_nodes)
    tokens = [tree.tokens[:, 0]]
    for d in range(1, tree.tokens.shape[1]):
        forced = cd.forced_token(tables, states[-1])
        token = jnp.where(forced >= 0, forced, tree.tokens[:, d])
        valid = valid & cd.allowed_bits(tables, states[-1], token)
        states.append(jnp.where(valid, cd.next_state(tables, states[-1], token), states[-1]))
        tokens.append(token)
        n_nodes = n_nodes + valid.astype(n_nodes.dtype)
    return tree.replace(tokens=jnp.stack(tokens, axis=1), n_nodes=n_nodes), jnp.stack(states, axis=1)


def choose_tokens(logits: jax.Array, rows: sampling.SamplingRows, keys: jax.Array, top_k_cap: int,
                  tables: cd.AutomatonTables | None = None, node_states: jax.Array | None = None) -> jax.Array:
    """`sampling.choose` over each slot's allowed tokens: the target's distribution restricted to what the slot's
    state allows (greedy: the highest allowed logit, NaN as -inf, the lowest allowed id if all are -inf). Skipped
    when every row is in the free state. logits [Bt, N, V], node_states [Bt, N] -> [Bt, N] int32."""
    if tables is None:
        return sampling.choose(logits, rows, keys, top_k_cap)

    def masked(_):
        x = cd.mask_logits(logits, tables, node_states)
        pick = sampling.choose(x, rows, keys, top_k_cap)
        dead = jnp.all(x == -jnp.inf, axis=-1)
        return jnp.where(dead, cd.first_allowed_token(tables, node_states), pick)

    return jax.lax.cond(cd.any_constrained(node_states), masked,
                        lambda _: sampling.choose(logits, rows, keys, top_k_cap), None)


def drafter_pass(spec, drafter, target, draft_cache, ctx_hidden, n_ctx, bonus, first_allowed=None):
    """Append the new context rows, draft the next block, keep its top-K per depth. `first_allowed` [Bt, V] bool:
    the tokens the root's state allows, the only candidates kept at depth 1 (deeper states depend on the node)."""
    logits, draft_cache = draft(
        drafter, draft_cache, ctx_hidden, n_ctx, bonus, target.embed_table(), target.lm_head_table(),
        mask_token_id=spec.mask_token_id,
    )
    if first_allowed is not None and logits.shape[1] > 0:
        logits = logits.at[:, 0].set(jnp.where(first_allowed, logits[:, 0], -jnp.inf))
    with jax.named_scope("topk"):
        lp, ids = topk_logprobs(logits, spec.top_k)
    return lp, ids, draft_cache


def speculative_round(spec: DecodeSpec, target, drafter, state: DecodeState,
                      tables: cd.AutomatonTables | None = None) -> DecodeState:
    """One round for every request in the batch; finished requests are carried unchanged. With `tables` each row
    decodes under the automaton its `constraint_state` lies in."""
    with jax.named_scope("round/tree"):
        tree, node_states = make_tree(spec, state, tables)
    new, out, acc = verify_and_commit(spec, target, state, tree, tables, node_states)
    if spec.mode == "ar":
        return new
    with jax.named_scope("round/draft"):
        ctx = cache_update.gather_slots(out.hidden, acc.path)
        n_ctx = jnp.where(state.done, 0, acc.n_accepted)
        first = None if tables is None else cd.allowed_mask(tables, new.constraint_state)
        lp, ids, draft_cache = drafter_pass(spec, drafter, target, state.draft_cache, ctx, n_ctx, new.bonus, first)
    return new.replace(draft_cache=draft_cache, draft_lp=lp, draft_ids=ids)


def verify_and_commit(spec: DecodeSpec, target, state: DecodeState, tree: Tree,
                      tables: cd.AutomatonTables | None = None, node_states: jax.Array | None = None):
    """Verify `tree`, pick the target's tokens, walk, compact the cache and commit: the round up to the drafter.
    With `tables`, each slot picks among its state's allowed tokens (`node_states` [Bt, N]) and the row's state
    moves along the accepted path and the bonus. Returns (state, the target's forward output, the walk)."""
    with jax.named_scope("round/verify"):
        positions = state.length[:, None] + tree.depths
        out = forward_verify(
            target, tree.tokens, positions, state.length, tree.vis, state.cache, taps=spec.taps,
            use_pallas=spec.use_pallas, attn_backend=spec.attn_backend,
        )
    with jax.named_scope("round/sample"):
        keys = sampling.position_keys(jax.random.wrap_key_data(state.keys), positions)
        choice = choose_tokens(out.logits, state.params.sampling, keys, spec.top_k_cap, tables, node_states)
    with jax.named_scope("round/accept"):
        acc = tree_accept(choice, tree.tokens, tree.parents, tree.n_nodes, max_depth=spec.depth)
    with jax.named_scope("round/cache_update"):
        cache = out.cache.replace(latent=cache_update.compact_latents(out.cache.latent, state.length, acc.src_slot,
                                                                      out.cache.page_table))
        emitted = cache_update.emitted_tokens(tree.tokens, acc.path, acc.n_accepted, acc.bonus)
        new = commit(state, emitted, acc.n_accepted, nonfinite_slots(out.logits, tree))
        if spec.logprobs is not None:
            new = new.replace(logprobs=record_logprobs(state, out.logits, emitted, acc))
        if tables is not None:
            last = jnp.take_along_axis(acc.path, (acc.n_accepted - 1)[:, None], axis=1)  # deepest accepted slot
            moved = cd.next_state(tables, jnp.take_along_axis(node_states, last, axis=1)[:, 0], acc.bonus)
            new = new.replace(constraint_state=jnp.where(state.done, state.constraint_state, moved))
    return new.replace(cache=cache), out, acc


def record_logprobs(state: DecodeState, logits: jax.Array, emitted: jax.Array, acc) -> lp_mod.LogprobRows:
    """The round's emitted tokens into the state's buffer: token j >= 1 of `emitted` was drawn from the logits of
    path slot j - 1 (the root's for the first draft, the deepest accepted node's for the bonus), raw: before the
    sampling rule and the constraint's mask."""
    depth1 = acc.path.shape[1]
    j = jnp.arange(1, depth1 + 1, dtype=jnp.int32)[None, :]
    rows = cache_update.gather_slots(logits, acc.path)  # [Bt, D + 1, V]
    keep = (j <= acc.n_accepted[:, None]) & ~state.done[:, None]
    index = (state.length - state.prompt_len)[:, None] + j
    return lp_mod.write(state.logprobs, rows, emitted[:, 1:], index, keep)


def nonfinite_slots(logits: jax.Array, tree: Tree) -> jax.Array:
    """[Bt] true where any real slot's logits hold a NaN or Inf."""
    real = jnp.arange(logits.shape[1])[None, :] <= tree.n_nodes[:, None]
    bad = ~jnp.all(jnp.isfinite(logits), axis=-1)
    return jnp.any(bad & real, axis=1)


def commit(state: DecodeState, emitted, n_accepted, nonfinite) -> DecodeState:
    """Write the round's tokens, count them, and stop requests at a stop token or at their max_new_tokens."""
    done = state.done
    j = jnp.arange(emitted.shape[1])[None, :]
    fresh = (j >= 1) & (j <= n_accepted[:, None])  # accepted drafts + the new bonus; the root was counted before
    is_stop = fresh & is_stop_token(emitted, state.params.stop_ids)
    first_stop = jnp.min(jnp.where(is_stop, j, emitted.shape[1]), axis=1)  # [Bt]
    room = state.params.max_new_tokens - state.n_generated
    n_new = jnp.minimum(jnp.minimum(n_accepted, first_stop), room)
    finish = jnp.where(
        nonfinite, FINISH_NONFINITE,
        jnp.where(first_stop <= n_new, FINISH_STOP, jnp.where(n_new >= room, FINISH_LENGTH, RUNNING)),
    )
    tokens = cache_update.write_rows(state.tokens, emitted, state.length)
    r = state.round
    return state.replace(
        tokens=jnp.where(done[:, None], state.tokens, tokens),
        length=jnp.where(done, state.length, state.length + n_accepted),
        n_generated=jnp.where(done | nonfinite, state.n_generated, state.n_generated + n_new),
        finish=jnp.where(done, state.finish, finish),
        round=r + 1,
        accept_len=state.accept_len.at[:, r].set(jnp.where(done | nonfinite, 0, n_accepted)),
    )


def first_token_finish(last_logits: jax.Array, first: jax.Array, params: RequestRows, n_prev) -> jax.Array:
    """[Bt] int32: the finish code of rows whose prefill drew `first` from `last_logits` [Bt, V], with `n_prev`
    tokens generated before it (a resumed request's): logits that are not finite, a stop token, or the token limit
    reached, else RUNNING."""
    nonfinite = ~jnp.all(jnp.isfinite(last_logits), axis=-1)
    return jnp.where(nonfinite, FINISH_NONFINITE, jnp.where(
        is_stop_token(first[:, None], params.stop_ids)[:, 0], FINISH_STOP,
        jnp.where(params.max_new_tokens <= n_prev + 1, FINISH_LENGTH, RUNNING))).astype(jnp.int32)


def is_stop_token(tokens: jax.Array, stop_ids: jax.Array) -> jax.Array:
    """tokens [Bt, T], stop_ids [Bt, n_stop] (-1 pads) -> [Bt, T] true where a token is one of its row's stop ids."""
    hit = tokens[..., None] == stop_ids[:, None, :]
    return jnp.any(hit & (stop_ids[:, None, :] >= 0), axis=-1)
