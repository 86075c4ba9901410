"""What each Pallas kernel costs an H200 in registers, stack (spills) and shared memory, found without a GPU.

The CPU lowering check (`_pallas.lower_for_h200`) stops at Triton IR, so a kernel that needs more shared memory than
a Hopper block may have, or that spills its accumulator to local memory, passes it and fails (or crawls) on the GPU.
Here each `pallas_call`'s Triton IR, captured while lowering for the abstract H200, is compiled to a cubin for sm_90
by the `triton` package (its own ptxas), and the cubin's resource usage and instruction mix are read with the
cuobjdump that package carries. Needs `triton` (the GPU machine's version, 3.6.0; Linux x86-64).

The IR comes from jax's private Pallas Triton lowering (`jax._src.pallas.triton.lowering`), patched only inside
`capture`; warps and stages are read back from each custom call's backend config in the lowered module.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import subprocess
import tempfile

import jax

from pallas_kernels._pallas import lower_for_h200

H200_TARGET = ("cuda", 90, 32)  # (backend, compute capability, warp size)
SHARED_LIMIT = 232448  # bytes of shared memory one block may use on sm_90 (227 KiB)
REGISTER_LIMIT = 255  # per thread: a kernel at this cap has probably spilled (check stack_bytes)
SM_SHARED = 233472  # bytes of shared memory per SM on sm_90 (228 KiB; 1 KiB of it reserved per resident block)
SM_REGISTERS = 65536  # 32-bit registers per SM
SM_MAX_BLOCKS = 32
_CALL_PARAMS = re.compile(r'name = "([^"]+)", num_stages = (\d+) : i32, num_warps = (\d+) : i32')


@dataclasses.dataclass(frozen=True)
class KernelResources:
    name: str
    num_warps: int
    num_stages: int
    registers: int  # per thread
    stack_bytes: int  # per thread: local memory, where spilled registers go
    shared_bytes: int  # dynamic shared memory the launch needs
    spill_loads: int  # LDL instructions in the SASS
    spill_stores: int  # STL instructions
    wgmma: int  # HGMMA instructions (Hopper warpgroup MMA)
    mma: int  # HMMA instructions (Ampere-style mma.sync)
    async_copies: int = 0  # LDGSTS (cp.async) + UTMALDG (TMA): global loads that software pipelining overlaps

    @property
    def blocks_per_sm(self) -> int:
        """Blocks one SM can hold at once (shared memory and registers): a grid of more than 132 x this runs in
        several waves, and a small last wave costs as much as a full one."""
        by_shared = SM_SHARED // (self.shared_bytes + 1024)
        by_registers = SM_REGISTERS // max(1, self.registers * 32 * self.num_warps)
        return max(0, min(by_shared, by_registers, SM_MAX_BLOCKS))

    @property
    def fits(self) -> bool:
        return self.shared_bytes <= SHARED_LIMIT

    @property
    def spills(self) -> bool:
        return self.stack_bytes > 0 or self.spill_loads > 0 or self.spill_stores > 0


@contextlib.contextmanager
def _capture_modules(out: list):
    from jax._src.pallas.triton import lowering

    original = lowering.lower_jaxpr_to_triton_module

    def spy(*args, **kwargs):
        result = original(*args, **kwargs)
        out.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    lowering.lower_jaxpr_to_triton_module = spy
    try:
        yield
    finally:
        lowering.lower_jaxpr_to_triton_module = original


def capture(fn, *specs) -> list[tuple[str, int, int, str]]:
    """(kernel name, num_warps, num_stages, Triton IR text) of every pallas_call in fn(*specs), lowered for H200."""
    modules: list[str] = []
    jax.clear_caches()  # a cached lowering would not pass through the spy
    with _capture_modules(modules):
        text = lower_for_h200(fn, *specs).as_text()
    params = {name: (int(warps), int(stages)) for name, stages, warps in _CALL_PARAMS.findall(text)}
    kernels = []
    for ttir in modules:
        name = re.match(r"module @(\S+)", ttir).group(1)
        if name not in params:
            raise RuntimeError(f"triton_report: no custom call named {name!r} in the lowered module")
        kernels.append((name, *params[name], ttir))
    return kernels


def _compile_and_dump(name: str, num_warps: int, num_stages: int, ttir: str, *flags: str):
    """Compile one kernel's Triton IR for sm_90 with triton's own ptxas; (its metadata, cuobjdump output per flag)."""
    import triton
    from triton.backends.compiler import GPUTarget

    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, f"{name}.ttir")
        with open(src, "w") as f:
            f.write(ttir)
        kernel = triton.compile(src, target=GPUTarget(*H200_TARGET),
                                options=dict(num_warps=num_warps, num_stages=num_stages))
        cubin = os.path.join(tmp, f"{name}.cubin")
        with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])
        return kernel.metadata, [_cuobjdump(bindir, flag, cubin) for flag in flags]


def compile_sm90(name: str, num_warps: int, num_stages: int, ttir: str) -> KernelResources:
    """Compile one kernel's Triton IR for sm_90 and read its resource usage and instruction mix."""
    meta, (usage, sass) = _compile_and_dump(name, num_warps, num_stages, ttir, "--dump-resource-usage", "--dump-sass")
    field = lambda key: int(re.search(rf"\b{key}:(\d+)", usage).group(1))  # noqa: E731
    count = lambda op: len(re.findall(rf"\b{op}\b", sass))  # noqa: E731
    return KernelResources(name=name, num_warps=num_warps, num_stages=num_stages, registers=field("REG"),
                           stack_bytes=field("STACK"), shared_bytes=int(meta.shared),
                           spill_loads=count("LDL"), spill_stores=count("STL"), wgmma=count("HGMMA"),
                           mma=count("HMMA"), async_copies=count("LDGSTS") + count("UTMALDG"))


