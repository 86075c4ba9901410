"""bench_serving: its latency metrics on hand-made timestamps, its load driver and HTTP chunk reading on fakes, and
a tiny in-process run on the shipped pair (ar and ddtree at concurrency 1 and 2)."""
import asyncio
import json
import math

import numpy as np
import pytest
from script_loader import load_script


def _module():
    return load_script("scripts/bench_serving.py")


def _request(mod, send, times, counts, ok=True):
    return mod.RequestResult(send_time=send, request_id=None, chunk_times=times, chunk_tokens=counts,
                             output_tokens=sum(counts), prompt_tokens=4, ok=ok)


def test_latencies_and_percentiles_on_hand_made_timestamps():
    mod = _module()
    # sent at 10 s; deltas of 1, 2 and 4 tokens at 10.5, 11.0 and 11.5 s
    lat = mod.latencies(_request(mod, 10.0, [10.5, 11.0, 11.5], [1, 2, 4]))
    assert lat.ttft == 0.5
    assert lat.tpot == 1.0 / 6  # (11.5 - 10.5) s over the 6 tokens after the first
    assert lat.itl == [0.25, 0.25, 0.125, 0.125, 0.125, 0.125]  # each gap split over its delta's tokens
    assert lat.delta_gaps == [0.5, 0.5]
    assert mod.latencies(_request(mod, 1.0, [1.25], [1])) == mod.Latencies(0.25, None, [], [])  # 1 token: no TPOT
    assert mod.latencies(_request(mod, 1.0, [], [])) == mod.Latencies(None, None, [], [])

    p = mod.percentiles([0.004, 0.001, 0.003, 0.002])  # ms 1..4; numpy's linear interpolation
    assert p == pytest.approx({"mean": 2.5, "p50": 2.5, "p99": 3.97}, rel=1e-12)
    assert mod.percentiles([]) is None

    results = [_request(mod, 10.0, [10.5, 11.0, 11.5], [1, 2, 4]), _request(mod, 10.0, [10.25], [1]),
               _request(mod, 10.0, [10.5], [1], ok=False)]
    s = mod.summarize(results, wall_s=2.0)
    assert (s["completed"], s["failed"], s["output_tokens"]) == (2, 1, 8)
    assert (s["output_tokens_per_s"], s["requests_per_s"]) == (4.0, 1.0)
    assert s["ttft_ms"] == pytest.approx({"mean": 375.0, "p50": 375.0, "p99": 497.5}, rel=1e-12)
    assert s["tpot_ms"] == pytest.approx({"mean": 1e3 / 6, "p50": 1e3 / 6, "p99": 1e3 / 6}, rel=1e-12)
    assert s["itl_ms"]["p50"] == 125.0 and s["itl_ms"]["p99"] == 250.0
    assert s["mean_acceptance_length"] is None  # no request reported rounds


def test_arrivals_and_concurrency_cap():
    mod = _module()
    assert mod.arrival_offsets(5, math.inf, np.random.default_rng(0)).tolist() == [0.0] * 5
    rate = 50.0
    a = mod.arrival_offsets(4000, rate, np.random.default_rng(1))
    assert a[0] == 0.0 and np.all(np.diff(a) > 0)
    assert np.mean(np.diff(a)) == pytest.approx(1 / rate, rel=0.1)
    assert np.array_equal(a, mod.arrival_offsets(4000, rate, np.random.default_rng(1)))  # seeded

    in_flight, most = 0, 0

    async def send(i):
        nonlocal in_flight, most
        in_flight += 1
        most = max(most, in_flight)
        await asyncio.sleep(0.001 * (i % 3))
        in_flight -= 1
        return i

    results, wall = asyncio.run(mod.drive(send, mod.LoadPoint(2, math.inf, 7), seed=0))
    assert results == list(range(7)) and most == 2 and wall > 0


