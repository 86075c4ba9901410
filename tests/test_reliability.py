"""Reliability of the public `Engine` API: generation up to the context limit, stop tokens, non-finite logits that
appear mid-generation, determinism across engines, processes and batch composition, top-k sampling, and bad input
refused before anything is compiled. docs/faults.md maps every case to its test.

Most tests share one small random pair and one batch of four ragged prompts, so the whole file compiles only a few
programs (the persistent XLA cache set up in conftest.py makes identical programs of a second Engine free).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_utils import drafter_config, random_drafter

from kdtree_jax.checkpoint.weights import init_random, random_hf_weights
from kdtree_jax.decode.engine import ContextTooLongError, Engine
from kdtree_jax.model import config
from kdtree_jax.model.config import ConfigError
from kdtree_jax.oracles.reference import reference_forward

CONTEXT = 48  # max_position_embeddings of the small target: a full-context run stays cheap on CPU
PROMPT_LENS = (6, 8, 7, 5)  # ragged; the longest is request 1, so errors must name the right prompt
MAX_NEW = CONTEXT - max(PROMPT_LENS)  # request 1 ends exactly at the context limit
BLOCK, BUDGET = 4, 8
NEAR_TIE = 1e-4  # float64 top-2 logit gap below which fp32 greedy may legitimately differ
SAMPLED_NEW, TOPK = 12, 2
SAMPLED = dict(temperature=4.0, top_k=TOPK)  # every T > 0 test here: one compiled program per mode
TESTS = os.path.dirname(os.path.abspath(__file__))
SHIPPED = os.path.join(os.path.dirname(TESTS), "checkpoints", "kdtree-mini")


@dataclasses.dataclass
class Small:
    cfg: config.ModelConfig
    seed: int
    engine: Engine
    prompts: list[list[int]]
    ar: object  # GenerationResult, greedy, MAX_NEW tokens
    tree: object  # GenerationResult, greedy ddtree
    batches: dict = dataclasses.field(default_factory=dict)  # mode -> greedy GenerationResult of `prompts`

    def batch(self, mode: str):
        """The greedy result of the shared batch in `mode` (chain is generated on first use)."""
        if mode not in self.batches:
            self.batches[mode] = self.engine.generate(self.prompts, MAX_NEW, mode=mode, budget=BUDGET)
        return self.batches[mode]

    @functools.cached_property
    def weights(self) -> dict[str, np.ndarray]:
        """The HF-named float64 weights of the pair's target, for the numpy reference."""
        return random_hf_weights(self.cfg, self.seed)

    @functools.cached_property
    def plain_engine(self) -> Engine:
        """The same modules without the Pallas verify kernel (cheaper to compile in interpret mode)."""
        return Engine(self.engine.target, self.engine.drafter, None, use_pallas=False)

    def pair(self, cfg=None):
        """A fresh target + drafter with the same weights (optionally under a changed config)."""
        return make_pair(cfg or self.cfg, self.seed)


def small_config() -> config.ModelConfig:
    return config.tiny(eos_token_id=(), max_position_embeddings=CONTEXT, num_hidden_layers=2)


def make_pair(cfg, seed):
    return init_random(cfg, seed=seed), random_drafter(drafter_config(cfg, block_size=BLOCK), seed)


@pytest.fixture(scope="module")
def small() -> Small:
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"small pair seed={seed}")
    rng = np.random.default_rng(seed)
    cfg = small_config()
    target, drafter = make_pair(cfg, seed)
    eng = Engine(target, drafter, None)
    # tokens 1 .. V-2: no pad token 0 and no drafter mask token in the prompts
    prompts = [rng.integers(1, cfg.vocab_size - 1, n).tolist() for n in PROMPT_LENS]
    ar = eng.generate(prompts, MAX_NEW, mode="ar")
    tree = eng.generate(prompts, MAX_NEW, mode="ddtree", budget=BUDGET)
    return Small(cfg, seed, eng, prompts, ar, tree, {"ar": ar, "ddtree": tree})


