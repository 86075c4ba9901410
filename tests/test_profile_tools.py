"""The profiling benchmarks' bookkeeping: kernel -> part attribution (trace_parts, for profile_round's round parts
and bench_kimi_layer's step parts), the per-step slope (bench_kimi_layer) and kernel time per call from trace events
(bench_kernels), on synthetic traces with fresh random durations."""
import dataclasses
import json

import numpy as np
import pytest
from script_loader import load_script


def _load(name):
    return load_script(f"benchmarks/{name}.py")


profile_round = _load("profile_round")
bench_kimi_layer = _load("bench_kimi_layer")
trace_parts = _load("trace_parts")

HLO = """\
HloModule jit_loop

%fused_pad.3 (param_0: bf16[4]) -> bf16[8] {
  %param_0 = bf16[4]{0} parameter(0)
  ROOT %pad.1 = bf16[8]{0} pad(%param_0, %c), padding=0_4, metadata={op_name="jit(f)/while/body/round/draft/pad"}
}

%fused_add.4 (param_0: bf16[8]) -> bf16[8] {
  %param_0 = bf16[8]{0} parameter(0)
  %broadcast.2 = bf16[8]{0} broadcast(%c), metadata={op_name="jit(f)/while/body/round/tree/broadcast_in_dim"}
  %mul.3 = bf16[8]{0} multiply(%param_0, %broadcast.2), metadata={op_name="jit(f)/while/body/round/verify/mul"}
  ROOT %add.1 = bf16[8]{0} add(%mul.3, %broadcast.2), metadata={op_name="jit(f)/while/body/round/verify/add"}
}

%fused_select.5 (param_0: s32[8]) -> s32[8] {
  %broadcast.3 = s32[8]{0} broadcast(%c), metadata={op_name="jit(f)/while/body/round/tree/broadcast_in_dim"}
  %lt.1 = pred[8]{0} compare(%param_0, %broadcast.3), metadata={op_name="jit(f)/while/body/round/accept/lt"}
  %min.1 = s32[8]{0} minimum(%param_0, %broadcast.3), metadata={op_name="jit(f)/while/body/round/accept/min"}
  ROOT %select.1 = s32[8]{0} select(%lt.1, %param_0, %min.1)
}

ENTRY %main.5 (p: bf16[4]) -> bf16[8] {
  %loop_add_fusion.4 = bf16[8]{0} fusion(%p), kind=kLoop, calls=%fused_add.4, metadata={scheduling_name="y"}
  %loop_select_fusion.5 = s32[8]{0} fusion(%p), kind=kLoop, calls=%fused_select.5
  %loop_pad_fusion.3 = bf16[8]{0} fusion(%p), kind=kLoop, calls=%fused_pad.3, metadata={scheduling_name="x"}
  %custom-call.2 = f32[8]{0} custom-call(%p), custom_call_target="triton", metadata={op_name="jit(f)/while/body/round/draft/topk/pallas_call"}
  %gemm.1 = bf16[8]{0} custom-call(%p), metadata={op_name="jit(f)/while/body/round/verify/layer0/dot_general"}
  %copy.7 = bf16[8]{0} copy(%p), metadata={op_name="jit(f)/while/body/closed_call"}
  ROOT %t = (bf16[8]) tuple(%loop_pad_fusion.3)
}
"""


def test_kernels_attribute_to_round_parts(rng):
    part_of = profile_round.part_of
    scopes = trace_parts.hlo_scopes(HLO, part_of)
    assert scopes["loop_pad_fusion_3"].endswith("round/draft/pad")  # from the fused computation it calls
    assert scopes["loop_add_fusion_4"].endswith("round/verify/add")  # its ROOT's, not a shared broadcast's
    assert part_of(scopes["loop_select_fusion_5"]) == "accept"  # no ROOT op_name: the majority
    cases = [("loop_pad_fusion_3", "loop_pad_fusion.3", "draft"), ("topk_chunk", "custom-call.2", "topk"),
             ("nvjet_sm90_tst", "gemm.1", "verify"), ("tree_build", "command_buffer_3", "tree"),
             ("copy", "copy.7", "outside the round"), ("mystery_kernel", "", "unattributed")]
    _check_attribution(rng, cases, scopes, part_of, profile_round.PALLAS_PARTS, "outside the round")