def test_repeats_report_the_median_run():
    mod = _module()
    calls = {"n": 0}
    delays = [0.03, 0.001, 0.012]  # repeat 1 slowest, repeat 2 fastest: the median is repeat 3

    async def send(i):
        await asyncio.sleep(delays[calls["n"] // 2])
        calls["n"] += 1
        return _request(mod, 0.0, [0.1], [4])

    summary, results, every = asyncio.run(mod.drive_repeats(send, mod.LoadPoint(2, math.inf, 2), 0, 3, "x"))
    tps = summary["output_tokens_per_s_repeats"]
    assert len(tps) == 3 and tps[1] > tps[2] > tps[0], tps
    assert summary["output_tokens_per_s"] == tps[2] and summary["repeats"] == 3
    assert len(every) == 3 and all(len(r) == 2 for r in every) and results is every[2]
    assert mod.parse_budget_table("1:32,4:16,8:ar") == {1: 32, 4: 16, 8: "ar"}


def _sse(*events) -> bytes:
    return b"".join(b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n" for e in events)


# a stream as kdtree_jax.serve sends it: text chunks with token ids, the finish chunk with the speculative statistics
# in `spec_decode`, the usage chunk, then [DONE]
_STREAM = _sse(
    {"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": "a", "token_ids": [5],
                                                          "finish_reason": None}]},
    {"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": "bc", "token_ids": [6, 7],
                                                          "finish_reason": None}]},
    {"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": "", "finish_reason": "length"}],
     "spec_decode": {"num_spec_steps": 2, "num_draft_tokens": 32, "num_accepted_tokens": 1,
                     "mean_acceptance_length": 1.5}},
    {"id": "c", "object": "text_completion", "choices": [],
     "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}},
    b"[DONE]")


@pytest.mark.parametrize("client_kind", ["httpx", "openai"])
def test_http_sender_reads_token_counts_usage_and_spec_stats(client_kind):
    import httpx
    import openai

    mod = _module()
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append((request.url.path, body))
        if body["prompt"] == [9]:
            return httpx.Response(400, json={"error": {"message": "bad", "param": "prompt"}})
        return httpx.Response(200, content=_STREAM, headers={"content-type": "text/event-stream"})

    async def run():
        http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        client = (openai.AsyncOpenAI(base_url="http://x/v1", api_key="k", http_client=http, max_retries=0)
                  if client_kind == "openai" else http)
        args = mod.parse_args(["--url", "http://x", "--max-new-tokens", "3", "--client", client_kind])
        send = mod.http_sender(client, "http://x", "m", [[1, 2, 3], [9]], args, tokenizer=None)
        return await send(0), await send(1)

    good, bad = asyncio.run(run())
    assert good.ok and good.chunk_tokens == [1, 2] and good.output_tokens == 3 and len(good.chunk_times) == 2
    assert (good.spec_rounds, good.spec_committed) == (2, 3.0)
    assert not bad.ok and "400" in bad.error
    path, body = seen[0]
    assert path == "/v1/completions" and body["model"] == "m" and body["prompt"] == [1, 2, 3]
    assert body["stream"] and body["stream_options"] == {"include_usage": True} and body["max_tokens"] == 3


@pytest.mark.heavy
def test_tiny_inprocess_run_on_the_shipped_pair(tmp_path):
    mod = _module()
    out = tmp_path / "serving.json"
    mod.main(["--num-prompts", "3", "--prompt-tokens", "16", "--max-new-tokens", "8", "--concurrency", "1,2",
              "--num-requests", "3", "--repeats", "2", "--configs", "ar,ddtree", "--prefill-batch", "1", "--out", str(out)])
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [(r["config"], r["concurrency"]) for r in rows] == [("ar", 1), ("ar", 2), ("ddtree", 1), ("ddtree", 2)]
    for r in rows:
        assert r["completed"] == 3 and r["failed"] == 0 and r["output_tokens_per_s"] > 0, r
        for metric in ("ttft_ms", "tpot_ms", "itl_ms"):
            assert 0 < r[metric]["p50"] <= r[metric]["p99"], (metric, r)
        assert r["greedy_equal"] == r["greedy_checked"] == 6, r  # every request of both repeats = generate's tokens
        assert r["repeats"] == 2 and r["output_tokens_per_s"] == max(r["output_tokens_per_s_repeats"]), r
        assert sum(r["step_kinds"].values()) > 0 and r["compiles"] == 0, r
        assert set(r["step_kinds"]) == {"ar" if r["config"] == "ar" else "ddtree-16"}
    assert all(r["vs_baseline"] > 0 for r in rows if r["concurrency"] == 1)
    assert {c["config"]: c["generate"]["kind"] for c in result["configs"]} == {"ar": "ar", "ddtree": "ddtree-16"}
    assert result["git_commit"] and result["jax_version"] and result["command"]


