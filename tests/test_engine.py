"""The speculative engine: lossless greedy output in every mode, batching, stopping, sampling distribution,
and a whole generation as one compiled computation."""
from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_utils import TARGET_CONFIGS, assert_same_distribution, exact_pair_distribution, random_pair

from kdtree_jax.decode import engine as engine_mod
from kdtree_jax.decode import memory_fit, programs
from kdtree_jax.decode.engine import ContextTooLongError, Engine
from kdtree_jax.decode.memory_fit import ResourceLimitError, estimate_bytes

BLOCK = 4  # drafter block L: depth D = 3
BUDGETS = (1, 4, 16, 64)


@dataclasses.dataclass
class Shared:
    engine: Engine
    seed: int  # random_pair's: the same weights again


@pytest.fixture(scope="module")
def shared_pairs():
    """One engine per target config for the whole module, so each program compiles once; tests that change an
    engine's settings do it through monkeypatch."""
    built = {}

    def get(name: str) -> Shared:
        if name not in built:
            seed = int.from_bytes(os.urandom(4), "little") >> 2
            print(f"{name} pair seed={seed}")
            built[name] = Shared(Engine(*random_pair(name, seed, block_size=BLOCK), None, use_pallas=True), seed)
        return built[name]

    return get


# "grouped" in the fast tier; the other configs' programs are the full tier's (compiling them takes minutes on CPU)
@pytest.fixture(scope="module", params=[name if name == "grouped" else pytest.param(name, marks=pytest.mark.heavy)
                                        for name in sorted(TARGET_CONFIGS)])
def pair_engine(request, shared_pairs):
    return shared_pairs(request.param).engine


@pytest.fixture
def grouped(shared_pairs) -> Engine:
    """The "grouped" pair's shared engine."""
    return shared_pairs("grouped").engine


# test_greedy_modes_equal_ar's runs (batch 4, prompt lengths (7, 3, 5, 8), 10 tokens): tests that reuse its modes
# and shapes run on the shared engine's programs without compiling
GREEDY_MODES = {"ar": {}, "chain": {}, "ddtree": {"budget": 4}}


def compile_calls(eng: Engine, monkeypatch) -> list:
    """The keys of every program `eng` fetches or compiles from now on (`Engine.compile` does both)."""
    calls = []
    real = eng.compile

    def recording(fn, args, key, **kw):
        calls.append(key)
        return real(fn, args, key, **kw)

    monkeypatch.setattr(eng, "compile", recording)
    return calls


def _prompts(rng, vocab, n, lengths=(7, 3, 5, 8)):
    return [rng.integers(0, vocab - 1, size=lengths[i % len(lengths)]).tolist() for i in range(n)]


def _assert_tree_equals_ar(tree, ar, budget):
    assert tree.token_ids == ar.token_ids, f"budget {budget}"
    for out in tree.outputs:
        assert all(1 <= a <= BLOCK for a in out.accept_lengths)
        assert 1 + sum(out.accept_lengths) >= len(out.token_ids)


def test_greedy_modes_equal_ar(pair_engine, rng):
    """chain and ddtree (budget 4) give the AR tokens, batch 4 with ragged prompts."""
    eng = pair_engine
    prompts = _prompts(rng, eng.target.cfg.vocab_size, 4)
    ar = eng.generate(prompts, 10, mode="ar")
    assert eng.generate(prompts, 10, mode="chain").token_ids == ar.token_ids
    _assert_tree_equals_ar(eng.generate(prompts, 10, mode="ddtree", **GREEDY_MODES["ddtree"]), ar, 4)


@pytest.mark.heavy
def test_greedy_ddtree_equals_ar_at_every_budget_and_alone(pair_engine, rng):
    """ddtree at every budget gives the AR tokens, batch 4 with ragged prompts, and so does each prompt alone."""
    eng = pair_engine
    prompts = _prompts(rng, eng.target.cfg.vocab_size, 4)
    ar = eng.generate(prompts, 10, mode="ar")
    for budget in BUDGETS:
        _assert_tree_equals_ar(eng.generate(prompts, 10, mode="ddtree", budget=budget), ar, budget)
    for i, p in enumerate(prompts):  # same prompt alone: same tokens as inside the batch
        alone = eng.generate([p], 10, mode="ddtree", budget=4)
        assert alone.token_ids[0] == ar.token_ids[i]