def _check_attribution(rng, cases, scopes, part_of, pallas_parts, outside):
    """Events of fresh random durations for each (kernel name, hlo_op, part): each one attributes to its part, and
    part_times sums them per part over a random number of steps."""
    events, want, by_name = [], {}, {}
    steps = int(rng.integers(1, 6))
    for name, hlo_op, part in cases:
        for _ in range(int(rng.integers(1, 4))):  # launches of one kernel add up
            dur = float(rng.uniform(0.5, 50.0))
            events.append({"name": name, "args": {"hlo_op": hlo_op}, "dur": dur, "ts": 0.0})
            want[part] = want.get(part, 0.0) + dur / steps
            by_name.setdefault(part, {}).setdefault(name, 0.0)
            by_name[part][name] += dur / steps
        assert trace_parts.attribute(events[-1], scopes, part_of, pallas_parts, outside) == part, name
    got = trace_parts.part_times(events, scopes, part_of, pallas_parts, outside, steps)
    assert got.keys() == want.keys()
    for part, us in want.items():
        assert got[part] == pytest.approx(us, rel=1e-12)
    top = trace_parts.top_kernels(events, scopes, part_of, pallas_parts, outside, steps, n=1)
    assert top.keys() == want.keys()
    for part, names in by_name.items():
        name, us = max(names.items(), key=lambda kv: kv[1])
        assert top[part] == {name: pytest.approx(us, abs=0.051)}
    every = trace_parts.top_kernels(events, scopes, part_of, pallas_parts, outside, steps, n=None)
    assert {part: set(names) for part, names in every.items()} == {part: set(n) for part, n in by_name.items()}


def test_busy_time_counts_overlaps_once_and_idle_gaps_not_at_all(rng):
    """Random kernels on a numpy timeline (1 µs cells): busy = the cells some kernel covers, span = first start to
    last end, launches per step; the events come unsorted."""
    steps = int(rng.integers(1, 5))
    starts = rng.integers(0, 400, 30)
    durs = rng.integers(1, 40, 30)
    covered = np.zeros(500, bool)
    for a, d in zip(starts, durs):
        covered[a:a + d] = True
    events = [{"name": "k", "ts": float(a), "dur": float(d)} for a, d in zip(starts, durs)]
    got = trace_parts.busy_time([events[i] for i in rng.permutation(len(events))], steps)
    assert got["kernels"] == pytest.approx(30 / steps)
    assert got["busy_us"] == pytest.approx(covered.sum() / steps)
    assert got["span_us"] == pytest.approx((max(starts + durs) - min(starts)) / steps)
    assert got["busy_us"] < got["span_us"] or covered[min(starts):max(starts + durs)].all()


def test_layer_kernels_attribute_to_step_parts(rng):
    """bench_kimi_layer --trace: the model's named scopes survive compilation, so the compiled step's instructions
    name every part (attention, routed experts, shared expert, router, dense MLP, head), and kernels sum per part."""
    import jax.numpy as jnp

    from kdtree_jax.model.config import tiny
    from kdtree_jax.model.target import LatentCache

    cfg = dataclasses.replace(tiny(), num_hidden_layers=2)  # layer 0 dense, layer 1 MoE with a shared expert
    graphdef, state = bench_kimi_layer.build_model(cfg, jnp.float32)
    fn = bench_kimi_layer.make_verify(graphdef, cfg, "as_is", use_pallas=False, interpret=True)
    bt, n, steps = 2, 3, 2
    mask = bench_kimi_layer.ancestor_mask(rng, bt, n)
    cache = LatentCache.from_stacked(jnp.asarray(rng.normal(size=(2, bt, 32, cfg.latent_dim)), jnp.float32))
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (steps, bt, n)), jnp.int32)
    start = jnp.full((bt,), 4, jnp.int32)
    hlo = fn.lower(state, tokens, start[:, None] + jnp.asarray(mask.sum(-1) - 1), start, jnp.asarray(mask),
                   cache).compile().as_text()
    scopes = trace_parts.hlo_scopes(hlo, bench_kimi_layer.layer_part)
    by_part = {}
    for inst, op in sorted(scopes.items()):
        by_part.setdefault(bench_kimi_layer.layer_part(op), inst)
    parts = {part for _, part in bench_kimi_layer.LAYER_PARTS}
    assert parts <= by_part.keys(), sorted(parts - by_part.keys())
    cases = [(inst, inst, part) for part, inst in by_part.items() if part is not None]
    cases += [("verify_attn_mgpu_kernel", "", "attention"), ("int4_swiglu", "", "experts"),
              ("mystery_kernel", "", "unattributed")]
    if None in by_part:
        cases.append((by_part[None], by_part[None], "other"))
    _check_attribution(rng, cases, scopes, bench_kimi_layer.layer_part, bench_kimi_layer.LAYER_PALLAS_PARTS, "other")