def _assert_greedy_continuation(cfg, weights, prompt, out):
    """out is the float64 golden model's greedy continuation of prompt (up to a genuine near-tie)."""
    logits = reference_forward(cfg, weights, np.asarray(list(prompt) + list(out[:-1])))  # [T, V]
    for i, tok in enumerate(out):
        row = logits[len(prompt) - 1 + i]
        if int(np.argmax(row)) != tok:
            gap = np.diff(np.sort(row)[-2:])[0]
            assert gap < NEAR_TIE, f"token {i} (position {len(prompt) + i}): got {tok}, greedy {np.argmax(row)}"
            return


# ---- the context limit -----------------------------------------------------------------------------------------
def test_generation_runs_to_the_context_limit(small):
    """prompt + max_new_tokens == max_position_embeddings: every request gets exactly max_new_tokens tokens."""
    assert max(PROMPT_LENS) + MAX_NEW == small.cfg.max_position_embeddings
    for res in (small.ar, small.tree):
        assert [o.finish_reason for o in res.outputs] == ["length"] * 4
        assert [len(o.token_ids) for o in res.outputs] == [MAX_NEW] * 4
        assert all(0 <= t < small.cfg.vocab_size for o in res.outputs for t in o.token_ids)
    assert small.tree.token_ids == small.ar.token_ids
    assert all(o.accept_lengths == [1] * (MAX_NEW - 1) for o in small.ar.outputs)
    # the last positions (YaRN near the limit, cache rows up to the end) are right, not merely self-consistent
    _assert_greedy_continuation(small.cfg, small.weights, small.prompts[1], small.tree.token_ids[1])


@pytest.mark.parametrize("mode", ["ar", "ddtree"])
def test_one_token_past_the_context_is_refused_before_compiling(small, mode):
    eng = Engine(small.engine.target, small.engine.drafter, None)
    with pytest.raises(ContextTooLongError, match=rf"prompt 1 has 8 tokens; with max_new_tokens={MAX_NEW + 1}"):
        eng.generate(small.prompts, MAX_NEW + 1, mode=mode, budget=BUDGET)
    with pytest.raises(ContextTooLongError, match="prompt 1 has"):
        next(eng.generate_stream(small.prompts, MAX_NEW + 1, mode=mode, budget=BUDGET))
    assert issubclass(ContextTooLongError, ValueError)
    assert not eng._compiled


# ---- stop tokens -----------------------------------------------------------------------------------------------
def _expected_with_stops(outs, stops):
    """Each request's tokens cut after its first stop token (included), and the finish reason."""
    want = []
    for out in outs:
        hits = [i for i, t in enumerate(out) if t in stops]
        want.append((out[: hits[0] + 1], "stop") if hits else (out, "length"))
    return want


def test_stop_tokens_end_each_request_at_its_own_stop(small):
    """Two stop ids: one is request 0's very first token (stop at prefill), one appears later in request 1."""
    clean = small.ar.token_ids
    first = clean[0][0]
    later = next(t for t in clean[1][3:] if t != first)
    stops = (first, later)
    target, drafter = small.pair(dataclasses.replace(small.cfg, eos_token_id=stops))
    res = Engine(target, drafter, None).generate(small.prompts, MAX_NEW, mode="ddtree", budget=BUDGET)
    want = _expected_with_stops(clean, stops)
    for b, (o, (tokens, reason)) in enumerate(zip(res.outputs, want)):
        assert (o.token_ids, o.finish_reason) == (tokens, reason), f"request {b}"
        if reason == "stop":  # the stop token is emitted and nothing after it
            assert o.token_ids[-1] in stops and not set(o.token_ids[:-1]) & set(stops)
    assert res.outputs[0].token_ids == [first] and res.outputs[0].accept_lengths == []
    assert res.outputs[1].finish_reason == "stop" and len(res.outputs[1].token_ids) <= clean[1].index(later) + 1


# ---- non-finite logits -----------------------------------------------------------------------------------------
def _poison_target(small, token, value):
    """The small target with embedding row `token` replaced by `value` (NaN / Inf)."""
    target, drafter = small.pair()
    table = np.array(target.embed[...])
    table[token] = value
    target.embed[...] = jnp.asarray(table)
    return target, drafter


