"""The OpenAI-compatible server on the shipped pair, driven over HTTP by the `openai` client and by raw httpx.

One server (uvicorn in a thread, on a free port of 127.0.0.1) serves every test but the SIGTERM one, which starts
`python -m kdtree_jax.serve` as a subprocess. Greedy references come from `Engine.generate` on the same engine,
computed before the server starts. What no request reaches (the API key check, /metrics' form) is tested in-process
on an app around a serving engine that compiles nothing.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import jax
import openai
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from kdtree_jax import serve
from kdtree_jax.cli import UsageError
from kdtree_jax.decode.budget import DEFAULT_BUDGET
from kdtree_jax.decode.engine import Engine
from kdtree_jax.generate import DEFAULT_DRAFTER, DEFAULT_TARGET
from kdtree_jax.serve import DEFAULT_HOST, DEFAULT_PORT, _check_args, build_parser, make_server
from kdtree_jax.server import ServerSettings, build_app
from kdtree_jax.server.text import TextStream
from kdtree_jax.serving import AsyncServingEngine, ServeConfig, ServingEngine

MODEL = "kdtree-mini"
MODE = "ddtree"
# prefill programs: buckets 32..256 of 1 or 2 rows (8, not the default 15: each is seconds of compiling on a CPU)
SERVE = {"max_slots": 4, "max_context": 256, "rounds_per_step": 4, "max_queue": 16, "prefill_batch": 2,
         "min_prompt_bucket": 32}
REF_TOKENS = 24  # greedy reference length; shorter requests compare with its prefix
PROMPTS = ("def fibonacci(n):\n", "class Stack:\n    def __init__(self):\n", "import os\nimport sys\n\n",
           "def quicksort(xs):\n    ")
CHAT = "Write a function that adds two numbers."
SHUTDOWN_TIMEOUT_S = 2.0  # the subprocess server's --shutdown-timeout
STARTUP_DEADLINE_S = 300.0  # the subprocess loads, then compiles (from the persistent cache when warm)
CANCEL_MARGIN_S = 5.0  # beyond the shutdown timeout, for the cancelled stream to end: a step or two on this CPU
EXIT_MARGIN_S = 15.0  # beyond the shutdown timeout, for the process to exit: the above, then interpreter teardown
CHILD_EXIT_S = 5.0  # after the server exited, for its child processes to be gone
DISCONNECT_DEADLINE_S = 2.0  # a dropped stream's slot is free within this (a few steps on this CPU)
PROBE_TIMEOUT_S = 1.0  # a /health probe
HTTP_TIMEOUT_S = 120.0  # one request, queueing included
SERVER_UP_S = 60.0  # uvicorn's own startup (the engine is warmed up before it) and its shutdown
LONG_REQUEST = {"max_tokens": 200, "extra_body": {"ignore_eos": True}}  # runs for many steps unless cancelled


# ---- fixtures ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine():
    return Engine.load(DEFAULT_TARGET, DEFAULT_DRAFTER)


class Reference:
    """Greedy `Engine.generate` outputs by prompt ("chat": the chat prompt), and their text as the server shows it
    (special tokens, such as the stop tokens, add no text)."""

    def __init__(self, tokenizer, outputs: dict):
        self._tokenizer, self._outputs = tokenizer, outputs
        self._special = set(tokenizer.special_tokens.values())

    def ids(self, key: str, n: int = REF_TOKENS) -> list[int]:
        return self._outputs[key].token_ids[:n]

    def text(self, key: str, n: int = REF_TOKENS) -> str:
        return self._tokenizer.decode([t for t in self.ids(key, n) if t not in self._special])

    def finish_reason(self, key: str) -> str:
        return self._outputs[key].finish_reason

    def check(self, key: str, token_ids: list[int], text: str, n: int = REF_TOKENS) -> None:
        """A greedy answer of at most n tokens is the reference's first n tokens and their text."""
        assert token_ids == self.ids(key, n)
        assert text == self.text(key, n)


@pytest.fixture(scope="module")
def reference(engine) -> Reference:
    """All references in one batch: one compile."""
    chat_ids = engine.encode_prompts([CHAT], chat=True)[0]
    assert chat_ids == engine.tokenizer.encode_chat([{"role": "user", "content": CHAT}])  # what the server renders
    ids = engine.encode_prompts(list(PROMPTS), chat=False) + [chat_ids]
    out = engine.generate(ids, max_new_tokens=REF_TOKENS, mode=MODE, temperature=0.0).outputs
    return Reference(engine.tokenizer, dict(zip([*PROMPTS, "chat"], out)))


