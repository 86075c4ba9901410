"""Each kernel's default tiles at engine sizes, compiled for sm_90 on the CPU (no GPU): shared memory fits one block
and no registers spill to local memory. The Triton-IR lowering tests cannot see either; the first GPU run of the
fp32 verify_attn found the shared-memory overflow the hard way (346 KiB asked, 227 KiB allowed)."""
import importlib.util
import os

import jax.numpy as jnp
import pytest

pytest.importorskip("triton", reason="the sm_90 compile needs the triton package (test extra, Linux x86-64)")

from pallas_kernels.triton_report import SHARED_LIMIT, report  # noqa: E402

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "kernel_resources.py")
_spec = importlib.util.spec_from_file_location("_kernel_resources", _PATH)
cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cases)

ENGINE_SIZES = {
    "verify_attn bf16 AR batch 64": lambda: cases.verify_case(64, 1, 8192, jnp.bfloat16),
    "verify_attn bf16 tree B=256": lambda: cases.verify_case(1, 257, 8192, jnp.bfloat16),
    "verify_attn bf16 K2.6 whole cache": lambda: cases.verify_case(8, 17, 32768, jnp.bfloat16, layers=61),
    "verify_attn fp32 tree": lambda: cases.verify_case(2, 17, 4096, jnp.float32, heads=8),
    "int4_moe 1 token": lambda: cases.int4_moe_case(1),
    "int4_moe 512 tokens": lambda: cases.int4_moe_case(512),
    "tree_build batch 64 B=256": lambda: cases.tree_build_case(64, 256),
}


@pytest.mark.parametrize("which", list(ENGINE_SIZES))
def test_default_tiles_fit_and_do_not_spill(which):
    _, fn, specs = ENGINE_SIZES[which]()
    kernels = report(fn, *specs)
    assert kernels, f"{which}: no Triton kernel was lowered"
    for k in kernels:
        assert k.shared_bytes <= SHARED_LIMIT, f"{which} / {k.name}: {k.shared_bytes} B of shared memory"
        assert not k.spills, f"{which} / {k.name}: spills ({k.stack_bytes} B stack, {k.spill_loads} LDL)"


def test_report_sees_a_spilling_config():
    """The check can fail: 64-row K2 tiles on 8 warps spill (the old verify_attn default)."""
    _, fn, specs = cases.verify_case(1, 1, 4096, jnp.bfloat16, block_q=64, block_k=32, num_warps=8)
    main = report(fn, *specs)[0]
    assert main.spills and main.stack_bytes > 0 and main.wgmma > 0