def _token_only_one_request_makes(small):
    """(request r, index j >= 2, token t): t first appears in r's output at j, and nowhere else in any prompt/output."""
    outs = small.ar.token_ids
    mask_id = small.engine.drafter.cfg.mask_token_id
    for r, out in enumerate(outs):
        elsewhere = {t for q in range(4) if q != r for t in outs[q] + small.prompts[q]} | set(small.prompts[r])
        for j in range(2, len(out)):
            t = out[j]
            if t not in out[:j] and t not in elsewhere and t not in (0, mask_id):
                return r, j, t
    raise AssertionError(f"every generated token is shared between requests: {outs}")


def test_inf_mid_generation_stops_only_that_request(small):
    """AR: the request whose token hits an Inf embedding row emits that token (sampled from finite logits) and
    then stops with 'nonfinite'; the others are bit-identical to the clean run."""
    r, j, token = _token_only_one_request_makes(small)
    target, drafter = _poison_target(small, token, np.inf)
    res = Engine(target, drafter, None).generate(small.prompts, MAX_NEW, mode="ar")
    for b, (o, clean) in enumerate(zip(res.outputs, small.ar.token_ids)):
        if b == r:
            assert (o.token_ids, o.finish_reason) == (clean[: j + 1], "nonfinite")
        else:
            assert (o.token_ids, o.finish_reason) == (clean, "length"), f"request {b}"


@pytest.mark.heavy
@pytest.mark.parametrize("mode", ["chain", "ddtree"])
def test_nan_mid_generation_in_a_tree_is_isolated_per_request(small, mode):
    """chain / ddtree: the poisoned request stops 'nonfinite' having emitted only clean tokens; every request gets
    exactly what it gets when run alone on the poisoned model (a request whose own drafted chain or tree holds the
    poisoned token also stops: the engine checks every verified slot, see docs/faults.md)."""
    r, j, token = _token_only_one_request_makes(small)
    target, drafter = _poison_target(small, token, np.nan)
    eng = Engine(target, drafter, None)
    res = eng.generate(small.prompts, MAX_NEW, mode=mode, budget=BUDGET)
    got = res.outputs[r]
    assert got.finish_reason == "nonfinite" and 1 <= len(got.token_ids) <= j + 1
    assert got.token_ids == small.ar.token_ids[r][: len(got.token_ids)]
    for b, (o, clean) in enumerate(zip(res.outputs, small.ar.token_ids)):
        assert o.token_ids == clean[: len(o.token_ids)], f"request {b}: emitted a token the clean model would not"
        assert o.finish_reason == ("length" if len(o.token_ids) == MAX_NEW else "nonfinite"), f"request {b}"
        alone = eng.generate([small.prompts[b]], MAX_NEW, mode=mode, budget=BUDGET).outputs[0]
        assert (alone.token_ids, alone.finish_reason) == (o.token_ids, o.finish_reason), f"request {b}"


def test_nonfinite_pad_token_does_not_leak_into_shorter_prompts(small):
    """Prompts are right-padded with token 0; a non-finite embedding row 0 must not reach requests that never use 0."""
    target, drafter = _poison_target(small, 0, np.nan)
    res = Engine(target, drafter, None).generate(small.prompts, MAX_NEW, mode="ar")
    for b, (o, clean) in enumerate(zip(res.outputs, small.ar.token_ids)):
        want = (clean[: clean.index(0) + 1], "nonfinite") if 0 in clean else (clean, "length")
        assert (o.token_ids, o.finish_reason) == want, f"request {b} (prompt length {PROMPT_LENS[b]})"


# ---- determinism -----------------------------------------------------------------------------------------------
@pytest.mark.heavy
def test_sampling_reproducible_across_engine_instances(small):
    """T > 0 ddtree: the same seed gives the same tokens from a second Engine over freshly built modules."""
    kw = dict(mode="ddtree", budget=BUDGET, **SAMPLED)
    a = small.engine.generate(small.prompts, SAMPLED_NEW, seed=1234, **kw)
    other = Engine(*small.pair(), None)
    b = other.generate(small.prompts, SAMPLED_NEW, seed=1234, **kw)
    c = other.generate(small.prompts, SAMPLED_NEW, seed=4321, **kw)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids
    assert a.token_ids != small.ar.token_ids  # it really sampled
    assert all(len(t) == SAMPLED_NEW for t in a.token_ids + c.token_ids)