def test_per_step_slope_drops_the_fixed_cost(rng):
    fixed, step = float(rng.uniform(1e-4, 1e-3)), float(rng.uniform(1e-4, 3e-3))
    k0, k1 = sorted(int(k) for k in rng.choice(range(1, 64), 2, replace=False))
    row = bench_kimi_layer.per_step_ms((k0, k1), [fixed + k0 * step, fixed + k1 * step])
    assert row["ms"] == pytest.approx(step * 1e3, rel=1e-9)
    assert row["ms_fixed_per_call"] == pytest.approx(fixed * 1e3, rel=1e-6)
    assert row[f"ms_per_step_of_{k0}"] == pytest.approx((fixed + k0 * step) * 1e3 / k0, rel=1e-12)
    one = bench_kimi_layer.per_step_ms((k0,), [fixed + k0 * step])
    assert one == {"ms": pytest.approx((fixed + k0 * step) * 1e3 / k0, rel=1e-12)}


def test_kernel_time_per_call_from_trace_events(rng):
    """bench_kernels --trace: kernel busy time and span per call from device timestamps, gaps excluded from busy."""
    bench_kernels = _load("bench_kernels")
    calls = int(rng.integers(1, 9))
    durs = rng.uniform(1.0, 50.0, 3 * calls)
    gaps = rng.uniform(0.0, 5.0, 3 * calls)
    t0 = float(rng.uniform(0, 1e6))
    starts = t0 + np.concatenate([[0.0], np.cumsum(durs + gaps)[:-1]])
    events = [dict(ts=float(s), dur=float(d)) for s, d in zip(starts, durs)]
    rng.shuffle(events)
    busy, span = bench_kernels.kernel_time_per_call(events, calls)
    assert busy == pytest.approx(durs.sum() * 1e-6 / calls, rel=1e-12)
    assert span == pytest.approx((durs.sum() + gaps[:-1].sum()) * 1e-6 / calls, rel=1e-9)
    with pytest.raises(RuntimeError, match="no GPU kernel events"):
        bench_kernels.kernel_time_per_call([], calls)


def test_bandwidth_summary_per_backend_and_clock():
    """The >= 60% check is reported per backend, on wall time and on kernel time."""
    bench_kernels = _load("bench_kernels")
    copy_bw, peak = 4e12, 600e12
    row = dict(prefix=8192, bytes=4e8, flops=1e9)
    rows = [dict(row, backend="mosaic", ms=0.2, kernel_ms=0.125), dict(row, backend="triton", ms=0.4, kernel_ms=0.2)]
    text = bench_kernels.bandwidth_summary(rows, copy_bw, peak)
    assert "mosaic, wall: memory-bound rows with prefix >= 8192: 1, % of copy bandwidth min 50%" in text
    assert "mosaic, kernels: memory-bound rows with prefix >= 8192: 1, % of copy bandwidth min 80%" in text
    assert "triton, wall" in text and "min 25%" in text and "triton, kernels" in text