def test_accept_lengths_count_emitted_tokens(pair_engine, rng):
    eng, n = pair_engine, 10  # test_greedy_modes_equal_ar's ddtree program
    out = eng.generate(_prompts(rng, eng.target.cfg.vocab_size, 4), n, mode="ddtree", **GREEDY_MODES["ddtree"])
    for o in out.outputs:
        assert o.finish_reason == "length" and len(o.token_ids) == n
        # the prefill gives the first token; every round commits its acceptance length, the last one may be cut
        assert sum(o.accept_lengths[:-1]) < n - 1 <= sum(o.accept_lengths)


def test_stop_token_ends_request_identically_without_recompiling(grouped, rng, monkeypatch):
    """A stop id ends every mode's request at the same token as ar. Stop ids are data of a run: the programs
    compiled without one serve it unchanged."""
    eng = grouped
    prompts = _prompts(rng, eng.target.cfg.vocab_size, 4)
    runs = list(GREEDY_MODES.items())
    ar = eng.generate(prompts, 10, mode="ar")
    for mode, kw in runs[1:]:  # compiled here unless an earlier test did
        eng.generate(prompts, 10, mode=mode, **kw)
    compiled = set(eng._compiled)
    stop = ar.token_ids[0][5]  # a token the first request emits
    monkeypatch.setattr(eng.target, "cfg", dataclasses.replace(eng.target.cfg, eos_token_id=(stop,)))
    assert eng.stop_ids == (stop,)
    for mode, kw in runs:
        res = eng.generate(prompts, 10, mode=mode, **kw)
        for b, (out, ref) in enumerate(zip(res.outputs, ar.token_ids)):
            cut = ref.index(stop) + 1 if stop in ref else len(ref)
            assert (out.token_ids, out.finish_reason) == (ref[:cut], "stop" if stop in ref else "length"), (mode, b)
        assert res.outputs[0].finish_reason == "stop"
    assert set(eng._compiled) == compiled


@pytest.mark.heavy  # in the fast tier, tests/test_cli.py streams through the engine
def test_streaming_equals_one_shot(grouped, rng):
    eng = grouped  # test_greedy_modes_equal_ar's ddtree program for the one-shot run
    prompts = _prompts(rng, eng.target.cfg.vocab_size, 4)
    full = eng.generate(prompts, 10, mode="ddtree", budget=4)
    stream = eng.generate_stream(prompts, 10, mode="ddtree", budget=4, stream_every=2)
    pieces = [[], [], [], []]
    n_yields = 0
    for new in stream:
        assert stream.result is None  # set once the stream ends
        n_yields += 1
        for b in range(4):
            pieces[b].extend(new[b])
    assert pieces == full.token_ids == stream.result.token_ids
    assert n_yields >= 2  # tokens came back before the end


def test_one_compiled_computation_without_host_callbacks(grouped, rng, monkeypatch):
    eng = grouped  # test_greedy_modes_equal_ar's ddtree program
    prompts = _prompts(rng, eng.target.cfg.vocab_size, 4)
    run = eng._prepare(prompts, engine_mod.DecodeOptions.of(max_new_tokens=10, budget=4))
    spec = run.spec

    def fn(t_state, d_state, *inputs):
        return programs.generate_device(spec, *eng.merged(t_state, d_state, True), *inputs)

    jaxpr = jax.make_jaxpr(fn)(*eng.weights, *run.inputs)
    text = str(jaxpr)
    assert "while" in text
    for bad in ("callback", "io_callback", "pure_callback", "debug_print"):
        assert bad not in text
    hlo = jax.jit(fn).lower(*eng.weights, *run.inputs).as_text()
    assert "custom_call_target=\"xla_python" not in hlo
    calls = compile_calls(eng, monkeypatch)
    eng.generate(prompts, 10, mode="ddtree", budget=4)
    assert calls == [(spec, "generate")]  # the whole generation runs one executable