_CHILD = """
import json, sys
sys.path.insert(0, sys.argv[1])
import conftest  # noqa: F401  (the XLA flags and compilation cache of the test process)
from test_reliability import make_pair, small_config
from kdtree_jax.decode.engine import Engine
a = json.loads(sys.argv[2])
engine = Engine(*make_pair(small_config(), a["seed"]), None)
print(json.dumps(engine.generate(a["prompts"], a["n"], **a["kw"]).token_ids))
"""


@pytest.mark.heavy
def test_sampling_reproducible_across_processes(small, rng):
    """T > 0 ddtree with a fixed seed in two fresh interpreters (different hash seeds): the same tokens, and on CPU
    the tokens of this process. Run here first, so the children load the program from the compilation cache."""
    kw = dict(mode="ddtree", budget=BUDGET, seed=int(rng.integers(1 << 31)), **SAMPLED)
    here = small.engine.generate(small.prompts, SAMPLED_NEW, **kw).token_ids
    arg = json.dumps(dict(seed=small.seed, prompts=small.prompts, n=SAMPLED_NEW, kw=kw))
    children = [subprocess.Popen([sys.executable, "-c", _CHILD, TESTS, arg], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True,
                                 env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONHASHSEED=str(h))) for h in (1, 2)]
    got = []
    for child in children:
        out, err = child.communicate(timeout=300)
        assert child.returncode == 0, err[-3000:]
        got.append(json.loads(out.strip().splitlines()[-1]))
    assert got[0] == got[1]
    if jax.default_backend() == "cpu":
        assert got[0] == here
    assert here != small.ar.token_ids and all(len(t) == SAMPLED_NEW for t in here)  # it really sampled


@pytest.mark.heavy
@pytest.mark.parametrize("mode", ["ar", "chain", "ddtree"])
def test_greedy_request_alone_equals_inside_ragged_batch(small, mode):
    batch = small.batch(mode)
    assert batch.token_ids == small.ar.token_ids  # greedy: every mode gives the ar tokens
    for b, prompt in enumerate(small.prompts):
        alone = small.engine.generate([prompt], MAX_NEW, mode=mode, budget=BUDGET)
        assert alone.token_ids[0] == batch.token_ids[b], f"{mode} request {b} (prompt length {len(prompt)})"


@pytest.mark.heavy
@pytest.mark.parametrize("budget", [1, 16, 64])
def test_greedy_ddtree_alone_equals_ar_at_every_budget(small, rng, budget):
    """Batch 1: a fresh prompt gives the ar tokens at budgets {1, 16, 64} (4: test_engine.py, 8: above), up to the
    context limit. The trees run with the jnp verify attention (use_pallas=False: about half the interpret-mode
    compile; the tree kernels still run, and test_engine.py sweeps the budgets through the verify kernel at
    batch 4)."""
    prompt = rng.integers(1, small.cfg.vocab_size - 1, int(rng.integers(5, 9))).tolist()  # one padded shape: 8
    ar = small.engine.generate([prompt], MAX_NEW, mode="ar").outputs[0]
    out = small.plain_engine.generate([prompt], MAX_NEW, mode="ddtree", budget=budget).outputs[0]
    assert out.token_ids == ar.token_ids
    assert out.finish_reason == "length" and all(1 <= a <= BLOCK for a in out.accept_lengths)


@pytest.mark.heavy
@pytest.mark.parametrize("mode", ["ar", "ddtree"])
def test_top_k_draws_only_from_the_targets_top_k(small, rng, mode):
    """T > 0, top_k=k: every emitted token is among the k largest float64 reference logits for its emitted prefix
    (up to a near-tie at the k-th); at this temperature an unfiltered draw would leave the top-k almost surely."""
    temperature = SAMPLED["temperature"]
    res = small.engine.generate(small.prompts, SAMPLED_NEW, mode=mode, budget=BUDGET, seed=int(rng.integers(1 << 31)),
                                **SAMPLED)
    log_p_inside = 0.0  # log P(every unfiltered draw lands in its top-k set)
    for b, (prompt, out) in enumerate(zip(small.prompts, res.token_ids)):
        assert len(out) == SAMPLED_NEW and res.outputs[b].finish_reason == "length"
        logits = reference_forward(small.cfg, small.weights, np.asarray(prompt + out[:-1]))  # [T, V]
        for i, tok in enumerate(out):
            row = logits[len(prompt) - 1 + i]
            kth = np.sort(row)[-TOPK]
            assert row[tok] >= kth - NEAR_TIE, f"request {b} token {i}: {tok} ranks {int((row > row[tok]).sum())}"
            p = np.exp((row - row.max()) / temperature)
            log_p_inside += np.log(np.sort(p)[-TOPK:].sum() / p.sum())
    assert log_p_inside < np.log(1e-6)
    assert res.token_ids != small.ar.token_ids  # it really sampled