@contextlib.contextmanager
def serve_in_thread(app, stop_within: float = SERVER_UP_S):
    """uvicorn on a free port of 127.0.0.1, in a thread of this process; yields the base URL. At exit the server
    gets `stop_within` seconds to shut down (a daemon thread: one that hangs is left behind)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = make_server(app, host="127.0.0.1", port=port, shutdown_timeout=SHUTDOWN_TIMEOUT_S, log_level="warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + SERVER_UP_S
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=stop_within)


@pytest.fixture(scope="module")
def base_url(engine, reference):
    core = ServingEngine(engine, ServeConfig(mode=MODE, budget=DEFAULT_BUDGET, **SERVE))
    core.warm_up()
    app = build_app(AsyncServingEngine(core), engine.tokenizer, ServerSettings(model_names=(MODEL,)))
    with serve_in_thread(app) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0)


def _aclient(base_url):
    return openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0)


def _health(base_url) -> dict:
    return httpx.get(base_url + "/health").json()


def _metrics(base_url) -> dict:
    """{(sample name, labels without model_name): value}."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(base_url + "/metrics").text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


def _extra(obj, name):
    return (obj.model_extra or {})[name]


# ---- completions and chat ----------------------------------------------------------------------------------------
@pytest.mark.heavy
def test_completion_greedy_matches_engine_generate(client, reference):
    for prompt in PROMPTS[:2]:
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=REF_TOKENS, temperature=0,
                                      extra_body={"return_token_ids": True})
        c = r.choices[0]
        reference.check(prompt, _extra(c, "token_ids"), c.text)
        assert c.finish_reason == reference.finish_reason(prompt)


@pytest.mark.heavy
def test_completion_stream_matches_engine_generate(client, reference):
    prompt = PROMPTS[2]
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=REF_TOKENS, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"return_token_ids": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    ids = [t for c in chunks if c.choices for t in _extra(c.choices[0], "token_ids")]
    reference.check(prompt, ids, text)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == reference.finish_reason(prompt)
    assert len([c for c in chunks if c.choices]) > 2  # streamed in pieces, not at once
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ids)


@pytest.mark.heavy
def test_chat_greedy_matches_engine_generate(client, reference):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": CHAT}],
                                       max_tokens=REF_TOKENS, temperature=0, extra_body={"return_token_ids": True})
    c = r.choices[0]
    reference.check("chat", _extra(c, "token_ids"), c.message.content)
    assert c.message.role == "assistant" and c.finish_reason == reference.finish_reason("chat")


@pytest.mark.heavy
def test_chat_stream_matches_engine_generate(client, reference):
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": CHAT}],
                                                 max_tokens=REF_TOKENS, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == reference.text("chat")
    assert chunks[-1].choices[0].finish_reason == reference.finish_reason("chat")


@pytest.mark.heavy
def test_response_carries_usage_and_speculative_stats(client, engine):
    prompt, n = PROMPTS[0], REF_TOKENS // 2
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0)
    assert r.usage.prompt_tokens == len(engine.tokenizer.encode(prompt))
    assert r.usage.completion_tokens == n and r.usage.total_tokens == r.usage.prompt_tokens + n
    assert r.choices[0].finish_reason == "length"
    spec = _extra(r, "spec_decode")
    steps, accepted = spec["num_spec_steps"], spec["num_accepted_tokens"]
    assert steps >= 1 and 0 <= accepted <= spec["num_draft_tokens"] == steps * DEFAULT_BUDGET
    assert spec["mean_acceptance_length"] == pytest.approx((accepted + steps) / steps)


@pytest.mark.heavy
def test_a_repeated_prefix_is_reported_as_cached_tokens(client, base_url, engine):
    """The second request that shares a long prefix reports the cached part in usage (OpenAI's
    prompt_tokens_details.cached_tokens, streamed too) and in /metrics, and gives the same tokens as the first."""
    shared = "".join(PROMPTS) * 5
    assert len(engine.tokenizer.encode(shared)) > 2 * ServeConfig.page_size
    first = client.completions.create(model=MODEL, prompt=shared, max_tokens=8, temperature=0)
    before = _metrics(base_url)
    again = client.completions.create(model=MODEL, prompt=shared, max_tokens=8, temperature=0)
    after = _metrics(base_url)
    cached = again.usage.prompt_tokens_details.cached_tokens
    page = ServeConfig.page_size
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # no earlier request shares a full page of it
    assert cached == (again.usage.prompt_tokens - 1) // page * page > 0
    assert again.choices[0].text == first.choices[0].text
    grew = {k: after[(k, ())] - before.get((k, ()), 0)
            for k in ("kdtree:prefix_cache_queries_total", "kdtree:prefix_cache_hits_total")}
    assert grew == {"kdtree:prefix_cache_queries_total": again.usage.prompt_tokens,
                    "kdtree:prefix_cache_hits_total": cached}
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": shared}], max_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    chat = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": shared}], max_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens == chat[-1].usage.prompt_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 0  # the chat template's tokens come first
    assert chat[-1].usage.prompt_tokens_details.cached_tokens == (chat[-1].usage.prompt_tokens - 1) // page * page