def test_context_too_long_rejected_before_compute(grouped, monkeypatch):
    eng = grouped
    calls = compile_calls(eng, monkeypatch)
    limit = eng.target.cfg.max_position_embeddings
    with pytest.raises(ContextTooLongError, match="prompt 0 has"):
        eng.generate([[1] * (limit - 3)], 8)
    with pytest.raises(ValueError, match="budget"):
        eng.generate([[1, 2]], 4, budget=-1)
    with pytest.raises(ValueError, match="temperature"):
        eng.generate([[1, 2]], 4, temperature=-0.5)
    assert calls == []  # refused before any program was compiled or fetched


@pytest.mark.heavy  # in the fast tier, tests/test_reliability.py puts an inf mid-generation
def test_nonfinite_logits_reported_not_emitted(shared_pairs, rng):
    """A NaN reaching one request's logits stops that request with finish 'nonfinite' and no token from it.

    In ar mode the other request is untouched. In chain and ddtree modes its drafter may propose the poisoned token
    as a node, whose NaN latent then reaches the request's own verify rows (masked keys still enter p @ V with
    weight 0), so it may stop early too: never with a wrong token, only a prefix of its clean output.
    """
    shared = shared_pairs("grouped")  # the clean runs reuse test_greedy_modes_equal_ar's programs
    target, drafter = random_pair("grouped", shared.seed, block_size=BLOCK)  # the same weights, poisoned below
    vocab = target.cfg.vocab_size
    prompts = _prompts(rng, vocab, 4)
    clean = {m: shared.engine.generate(prompts, 10, mode=m, **kw) for m, kw in GREEDY_MODES.items()}
    # the poisoned token appears only in request 0: never in another request's prompt nor in what it generates (their
    # tokens do not depend on request 0's prompt, so changing that prompt leaves `clean` valid for them); not the pad
    # token 0 nor the drafter's mask token, which every request uses
    seen = {0, drafter.cfg.mask_token_id}.union(*prompts[1:], *(clean[m].outputs[b].token_ids for m in clean
                                                                 for b in range(1, 4)))
    poison = max(t for t in range(vocab) if t not in seen)
    prompts[0][0] = poison
    table = np.array(target.embed[...])
    table[poison] = np.nan
    target.embed[...] = jnp.asarray(table)
    eng = Engine(target, drafter, None)
    for mode, kw in GREEDY_MODES.items():
        bad = eng.generate(prompts, 10, mode=mode, **kw)
        assert bad.outputs[0].finish_reason == "nonfinite" and bad.outputs[0].token_ids == [], mode
        for b in range(1, 4):
            other, ref = bad.outputs[b], clean[mode].outputs[b].token_ids
            if mode == "ar" or other.finish_reason != "nonfinite":
                assert (other.token_ids, other.finish_reason) == (ref, "length"), (mode, b)
            else:
                assert ref[: len(other.token_ids)] == other.token_ids, (mode, b)


def test_same_seed_same_samples(grouped, rng):
    eng = grouped  # test_greedy_modes_equal_ar's program: the temperature is data of a run
    prompts = _prompts(rng, eng.target.cfg.vocab_size, 4)
    kw = {"mode": "ddtree", "budget": 4, "temperature": 1.0}
    a = eng.generate(prompts, 10, seed=7, **kw)
    b = eng.generate(prompts, 10, seed=7, **kw)
    c = eng.generate(prompts, 10, seed=8, **kw)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids
    # a seed per request: the same draws at any batch position (the longest prompt keeps one compiled shape)
    batch = eng.generate([prompts[1], prompts[2], prompts[0], prompts[3]], 10, seed=[11, 12, 13, 14], **kw)
    alone = eng.generate([prompts[0]] * 4, 10, seed=[13, 15, 16, 17], **kw)
    assert batch.token_ids[2] == alone.token_ids[0]