@pytest.mark.slow  # three compiles of the 6-layer pair: ~35 s on 2 CPU cores
@pytest.mark.skipif(not os.path.isdir(SHIPPED), reason="no shipped default checkpoint")
def test_shipped_pair_is_deterministic():
    """The trained default pair: T > 0 reproducible across two loads; greedy alone == inside a ragged batch of 4."""
    paths = (os.path.join(SHIPPED, "target"), os.path.join(SHIPPED, "drafter"))
    eng, again = Engine.load(*paths), Engine.load(*paths)
    with open(os.path.join(SHIPPED, "heldout_prompts.jsonl")) as f:
        texts = [json.loads(line)["text"] for line in f][:4]
    prompts = [eng.tokenizer.encode(t)[:n] for t, n in zip(texts, (16, 9, 12, 14))]  # one padded length: 16
    kw = dict(mode="ddtree", budget=16, temperature=0.8)
    assert eng.generate(prompts, 16, seed=7, **kw).token_ids == again.generate(prompts, 16, seed=7, **kw).token_ids
    batch = eng.generate(prompts, 16, mode="ddtree", budget=16)
    for b, prompt in enumerate(prompts):
        assert eng.generate([prompt], 16, mode="ddtree", budget=16).token_ids[0] == batch.token_ids[b], f"request {b}"


# ---- bad input through the Python API --------------------------------------------------------------------------
BAD_CALLS = [  # (case, generate args (prompts, max_new_tokens), kwargs, exception, message must match)
    ("no prompts", ([], 4), {}, ValueError, "no prompts"),
    ("empty prompt", ([[3, 4], []], 4), {}, ValueError, "prompt 1 is empty"),
    ("token id >= vocab", ([[3, 256]], 4), {}, ValueError, r"prompt 0 has token ids outside the vocabulary.*\[256\]"),
    ("negative token id", ([[3], [-1, 4]], 4), {}, ValueError, r"prompt 1 has token ids outside.*\[-1\]"),
    ("text without tokenizer", (["hello"], 4), {}, ValueError, "text prompts need a tokenizer"),
    ("max_new_tokens 0", ([[3]], 0), {}, ValueError, "max_new_tokens must be >= 1"),
    ("negative budget", ([[3]], 4), dict(budget=-2), ValueError, "budget must be >= 0, got -2"),
    ("negative temperature", ([[3]], 4), dict(temperature=-1.0), ValueError, "temperature must be a finite number >= 0"),
    ("top_p 0", ([[3]], 4), dict(top_p=0.0), ValueError, r"top_p must be in \(0, 1\]"),
    ("top_p > 1", ([[3]], 4), dict(top_p=1.5), ValueError, r"top_p must be in \(0, 1\]"),
    ("top_p NaN", ([[3]], 4), dict(top_p=float("nan")), ValueError, "top_p"),
    ("negative top_k", ([[3]], 4), dict(top_k=-1), ValueError, r"top_k must be an integer >= 0"),
    ("unknown mode", ([[3]], 4), dict(mode="beam"), ValueError, "mode must be one of .*'beam'"),
    ("seed count", ([[3], [4]], 4), dict(seed=[1, 2, 3]), ValueError, "3 seeds for 2 prompts"),
    ("prompt too long", ([[3] * CONTEXT], 1), {}, ContextTooLongError, f"prompt 0 has {CONTEXT} tokens"),
    # a bare string is one text prompt (test_bare_string_is_one_text_prompt); without a tokenizer it is refused
    ("bare string without tokenizer", ("hello", 4), {}, ValueError, "text prompts need a tokenizer"),
    ("float token ids", ([[1.7, 2]], 4), {}, ValueError,
     r"prompt 0 must be a string or a list of integer token ids, got \[1\.7, 2\]"),
    ("bool token ids", ([[3], [True, 2]], 4), {}, ValueError, "prompt 1 must be .* integer token ids"),
    ("bytes prompt", ([b"hi"], 4), {}, ValueError, "prompt 0 must be a string or a list of integer token ids"),
    ("array of prompts", (np.array([[3, 4]]), 4), {}, ValueError, "prompts must be a string or a list .* ndarray"),
]