@pytest.mark.heavy
def test_n_greedy_choices_are_equal_and_share_the_prompts_pages(client, base_url, engine):
    """n greedy samples of one prompt: n equal choices, the prompt counted once in usage, and every sibling found
    the prompt's full pages in the prefix cache (submitted once the first had prefilled them)."""
    prompt, n, page = PROMPTS[1] * 10, 4, ServeConfig.page_size
    prompt_tokens = len(engine.tokenizer.encode(prompt))
    assert prompt_tokens > page
    before = _metrics(base_url)
    r = client.completions.create(model=MODEL, prompt=prompt, n=n, max_tokens=8, temperature=0)
    after = _metrics(base_url)
    assert [c.index for c in r.choices] == list(range(n)) and len({c.text for c in r.choices}) == 1
    assert r.usage.prompt_tokens == prompt_tokens and r.usage.completion_tokens == 8 * n
    hits = after[("kdtree:prefix_cache_hits_total", ())] - before.get(("kdtree:prefix_cache_hits_total", ()), 0)
    assert hits >= (n - 1) * ((prompt_tokens - 1) // page * page)
    alone = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    assert alone.choices[0].text == r.choices[0].text


@pytest.mark.heavy
def test_n_sampled_choices_with_a_seed_are_reproducible_and_differ(client):
    """n sampled choices under one seed: the same n texts on every request, not all equal, the first that of the
    same request with n = 1."""
    kw = {"model": MODEL, "messages": [{"role": "user", "content": CHAT}], "max_tokens": 16, "temperature": 1.0,
          "seed": 2024}
    first = [c.message.content for c in client.chat.completions.create(n=4, **kw).choices]
    again = [c.message.content for c in client.chat.completions.create(n=4, **kw).choices]
    assert first == again and len(set(first)) > 1, first
    assert client.chat.completions.create(**kw).choices[0].message.content == first[0]


@pytest.mark.heavy
def test_stop_string_cuts_text_and_ends_request(client, reference):
    prompt = PROMPTS[0]
    full = reference.text(prompt)
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    want = full[: full.index(stop)]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=REF_TOKENS, temperature=0, stop=[stop])
    assert (r.choices[0].text, r.choices[0].finish_reason, _extra(r.choices[0], "stop_reason")) == (want, "stop", stop)
    assert r.usage.completion_tokens < REF_TOKENS
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=REF_TOKENS, temperature=0,
                                            stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want and chunks[-1].choices[0].finish_reason == "stop"


def test_stop_string_spanning_tokens_is_found(engine):
    tok = engine.tokenizer
    ids = tok.encode("def add(a, b):\n    return a + b\n")
    assert not any("n a" in tok.decode([t]) for t in ids)  # the stop string spans tokens
    text = TextStream(tok, stop=["n a +"])
    out = "".join(text.feed([t]) for t in ids) + text.finish()
    assert out == "def add(a, b):\n    retur" and text.stop_string == "n a +"
    assert tok.decode(text.token_ids) == "def add(a, b):\n    return a +"  # tokens up to the one completing it
    assert text.feed(tok.encode(" b")) == "" and text.finish() == ""  # nothing after a stop string


# ---- concurrency, queue, disconnect ------------------------------------------------------------------------------
async def _peak_running(base_url: str, stop: asyncio.Event) -> int:
    """The most requests /health reported running, polled until `stop`."""
    peak = 0
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as hc:
        while not stop.is_set():
            peak = max(peak, (await hc.get("/health")).json()["running"])
            await asyncio.sleep(0.01)
    return peak


