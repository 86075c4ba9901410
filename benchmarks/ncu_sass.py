"""Where a kernel's warps wait, instruction by instruction: an ncu source page (SASS) summed by opcode and reason.

    ncu -k regex:int4 --section SourceCounters --section WarpStateStats -o rep python benchmarks/bench_int4_moe.py --once
    ncu -i rep.ncu-rep --page source --csv --print-source sass > sass.csv
    python benchmarks/ncu_sass.py sass.csv

ncu samples each resident warp's state at a fixed interval and charges the sample to the instruction the warp is at,
with its stall reason. Summed over the kernel, and over its K loop (the innermost loop that issues MMAs,
`triton_report.mma_loop`), the samples say which instructions the kernel's time goes to: a sample "selected" is an
issue, any other reason a cycle that warp waited.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import functools
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from triton_report import MIX_GROUPS, SASS_INSTRUCTION, mma_loop  # noqa: E402

ALL_SAMPLES = "Warp Stall Sampling (All Samples)"
REASON = re.compile(r"^stall_(\w+)$")  # per-reason sample columns (those with " (Not Issued)" count only non-issues)
BY = ("group", "opcode", "reason")
_OPCODE = re.compile(r"^\s*" + SASS_INSTRUCTION)
_GROUP_OF = {op: g for g, ops in MIX_GROUPS.items() for op in ops}


@dataclasses.dataclass(frozen=True)
class KernelSamples:
    name: str
    instrs: list  # (address, opcode, operands, all samples, {reason: samples})

    @functools.cached_property
    def loop(self) -> tuple[int, int] | None:
        return mma_loop([(a, op, args) for a, op, args, _, _ in self.instrs])

    def total(self, in_loop: bool = False) -> float:
        span = self.loop if in_loop else None
        return sum(s for a, _, _, s, _ in self.instrs if span is None or span[0] <= a <= span[1])

    def by(self, key: str, in_loop: bool = False) -> dict:
        """Share of the kernel's samples (or of its K loop's, the whole kernel's if it has none) by "opcode", "group"
        (`MIX_GROUPS`) or "reason"."""
        if key not in BY:
            raise ValueError(f"ncu_sass: by={key!r} must be one of {BY}")
        span = self.loop if in_loop else None
        out: dict = {}
        for a, op, _, samples, reasons in self.instrs:
            if span is not None and not span[0] <= a <= span[1]:
                continue
            if key == "reason":
                for r, n in reasons.items():
                    out[r] = out.get(r, 0.0) + n
            else:
                k = op if key == "opcode" else _GROUP_OF.get(op, "other")
                out[k] = out.get(k, 0.0) + samples
        total = self.total(in_loop) or 1.0
        return dict(sorted(((k, v / total) for k, v in out.items()), key=lambda kv: -kv[1]))


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def parse(lines) -> list[KernelSamples]:
    """Each kernel's table of an `ncu --page source --csv --print-source sass` export ("Kernel Name" rows start one)."""
    kernels, name, head = [], None, None
    for row in csv.reader(lines):
        if not row:
            continue
        if row[0] == "Kernel Name":
            name, head = row[1], None
            kernels.append(KernelSamples(name, []))
        elif head is None and name is not None:
            if ALL_SAMPLES not in row:
                raise ValueError(f"ncu source page: kernel {name}'s header has no {ALL_SAMPLES!r} column "
                                 "(profile with --section SourceCounters --section WarpStateStats)")
            head = row
            reasons = {i: REASON.match(c).group(1) for i, c in enumerate(head) if REASON.match(c)}
            addr_col, src_col, all_col = head.index("Address"), head.index("Source"), head.index(ALL_SAMPLES)
        elif len(row) == len(head):
            m = _OPCODE.match(row[src_col])
            if m is None:
                continue
            kernels[-1].instrs.append((int(row[addr_col], 16), m.group(1), m.group(3).strip(),
                                       _number(row[all_col]), {r: _number(row[i]) for i, r in reasons.items()}))
    return kernels


def markdown(kernels: list[KernelSamples], top: int = 8) -> str:
    lines = []
    for k in kernels:
        loop_share = k.total(in_loop=True) / (k.total() or 1.0)
        lines.append(f"### {k.name}: {k.total():.0f} samples, {100 * loop_share:.0f}% in the K loop\n")
        where = "K loop" if k.loop else "no K loop: kernel"
        lines.append(f"| {where}, by | " + " | ".join(f"{i + 1}" for i in range(top)) + " |")
        lines.append("|---" * (top + 1) + "|")
        for key in BY:
            cells = [f"{name} {100 * v:.1f}%" for name, v in list(k.by(key, in_loop=True).items())[:top]]
            lines.append(f"| {key} | " + " | ".join(cells + [""] * (top - len(cells))) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", help="ncu -i REPORT --page source --csv --print-source sass, saved to a file")
    parser.add_argument("--top", type=int, default=8, help="columns per row")
    args = parser.parse_args(argv)
    with open(args.csv, newline="") as f:
        print(markdown(parse(f), args.top))


if __name__ == "__main__":
    main()
