"""Each kernel's default tiles at engine sizes, compiled for sm_90 on the CPU (no GPU): shared memory fits one block
and register spills stay small. The Triton-IR lowering tests cannot see either; the first GPU run of the fp32
verify_attn found the shared-memory overflow the hard way (346 KiB asked, 227 KiB allowed).

Spills are bounded, not forbidden: on the H200 the bf16 verify_attn tiles on 4 warps (up to 280 B of stack per
thread at B = 256) ran 1.6-2.2x faster than spill-free 8-warp tiles (BENCHMARKS.md §3). A default that spills more
than SPILL_LIMIT is a change to measure on the GPU before it lands."""
import os
import sys

import jax.numpy as jnp
import pytest

pytest.importorskip("triton", reason="the sm_90 compile needs the triton package (test extra, Linux x86-64)")

_BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, _BENCHMARKS)  # triton_report lives next to kernel_resources, its command-line user

from script_loader import load_script
from triton_report import SHARED_LIMIT, KernelResources, mma_loop, opcode_counts, parse_sass, report  # noqa: E402

from pallas_kernels.verify_attn import DEFAULTS, MIN_DOT  # noqa: E402

SPILL_LIMIT = 512  # stack bytes per thread

cases = load_script("benchmarks/kernel_resources.py")

ENGINE_SIZES = {
    "verify_attn bf16 AR batch 64": lambda: cases.verify_case(64, 1, 8192, jnp.bfloat16),
    "verify_attn bf16 tree B=256": lambda: cases.verify_case(1, 257, 8192, jnp.bfloat16),
    "verify_attn bf16 K2.6 whole cache": lambda: cases.verify_case(8, 17, 32768, jnp.bfloat16, layers=61),
    "verify_attn bf16 AR 8 heads (8-way TP)": lambda: cases.verify_case(8, 1, 32768, jnp.bfloat16, heads=8),
    "verify_attn fp32 tree": lambda: cases.verify_case(2, 17, 4096, jnp.float32, heads=8),
    "int4_moe 1 token": lambda: cases.int4_moe_case(1),
    "int4_moe 512 tokens": lambda: cases.int4_moe_case(512),
    "int4_moe 1 token f32 unpack": lambda: cases.int4_moe_case(1, unpack="f32"),
    "tree_build batch 64 B=256": lambda: cases.tree_build_case(64, 256),
}


@pytest.mark.heavy
@pytest.mark.parametrize("which", list(ENGINE_SIZES))
def test_default_tiles_fit_and_spill_little(which):
    _, fn, specs = ENGINE_SIZES[which]()
    kernels = report(fn, *specs)
    assert kernels, f"{which}: no Triton kernel was lowered"
    for k in kernels:
        assert k.shared_bytes <= SHARED_LIMIT, f"{which} / {k.name}: {k.shared_bytes} B of shared memory"
        assert k.stack_bytes <= SPILL_LIMIT, f"{which} / {k.name}: spills {k.stack_bytes} B stack ({k.spill_loads} LDL)"


@pytest.mark.heavy
@pytest.mark.parametrize("tokens", [64, 1088])  # AR batch 64; batch 64 with B = 16 (32-row blocks)
def test_tile_major_launches_fit_shared_memory(tokens):
    """The engine's tile-major INT4 launches (4 warps) at AR batch 64 (16-row blocks) and at their largest row block
    (32 rows at 1088 tokens): both kernels fit one block's shared memory. At 64 rows they did not, and a batch-64
    B = 16 verify failed to launch on the H200."""
    _, fn, specs = cases.int4_moe_case(tokens, tiled=True)
    kernels = report(fn, *specs)
    assert {k.name for k in kernels} == {"int4_swiglu", "int4_matmul"}
    for k in kernels:
        assert k.shared_bytes <= SHARED_LIMIT, f"{tokens} tokens / {k.name}: {k.shared_bytes} B of shared memory"