@pytest.mark.heavy
@pytest.mark.parametrize("mode", ["ddtree", "chain"])
def test_sampling_matches_target_distribution(mode, rng):
    """Chi-square: (t2, t3) emitted by the speculative engine ~ the target's own sampling distribution."""
    from engine_utils import drafter_config, random_drafter

    from kdtree_jax.checkpoint.weights import init_random
    from kdtree_jax.model import config

    cfg = config.tiny(vocab_size=6, eos_token_id=())
    seed = int(rng.integers(1 << 30))
    target = init_random(cfg, seed=seed)
    drafter = random_drafter(drafter_config(cfg, block_size=BLOCK), seed, scale=3.0)
    eng = Engine(target, drafter, None, use_pallas=False)
    prompt = rng.integers(0, 6, size=4).tolist()
    temperature, top_p = 1.5, 0.95
    expected = exact_pair_distribution(cfg, seed, prompt, temperature, top_p)
    counts = np.zeros((6, 6))
    batch, calls, accepted_deep = 512, 4, 0
    for _ in range(calls):
        out = eng.generate([prompt] * batch, 3, mode=mode, budget=8, temperature=temperature, top_p=top_p,
                           seed=[int(rng.integers(1 << 30)) for _ in range(batch)])
        accepted_deep += sum(any(a >= 2 for a in o.accept_lengths) for o in out.outputs)
        for o in out.outputs:
            counts[o.token_ids[1], o.token_ids[2]] += 1
    assert accepted_deep > 0  # some draws went through an accepted draft node
    assert_same_distribution(counts, expected)


def test_generation_that_does_not_fit_is_refused_up_front(grouped, rng, monkeypatch):
    eng = grouped  # test_greedy_modes_equal_ar's ddtree program
    prompts = _prompts(rng, eng.target.cfg.vocab_size, 4)
    spec = eng._prepare(prompts, engine_mod.DecodeOptions.of(max_new_tokens=10, budget=4)).spec
    need = estimate_bytes(spec, eng.target, eng.drafter)
    cfg = eng.target.cfg
    assert need["latent cache"] == cfg.num_hidden_layers * 4 * spec.capacity * cfg.latent_dim * 4
    calls = compile_calls(eng, monkeypatch)
    monkeypatch.setattr(eng, "memory_limit_bytes", sum(need.values()) - 1)
    with pytest.raises(ResourceLimitError, match=rf"batch 4 x {spec.capacity} cache rows needs about "
                                                 rf"{sum(need.values())} bytes"):
        eng.generate(prompts, 10, mode="ddtree", budget=4)
    assert calls == []  # refused before any program was compiled or fetched
    monkeypatch.setattr(eng, "memory_limit_bytes", sum(need.values()))
    assert len(eng.generate(prompts, 10, mode="ddtree", budget=4).token_ids) == 4
    assert calls == [(spec, "generate")]


def _refusal(eng, monkeypatch, prompts, small, big, set_limit=None):
    """Generate with `big` (kwargs) under a limit that `small` exactly fits (set by `set_limit(bytes)`, default
    memory_limit_bytes); return big's spec and estimate, the limit and the ResourceLimitError message. No program
    may be compiled or fetched."""
    specs = {}
    for name, kw in (("small", small), ("big", big)):
        specs[name] = eng._prepare(prompts, engine_mod.DecodeOptions.of(**kw)).spec
    need = {k: estimate_bytes(s, eng.target, eng.drafter if s.mode != "ar" else None) for k, s in specs.items()}
    fits = sum(need["small"].values())
    assert sum(need["big"].values()) > fits
    if set_limit is None:
        monkeypatch.setattr(eng, "memory_limit_bytes", fits)
    else:
        set_limit(fits)
    eng._check_fits(specs["small"])  # exactly at the limit: allowed
    calls = compile_calls(eng, monkeypatch)
    with pytest.raises(ResourceLimitError) as info:
        eng.generate(prompts, big["max_new_tokens"], mode=big["mode"], budget=big["budget"])
    assert isinstance(info.value, ValueError)
    assert calls == []
    return specs["big"], need["big"], fits, str(info.value)


