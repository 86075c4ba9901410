"""benchmarks/bench_int4_moe.py's --unpack-drop variants: the kernel's own inline PTX with instructions left out."""
import os
import sys

import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import bench_int4_moe as bench  # noqa: E402

from pallas_kernels import int4_moe  # noqa: E402
from pallas_kernels.int4_moe_ref import int4_moe_ffn_ref  # noqa: E402


@pytest.mark.parametrize("k", range(8))
def test_dropped_asm_leaves_out_only_the_named_instructions(k):
    real = int4_moe._bf16x2_asm(k).split("\n")
    assert bench.dropped_asm(())(k).split("\n") == real
    no_sub = bench.dropped_asm(bench.UNPACK_DROPS["sub"])(k).split("\n")
    assert no_sub == [line for line in real if not line.startswith("sub.")] and len(no_sub) == len(real) - 1
    bare = bench.dropped_asm(bench.UNPACK_DROPS["sub, mul"])(k).split("\n")
    assert bare[-2:] == ["mov.b32 $0, u;", "}"]  # the plane is still written
    assert [line for line in bare if line.startswith(("sub.", "mul."))] == []
    assert bare[:-2] == [line for line in real if not line.startswith(("sub.", "mul."))][:-1]


def test_dropped_asm_refuses_an_unpack_it_does_not_know(monkeypatch):
    monkeypatch.setattr(int4_moe, "_bf16x2_asm", lambda k: "{\nmov.b32 $0, $3;\n}")
    with pytest.raises(RuntimeError, match="UNPACK_DROPS"):
        bench.dropped_asm(bench.UNPACK_DROPS["sub"])(0)


def test_once_runs_each_unpack_on_tile_major_experts_and_matches_float64():
    """--once's calls (what a profiler records) compute the FFN: each variant against the float64 reference."""
    shape = bench.dataclasses.replace(bench.CPU_SMOKE, tokens=(3,))
    outs = bench.run_once(shape, (int4_moe.UNPACK_F32, int4_moe.UNPACK_BF16X2), jnp.bfloat16, interpret=True)
    assert sorted(outs) == [(3, int4_moe.UNPACK_BF16X2), (3, int4_moe.UNPACK_F32)]
    x, idx, w = bench.make_sets(shape, 3, jnp.bfloat16, seed=3)[0]
    ref = int4_moe_ffn_ref(*(np.asarray(a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a)
                             for a in (x, idx, w, *bench.random_ffn_int4(shape))))
    for y in outs.values():
        y = np.asarray(y.astype(jnp.float32), np.float64)
        assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 1e-2  # bf16 h and y: ~4e-3