@pytest.mark.parametrize("case,args,kwargs,exc,match", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_input_is_a_value_error_naming_the_argument(small, case, args, kwargs, exc, match):
    eng = Engine(small.engine.target, small.engine.drafter, None)
    with pytest.raises(exc, match=match) as info:
        eng.generate(*args, **kwargs)
    assert isinstance(info.value, ValueError), case
    with pytest.raises(exc, match=match):
        next(eng.generate_stream(*args, **kwargs))
    assert not eng._compiled  # refused before any compile


def test_mode_needing_a_drafter_without_one(small):
    eng = Engine(small.engine.target, None, None)
    for mode in ("ddtree", "chain"):
        with pytest.raises(ValueError, match=f"mode '{mode}' needs a drafter"):
            eng.generate([[3, 4]], 4, mode=mode)
    with pytest.raises(ValueError, match="stream_every must be >= 1"):
        next(eng.generate_stream([[3, 4]], 4, mode="ar", stream_every=0))
    assert not eng._compiled


@pytest.mark.parametrize("change,match", [
    (dict(hidden_size=32), "hidden_size"),
    (dict(vocab_size=128, mask_token_id=127), "vocab_size"),
    (dict(target_layer_ids=(0, 5), num_target_layers=None), "target_layer_ids"),
    (dict(num_target_layers=5), "num_target_layers"),
])
def test_mismatched_drafter_refused_naming_the_field(small, change, match):
    dcfg = dataclasses.replace(drafter_config(small.cfg, block_size=BLOCK), **change)
    with pytest.raises(ConfigError, match=match) as info:
        Engine(small.engine.target, random_drafter(dcfg, 0), None)
    assert isinstance(info.value, ValueError)


def test_nan_temperature_refused(small):
    """Checked by `RequestParams.check_sampling`, which Engine.generate runs before anything compiles."""
    eng = Engine(small.engine.target, small.engine.drafter, None)
    with pytest.raises(ValueError, match="temperature"):
        eng.generate([[3]], 4, temperature=float("nan"))
    assert not eng._compiled


class _CharTokenizer:
    """A stand-in tokenizer: one token per character."""

    stop_token_ids = ()  # as the small target's eos_token_id: the same compiled program as token-id prompts

    def encode(self, text, allow_special=False):
        return [1 + ord(c) % 250 for c in text]

    def decode(self, ids):
        return " ".join(map(str, ids))


def test_bare_string_is_one_text_prompt(small, rng, monkeypatch):
    """With a tokenizer, generate("text") is generate(["text"]): one request, not one per character."""
    text = "".join(chr(c) for c in rng.integers(ord("a"), ord("z") + 1, int(rng.integers(5, 9))))
    monkeypatch.setattr(small.engine, "tokenizer", _CharTokenizer())
    ids = small.engine.tokenizer.encode(text)
    assert small.engine.encode_prompts(text, chat=False) == [ids]
    bare = small.engine.generate(text, MAX_NEW, mode="ar")
    assert len(bare.outputs) == 1 and len(bare.token_ids[0]) == MAX_NEW
    assert bare.token_ids == small.engine.generate([ids], MAX_NEW, mode="ar").token_ids
    assert bare.texts == [" ".join(map(str, bare.token_ids[0]))]


def test_flat_token_list_refused_naming_prompts(small):
    with pytest.raises(ValueError, match="prompt"):
        Engine(small.engine.target, small.engine.drafter, None).generate([3, 4, 5], 4)
