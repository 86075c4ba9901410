"""The server with the serving engine in its own process (`--engine-process`, the default): greedy answers equal
`Engine.generate`'s in this process, streaming works, a dropped stream frees its slot and pages as the engine reports
them across the process boundary, bad requests are refused in the server process, and an engine process killed mid
stream ends the requests in flight with 503 / an error event at once, and /health with 503.

The server runs in this process (uvicorn in a thread, as in test_server.py) over `serve.load`'s
`EngineProcessClient`; the engine process loads the shipped pair and takes tests/test_server.py's serving config, so
its programs come from the persistent compilation cache once either file has compiled them.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import threading
import time
import types

import httpx
import openai
import pytest
from test_server import (  # noqa: F401  (engine, reference: fixtures)
    CHAT,
    HTTP_TIMEOUT_S,
    LONG_REQUEST,
    MODEL,
    PROMPTS,
    REF_TOKENS,
    SERVE,
    SERVER_UP_S,
    _aborted,
    _extra,
    _freed_and_aborted,
    _health,
    _metrics,
    _peak_running,
    engine,
    reference,
    serve_in_thread,
)

from kdtree_jax import serve
from kdtree_jax.cli import UsageError
from kdtree_jax.decode.budget import DEFAULT_BUDGET
from kdtree_jax.server import build_app
from kdtree_jax.serving import AsyncServingEngine, RequestParams, RequestRecord, ServeConfig, StepReport, TokenDelta
from kdtree_jax.serving.engine_process import DEFAULT_STEP_TIMEOUT_S, EngineProcessClient
from kdtree_jax.serving.frontend import EngineDeadError
from kdtree_jax.serving.request import RequestLimits

DEATH_DEADLINE_S = 10.0  # a killed engine: requests in flight end and new ones are refused within this
DEATH_MESSAGE = "engine process exited with code -9"


def _args():
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in SERVE.items()]
    args = serve.build_parser().parse_args([*flags, "--budget", str(DEFAULT_BUDGET), "--engine-process"])
    serve._check_args(args)
    return args


@contextlib.contextmanager
def process_server(stop_within: float = SERVER_UP_S):
    """(base URL, the engine process's client) of a server whose engine runs in its own process."""
    front, tokenizer, settings = serve.load(_args())
    assert isinstance(front, EngineProcessClient) and front.process.is_alive()
    try:
        with serve_in_thread(build_app(front, tokenizer, settings), stop_within) as url:
            yield url, front
    finally:
        front.close()


@pytest.fixture(scope="module")
def url(reference):
    with process_server() as (base_url, _):
        yield base_url


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


@pytest.mark.heavy
def test_completions_match_engine_generate_streamed_or_not(client, reference):
    prompt = PROMPTS[0]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=REF_TOKENS, temperature=0,
                                  extra_body={"return_token_ids": True})
    reference.check(prompt, _extra(r.choices[0], "token_ids"), r.choices[0].text)
    assert r.choices[0].finish_reason == reference.finish_reason(prompt)
    prompt = PROMPTS[2]
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=REF_TOKENS, temperature=0,
                                            stream=True, extra_body={"return_token_ids": True}))
    reference.check(prompt, [t for c in chunks for t in _extra(c.choices[0], "token_ids")],
                    "".join(c.choices[0].text for c in chunks))
    assert len(chunks) > 2  # streamed in pieces, not at once


@pytest.mark.heavy
def test_chat_matches_engine_generate_streamed_or_not(client, reference):
    messages = [{"role": "user", "content": CHAT}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=REF_TOKENS, temperature=0,
                                       extra_body={"return_token_ids": True})
    reference.check("chat", _extra(r.choices[0], "token_ids"), r.choices[0].message.content)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=REF_TOKENS,
                                                 temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == reference.text("chat")
    assert chunks[-1].choices[0].finish_reason == reference.finish_reason("chat")