def test_verify_table_reads_against_the_same_bytes(rng):
    """The `--trace` table's read columns: an XLA read's kernel time and its share of the kernel's."""
    bench_kernels = _load("bench_kernels")
    kern, read = rng.uniform(0.02, 0.2), rng.uniform(0.005, 0.02)
    row = dict(backend="mosaic", batch=1, nodes=1, heads=64, prefix=8192, ms=0.05, gbps=200.0, bytes=1e7, flops=1e9,
               kernel_ms=kern, span_ms=kern, read_kernel_ms=read, tflops=20.0, rel_err_row0=1e-3)
    header, _, line = (
        [c.strip() for c in x.split("|")[1:-1]] for x in bench_kernels.verify_table([row], 4e12, 6e14).splitlines())
    got = dict(zip(header, line))
    assert got["read ms (kernels)"] == f"{read:.3f}"
    assert got["% read (kernels)"] == f"{100 * read / kern:.0f}%"


def test_step_table_flags_a_negative_fixed_cost(rng):
    """bench_kimi_layer's table: a slope whose fixed cost per call comes out negative (two timings that disagree)
    is flagged in the row's note; a positive one is not."""
    rows = []
    for fixed in (rng.uniform(0.1, 1.0), -rng.uniform(0.1, 1.0)):
        rows.append(dict(kind="verify", moe="kernel", expert_layout="tile-major", batch=8, nodes=1, prefix=4096,
                         ms=rng.uniform(1.0, 3.0), ms_fixed_per_call=fixed, distinct_experts=[47.0],
                         bytes=rng.uniform(4e9, 6e9)))
    lines = bench_kimi_layer.markdown(rows, 4e12, 6e14).splitlines()[2:4]
    notes = [line.split("|")[-2].strip() for line in lines]
    assert notes[0] == ""
    assert notes[1] == f"slope noisy: fixed cost {rows[1]['ms_fixed_per_call']:.2f} ms per call"


def test_part_roofline_takes_each_part_at_its_bound(rng):
    """bench_kimi_layer's part roofline: each of the step's three parts at the slower of its bytes and its FLOPs
    (fresh random sizes, each part's bound drawn either way), in the table's "× part roofline" column."""
    bw, peak = 4e12, 6e14
    rows = []
    for _ in range(3):
        cache, weights, experts = rng.uniform(1e7, 5e9, 3)
        flops = dict(zip(("attention", "weights", "experts"), rng.uniform(1e10, 3e12, 3)))
        want = sum(max(b / bw, flops[p] / peak) for b, p in ((cache, "attention"), (weights, "weights"),
                                                             (experts, "experts")))
        rows.append(dict(kind="verify", moe="kernel", expert_layout="tile-major", batch=8, nodes=17, prefix=4096,
                         ms=rng.uniform(1.0, 9.0), distinct_experts=[100.0], bytes=cache + weights + experts,
                         cache_bytes=cache, expert_bytes=experts, flops_by_part=flops))
        assert bench_kimi_layer.part_roofline_s(rows[-1], bw, peak) == pytest.approx(want, rel=1e-12)
    header, _, *lines = bench_kimi_layer.markdown(rows, bw, peak).splitlines()
    col = [c.strip() for c in header.split("|")].index("× part roofline")
    for row, line in zip(rows, lines):
        want = row["ms"] / 1e3 / bench_kimi_layer.part_roofline_s(row, bw, peak)
        assert line.split("|")[col].strip() == f"{want:.2f}"


def test_step_flops_count_every_matmul_once():
    """step_flops at K2.6 width: 2 FLOPs per non-routed bf16 weight per token, 3 expert matrices per routed pair per
    MoE layer, and the attention core of `attn_flops`."""
    from kdtree_jax.model.config import kimi_k2_6

    cfg = dataclasses.replace(kimi_k2_6(), num_hidden_layers=2)  # layer 0 dense, layer 1 MoE
    wbytes = dict(attention=4.0e8, other=3.2e9)
    got = bench_kimi_layer.step_flops(cfg, wbytes, 8, 17, 4096, 2)
    assert got["weights"] == 2 * 136 * 3.6e9 / 2
    assert got["experts"] == 2 * 136 * 8 * 3 * 7168 * 2048
    assert got["attention"] == bench_kimi_layer.attn_flops(cfg, 8, 17, 4096)


