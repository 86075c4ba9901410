"""Log-probabilities: each emitted token's raw log-probability and top-k, computed on the device from the logits a
round already has, are the target's in every mode (ar, chain and ddtree agree, and equal a float64 numpy forward
over the produced sequence), raw under a grammar, and reach the OpenAI server in its shapes: chat `logprobs.content`,
the completions `logprobs` object, and `echo` with the prompt's log-probabilities (an lm-eval loglikelihood request),
which a prefix-cache hit does not lose, for every choice of a list of prompts and of `n`.

The shipped pair (trained, float32) serves here, so DDTree rounds accept several tokens: the tests assert it.
"""
from __future__ import annotations

import os

import numpy as np
import openai
import pytest
from test_server import serve_in_thread

from kdtree_jax.checkpoint.hf import HFCheckpoint
from kdtree_jax.decode.engine import Engine
from kdtree_jax.oracles.reference import reference_forward, reference_weights
from kdtree_jax.server import ServerSettings, build_app
from kdtree_jax.serving import AsyncServingEngine, RequestError, RequestParams, ServeConfig, ServingEngine
from kdtree_jax.serving.request import RequestLimits, check_request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = os.path.join(REPO, "checkpoints", "kdtree-mini")
MODEL = "kdtree-mini"
PROMPT = "def fibonacci(n):\n"
LONG = "import os\nimport sys\n\n\nclass Stack:\n    def __init__(self):\n        self.items = []\n\n" * 2
NEW_TOKENS = 16
TOP = 20  # the server's max_logprobs: every program keeps this many alternatives
CROSS_MODE_ATOL = 1e-5  # fp32 values of the same token from the verify pass, the chain and the AR step
REF_ATOL = 5e-5  # fp32 against the float64 forward
SAMPLED = {"temperature": 0.9, "top_p": 0.9, "seed": 7}
SERVE = {"max_slots": 2, "max_context": 160, "mode": "ddtree", "budget": 8, "rounds_per_step": 3, "page_size": 16,
         "max_num_batched_tokens": 32, "min_prompt_bucket": 32, "prefill_batch": 1, "step_widths": (2,),
         "max_logprobs": TOP}


@pytest.fixture(scope="module")
def pair() -> Engine:
    return Engine.load(os.path.join(SHIPPED, "target"), os.path.join(SHIPPED, "drafter"))


@pytest.fixture(scope="module")
def reference():
    """seq -> [len(seq), V] float64 log_softmax of the float64 forward: row p is the distribution of token p + 1."""
    ck = HFCheckpoint.open(os.path.join(SHIPPED, "target"))
    cfg, weights = ck.config, reference_weights(ck)

    def log_softmax(seq: list[int]) -> np.ndarray:
        logits = reference_forward(cfg, weights, np.asarray(seq))
        top = logits.max(-1, keepdims=True)
        return logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))

    return log_softmax


def _check_against_reference(lsm: np.ndarray, first_row: int, entries, k: int) -> None:
    """Entry i is the token at row first_row + i of the float64 log_softmax: its value, and its k alternatives (the
    reference's k best values, each id's own value: a near-tie may order ids differently)."""
    assert entries
    for i, e in enumerate(entries):
        row = lsm[first_row + i]
        assert e.logprob == pytest.approx(row[e.token], abs=REF_ATOL), (i, e.token)
        ids, values = np.array([t for t, _ in e.top]), np.array([v for _, v in e.top])
        assert len(ids) == k and np.all(np.diff(values) <= 0)
        np.testing.assert_allclose(values, np.sort(row)[::-1][:k], atol=REF_ATOL)
        np.testing.assert_allclose(values, row[ids], atol=REF_ATOL)