@pytest.mark.heavy
def test_concurrent_requests_run_together_and_match(url, reference):
    """Eight greedy requests at once over four slots: each equals Engine.generate, and /health (the engine's
    snapshot) saw several running at once."""

    async def one(ac, prompt, n):
        r = await ac.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0,
                                        extra_body={"return_token_ids": True})
        return r.choices[0].text, _extra(r.choices[0], "token_ids")

    async def main():
        ac = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        jobs = [(p, n) for p in PROMPTS for n in (REF_TOKENS, REF_TOKENS // 2)]
        stop = asyncio.Event()
        watcher = asyncio.create_task(_peak_running(url, stop))
        out = await asyncio.gather(*(one(ac, p, n) for p, n in jobs))
        stop.set()
        return jobs, out, await watcher

    jobs, out, peak = asyncio.run(main())
    assert peak > 1, f"the engine never ran two requests at once (peak {peak})"
    for (prompt, n), (text, ids) in zip(jobs, out):
        reference.check(prompt, ids, text, n)


@pytest.mark.heavy
def test_dropped_stream_frees_slot_and_pages_as_metrics_and_health_show(client, url):
    """While a request runs, /metrics and /health show it holding a slot and pages (the engine's snapshot crossing
    the process boundary); once its client goes away the cancel reaches the engine and everything comes back."""
    aborted = _aborted(url)
    idle = _metrics(url)
    assert idle[("kdtree:kv_cache_usage_perc", ())] == 0
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[1], stream=True, **LONG_REQUEST)
    for _, chunk in zip(range(2), stream):
        assert chunk.choices[0].finish_reason is None
    busy = _metrics(url)
    assert busy[("kdtree:num_requests_running", ())] == 1 and busy[("kdtree:kv_cache_usage_perc", ())] > 0
    assert busy[("kdtree:num_free_pages", ())] < idle[("kdtree:num_free_pages", ())]
    assert _health(url)["running"] == 1
    stream.close()
    _freed_and_aborted(url, aborted)
    after = _metrics(url)
    assert after[("kdtree:num_requests_running", ())] == 0 and after[("kdtree:kv_cache_usage_perc", ())] == 0
    assert after[("kdtree:num_free_pages", ())] == idle[("kdtree:num_free_pages", ())]
    assert after[("kdtree:generation_tokens_total", ())] > idle[("kdtree:generation_tokens_total", ())]


@pytest.mark.heavy
@pytest.mark.parametrize("body, param", [({"top_k": 10**6}, "top_k"), ({"prompt": [1, 2, 10**9]}, "prompt"),
                                         ({"seed": 2**40}, "seed")])
def test_bad_request_is_refused_by_the_server_process(url, body, param):
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4, **body},
                   timeout=HTTP_TIMEOUT_S)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.heavy
def test_killed_engine_process_fails_requests_at_once_and_health_is_503(reference):
    """SIGKILL the engine process while one request streams and another waits for its whole answer: both end
    within DEATH_DEADLINE_S (an error event then [DONE]; a 503 in OpenAI's error shape), /health answers 503 naming
    the exit code, and a new request gets the same 503."""
    with process_server(stop_within=DEATH_DEADLINE_S) as (url, front):  # a server that missed the death: no drain
        results: dict = {}

        def stream():
            lines = results.setdefault("lines", [])
            with httpx.stream("POST", url + "/v1/completions", timeout=DEATH_DEADLINE_S,
                              json={"model": MODEL, "prompt": PROMPTS[0], "stream": True, "ignore_eos": True,
                                    "max_tokens": LONG_REQUEST["max_tokens"]}) as r:
                lines.extend(line for line in r.iter_lines() if line)

        def whole():
            results["whole"] = httpx.post(url + "/v1/completions", timeout=HTTP_TIMEOUT_S,
                                          json={"model": MODEL, "prompt": PROMPTS[1], "ignore_eos": True,
                                                "max_tokens": LONG_REQUEST["max_tokens"]})

        threads = [threading.Thread(target=f, daemon=True) for f in (stream, whole)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + HTTP_TIMEOUT_S
        while len(results.get("lines", ())) < 2 or _health(url)["running"] < 2:
            assert time.monotonic() < deadline, "the two requests never ran together"
            time.sleep(0.02)
        t0 = time.monotonic()
        os.kill(front.pid, signal.SIGKILL)
        for t in threads:
            t.join(timeout=max(DEATH_DEADLINE_S - (time.monotonic() - t0), 0))
        assert not any(t.is_alive() for t in threads), "a request outlived the engine process"
        assert time.monotonic() - t0 < DEATH_DEADLINE_S
        lines = results["lines"]
        assert lines[-1] == "data: [DONE]"
        error = json.loads(lines[-2][len("data: "):])["error"]
        assert DEATH_MESSAGE in error["message"] and error["code"] == "engine_dead"
        whole = results["whole"]
        assert whole.status_code == 503 and DEATH_MESSAGE in whole.json()["error"]["message"]
        health = httpx.get(url + "/health", timeout=DEATH_DEADLINE_S)
        assert health.status_code == 503 and DEATH_MESSAGE in health.json()["error"]
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 4},
                       timeout=DEATH_DEADLINE_S)
        err = r.json()["error"]
        assert r.status_code == 503 and set(err) == {"message", "type", "param", "code"}
        assert err["message"] == f"{DEATH_MESSAGE} (SIGKILL)" and err["type"] == "server_error"