def _cuobjdump(bindir: str, flag: str, cubin: str) -> str:
    res = subprocess.run([os.path.join(bindir, "cuobjdump"), flag, cubin], capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"cuobjdump {flag} {cubin}: {res.stderr.strip()}")
    return res.stdout


def report(fn, *specs) -> list[KernelResources]:
    """Resources of every pallas_call in fn(*specs) (kernels called with interpret=False), compiled for H200."""
    return [compile_sm90(*k) for k in capture(fn, *specs)]


# ---- instruction mix of the hot loop -----------------------------------------------------------------------------
# SASS opcode (the part before the first '.') -> what it does, to read a kernel's inner loop at a glance. IMAD and
# IADD3 also serve as moves and address arithmetic; they still take an integer issue slot.
MIX_GROUPS = {
    "global_load": ("LDG", "LDGSTS", "UTMALDG"),
    "shared": ("LDS", "LDSM", "STS"),  # beyond the cp.async staging reads: layout conversions
    "int_alu": ("SHF", "LOP3", "IADD3", "SGXT", "IMAD", "LEA", "VIADD", "PRMT"),
    "convert": ("I2F", "I2FP", "F2F", "F2FP", "F2I"),
    "fp32": ("FADD", "FMUL", "FFMA"),
    "half2": ("HADD2", "HMUL2", "HFMA2"),  # packed 16-bit lanes (fp16 / bf16 pairs)
    "mma": ("HMMA", "HGMMA"),
}
# one SASS instruction as cuobjdump and ncu print it: [predicate] opcode, its .modifiers, operands
SASS_INSTRUCTION = r"(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(\S*)\s*([^;]*)"
_SASS_LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+" + SASS_INSTRUCTION + ";", re.M)


@dataclasses.dataclass(frozen=True)
class InstructionMix:
    """Static SASS opcode counts of one kernel: the whole kernel, and the innermost loop that issues MMAs (the
    K loop, where the per-weight work is)."""

    name: str
    loop: dict  # opcode -> count in the innermost loop holding an HMMA / HGMMA (empty if none)
    kernel: dict  # opcode -> count in the whole kernel

    def group(self, group: str, where: str = "loop") -> int:
        counts = self.loop if where == "loop" else self.kernel
        return sum(counts.get(op, 0) for op in MIX_GROUPS[group])


def parse_sass(sass: str) -> list[tuple[int, str, str]]:
    """(address, opcode without modifiers, operands) of every instruction in a cuobjdump SASS listing."""
    return [(int(addr, 16), op, args.strip()) for addr, op, _mods, args in _SASS_LINE.findall(sass)]


def mma_loop(instrs: list[tuple[int, str, str]]) -> tuple[int, int] | None:
    """(first, last) address of the innermost loop (a backward BRA's span) that contains an MMA instruction."""
    mma_at = [a for a, op, _ in instrs if op in MIX_GROUPS["mma"]]
    spans = []
    for addr, op, args in instrs:
        target = re.match(r"(0x[0-9a-f]+)", args) if op == "BRA" else None
        if target and int(target.group(1), 16) < addr:
            lo = int(target.group(1), 16)
            if any(lo <= a <= addr for a in mma_at):
                spans.append((addr - lo, lo, addr))
    return min(spans)[1:] if spans else None


def opcode_counts(instrs, span: tuple[int, int] | None = None) -> dict:
    """Opcode -> count, over all instructions or over those inside span (inclusive)."""
    counts: dict = {}
    for addr, op, _ in instrs:
        if span is None or span[0] <= addr <= span[1]:
            counts[op] = counts.get(op, 0) + 1
    return counts


def sass_sm90(name: str, num_warps: int, num_stages: int, ttir: str) -> str:
    """The SASS listing of one kernel's Triton IR compiled for sm_90."""
    return _compile_and_dump(name, num_warps, num_stages, ttir, "--dump-sass")[1][0]


def instruction_mix(fn, *specs) -> list[InstructionMix]:
    """Instruction mix of every pallas_call in fn(*specs) (kernels called with interpret=False), compiled for H200."""
    mixes = []
    for name, warps, stages, ttir in capture(fn, *specs):
        instrs = parse_sass(sass_sm90(name, warps, stages, ttir))
        span = mma_loop(instrs)
        mixes.append(InstructionMix(name, opcode_counts(instrs, span) if span else {}, opcode_counts(instrs)))
    return mixes