# ---- the device: every mode, the float64 reference ---------------------------------------------------------------
@pytest.mark.timeout(600)
def test_logprobs_are_the_targets_in_every_mode_greedy_and_sampled(pair, reference):
    """Engine.generate(logprobs=20) in ar, chain and ddtree: the same tokens (greedy, and sampled from one seed), the
    same log-probabilities within 1e-5, and those of a float64 forward over prompt + output."""
    prompt = pair.tokenizer.encode(PROMPT)
    outs = {(mode, temp): pair.generate([prompt], NEW_TOKENS, mode=mode, budget=8, logprobs=TOP,
                                        **({"temperature": 0.0} if temp == 0 else SAMPLED)).outputs[0]
            for mode in ("ar", "chain", "ddtree") for temp in (0.0, SAMPLED["temperature"])}
    for temp in (0.0, SAMPLED["temperature"]):
        ar = outs[("ar", temp)]
        assert len(ar.token_ids) == len(ar.logprobs) == NEW_TOKENS
        for mode in ("chain", "ddtree"):
            got = outs[(mode, temp)]
            assert got.token_ids == ar.token_ids
            assert [e.token for e in got.logprobs] == ar.token_ids
            np.testing.assert_allclose([e.logprob for e in got.logprobs], [e.logprob for e in ar.logprobs],
                                       atol=CROSS_MODE_ATOL, rtol=0)
            np.testing.assert_allclose([[v for _, v in e.top] for e in got.logprobs],
                                       [[v for _, v in e.top] for e in ar.logprobs], atol=CROSS_MODE_ATOL, rtol=0)
        assert outs[("ddtree", temp)].mean_acceptance_length > 1.5  # the tree's accepted paths were read
        _check_against_reference(reference(prompt + ar.token_ids), len(prompt) - 1, ar.logprobs, TOP)
    assert outs[("ar", 0.0)].token_ids != outs[("ar", SAMPLED["temperature"])].token_ids


def _serve_alone(core: ServingEngine, prompt: list[int], params: RequestParams):
    """(record, entries) of one request stepped to its end on a core of its own."""
    rid = core.submit(prompt, params)
    entries, records = [], []
    while not records:
        report = core.step()
        entries += [e for d in report.deltas if d.request_id == rid for e in d.logprobs or ()]
        records += [r for r in report.records if r.request_id == rid]
    return records[0], entries


@pytest.mark.heavy
@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode", ["ar", "chain"])
def test_serving_engine_logprobs_in_ar_and_chain_are_the_targets(pair, reference, mode):
    """The serving engine's ar step (which keeps the drafter's context) and chain step hand out the float64
    forward's values for the sampled tokens, with the top 20."""
    core = ServingEngine(pair, ServeConfig(**{**SERVE, "mode": mode, "overlap": mode == "ar"}))
    prompt = pair.tokenizer.encode(LONG)
    record, entries = _serve_alone(core, prompt, RequestParams(max_new_tokens=NEW_TOKENS, logprobs=TOP,
                                                               ignore_eos=True, **SAMPLED))
    assert [e.token for e in entries] == record.token_ids and len(entries) == NEW_TOKENS
    if mode == "chain":
        assert record.mean_acceptance_length > 1.2
    _check_against_reference(reference(prompt + record.token_ids), len(prompt) - 1, entries, TOP)


@pytest.mark.timeout(60)
def test_a_request_asking_for_logprobs_an_engine_was_not_compiled_for_is_refused():
    params = RequestParams(max_new_tokens=4, logprobs=3)
    limits = RequestLimits(4096, 64, 8, 4, (1,), max_logprobs=None)
    with pytest.raises(RequestError, match="--max-logprobs") as e:
        check_request([1, 2], params, limits, np.random.default_rng(0))
    assert e.value.field == "logprobs"
    limits = RequestLimits(4096, 64, 8, 4, (1,), max_logprobs=2)
    for field, value in (("logprobs", 3), ("prompt_logprobs", 3), ("logprobs", -1), ("logprobs", True)):
        with pytest.raises(RequestError) as e:
            check_request([1, 2], RequestParams(max_new_tokens=4, **{field: value}), limits, np.random.default_rng(0))
        assert e.value.field == field