@pytest.mark.heavy
def test_sixteen_concurrent_mixed_requests_over_four_slots_all_correct(base_url, reference):
    """Greedy requests (completion / chat, streamed or not, various lengths) equal Engine.generate; seeded sampled
    requests equal the same request sent alone; and they ran together (the server's /health saw several running at
    once: a server that ran them one at a time would pass the rest)."""
    sampled = {"temperature": 0.8, "top_p": 0.9, "extra_body": {"top_k": 20, "return_token_ids": True}}

    async def completion(ac, prompt, n, stream, **kw):
        kw = {"temperature": 0, "extra_body": {"return_token_ids": True}, **kw}
        if not stream:
            r = await ac.completions.create(model=MODEL, prompt=prompt, max_tokens=n, **kw)
            return r.choices[0].text, _extra(r.choices[0], "token_ids")
        text, ids = "", []
        async for c in await ac.completions.create(model=MODEL, prompt=prompt, max_tokens=n, stream=True, **kw):
            text, ids = text + c.choices[0].text, ids + _extra(c.choices[0], "token_ids")
        return text, ids

    async def chat(ac, n):
        r = await ac.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": CHAT}], max_tokens=n,
                                             temperature=0, extra_body={"return_token_ids": True})
        return r.choices[0].message.content, _extra(r.choices[0], "token_ids")

    async def main():
        ac = _aclient(base_url)
        greedy = [(p, n, s) for p in PROMPTS for n, s in ((REF_TOKENS, False), (REF_TOKENS // 2, True))]
        jobs = [completion(ac, p, n, s) for p, n, s in greedy]
        jobs += [chat(ac, REF_TOKENS), chat(ac, REF_TOKENS // 3)]
        seeds = [(PROMPTS[i % len(PROMPTS)], 100 + i, i % 2 == 0) for i in range(6)]
        jobs += [completion(ac, p, REF_TOKENS, s, seed=seed, **sampled) for p, seed, s in seeds]
        assert len(jobs) >= 16
        stop = asyncio.Event()
        watcher = asyncio.create_task(_peak_running(base_url, stop))
        together = await asyncio.gather(*jobs)
        stop.set()
        alone = [await completion(ac, p, REF_TOKENS, False, seed=seed, **sampled) for p, seed, _ in seeds]
        return greedy, together, alone, await watcher

    greedy, together, alone, peak = asyncio.run(main())
    assert peak > 1, f"the server never ran two requests at once (peak {peak})"
    for (prompt, n, _), (text, ids) in zip(greedy, together):
        reference.check(prompt, ids, text, n)
    for (text, ids), n in zip(together[len(greedy) : len(greedy) + 2], (REF_TOKENS, REF_TOKENS // 3)):
        reference.check("chat", ids, text, n)
    assert together[len(greedy) + 2 :] == alone


@pytest.mark.heavy
def test_full_queue_answers_503_and_the_rest_complete(base_url, reference):
    n_requests = 2 * (SERVE["max_slots"] + SERVE["max_queue"])
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": REF_TOKENS, "temperature": 0,
            "return_token_ids": True}

    async def main():
        async with httpx.AsyncClient(base_url=base_url, timeout=HTTP_TIMEOUT_S) as hc:
            return await asyncio.gather(*(hc.post("/v1/completions", json=body) for _ in range(n_requests)))

    responses = asyncio.run(main())
    refused = [r for r in responses if r.status_code == 503]
    served = [r for r in responses if r.status_code == 200]
    assert refused and served and len(refused) + len(served) == n_requests
    err = refused[0].json()["error"]
    assert err["code"] == "queue_full" and err["type"] == "server_error" and "Retry-After" in refused[0].headers
    for r in served:
        c = r.json()["choices"][0]
        reference.check(PROMPTS[1], c["token_ids"], c["text"])


@pytest.mark.heavy
def test_disconnect_mid_stream_frees_the_slot(client, base_url):
    aborted = _aborted(base_url)
    assert _health(base_url)["running"] == 0
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[0], stream=True, **LONG_REQUEST)
    for _, chunk in zip(range(2), stream):
        assert chunk.choices[0].finish_reason is None
    assert _health(base_url)["running"] == 1
    stream.close()
    _freed_and_aborted(base_url, aborted)


def _aborted(base_url) -> float:
    return _metrics(base_url).get(("kdtree:request_success_total", (("finished_reason", "abort"),)), 0)


def _freed_and_aborted(base_url, aborted_before: float) -> None:
    """After a client went away: its slot and pages come back, and it is counted as aborted, within the deadline."""
    deadline = time.monotonic() + DISCONNECT_DEADLINE_S
    while _health(base_url)["running"] and time.monotonic() < deadline:
        time.sleep(0.02)
    health = _health(base_url)
    assert health["running"] == 0 and health["free_slots"] == SERVE["max_slots"]
    assert health["free_pages"] == health["num_pages"]
    deadline = time.monotonic() + DISCONNECT_DEADLINE_S
    while _aborted(base_url) == aborted_before:
        assert time.monotonic() < deadline, "the dropped request was never counted as aborted"
        time.sleep(0.02)


@pytest.mark.heavy
@pytest.mark.timeout(300)
def test_disconnect_while_waiting_for_a_whole_response_frees_the_slot_and_pages(base_url):
    """A non-streaming request whose client hangs up before the answer: the server cancels it at once."""
    aborted = _aborted(base_url)
    assert _health(base_url)["running"] == 0
    body = json.dumps({"model": MODEL, "prompt": PROMPTS[0], "max_tokens": LONG_REQUEST["max_tokens"],
                       "ignore_eos": True}).encode()
    url = httpx.URL(base_url)
    with socket.create_connection((url.host, url.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        deadline = time.monotonic() + DISCONNECT_DEADLINE_S
        while _health(base_url)["running"] == 0:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.01)
    _freed_and_aborted(base_url, aborted)


# ---- bad input ---------------------------------------------------------------------------------------------------
COMPLETIONS, CHAT_PATH = "/v1/completions", "/v1/chat/completions"
OK = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4}
OK_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": CHAT}], "max_tokens": 4}
BAD_BODIES = {  # name: (path, body (bytes: sent as is), status, param the error names)
    "truncated_json": (COMPLETIONS, b'{"model": "kdtree-mini", "prompt": "def f', 400, None),
    "not_an_object": (COMPLETIONS, b"[1, 2, 3]", 400, None),
    "max_tokens_string": (COMPLETIONS, {**OK, "max_tokens": "4"}, 400, "max_tokens"),
    "prompt_wrong_type": (COMPLETIONS, {**OK, "prompt": {"text": "hi"}}, 400, "prompt"),
    "huge_max_tokens": (COMPLETIONS, {**OK, "max_tokens": 10**12}, 400, "max_tokens"),
    "one_megabyte_prompt": (COMPLETIONS, {**OK, "prompt": "x" * (1 << 20)}, 400, "prompt"),
    "prompt_over_max_context": (COMPLETIONS, {**OK, "prompt": "a = 1\n" * SERVE["max_context"]}, 400, "prompt"),
    "negative_max_tokens": (COMPLETIONS, {**OK, "max_tokens": -5}, 400, "max_tokens"),
    "n_above_sixteen": (COMPLETIONS, {**OK, "n": 17}, 400, "n"),
    "temperature_nan": (COMPLETIONS, json.dumps({**OK, "temperature": float("nan")}).encode(), 400, "temperature"),
    "temperature_negative": (COMPLETIONS, {**OK, "temperature": -0.5}, 400, "temperature"),
    "top_p_zero": (COMPLETIONS, {**OK, "top_p": 0}, 400, "top_p"),
    "top_k_above_cap": (COMPLETIONS, {**OK, "top_k": 10**6}, 400, "top_k"),
    "negative_seed": (COMPLETIONS, {**OK, "seed": -1}, 400, "seed"),
    "stop_wrong_type": (COMPLETIONS, {**OK, "stop": 5}, 400, "stop"),
    "token_id_outside_vocab": (COMPLETIONS, {**OK, "prompt": [1, 2, 10**9]}, 400, "prompt"),
    "empty_prompt": (COMPLETIONS, {**OK, "prompt": ""}, 400, "prompt"),
    "logprobs_asked": (COMPLETIONS, {**OK, "logprobs": 3}, 400, "logprobs"),
    "unknown_model": (COMPLETIONS, {**OK, "model": "gpt-5"}, 404, "model"),
    "unknown_role": (CHAT_PATH, {**OK_CHAT, "messages": [{"role": "wizard", "content": "hi"}]}, 400,
                     "messages[0].role"),
    "empty_messages": (CHAT_PATH, {**OK_CHAT, "messages": []}, 400, "messages"),
    "message_without_content": (CHAT_PATH, {**OK_CHAT, "messages": [{"role": "user"}]}, 400, "messages[0].content"),
    "chat_max_tokens_zero": (CHAT_PATH, {**OK_CHAT, "max_tokens": 0}, 400, "max_tokens"),
}


@pytest.mark.heavy
@pytest.mark.parametrize("case", sorted(BAD_BODIES))
def test_malformed_body_gets_4xx_and_server_still_answers(case, base_url, client, reference):
    path, body, status, param = BAD_BODIES[case]
    kw = {"content": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, bytes) else {
        "json": body}
    r = httpx.post(base_url + path, timeout=HTTP_TIMEOUT_S, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["param"] == param
    if "max_context" in case or "huge" in case or "megabyte" in case:
        assert str(SERVE["max_context"]) in err["message"]  # says the limit
    after = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=4, temperature=0)
    assert after.choices[0].text == reference.text(PROMPTS[3], 4)


@pytest.mark.heavy
def test_unknown_fields_are_ignored(base_url, reference):
    r = httpx.post(base_url + COMPLETIONS, json={**OK, "temperature": 0, "frobnicate": [1, 2], "min_p": 0.1},
                   timeout=HTTP_TIMEOUT_S)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == reference.text(PROMPTS[0], 4)


@pytest.mark.heavy
def test_unknown_path_is_404_in_openai_shape(base_url):
    r = httpx.get(base_url + "/v1/engines")
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"


# ---- models, health, metrics -------------------------------------------------------------------------------------
@pytest.mark.heavy
def test_models_lists_the_served_name(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL] and _extra(models[0], "max_model_len") == SERVE["max_context"]


@pytest.mark.heavy
def test_health_reports_running_waiting_free_slots_and_free_pages(base_url):
    r = httpx.get(base_url + "/health")
    assert r.status_code == 200
    body = r.json()
    assert body["num_pages"] > 0 and body["page_size"] == ServeConfig.page_size
    assert body == {"status": "ok", "running": 0, "waiting": 0, "free_slots": SERVE["max_slots"],
                    "max_slots": SERVE["max_slots"], "free_pages": body["num_pages"], "num_pages": body["num_pages"],
                    "page_size": ServeConfig.page_size}


@pytest.mark.heavy
def test_metrics_count_tokens_speculation_and_latency(client, base_url):
    before = _metrics(base_url)
    r = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=12, temperature=0)
    after = _metrics(base_url)
    spec = _extra(r, "spec_decode")

    def grew(name, labels=()):
        return after[(name, labels)] - before.get((name, labels), 0)

    assert grew("kdtree:prompt_tokens_total") == r.usage.prompt_tokens
    assert grew("kdtree:generation_tokens_total") == r.usage.completion_tokens
    assert grew("kdtree:spec_decode_num_drafts_total") == spec["num_spec_steps"]
    assert grew("kdtree:spec_decode_num_draft_tokens_total") == spec["num_draft_tokens"]
    assert grew("kdtree:spec_decode_num_accepted_tokens_total") == spec["num_accepted_tokens"]
    assert grew("kdtree:request_success_total", (("finished_reason", "length"),)) == 1
    for hist in ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds"):
        assert grew(f"kdtree:{hist}_count") == 1 and grew(f"kdtree:{hist}_sum") > 0
    assert after[("kdtree:num_requests_running", ())] == 0 and after[("kdtree:num_requests_waiting", ())] == 0
    # idle: every page back in the pool, none preempted at this load
    assert after[("kdtree:kv_cache_usage_perc", ())] == 0 and after[("kdtree:num_free_pages", ())] > 0
    assert after[("kdtree:num_preemptions_total", ())] == 0
    assert after[("kdtree:kv_cache_pool_bytes", ())] > 0  # the pools' bytes, as the start-up line reports them


# ---- the command line --------------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["--engine-process", "--no-engine-process"])
def test_a_pool_too_small_for_one_request_stops_the_server_naming_the_flags(where):
    """The engine refuses the pool; from the engine process the same one-line error reaches the server."""
    args = build_parser().parse_args(["--num-pages", "2", "--page-size", "16", "--max-context", "512", where])
    _check_args(args)
    with pytest.raises(serve.UsageError, match="--num-pages or --gpu-memory-utilization.*--max-context"):
        serve.load(args)


def test_cli_defaults_serve_the_shipped_pair_on_localhost_8000():
    args = build_parser().parse_args([])
    _check_args(args)
    assert (args.checkpoint, args.drafter, args.mode) == (DEFAULT_TARGET, DEFAULT_DRAFTER, "ddtree")
    assert (args.host, args.port, args.served_model_name) == (DEFAULT_HOST, DEFAULT_PORT, [MODEL])
    table = build_parser().parse_args(["--budget", "1:64,4:ar", "--max-model-len", "512", "--max-num-seqs", "8"])
    assert (table.budget, table.max_context, table.max_slots) == ({1: 64, 4: "ar"}, 512, 8)
    assert build_parser().parse_args(["--budget", "auto"]).budget == "auto"
    for bad in ("1:64,4", "1:x", "one:8"):  # a pair without ':', a budget or a slot count that is no integer
        with pytest.raises(UsageError, match="slots:budget|integer or 'auto'"):
            build_parser().parse_args(["--budget", bad])


def test_help_states_the_slot_tables_defaults():
    """The scheduling flags left unset take ServeConfig's values, and --help says which."""
    entries = {}  # flag -> its help text, whitespace collapsed
    for block in re.split(r"\n(?=  -)", build_parser().format_help()):
        head = re.split(r"\s{2,}", block.strip())[0]
        for flag in re.findall(r"(?:^|, )(--[a-z-]+)", head):
            entries[flag] = " ".join(block.split())
    defaults = {f.name: f.default for f in dataclasses.fields(ServeConfig)}
    for name in ("max_slots", "max_context", "max_queue", "rounds_per_step", "prefill_batch", "min_prompt_bucket"):
        flag = "--" + name.replace("_", "-")
        assert re.search(rf"default: {defaults[name]}(?![\d.])", entries[flag]), entries[flag]
    assert "ServeConfig" not in build_parser().format_help()


def test_api_key_from_the_flag_else_the_environment(monkeypatch):
    monkeypatch.delenv(serve.API_KEY_ENV, raising=False)
    for argv, want in (([], None), (["--api-key", "sk-flag"], "sk-flag")):
        args = build_parser().parse_args(argv)
        _check_args(args)
        assert args.api_key == want
    monkeypatch.setenv(serve.API_KEY_ENV, "sk-env")
    for argv, want in (([], "sk-env"), (["--api-key", "sk-flag"], "sk-flag")):
        args = build_parser().parse_args(argv)
        _check_args(args)
        assert args.api_key == want
    assert "sk-env" not in build_parser().format_help()  # --help names the variable, never its value


def test_loop_graphs_flag_only_where_a_gpu_backend_can_start(monkeypatch):
    """--loop-graphs sets XLA's GPU-only flag where a CUDA or ROCm plugin is installed and JAX_PLATFORMS allows a GPU;
    on a CPU-only install it sets nothing (so nothing GPU-only shows up in the XLA_FLAGS the server logs)."""
    calls = []
    monkeypatch.setattr(serve, "enable_loop_graphs", lambda: calls.append("set") or True)
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setattr(serve, "jax_plugin_names", lambda: {"jax_plugins.xla_cuda13"})
    assert serve.loop_graphs(True) and calls == ["set"]
    assert not serve.loop_graphs(False) and calls == ["set"]
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert not serve.loop_graphs(True) and calls == ["set"]
    monkeypatch.delenv("JAX_PLATFORMS")
    monkeypatch.setattr(serve, "jax_plugin_names", lambda: set())  # a CPU-only install
    assert not serve.loop_graphs(True) and calls == ["set"]


# ---- what no request reaches: an app around a serving engine left cold ------------------------------------------
API_KEY = "sk-kdtree-test"


@pytest.fixture
def idle_app(engine):
    """A TestClient for the app, API_KEY required, around a serving engine that no request reaches: nothing compiles
    (Engine.load is what it costs)."""
    core = ServingEngine(engine, ServeConfig(mode=MODE, budget=DEFAULT_BUDGET, **SERVE))
    app = build_app(AsyncServingEngine(core), engine.tokenizer, ServerSettings(model_names=(MODEL,), api_key=API_KEY))
    with TestClient(app) as http:
        yield http


@pytest.mark.timeout(120)
def test_api_key_guards_every_v1_route(idle_app):
    """Without `Authorization: Bearer <key>` a /v1 route answers 401 in OpenAI's error shape (the key missing or
    wrong); with it the request reaches its endpoint. /health and /metrics stay open."""
    body = {"model": "other-model", "prompt": "x", "max_tokens": 1}
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                         ("GET", "/v1/nothing-here")):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
            r = idle_app.request(method, path, json=body if method == "POST" else None, headers=headers)
            assert r.status_code == 401, (path, headers, r.text)
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
            assert error["code"] == (None if not headers else "invalid_api_key")
    keyed = {"Authorization": f"Bearer {API_KEY}"}
    assert idle_app.get("/v1/models", headers=keyed).json()["data"][0]["id"] == MODEL
    r = idle_app.post(COMPLETIONS, json=body, headers=keyed)  # past the key: the endpoint's own 404
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert idle_app.get("/health").status_code == 200 and idle_app.get("/metrics").status_code == 200


@pytest.mark.timeout(120)
def test_openai_client_with_the_api_key(idle_app):
    def client(key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=str(idle_app.base_url) + "/v1", api_key=key, http_client=idle_app,
                             max_retries=0)

    assert [m.id for m in client(API_KEY).models.list()] == [MODEL]
    with pytest.raises(openai.AuthenticationError):
        client("sk-wrong").models.list()


@pytest.mark.timeout(120)
def test_metrics_have_no_created_series(idle_app):
    text = idle_app.get("/metrics").text
    assert "kdtree:prompt_tokens_total" in text and "kdtree:e2e_request_latency_seconds_count" in text
    assert "_created" not in text


@pytest.mark.heavy
def test_sigterm_stops_accepting_cancels_within_the_bound_and_exits_zero(tmp_path):
    """A request still streaming at SIGTERM: the port closes at once, the request is cancelled after
    --shutdown-timeout and its stream still ends well-formed, the engine process (the default) stops, and the server
    process exits 0."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "KDTREE_COMPILATION_CACHE": jax.config.jax_compilation_cache_dir or "off"}
    cmd = [sys.executable, "-m", "kdtree_jax.serve", "--port", str(port), "--shutdown-timeout",
           str(SHUTDOWN_TIMEOUT_S), *(f"--{k.replace('_', '-')}={v}" for k, v in SERVE.items())]
    with open(tmp_path / "serve.log", "w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            _wait_healthy(url, proc, log)
            children = _children(proc.pid)
            assert children, "no engine process"
            lines, reader = _stream_lines(url, {"model": MODEL, "prompt": PROMPTS[0], "stream": True,
                                                "max_tokens": SERVE["max_context"] - 16, "ignore_eos": True})
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            assert _refuses_connections(url, within=SHUTDOWN_TIMEOUT_S), "still accepting after SIGTERM"
            reader.join(timeout=SHUTDOWN_TIMEOUT_S + CANCEL_MARGIN_S)
            assert not reader.is_alive(), "the running request outlived the shutdown timeout"
            code = proc.wait(timeout=SHUTDOWN_TIMEOUT_S + EXIT_MARGIN_S - (time.monotonic() - t0))
            assert code == 0, _tail(log)
            deadline = time.monotonic() + CHILD_EXIT_S  # the resource tracker exits once the server has
            while [pid for pid in children if _alive(pid)] and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not [pid for pid in children if _alive(pid)], "the engine process outlived the server"
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    events = [json.loads(x[len("data: "):]) for x in lines if x.startswith("data: {")]
    assert lines[-1] == "data: [DONE]" and events[-1]["choices"][0]["finish_reason"] in ("length", "abort")


def _children(pid: int) -> list[int]:
    """The child processes of `pid` (Linux /proc)."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(x) for x in f.read().split()]


def _alive(pid: int) -> bool:
    """A process that has not exited (a zombie left unreaped counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _stream_lines(url: str, body: dict) -> tuple[list[str], threading.Thread]:
    """Stream a completion in a thread; returns once its first event is in (the SSE lines, the thread)."""
    lines: list[str] = []
    first = threading.Event()

    def read():
        with httpx.stream("POST", url + COMPLETIONS, json=body, timeout=STARTUP_DEADLINE_S) as r:
            for line in r.iter_lines():
                if line:  # events are separated by blank lines
                    lines.append(line)
                    first.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert first.wait(STARTUP_DEADLINE_S), "no streamed event"
    return lines, reader


def _refuses_connections(url: str, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            httpx.get(url + "/health", timeout=PROBE_TIMEOUT_S)
        except httpx.TransportError:
            return True
        time.sleep(0.05)
    return False


def _wait_healthy(url, proc, log) -> None:
    deadline = time.monotonic() + STARTUP_DEADLINE_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the server exited during startup:\n{_tail(log)}"
        try:
            if httpx.get(url + "/health", timeout=PROBE_TIMEOUT_S).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    pytest.fail(f"the server did not start in {STARTUP_DEADLINE_S} s:\n{_tail(log)}")


def _tail(log, n: int = 4000) -> str:
    log.flush()
    log.seek(0)
    return log.read()[-n:]