class HangingCore:
    """A `ServingEngine` stand-in for the engine process (no model): each request is answered with one token in one
    step, except a prompt starting with HANG, whose step never returns."""

    HANG = 7
    config = ServeConfig(max_slots=2, max_context=128)
    stop_ids = ()
    engine = types.SimpleNamespace(target=types.SimpleNamespace(cfg=types.SimpleNamespace(vocab_size=16)))
    limits = RequestLimits(16, config.max_context, config.top_k_cap, config.max_stop_ids, stop_ids)
    cache = types.SimpleNamespace(free_pages=1, num_pages=1, page_size=16, usage=0.0)
    n_running = n_waiting = n_preemptions = prefix_cache_queries = prefix_cache_hits = pool_bytes = 0

    def __init__(self):
        self.queued: list[tuple[int, list[int]]] = []

    def submit(self, prompt, params, request_id):
        self.queued.append((request_id, list(prompt)))

    @property
    def has_work(self) -> bool:
        return bool(self.queued)

    def cancel(self, request_id):
        return None

    def shutdown(self):
        return []

    def step(self) -> StepReport:
        rid, prompt = self.queued.pop(0)
        while prompt[0] == self.HANG:
            time.sleep(60)
        record = RequestRecord(request_id=rid, token_ids=[1], finish_reason="length", prompt_tokens=len(prompt),
                               accept_lengths=[], num_draft_tokens=0)
        return StepReport(deltas=[TokenDelta(rid, [1], time.perf_counter())], records=[record], kind=None, active=1,
                          admitted=0)


@pytest.mark.timeout(120)
def test_a_hung_engine_process_is_killed_and_its_requests_fail_after_the_step_timeout():
    """An engine process that lives but never finishes a step: with a request open, the server hears nothing for
    the step timeout, kills it and ends the request with the reason; a later submit is refused with it. Idle time
    longer than the timeout is not a hang: a request after it is answered."""
    timeout = 2.0

    async def main():
        front = EngineProcessClient(HangingCore, step_timeout_s=timeout)
        await asyncio.get_running_loop().run_in_executor(None, front.launch)
        try:
            await front.start()
            await asyncio.sleep(timeout + 1.0)  # idle, past the timeout
            fine = await asyncio.wait_for(front.submit([1, 2], RequestParams()).result(), timeout)
            t0 = time.monotonic()
            hung = await asyncio.wait_for(front.submit([HangingCore.HANG], RequestParams()).result(), 4 * timeout)
            waited = time.monotonic() - t0
            await asyncio.get_running_loop().run_in_executor(None, front.process.join, 5.0)
            with pytest.raises(EngineDeadError, match="hung"):
                front.submit([1], RequestParams())
            return fine, hung, waited, front.process.exitcode
        finally:
            front.close()

    fine, hung, waited, exitcode = asyncio.run(main())
    assert fine.finish_reason == "length" and fine.token_ids == [1]
    assert hung.finish_reason == "error" and "engine process hung (no step for 2 s), killed" in hung.error
    assert timeout <= waited < timeout + 3.0 and exitcode == -signal.SIGKILL


def test_the_step_timeout_flag_reaches_the_client_and_zero_turns_it_off():
    args = serve.build_parser().parse_args(["--engine-step-timeout", "0"])
    serve._check_args(args)
    assert args.engine_step_timeout == 0
    assert serve.build_parser().parse_args([]).engine_step_timeout == DEFAULT_STEP_TIMEOUT_S
    with pytest.raises(UsageError, match="--engine-step-timeout"):
        serve._check_args(serve.build_parser().parse_args(["--engine-step-timeout", "-1"]))
    with pytest.raises(ValueError, match="step_timeout_s"):
        EngineProcessClient(HangingCore, step_timeout_s=0)


class _FailingCore:
    """A `ServingEngine` stand-in whose step raises what step() itself does not handle."""

    config = ServeConfig()
    n_waiting = 0

    def __init__(self):
        self.submitted: list[int] = []

    def check(self, prompt, params):
        return list(prompt), (), 0

    def submit(self, prompt, params, request_id):
        self.submitted.append(request_id)

    @property
    def has_work(self) -> bool:
        return bool(self.submitted)

    def step(self):
        raise RuntimeError("device lost")


@pytest.mark.timeout(60)
def test_a_failed_engine_thread_ends_its_requests_and_refuses_new_ones():
    """In-process, the same contract as a dead engine process: the open request ends with the error, `failure`
    says why, and a later submit raises EngineDeadError."""

    async def main():
        front = AsyncServingEngine(_FailingCore())
        await front.start()
        record = await asyncio.wait_for(front.submit([1, 2, 3], RequestParams()).result(), DEATH_DEADLINE_S)
        with pytest.raises(EngineDeadError, match="device lost"):
            front.submit([1], RequestParams())
        return record, front.failure

    record, failure = asyncio.run(main())
    assert record.finish_reason == "error" and "RuntimeError: device lost" in record.error
    assert failure == record.error