# ---- the server --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def served(pair):
    """(core, client) of the shipped pair served with --max-logprobs 20."""
    core = ServingEngine(pair, ServeConfig(**SERVE))
    core.warm_up()
    app = build_app(AsyncServingEngine(core), pair.tokenizer, ServerSettings(model_names=(MODEL,)))
    with serve_in_thread(app) as url:
        yield core, openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


class _Entry:
    """A response's entry as the device's: token id, value, (id, value) alternatives."""

    def __init__(self, token, logprob, top):
        self.token, self.logprob, self.top = token, logprob, top


def _chat_entries(tok, content) -> list[_Entry]:
    ids = {tok.token_bytes(i): i for i in range(tok.vocab_size)}
    return [_Entry(ids[bytes(c.bytes)], c.logprob, [(ids[bytes(t.bytes)], t.logprob) for t in c.top_logprobs])
            for c in content]


@pytest.mark.timeout(600)
def test_chat_logprobs_streamed_and_not_are_the_targets(served, pair, reference):
    _, client = served
    tok = pair.tokenizer
    messages = [{"role": "user", "content": "Write a function that adds two numbers."}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=NEW_TOKENS, logprobs=True,
                                       top_logprobs=5, extra_body={"return_token_ids": True, "ignore_eos": True},
                                       **SAMPLED)
    c = r.choices[0]
    ids = c.model_extra["token_ids"]
    entries = _chat_entries(tok, c.logprobs.content)
    assert [e.token for e in entries] == ids and len(ids) == NEW_TOKENS
    assert [x.token for x in c.logprobs.content] == [tok.token_bytes(t).decode("utf-8", "replace") for t in ids]
    prompt = tok.encode_chat(messages)
    _check_against_reference(reference(prompt + ids), len(prompt) - 1, entries, 5)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=NEW_TOKENS, logprobs=True,
                                                 top_logprobs=5, stream=True, extra_body={"ignore_eos": True},
                                                 **SAMPLED))
    streamed = [x for ch in chunks if ch.choices and ch.choices[0].logprobs for x in ch.choices[0].logprobs.content]
    assert [x.model_dump() for x in streamed] == [x.model_dump() for x in c.logprobs.content]
    assert len([ch for ch in chunks if ch.choices and ch.choices[0].logprobs]) > 1  # streamed in pieces
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None


@pytest.mark.timeout(600)
def test_completion_logprobs_streamed_and_not_in_openai_shape(served, pair, reference):
    _, client = served
    tok = pair.tokenizer
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0, logprobs=3,
                                  extra_body={"return_token_ids": True})
    c = r.choices[0]
    ids, lp = c.model_extra["token_ids"], c.logprobs
    assert lp.tokens == [tok.token_bytes(t).decode("utf-8", "replace") for t in ids]
    assert lp.text_offset == list(np.cumsum([0] + [len(t) for t in lp.tokens[:-1]]))
    assert all(len(d) == 3 and max(d, key=d.get) == t for d, t in zip(lp.top_logprobs, lp.tokens))  # greedy
    prompt = tok.encode(PROMPT)
    lsm = reference(prompt + ids)
    np.testing.assert_allclose(lp.token_logprobs, [lsm[len(prompt) - 1 + i, t] for i, t in enumerate(ids)],
                               atol=REF_ATOL, rtol=0)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0,
                                            logprobs=3, stream=True))
    parts = [ch.choices[0].logprobs for ch in chunks if ch.choices and ch.choices[0].logprobs]
    assert len(parts) > 1
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for p in parts for x in getattr(p, field)] == getattr(lp, field)


