"""Whether a generation fits the device: its bytes beyond the weights, estimated from the spec, against a limit.

Checked on the host before anything compiles, so a generation too large for the device is refused with what to lower
instead of failing inside XLA's allocator.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from kdtree_jax.decode.speculative import DecodeSpec
from pallas_kernels import verify_attn_mgpu
from pallas_kernels.verify_attn import SM_COUNT


class ResourceLimitError(ValueError):
    """A generation whose caches and activations would not fit the device's free memory."""


def estimate_bytes(spec: DecodeSpec, target, drafter) -> dict[str, int]:
    """Device bytes a generation allocates beyond the weights: caches plus the larger of prefill and verify
    activations (logits, attention scores unless the kernel streams them, and MoE intermediates of one forward as
    the dense path would hold them, x2 for temporaries)."""
    cfg = target.cfg
    bt, cap = spec.batch, spec.capacity
    itemsize = jnp.dtype(target.cache_dtype).itemsize
    act = jnp.dtype(target.dtype).itemsize
    out = {"latent cache": cfg.num_hidden_layers * bt * cap * cfg.latent_dim * itemsize}
    if drafter is not None and spec.mode != "ar":
        d = drafter.cfg
        out["drafter cache"] = 2 * d.num_hidden_layers * bt * cap * d.num_key_value_heads * d.head_dim * act

    def forward(tokens: int, keys: int) -> int:
        logits = bt * tokens * cfg.vocab_size * 4
        # the verify_attn kernel (verify and, with Pallas, prefill chunks) streams the cached keys: no [Bt, H, T, S]
        # scores; its wgmma path keeps the [Bt, T, H, T] tree block and fp32 split partials (about two waves of
        # 64-row programs at most, or the rows themselves)
        heads = cfg.num_attention_heads
        partials = max(bt * tokens * heads, 2 * SM_COUNT * verify_attn_mgpu.ROWS) * cfg.kv_lora_rank * 4
        if spec.use_pallas:
            scores = bt * heads * tokens * (tokens + 2) * 4 + partials
        else:
            scores = bt * heads * tokens * keys * 4
        moe = bt * tokens * max(cfg.n_routed_experts, 1) * max(cfg.moe_intermediate_size, 1) * act
        hidden = bt * tokens * max(cfg.intermediate_size, cfg.hidden_size) * act * 4
        return 2 * (logits + scores + moe + hidden)

    out["activations"] = max(forward(spec.prefill_chunk, cap), forward(spec.n_slots, cap))
    return out


def free_device_bytes() -> tuple[int, str]:
    """Free memory of the default device (GPU: allocator limit minus use; CPU: the host's available memory)."""
    dev = jax.devices()[0]
    stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0)), str(dev)
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024, f"{dev} (host memory)"
    return 1 << 62, str(dev)


def check_fits(spec: DecodeSpec, target, drafter, memory_limit_bytes: int | None) -> None:
    """Refuse, before anything compiles, a generation whose estimate (`estimate_bytes`; `drafter` None where the
    spec does not use it) exceeds the limit: `memory_limit_bytes`, else the device's free memory. The message gives
    both in bytes (a human unit beside them: tiny models need a few MiB, which GiB rounds to 0.00) and what to
    lower."""
    need = estimate_bytes(spec, target, drafter)
    total = sum(need.values())
    if memory_limit_bytes is not None:
        limit = memory_limit_bytes
        has = f"memory_limit_bytes is {limit} bytes ({_human_bytes(limit)})"
    else:
        limit, where = free_device_bytes()
        has = f"{where} has {limit} bytes ({_human_bytes(limit)}) free"
    if total > limit:
        parts = ", ".join(f"{k} {v} bytes" for k, v in need.items())
        lower = [f"the budget ({spec.budget}; activations grow with the {spec.n_slots} tokens verified per round)"]
        lower = (lower if spec.mode == "ddtree" else []) + [
            f"the batch size ({spec.batch})",
            f"the context (prompt padded to {spec.prompt_cap} + max_new_tokens {spec.max_new_tokens}: "
            f"{spec.capacity} cache rows per request)"]
        raise ResourceLimitError(
            f"mode {spec.mode}, batch {spec.batch} x {spec.capacity} cache rows needs about {total} bytes "
            f"({_human_bytes(total)}: {parts}) but {has}; "
            f"lower {', '.join(lower[:-1])} or {lower[-1]}"
        )


def _human_bytes(n: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n} bytes" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