# ---- traces: mixed lengths at fixed bytes, a long prompt joining ------------------------------------------------
def _step(mod, active, deltas=(), finished=(), t=0.0):
    return mod.TraceStep(t, t + 0.1, active, active, "ar" if active else None, 0, 0, 0.0, list(deltas),
                         list(finished))


def test_trace_concurrency_and_window_itl_on_hand_made_steps():
    mod = _module()
    steps = [_step(mod, 0), _step(mod, 2), _step(mod, 5), _step(mod, 3), _step(mod, 0)]
    assert mod.concurrency(steps) == {"max_active": 5, "mean_active": 10 / 3, "decode_steps": 3}

    # stream 1: deltas at 1.0 (1 token), 1.1 (4), 1.3 (2), 2.3 (4), 2.4 (1); stream 2: 1.0, 1.2 (2), 1.4 (2)
    deltas = {1: [(1.0, 1), (1.1, 4), (1.3, 2), (2.3, 4), (2.4, 1)], 2: [(1.0, 1), (1.2, 2), (1.4, 2)]}
    w = mod.window_itl(deltas, [1, 2], t_from=1.15)  # gaps ending after 1.15 s
    assert w["gaps"] == pytest.approx([0.2, 1.0, 0.1, 0.2, 0.2])
    assert w["itl"] == pytest.approx([0.1] * 2 + [0.25] * 4 + [0.1] + [0.1] * 2 + [0.1] * 2)
    first = mod.window_itl(deltas, [1, 2], t_from=1.15, max_gaps=1)  # each stream's first gap only
    assert first["gaps"] == pytest.approx([0.2, 0.2])
    before = mod.window_itl(deltas, [1, 2], t_from=-math.inf, t_to=1.15)
    assert before["gaps"] == pytest.approx([0.1]) and before["itl"] == pytest.approx([0.025] * 4)

    s = mod.itl_stats(w["itl"])  # 11 samples: 7 of 100 ms, 4 of 250 ms
    v = np.array(sorted(w["itl"])) * 1e3
    assert s["samples"] == 11 and s["p50"] == pytest.approx(100.0) and s["mean"] == pytest.approx(v.mean())
    assert s["p99"] == pytest.approx(250.0) and s["p99_over_p50"] == pytest.approx(2.5)
    assert mod.itl_stats([]) is None


def test_trace_lengths_scale_with_the_context():
    mod = _module()
    args = mod.parse_args(["--trace", "mixed,long-join"])
    assert args.trace == ["mixed", "long-join"] and args.trace_context == 1024
    assert mod.scaled_range(mod.REAL_PROMPTS, 1024 / 4608) == (14, 910)
    assert mod.scaled_range(mod.REAL_OUTPUTS, 1024 / 4608, floor=2) == (4, 114)
    assert mod.trace_page_size(args) == 16  # 64 x 1024 / 4608 = 14.2, rounded up to a page the kernels take
    x = mod.log_uniform(np.random.default_rng(0), 14, 910, 4000)
    assert min(x) >= 14 and max(x) <= 910
    assert np.median(x) == pytest.approx(math.sqrt(14 * 910), rel=0.1)  # log-uniform: the geometric mean
    with pytest.raises(SystemExit):
        mod.parse_args(["--trace", "mixed,bogus"])


