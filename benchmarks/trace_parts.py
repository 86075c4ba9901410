"""GPU kernel time by part, from a `jax.profiler` trace and the compiled HLO's named scopes.

Each kernel event of the trace names the HLO instruction that launched it; that instruction's `op_name` metadata
holds the `jax.named_scope` path it was traced under, and a caller's `part_of(op_name)` maps the path to a part
(None: not one of its parts). Kernels under an XLA command buffer report the buffer, not an instruction, so a
profile meant for attribution runs with command buffers off (`COMMAND_BUFFERS_OFF`). Pallas kernels are matched by
the `name=` prefix of their `pallas_call` instead.
"""
from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
from collections.abc import Callable, Mapping

COMMAND_BUFFERS_OFF = "--xla_gpu_enable_command_buffer="
UNATTRIBUTED = "unattributed"

PartOf = Callable[[str], "str | None"]


def command_buffers_off() -> None:
    """Append COMMAND_BUFFERS_OFF to XLA_FLAGS; call before JAX creates its GPU client."""
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + COMMAND_BUFFERS_OFF).strip()


def _norm(name: str) -> str:
    return re.sub(r"[^0-9A-Za-z]", "_", name)


def hlo_scopes(hlo_text: str, part_of: PartOf) -> dict[str, str]:
    """Normalised HLO instruction name -> the op_name (jax.named_scope path) it carries. Fusions often carry none
    of their own: they take their computation's ROOT op_name, else the op_name of the part most of its instructions
    belong to (a fusion may also hold a constant broadcast that another part's code created)."""
    inside: dict[str, list[str]] = collections.defaultdict(list)  # computation -> op_names inside
    root: dict[str, str] = {}
    own: dict[str, str] = {}
    calls: dict[str, str] = {}
    comp = ""
    for line in hlo_text.splitlines():
        head = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s+\(.*\)\s*->.*\{\s*$", line)
        if head:
            comp = head.group(1)
            continue
        inst = re.match(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=", line)
        if not inst:
            continue
        name = _norm(inst.group(2))
        op = re.search(r"op_name=\"([^\"]*)\"", line)
        if op:
            own[name] = op.group(1)
            inside[comp].append(op.group(1))
            if inst.group(1):
                root[comp] = op.group(1)
        callee = re.search(r"calls=%?([\w.\-]+)", line)
        if callee:
            calls[name] = callee.group(1)
    out = dict(own)
    for name, callee in calls.items():
        if name in out or not inside.get(callee):
            continue
        if callee in root:
            out[name] = root[callee]
        else:
            votes = collections.Counter(part_of(op) for op in inside[callee])
            best = votes.most_common(1)[0][0]
            out[name] = next(op for op in inside[callee] if part_of(op) == best)
    return out


def attribute(event: dict, scopes: Mapping[str, str], part_of: PartOf, pallas_parts: Mapping[str, str],
              outside: str) -> str:
    """The part one GPU kernel belongs to; `outside` for a known instruction under none of the parts."""
    hlo_op = event.get("args", {}).get("hlo_op", "")
    for key in (hlo_op, event["name"], re.sub(r"__\d+$", "", event["name"])):
        if key and not key.startswith("command_buffer") and _norm(key) in scopes:
            return part_of(scopes[_norm(key)]) or outside
    for prefix, part in pallas_parts.items():
        if event["name"].startswith(prefix):
            return part
    return UNATTRIBUTED


def gpu_kernels(trace_dir: str) -> list[dict]:
    """The GPU kernel events ('X' on a /device:GPU process) of the newest perfetto trace under trace_dir."""
    paths = sorted(glob.glob(os.path.join(trace_dir, "plugins", "profile", "*", "perfetto_trace.json.gz")))
    if not paths:
        raise FileNotFoundError(f"{trace_dir}: no plugins/profile/*/perfetto_trace.json.gz")
    with gzip.open(paths[-1]) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    gpu = {e["pid"] for e in events
           if e.get("ph") == "M" and e.get("name") == "process_name" and "GPU" in e["args"].get("name", "")}
    return sorted((e for e in events if e.get("ph") == "X" and e.get("pid") in gpu), key=lambda e: e["ts"])


def part_times(kernels: list[dict], scopes: Mapping[str, str], part_of: PartOf, pallas_parts: Mapping[str, str],
               outside: str, per: int) -> dict[str, float]:
    """µs of kernel time by part, divided by `per` (the rounds or steps the trace ran)."""
    acc: dict[str, float] = collections.defaultdict(float)
    for e in kernels:
        acc[attribute(e, scopes, part_of, pallas_parts, outside)] += e["dur"] / per
    return dict(acc)


def busy_time(kernels: list[dict], per: int) -> dict[str, float]:
    """Per `per` steps: kernel launches, µs in which some kernel ran (overlaps counted once) and µs from the first
    kernel's start to the last one's end. span - busy is time the GPU sat idle between kernels (launch latency, host
    round trips of loop predicates), which no kernel's speed-up recovers."""
    ordered = sorted(kernels, key=lambda e: e["ts"])
    busy, end = 0.0, float("-inf")
    for e in ordered:
        stop = e["ts"] + e["dur"]
        if stop > end:
            busy += stop - max(e["ts"], end)
            end = stop
    span = end - ordered[0]["ts"] if ordered else 0.0
    return dict(kernels=len(kernels) / per, busy_us=busy / per, span_us=span / per)


def top_kernels(kernels: list[dict], scopes: Mapping[str, str], part_of: PartOf, pallas_parts: Mapping[str, str],
                outside: str, per: int, n: int | None = 8) -> dict[str, dict[str, float]]:
    """The n kernels (by name, launches of one name added; None: all) that take the most µs per `per` in each part:
    what a part's time is made of, for finding where a part loses to its roofline."""
    acc: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for e in kernels:
        acc[attribute(e, scopes, part_of, pallas_parts, outside)][e["name"]] += e["dur"] / per
    return {part: {name: round(us, 1) for name, us in c.most_common(n)} for part, c in acc.items()}