def _assert_names_the_bytes(msg, need, limit):
    assert f"needs about {sum(need.values())} bytes" in msg, msg
    for part, n in need.items():
        assert f"{part} {n} bytes" in msg, (part, msg)
    assert f"{limit} bytes" in msg.split(" but ")[1], msg
    assert "0.00 GiB" not in msg and "MiB" in msg  # a tiny model's human unit is not rounded away


def test_budget_alone_over_the_memory_limit_is_refused_naming_the_budget(grouped, rng, monkeypatch):
    """Same batch and context; only the budget grows past what fits: the message names the bytes and the budget."""
    eng = grouped
    prompts = _prompts(rng, eng.target.cfg.vocab_size, 4)
    _, need, limit, msg = _refusal(eng, monkeypatch, prompts, {"mode": "ddtree", "budget": 4, "max_new_tokens": 8},
                                   {"mode": "ddtree", "budget": 64, "max_new_tokens": 8})
    _assert_names_the_bytes(msg, need, limit)
    assert f"memory_limit_bytes is {limit} bytes" in msg
    remedy = msg.split("; lower ")[1]
    assert "the budget (64" in remedy and "batch size (4)" in remedy and "max_new_tokens 8" in remedy, remedy


def test_context_alone_over_the_memory_limit_is_refused_naming_the_context(grouped, rng, monkeypatch):
    """ar (no budget): same batch, only max_new_tokens grows past what fits; the caches grow, and the message gives
    their bytes and names the context, not a budget ar does not have."""
    eng = grouped
    prompts = _prompts(rng, eng.target.cfg.vocab_size, 2)
    spec, need, limit, msg = _refusal(eng, monkeypatch, prompts, {"mode": "ar", "budget": 0, "max_new_tokens": 8},
                                      {"mode": "ar", "budget": 0, "max_new_tokens": 400})
    _assert_names_the_bytes(msg, need, limit)
    assert list(need) == ["latent cache", "activations"]  # ar: no drafter cache
    remedy = msg.split("; lower ")[1]
    assert "budget" not in msg and "batch size (2)" in remedy
    assert f"max_new_tokens 400: {spec.capacity} cache rows" in remedy, remedy


def test_free_device_memory_is_the_default_limit(grouped, rng, monkeypatch):
    """No memory_limit_bytes: the limit is the device's free memory (allocator limit minus use on GPU)."""
    eng = grouped
    prompts = _prompts(rng, eng.target.cfg.vocab_size, 2)

    class FakeGpu:
        in_use = 1_000_000
        free = 0  # set below

        def memory_stats(self):
            return {"bytes_limit": self.in_use + self.free, "bytes_in_use": self.in_use}

        def __str__(self):
            return "cuda:0"

    free, where = memory_fit.free_device_bytes()  # the real device: CPU reads the host's available memory
    assert free > 0 and where
    monkeypatch.setattr(memory_fit.jax, "devices", lambda *a, **k: [FakeGpu()])
    FakeGpu.free = 1 << 40  # room for _refusal's specs; it then lowers this to what the smaller one needs
    assert memory_fit.free_device_bytes() == (1 << 40, "cuda:0")
    _, need, limit, msg = _refusal(eng, monkeypatch, prompts, {"mode": "ddtree", "budget": 1, "max_new_tokens": 8},
                                   {"mode": "ddtree", "budget": 64, "max_new_tokens": 8},
                                   set_limit=lambda n: setattr(FakeGpu, "free", n))
    assert eng.memory_limit_bytes is None
    _assert_names_the_bytes(msg, need, limit)
    assert f"cuda:0 has {limit} bytes (" in msg, msg


SHIPPED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "checkpoints", "kdtree-mini")


@pytest.fixture(scope="module")
def shipped() -> Engine:
    """The shipped trained pair, loaded once for the module."""
    return Engine.load(os.path.join(SHIPPED, "target"), os.path.join(SHIPPED, "drafter"))


def heldout_texts(n: int) -> list[str]:
    with open(os.path.join(SHIPPED, "heldout_prompts.jsonl")) as f:
        return [json.loads(line)["text"] for line in f][:n]