def test_refit_fits_several_runs_as_one(rng, tmp_path):
    """bench_kimi_layer --refit A B: the AR-step run and the verify run share one cost model; points made by a known
    model of all four terms (fresh random coefficients), each run's attention roofline at that run's own copy rate and
    matmul peak, are fitted exactly, and runs of other layer counts refuse."""
    from kdtree_jax.model.config import kimi_k2_6

    cfg = dataclasses.replace(kimi_k2_6(), num_hidden_layers=2)
    coef = rng.uniform(0.5, 2.0, 4) * np.array([1e-3, 1.5, 1 / 2e12, 2e-6])

    def run_rows(shapes, bw, peak):
        rows = []
        for bt, n, prefix in shapes:
            experts = float(rng.uniform(8, 130)) * 24.77e6
            cache = bt * prefix * cfg.latent_dim * 2 * cfg.num_hidden_layers
            attn = max(cache / bw, bench_kimi_layer.attn_flops(cfg, bt, n, prefix) / peak)
            rows.append(dict(kind="verify", moe="kernel", batch=bt, nodes=n, prefix=prefix, expert_bytes=experts,
                             cache_bytes=cache, bytes=experts + cache + 4e9, distinct_experts=[1.0],
                             ms=float(np.dot(coef, [1.0, attn, experts, bt * n])) * 1e3))
        return rows

    def run(shapes, layers=2):
        bw, peak = float(rng.uniform(4000, 4300)), float(rng.uniform(650, 720))
        return dict(layers=layers, copy_gbps=bw, matmul_tflops=peak, rows=run_rows(shapes, bw * 1e9, peak * 1e12))

    ar = [(bt, 1, p) for bt in (1, 8, 32, 64) for p in (4096, 32768)]
    verify = [(bt, n, p) for bt, n in ((1, 17), (8, 17), (1, 65)) for p in (4096, 32768)]
    paths = []
    for i, shapes in enumerate((ar, verify)):
        paths.append(tmp_path / f"run{i}.json")
        paths[-1].write_text(json.dumps(run(shapes)))
    out = tmp_path / "fit.json"
    result = bench_kimi_layer.refit([str(p) for p in paths], str(out))
    fit = result["fit"]
    assert fit["points"] == len(ar) + len(verify) and fit["max_abs_rel_err"] < 1e-6
    assert all(abs(r["fit_rel_err"]) < 1e-6 for r in result["rows"])
    assert json.loads(out.read_text())["sources"] == [str(p) for p in paths]
    (tmp_path / "other.json").write_text(json.dumps(run(ar[:2], layers=4)))
    with pytest.raises(SystemExit, match="layer counts"):
        bench_kimi_layer.refit([str(paths[0]), str(tmp_path / "other.json")], None)