def _active_from_events(steps) -> list[int]:
    """Requests decoding in each step, from the events alone: a request decodes from the step of its first delta
    (unless that step also carries its record and it had no other delta: it ended at its prefill) until the step
    after the one that carries its record (its last step's tokens arrive with it, or a step later with overlap).
    Valid without preemptions."""
    first, record, count = {}, {}, {}
    for t, s in enumerate(steps):
        for rid, _, _ in s.deltas:
            first.setdefault(rid, t)
            count[rid] = count.get(rid, 0) + 1
        for rid, _ in s.finished:
            record[rid] = t
    decoders = {r: t for r, t in first.items() if not (record.get(r) == t and count[r] == 1)}
    return [sum(f <= t and record.get(r, len(steps)) >= t for r, f in decoders.items()) for t in range(len(steps))]


@pytest.mark.heavy
@pytest.mark.timeout(900)
def test_tiny_traces_on_the_shipped_pair_report_what_their_steps_did(tmp_path):
    mod = _module()
    captured = []
    run_steps = mod.run_steps

    def capture(*a, **kw):
        captured.append(run_steps(*a, **kw))
        return captured[-1]

    mod.run_steps = capture  # every run's steps, for the independent counts below
    out = tmp_path / "traces.json"
    result = mod.main(["--trace", "mixed,long-join", "--trace-context", "256", "--mixed-requests", "10",
                       "--pool-slots", "2", "--paged-slots", "8", "--mixed-batched-tokens", "64",
                       "--streams", "2", "--stream-prompt-tokens", "16", "--stream-new-tokens", "64",
                       "--long-prompt-tokens", "96", "--long-new-tokens", "8", "--chunk-tokens", "32",
                       "--join-after-steps", "2", "--rounds-per-step", "2", "--prefill-batch", "1", "--out", str(out)])
    assert json.loads(out.read_text())["traces"].keys() == {"mixed", "long-join"}
    # each engine: its warm-up pass, then the trace
    (_, paged), (_, table), (_, chunked), (_, one_chunk) = zip(captured[0::2], captured[1::2])

    mixed = result["traces"]["mixed"]
    d = mixed["trace"]
    assert d["prompt_tokens"] == [4, 228] and d["new_tokens"] == [2, 28]  # x 256 / 4608
    for name, steps in (("paged", paged), ("slot_table", table)):
        r = mixed["runs"][name]
        assert r["preemptions"] == 0 and r["completed"] == r["requests"] == 10, r
        active = [s.active for s in steps]
        assert r["active_per_step"] == active and _active_from_events(steps) == active
        assert r["max_active"] == max(active) and r["mean_active"] == pytest.approx(np.mean([a for a in active if a]))
        assert r["output_tokens"] == d["new_tokens_total"]  # ignore_eos: every request its max_new_tokens
        assert r["output_tokens_per_s"] == pytest.approx(r["output_tokens"] / r["wall_s"])
        assert r["num_pages"] == 2 * 256 // 16 and r["pool_bytes"] == r["num_pages"] * r["page_bytes"]
    assert mixed["runs"]["slot_table"]["max_slots"] == 2 and mixed["runs"]["slot_table"]["max_active"] <= 2
    assert mixed["ratios"]["max_active"] == mixed["runs"]["paged"]["max_active"] / mixed["runs"]["slot_table"][
        "max_active"]
    assert mixed["goal"]["value"] == mixed["ratios"]["max_active"]

    lj = result["traces"]["long-join"]
    window = -(-96 // 32) + 1
    for name, steps, chunk in (("chunked", chunked, 32), ("one_chunk", one_chunk, 96)):
        r = lj["runs"][name]
        assert r["max_num_batched_tokens"] == chunk and r["window_gaps_per_stream"] == window
        assert r["long_prefill_chunk_tokens"] == [chunk] * (96 // chunk) and r["streams_short_of_the_window"] == 0
        j = r["join_step"]  # the long prompt was submitted between steps j - 1 and j
        streams = sorted({rid for s in steps[:j] for rid, _, _ in s.deltas})
        assert len(streams) == 2
        itl = []
        for rid in streams:
            d = [(t, n) for s in steps for q, n, t in s.deltas if q == rid]
            k = next(i for i, (t, _) in enumerate(d) if t >= steps[j].t0)
            itl += [(d[i][0] - d[i - 1][0]) / d[i][1] for i in range(k, k + window) for _ in range(d[i][1])]
        v = np.asarray(itl) * 1e3
        assert r["itl_ms"]["samples"] == len(itl) == 2 * window * 2  # 2 streams, 2 tokens a delta (ar, 2 rounds)
        assert r["itl_ms"]["p50"] == pytest.approx(np.percentile(v, 50))
        assert r["itl_ms"]["p99"] == pytest.approx(np.percentile(v, 99))
    assert lj["goal"]["value"] == lj["runs"]["chunked"]["itl_ms"]["p99_over_p50"]
    assert result["git_commit"] and result["command"] and result["date"]


def test_markdown_table_has_ttft_and_tpot_percentile_columns(rng):
    """One column each for TTFT / TPOT p50 / p99, holding that row's value; "-" where a row recorded none."""
    mod = _module()
    stats = {m: {q: float(rng.uniform(0.1, 50.0)) for q in ("mean", "p50", "p99")} for m in ("ttft_ms", "tpot_ms")}
    base = {"config": "auto", "load": "c=1", "completed": 4, "num_requests": 4, "output_tokens_per_s": 100.0,
            "requests_per_s": 2.0, "itl_ms": None, "mean_acceptance_length": None}
    rows = [{**base, **stats}, {**base, "load": "c=2", "ttft_ms": stats["ttft_ms"], "tpot_ms": None}]
    lines = mod.markdown({"rows": rows, "configs": [], "targets": []}).splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:4]]
    assert len(lines[1].strip("|").split("|")) == len(header) == len(cells[0]) == len(cells[1])
    for metric, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT")):
        for q in ("p50", "p99"):
            col = header.index(f"{name} {q}")
            assert cells[0][col] == f"{stats[metric][q]:.2f}"
            assert cells[1][col] == ("-" if metric == "tpot_ms" else f"{stats[metric][q]:.2f}")