@pytest.mark.heavy
def test_trained_pair_is_lossless_with_long_acceptances(shipped):
    """The shipped drafter agrees with its target often: rounds accept > 2 tokens, and output still equals ar."""
    eng = shipped
    texts = heldout_texts(4)
    prompts = [eng.tokenizer.encode(t)[:n] for t, n in zip(texts, (40, 25, 33, 40))]
    ar = eng.generate(prompts, 24, mode="ar")
    assert eng.generate(prompts, 24, mode="chain").token_ids == ar.token_ids
    longest = 0
    for budget in BUDGETS:
        tree = eng.generate(prompts, 24, mode="ddtree", budget=budget)
        assert tree.token_ids == ar.token_ids, f"budget {budget}"
        longest = max([longest] + [a for o in tree.outputs for a in o.accept_lengths])
        assert all(1 <= a <= eng.drafter.cfg.block_size for o in tree.outputs for a in o.accept_lengths)
    assert longest > 2
    alone = eng.generate(prompts[:1], 24, mode="ddtree", budget=16)
    assert alone.token_ids[0] == ar.token_ids[0]


@pytest.mark.heavy
def test_chain_rounds_equal_the_offline_drafter_walk(shipped):
    """The engine's chain rounds are exactly what the training code's drafter evaluation predicts: the drafter's
    block at every anchor of the target's greedy continuation (features strictly before the anchor, as trained),
    walked one round per block. Ties the engine's drafter context, positions and target features to training's."""
    from kdtree_jax import train as T

    eng = shipped
    texts = heldout_texts(4)
    p, new, L = 40, 48, eng.drafter.cfg.block_size
    prompts = np.array([eng.tokenizer.encode(t)[:p] for t in texts], np.int32)
    # the walk's last round starts before generated token `new`, whose block needs L - 1 labels after it
    seqs = T.greedy_continue(eng.target, prompts, new + L - 2, 4)
    chain = eng.generate([q.tolist() for q in prompts], new, mode="chain")
    assert chain.token_ids == seqs[:, p: p + new].tolist()
    rounds = [a for o in chain.outputs for a in o.accept_lengths]
    agree = T.drafter_agreement(eng.target, eng.drafter, seqs, p - 1, 1, 4, walk_from=p)
    assert agree["chain_rounds"] == len(rounds)
    assert agree["chain_tau_per_round"] == pytest.approx(np.mean(rounds), rel=1e-12)
    assert max(rounds) > 2 and agree["chain_tau_mean"] != pytest.approx(agree["chain_tau_per_round"])


@pytest.mark.heavy
def test_prefill_through_the_verify_kernel_equals_plain_mla(rng):
    """Prompt chunks through the verify path (absorbed MLA, causal mask, Pallas kernel) fill the same cache rows,
    drafter context and first token as plain-MLA prefill, over several chunks and ragged prompts."""
    target, drafter = random_pair("grouped", int(rng.integers(1 << 30)), block_size=BLOCK)
    prompts = _prompts(rng, target.cfg.vocab_size, 3, lengths=(19, 6, 13))
    states = {}
    for use_pallas in (True, False):
        eng = Engine(target, drafter, None, use_pallas=use_pallas, prefill_chunk=8)
        run = eng._prepare(prompts, engine_mod.DecodeOptions.of(max_new_tokens=6, budget=4))
        spec, lens = run.spec, run.inputs[1]
        assert spec.prompt_cap // spec.prefill_chunk == 3
        states[use_pallas] = jax.jit(lambda *x, spec=spec: programs.prefill(spec, target, drafter, *x))(*run.inputs)
    kernel, plain = states[True], states[False]
    np.testing.assert_array_equal(np.asarray(kernel.tokens), np.asarray(plain.tokens))  # same first token
    lat_k, lat_p = np.asarray(kernel.cache.stacked()), np.asarray(plain.cache.stacked())
    for b, n in enumerate(np.asarray(lens)):
        np.testing.assert_allclose(lat_k[:, b, :n], lat_p[:, b, :n], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(kernel.draft_lp), np.asarray(plain.draft_lp), rtol=1e-4, atol=1e-4)