def test_predicted_step_reads_each_data_groups_cache(rng):
    """predict_k26 from a measured fit: the attention term is the fitted coefficient times the attention roofline of
    one GPU, whose cache read is the whole latent cache of its data-parallel group's requests (every tensor-parallel
    GPU reads its requests' cache; an odd batch's busiest group holds one more) and whose FLOPs, the group's, split
    over the model-parallel ways. A decode step (N = 1) is bound by the cache bytes, a 257-node tree by the FLOPs.
    Old fits' terms are refused."""
    predict = _load("predict_k26")
    from kdtree_jax.model.config import kimi_k2_6

    cfg = kimi_k2_6()
    coef, bw, peak = float(rng.uniform(1.0, 2.0)), 4.2e12, 670e12
    fit = {"terms": {"attn_roofline": coef}, "copy_gbps": bw / 1e9, "matmul_tflops": peak / 1e12}
    bt, prefix = int(rng.integers(1, 33)) * 2 + 1, int(rng.integers(1024, 40000))  # odd: data groups of 2 differ
    for data, n in ((1, 1), (2, 1), (1, 257), (2, 257)):
        mesh = type("Mesh", (), {"size": 8, "shape": {"data": data, "tensor": 8 // data, "expert": 1}})()
        got = predict.measured_step(cfg, {"other": 4e9, "expert_bytes": 24.77e6}, mesh, fit, 1e9, bt=bt, n=n,
                                    prefix=prefix, allreduce_s=0.0, drafter_bytes=0.0, bandwidth=4e12, rng=rng)
        group = (bt + data - 1) // data
        cache_s = group * prefix * cfg.latent_dim * 2 * cfg.num_hidden_layers / bw
        flops_s = bench_kimi_layer.attn_flops(cfg, group, n, prefix) / (8 // data) / peak
        assert (cache_s > flops_s) == (n == 1)
        assert got["parts"]["attention"] == pytest.approx(coef * max(cache_s, flops_s), rel=1e-12)
        assert got["t"] == pytest.approx(got["parts"]["attention"], rel=1e-12)  # no other term in this fit
    with pytest.raises(ValueError, match="cache_bytes"):
        predict.measured_step(cfg, {"other": 4e9, "expert_bytes": 24.77e6}, mesh, {"terms": {"cache_bytes": 1e-13}},
                              1e9, bt=1, n=1, prefix=4096, allreduce_s=0.0, drafter_bytes=0.0, bandwidth=4e12,
                              rng=rng)


def test_bytes_model_reads_each_data_groups_cache_and_experts(rng):
    """predict_k26's bytes-and-FLOPs model: a GPU reads its non-routed weights, the experts its data group's tokens
    touch and that group's whole cache; with 2 data groups an odd batch's busiest group holds one more request."""
    predict = _load("predict_k26")
    from kdtree_jax.model.config import kimi_k2_6

    cfg = kimi_k2_6()
    w = {"other": 4e9, "expert_bytes": 24.77e6, "other_params": 2e9, "expert_params": 44e6}
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    bt, prefix = int(rng.integers(1, 8)) * 2 + 1, int(rng.integers(1024, 40000))
    for data in (1, 2):
        mesh = type("Mesh", (), {"size": 8, "shape": {"data": data, "tensor": 8 // data, "expert": 1}})()
        got = predict.step_model(cfg, w, mesh, bt=bt, n=1, prefix=prefix, bandwidth=4e12, allreduce_s=0.0,
                                 drafter_bytes=0.0, rng=rng)
        group = (bt + data - 1) // data
        experts = min(cfg.n_routed_experts, group * cfg.num_experts_per_tok)
        want = w["other"] + n_moe * experts * w["expert_bytes"] + predict.cache_bytes(cfg, group, prefix)
        assert got["experts"] == experts and got["bytes"] == pytest.approx(want, rel=1e-12)


def test_trace_table_gives_the_span_against_the_part_roofline(rng):
    """bench_kimi_layer's part table: a traced row's span per step over its part roofline, at the row's own run's copy
    rate (a refit of several runs) where it has one; a row without the span says so."""
    bw, peak = 4e12, 6e14
    rows = []
    for own_bw in (None, rng.uniform(3e12, 5e12)):
        cache, weights, experts = rng.uniform(1e7, 5e9, 3)
        row = dict(kind="verify", moe="kernel", expert_layout="tile-major", batch=8, nodes=17, prefix=4096,
                   ms=rng.uniform(1.0, 9.0), distinct_experts=[100.0], bytes=cache + weights + experts,
                   cache_bytes=cache, expert_bytes=experts,
                   flops_by_part=dict(zip(("attention", "weights", "experts"), rng.uniform(1e10, 3e12, 3))),
                   parts_us_per_step=dict(experts=rng.uniform(100, 900), attention=rng.uniform(100, 900)),
                   gpu_time_per_step=dict(kernels=90.0, busy_us=rng.uniform(1e3, 5e3), span_us=rng.uniform(1e3, 9e3)))
        if own_bw is not None:
            row["copy_gbps"] = own_bw / 1e9
        rows.append(row)
    rows.append({**rows[0], "gpu_time_per_step": {}})
    lines = bench_kimi_layer.markdown(rows, bw, peak).splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| MoE |"))
    header = [c.strip() for c in lines[start].split("|")]
    col = header.index("span × part roofline")
    got = [line.split("|")[col].strip() for line in lines[start + 2:start + 5]]
    for row, cell in zip(rows[:2], got):
        row_bw = row["copy_gbps"] * 1e9 if "copy_gbps" in row else bw
        want = row["gpu_time_per_step"]["span_us"] / 1e6 / bench_kimi_layer.part_roofline_s(row, row_bw, peak)
        assert cell == f"{want:.2f}"
    assert got[2] == "—"
