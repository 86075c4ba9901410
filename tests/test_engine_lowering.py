"""The engine's whole generation program (prefill + every round in one jit) lowers for an abstract H200 with the
three round kernels compiled through Triton, in each mode and dtype. The per-kernel lowering tests see each kernel
alone at hand-picked shapes; this sees them at the shapes and inside the control flow the engine gives them."""

import jax
import jax.numpy as jnp
import pytest
from engine_utils import drafter_config, random_drafter
from flax import nnx
from script_loader import load_script

import pallas_kernels._pallas as pallas_mod
from kdtree_jax.checkpoint.weights import init_random
from kdtree_jax.decode.engine import Engine
from kdtree_jax.decode.params import RequestParams
from kdtree_jax.decode.programs import generate_device
from kdtree_jax.decode.speculative import RequestRows
from kdtree_jax.model import config
from pallas_kernels._pallas import lower_for_h200

TRITON_CALL = "__gpu$xla.gpu.triton"
CFG = config.tiny(eos_token_id=(), qk_rope_head_dim=16)  # latent 32 + 16: both powers of two, so no padding copy
KERNELS = {"ddtree": ("verify_attn", "tree_build", "tree_accept"), "chain": ("verify_attn", "tree_accept"),
           "ar": ("verify_attn",)}


def abstract(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


def ts_cache_shape(target, spec) -> tuple[int, ...]:
    cfg = target.cfg
    return (1, spec.batch, spec.capacity, cfg.latent_dim)  # one layer's cache, as the kernel views it


def with_dtype(module, dtype):
    graphdef, state = nnx.split(module)
    return nnx.merge(graphdef, jax.tree.map(lambda a: a.astype(dtype), state))


@pytest.mark.parametrize("mode,dtype", [("ddtree", jnp.float32), ("ddtree", jnp.bfloat16), ("chain", jnp.bfloat16),
                                        ("ar", jnp.float32)])
def test_generation_program_lowers_for_h200(monkeypatch, rng, mode, dtype):
    seed = int(rng.integers(1 << 30))
    target, drafter = init_random(CFG, seed=seed), random_drafter(drafter_config(CFG), seed)
    target, drafter = with_dtype(target, dtype), with_dtype(drafter, dtype)
    engine = Engine(target, drafter)
    spec = engine.spec_for(mode=mode, batch=3, prompt_len=12, max_new_tokens=20, budget=16)
    (tg, ts), (dg, ds) = nnx.split(target), nnx.split(drafter)
    rows = RequestRows.of([RequestParams(max_new_tokens=20, temperature=0.7, top_k=5, top_p=0.9)] * 3,
                          [engine.stop_ids] * 3, 2)

    def fn(ts, ds, prompts, lens, keys, rows):
        return generate_device(spec, nnx.merge(tg, ts), nnx.merge(dg, ds) if mode != "ar" else None, prompts, lens,
                               keys, rows)

    monkeypatch.setattr(pallas_mod, "default_interpret", lambda: False)  # compile the kernels, as on a GPU
    specs = (abstract(ts), abstract(ds), jax.ShapeDtypeStruct((3, spec.prompt_cap), jnp.int32),
             jax.ShapeDtypeStruct((3,), jnp.int32), jax.ShapeDtypeStruct((3, 2), jnp.uint32), abstract(rows))
    text = lower_for_h200(fn, *specs).as_text()
    assert text.count(TRITON_CALL) >= len(KERNELS[mode])
    for name in KERNELS[mode]:
        assert f'name = "{name}' in text or f'name = "_{name}' in text, f"{name} missing from the {mode} program"
    # verify_attn reads its layer's whole cache [Bt, S, A] in place, never a materialised copy of it
    cache_dt = jnp.dtype(target.cache_dtype).name.replace("float", "f")
    latent = "x".join(map(str, ts_cache_shape(target, spec))) + "x" + cache_dt
    calls = [line for line in text.splitlines() if TRITON_CALL in line and 'name = "verify_attn"' in line]
    assert calls and all(f"tensor<{latent}>" in line for line in calls), calls[:1]


@pytest.mark.heavy
@pytest.mark.parametrize("use_pallas", [False, True])
def test_decode_loop_never_copies_the_cache(use_pallas):
    """No `copy` of the whole latent cache in the compiled decode loop: each would read and write the entire cache
    every round (the vmapped writes and a write unordered with the attention's reads once made 7 to 9)."""
    mod = load_script("benchmarks/hlo_cache_copies.py")
    assert mod.cache_copies("ddtree", use_pallas) == []