@pytest.mark.parametrize("which", [k for k in ENGINE_SIZES if k.startswith("verify_attn bf16")])
def test_verify_attn_loads_are_pipelined_and_resident(which):
    """The KV loads are asynchronous copies (cp.async: software pipelining overlaps them with the dots), and a block
    fits an SM as many times as `verify_attn.DEFAULTS` declares for its tile: the split rule fills whole waves of
    that many blocks per SM."""
    _, fn, specs = ENGINE_SIZES[which]()
    (k,) = report(fn, *specs)
    assert k.async_copies > 0, f"{which}: no cp.async / TMA loads"
    _, n, h, _ = specs[0].shape
    tiles, one_tile, _, _ = DEFAULTS[2]
    resident = (one_tile if n * h <= MIN_DOT else tiles)[2]
    assert k.blocks_per_sm == resident, f"{which}: {k.blocks_per_sm} blocks / SM, DEFAULTS declares {resident}"


def test_blocks_per_sm_follows_shared_memory_and_registers():
    base = dict(name="k", num_warps=4, num_stages=3, stack_bytes=0, spill_loads=0, spill_stores=0, wgmma=0, mma=0)
    assert KernelResources(registers=64, shared_bytes=170496, **base).blocks_per_sm == 1  # 166 KiB: one per SM
    assert KernelResources(registers=64, shared_bytes=50000, **base).blocks_per_sm == 4  # shared memory bound
    assert KernelResources(registers=255, shared_bytes=0, **base).blocks_per_sm == 2  # 255 x 128 threads: registers


def test_report_sees_a_spilling_config():
    """The check can fail: 64-row K2 tiles on 4 warps spill far past the limit (and use wgmma)."""
    _, fn, specs = cases.verify_case(1, 1, 4096, jnp.bfloat16, block_q=64, block_k=64, num_warps=4)
    main = report(fn, *specs)[0]
    assert main.spills and main.stack_bytes > SPILL_LIMIT and main.wgmma > 0


# ---- INT4 unpack: K-loop instruction mix ---------------------------------------------------------------------------
BF16X2_MAX_ALU_RATIO = 0.6  # bf16x2 K loop: at most this share of the fp32 path's ALU instructions per weight


def test_mma_loop_is_the_innermost_backward_branch_with_an_mma():
    sass = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   LDS R2, [R3] ;
        /*0020*/                   HMMA.16816.F32.BF16 R4, R4, R6, R4 ;
        /*0030*/               @P0 BRA 0x10 ;
        /*0040*/                   LOP3.LUT R2, R2, 0xf, RZ, 0xc0, !PT ;
        /*0050*/               @P1 BRA 0x0 ;
        /*0060*/                   BRA 0x60;
    """
    instrs = parse_sass(sass)
    assert [op for _, op, _ in instrs] == ["MOV", "LDS", "HMMA", "BRA", "LOP3", "BRA", "BRA"]
    assert mma_loop(instrs) == (0x10, 0x30)
    assert opcode_counts(instrs, (0x10, 0x30)) == {"LDS": 1, "HMMA": 1, "BRA": 1}


def test_int4_bf16x2_unpack_cuts_loop_alu_without_layout_conversions():
    """Compile-time facts at 1 token (K2.6): the bf16x2 K loop has no conversions, no spills, no shared-memory
    stores (the dequantized tile stays in the mma operand registers) and far fewer ALU instructions per weight."""
    rows = {(r["unpack"], r["name"]): r for r in cases.int4_mix_rows(tokens=(1,))}
    for name in cases.INT4_WEIGHT_SETS:
        f32, bx = rows[("f32", name)], rows[("bf16x2", name)]
        for r in (f32, bx):
            assert r["mma"] > 0 and r["loop"].get("STS", 0) == 0, f"{name} {r['unpack']}: {r['loop']}"
            assert r["loop"].get("LDL", 0) == r["loop"].get("STL", 0) == 0, f"{name} {r['unpack']} spills in its loop"
        assert bx["convert"] == 0 and bx["half2"] > 0 and bx["mma"] == f32["mma"]
        assert bx["alu_per_weight"] <= BF16X2_MAX_ALU_RATIO * f32["alu_per_weight"], (
            f"{name}: {bx['alu_per_weight']:.2f} vs {f32['alu_per_weight']:.2f} ALU instructions per weight")