@pytest.mark.timeout(600)
def test_lm_eval_loglikelihood_request_returns_the_prompts_logprobs(served, pair, reference):
    """`echo: true, logprobs: 1, max_tokens: 0` (lm-eval's loglikelihood): the prompt back with each token's
    log-probability (None first) and its most likely alternative; with max_tokens 1, one more token after it."""
    _, client = served
    tok = pair.tokenizer
    prompt = tok.encode(LONG)
    assert len(prompt) > SERVE["max_num_batched_tokens"]  # prefilled in two chunks: the rows they share count too
    lsm = reference(prompt)
    r = client.completions.create(model=MODEL, prompt=LONG, max_tokens=0, echo=True, logprobs=1, temperature=0)
    c = r.choices[0]
    assert c.text == LONG and c.finish_reason == "length"
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == 0
    lp = c.logprobs
    assert lp.tokens == [tok.token_bytes(t).decode("utf-8", "replace") for t in prompt]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    np.testing.assert_allclose(lp.token_logprobs[1:], [lsm[p - 1, t] for p, t in enumerate(prompt) if p],
                               atol=REF_ATOL, rtol=0)
    greedy = [tok.token_bytes(int(np.argmax(lsm[p - 1]))).decode("utf-8", "replace") for p in range(1, len(prompt))]
    assert [next(iter(d)) for d in lp.top_logprobs[1:]] == greedy  # lm-eval's is_greedy reads these
    one = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, echo=True, logprobs=1, temperature=0)
    o = one.choices[0].logprobs
    assert o.token_logprobs[: len(prompt)] == lp.token_logprobs and len(o.tokens) == len(prompt) + 1
    assert o.token_logprobs[-1] == pytest.approx(lsm[-1].max(), abs=REF_ATOL)
    streamed = list(client.completions.create(model=MODEL, prompt=LONG, max_tokens=0, echo=True, logprobs=1,
                                              temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == LONG
    assert [x for ch in streamed if ch.choices and ch.choices[0].logprobs
            for x in ch.choices[0].logprobs.token_logprobs] == lp.token_logprobs


@pytest.mark.timeout(600)
def test_every_choice_of_a_prompt_list_and_of_n_carries_its_own_logprobs(served, pair, reference):
    """lm-eval batches loglikelihood requests as a list of prompts: each choice echoes its own prompt with that
    prompt's values, usage counting each prompt once and no completion tokens; n sampled choices of one prompt each
    carry their own tokens' values, streamed as whole."""
    _, client = served
    tok = pair.tokenizer
    texts = [PROMPT, "class Stack:\n    def push(self, x):\n"]
    n = 2
    r = client.completions.create(model=MODEL, prompt=texts, n=n, max_tokens=0, echo=True, logprobs=1, temperature=0)
    assert [c.index for c in r.choices] == list(range(len(texts) * n))
    prompts = [tok.encode(t) for t in texts]
    assert r.usage.prompt_tokens == sum(map(len, prompts)) and r.usage.completion_tokens == 0
    for c in r.choices:
        text, prompt = texts[c.index // n], prompts[c.index // n]
        assert c.text == text and c.finish_reason == "length"
        values = c.logprobs.token_logprobs
        assert values[0] is None and len(values) == len(prompt)
        lsm = reference(prompt)
        np.testing.assert_allclose(values[1:], [lsm[p - 1, t] for p, t in enumerate(prompt) if p], atol=REF_ATOL,
                                   rtol=0)
    r = client.completions.create(model=MODEL, prompt=PROMPT, n=n, max_tokens=6, logprobs=2, **SAMPLED,
                                  extra_body={"return_token_ids": True, "ignore_eos": True})
    prompt = tok.encode(PROMPT)
    ids = [c.model_extra["token_ids"] for c in r.choices]
    assert len(ids) == n and ids[0] != ids[1]  # their own seeds: different samples
    for c, out in zip(r.choices, ids):
        lsm = reference(prompt + out)
        assert c.logprobs.tokens == [tok.token_bytes(t).decode("utf-8", "replace") for t in out]
        np.testing.assert_allclose(c.logprobs.token_logprobs, [lsm[len(prompt) - 1 + i, t] for i, t in enumerate(out)],
                                   atol=REF_ATOL, rtol=0)
    streamed = {}
    for ch in client.completions.create(model=MODEL, prompt=PROMPT, n=n, max_tokens=6, logprobs=2, stream=True,
                                        extra_body={"ignore_eos": True}, **SAMPLED):
        for c in ch.choices:
            if c.logprobs:
                streamed.setdefault(c.index, []).extend(c.logprobs.token_logprobs)
    assert [streamed[i] for i in range(n)] == [c.logprobs.token_logprobs for c in r.choices]


@pytest.mark.timeout(600)
def test_a_prefix_cache_hit_does_not_lose_the_prompts_logprobs(served, pair, reference):
    """After a request that leaves the prompt's pages in the prefix cache, an echo request with logprobs computes the
    whole prompt (no cached tokens) and returns every prompt token's value, while a plain one reuses the pages."""
    core, client = served
    tok = pair.tokenizer
    text = "from collections import deque\n\n" + LONG  # its pages are in no cache yet
    prompt = tok.encode(text)
    first = client.completions.create(model=MODEL, prompt=text, max_tokens=2, temperature=0)
    hits = core.prefix_cache_hits
    again = client.completions.create(model=MODEL, prompt=text, max_tokens=2, temperature=0)
    page = SERVE["page_size"]
    assert again.usage.prompt_tokens_details.cached_tokens == (len(prompt) - 1) // page * page > 0
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    echo = client.completions.create(model=MODEL, prompt=text, max_tokens=0, echo=True, logprobs=2, temperature=0)
    assert echo.usage.prompt_tokens_details.cached_tokens == 0
    assert core.prefix_cache_hits == hits + again.usage.prompt_tokens_details.cached_tokens
    values = echo.choices[0].logprobs.token_logprobs
    assert values[0] is None and None not in values[1:] and len(values) == len(prompt)
    lsm = reference(prompt)
    np.testing.assert_allclose(values[1:], [lsm[p - 1, t] for p, t in enumerate(prompt) if p], atol=REF_ATOL, rtol=0)


@pytest.mark.timeout(600)
def test_logprobs_under_a_grammar_are_raw(served, pair, reference):
    """Under structured output the values are the target's unmasked ones: the emitted digits' log-probabilities
    are those of the float64 forward's full softmax, and the alternatives include tokens the grammar forbids."""
    _, client = served
    tok = pair.tokenizer
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=5,
                                  extra_body={"structured_outputs": {"regex": "[0-9]{6}"}, "return_token_ids": True})
    c = r.choices[0]
    ids = c.model_extra["token_ids"]
    assert c.text.isdigit()
    prompt = tok.encode(PROMPT)
    lsm = reference(prompt + ids)
    np.testing.assert_allclose(c.logprobs.token_logprobs, [lsm[len(prompt) - 1 + i, t] for i, t in enumerate(ids)],
                               atol=REF_ATOL, rtol=0)
    forbidden = [t for d in c.logprobs.top_logprobs for t in d if not t.isdigit()]
    assert forbidden  # a masked distribution would give these -inf and leave them out of the top 5


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kwargs, field", [
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": TOP + 1}, "top_logprobs"),
])
def test_bad_chat_logprobs_are_a_400_naming_the_field(served, kwargs, field):
    _, client = served
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       **kwargs)
    assert e.value.body["param"] == field


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kwargs, field", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 2, "logprobs": TOP + 1}, "logprobs"),
    ({"max_tokens": 2, "logprobs": -1}, "logprobs"),
])
def test_bad_completion_logprobs_are_a_400_naming_the_field(served, kwargs, field):
    _, client = served
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, **kwargs)
    assert e.value.body["param"] == field
