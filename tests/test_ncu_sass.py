"""benchmarks/ncu_sass.py: an ncu SASS source page summed by opcode, opcode group and stall reason."""
import io
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import ncu_sass  # noqa: E402

HEAD = ["Address", "Source", ncu_sass.ALL_SAMPLES, "Warp Stall Sampling (Not-issued Samples)", "stall_selected",
        "stall_wait", "stall_wait (Not Issued)"]


def _page(kernels: dict) -> str:
    out = io.StringIO()
    for name, rows in kernels.items():
        out.write(f'"Kernel Name","{name}",""\n')
        out.write(",".join(f'"{c}"' for c in HEAD) + "\n")
        for addr, src, selected, wait in rows:
            out.write(f'"{addr:#x}","{src}","{selected + wait}","{wait}","{selected}","{wait}","{wait}"\n')
    return out.getvalue()


def test_samples_sum_by_opcode_group_and_reason_over_the_k_loop():
    swiglu = [(0x100, "      LDC R1, c[0x0][0x28]", 5, 15),  # before the loop
              (0x110, "      LOP3.LUT R2, R3, 0xf, R4, 0xea, !PT", 3, 9),
              (0x120, "@P1   HMMA.16816.F32.BF16 R8, R2, R4, R8", 6, 2),
              (0x130, "      HADD2.BF16_V2 R2, R2, R5", 4, 1),
              (0x140, "@P0   BRA 0x110", 1, 0)]  # back to 0x110: the K loop is 0x110..0x140
    matmul = [(0x200, "      SHF.R.U32.HI R1, RZ, 0x4, R1", 2, 2)]
    ks = ncu_sass.parse(io.StringIO(_page({"int4_swiglu": swiglu, "int4_matmul": matmul})))
    assert [k.name for k in ks] == ["int4_swiglu", "int4_matmul"]
    k = ks[0]
    assert k.loop == (0x110, 0x140)
    assert k.total() == 46 and k.total(in_loop=True) == 26
    assert k.by("opcode", in_loop=True) == pytest.approx({"LOP3": 12 / 26, "HMMA": 8 / 26, "HADD2": 5 / 26,
                                                          "BRA": 1 / 26})
    assert k.by("group", in_loop=True) == pytest.approx({"int_alu": 12 / 26, "mma": 8 / 26, "half2": 5 / 26,
                                                         "other": 1 / 26})
    assert k.by("reason", in_loop=True) == pytest.approx({"wait": 12 / 26, "selected": 14 / 26})
    assert k.by("opcode") == pytest.approx({"LDC": 20 / 46, "LOP3": 12 / 46, "HMMA": 8 / 46, "HADD2": 5 / 46,
                                            "BRA": 1 / 46})
    assert ks[1].loop is None and ks[1].by("reason") == pytest.approx({"selected": 0.5, "wait": 0.5})
    with pytest.raises(ValueError, match="opcode"):
        k.by("pipe")
    text = ncu_sass.markdown(ks, top=3)
    assert "### int4_swiglu: 46 samples, 57% in the K loop" in text
    assert "| opcode | LOP3 46.2% | HMMA 30.8% | HADD2 19.2% |" in text
    assert "| no K loop: kernel, by |" in text  # int4_matmul's page has no backward branch


def test_a_page_without_stall_sampling_names_the_kernel_and_the_sections():
    page = '"Kernel Name","int4_matmul",""\n"Address","Source","Instructions Executed"\n"0x10","NOP","1"\n'
    with pytest.raises(ValueError, match="int4_matmul.*SourceCounters"):
        ncu_sass.parse(io.StringIO(page))