@pytest.mark.heavy
@pytest.mark.timeout(600)
def test_tiny_multi_turn_trace_hits_every_earlier_page_with_or_without_speculation(tmp_path):
    """Every later turn finds its conversation's earlier context in the cache, all of its full pages but the page
    of the last reply token (not yet written when the reply ended), for ddtree exactly as for ar; caching off finds
    nothing; ddtree's rounds really accept several tokens."""
    mod = _module()
    page, turns = 16, 3
    out = tmp_path / "multi_turn.json"
    result = mod.main(["--trace", "multi-turn", "--trace-context", "256", "--trace-page-size", str(page),
                       "--conversations", "2", "--turns", str(turns), "--system-prompt-tokens", "64",
                       "--user-tokens", "12", "--reply-tokens", "20", "--shared-tokens", "64",
                       "--rounds-per-step", "2", "--prefill-batch", "1", "--min-prompt-bucket", "64",
                       "--out", str(out)])
    assert json.loads(out.read_text())["traces"].keys() == {"multi-turn"}
    runs = result["traces"]["multi-turn"]["runs"]
    turn_hits = {}
    for mode in ("ar", "ddtree"):
        on, off = runs[f"{mode}_cached"], runs[f"{mode}_uncached"]
        for r in (on, off):
            assert r["requests"] == r["completed"] == 2 * turns, r
            assert all(q["tokens"] == 20 for q in r["per_request"])
        assert off["hit_rate"] == 0 and all(q["cached_tokens"] == 0 for q in off["per_request"])
        later = [q for q in on["per_request"] if q["turn"] > 0]
        assert len(later) == 2 * (turns - 1)
        for q in later:  # the previous turn's rows: its whole context but the last reply token
            assert q["cached_tokens"] == (q["shared_tokens"] - 1) // page * page, q
        turn_hits[mode] = sorted((q["conversation"], q["turn"], q["cached_tokens"]) for q in on["per_request"])
        want = sum(q["cached_tokens"] for q in later) / sum(q["prompt_tokens"] for q in later)
        assert on["hit_rate_from_turn_2"] == pytest.approx(want)
    assert turn_hits["ddtree"] == turn_hits["ar"]
    assert runs["ddtree_cached"]["mean_acceptance_length"] > 1.5
