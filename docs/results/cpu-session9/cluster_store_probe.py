"""Session 9 probe: can Mosaic GPU's CPU interpreter (jax 0.11.2) run a store into a cluster peer's shared memory?
Run: python docs/results/cpu-session9/cluster_store_probe.py. Output: cluster_store_probe.log (it cannot)."""
import jax, jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

def body(x_ref, o_ref, smem, bar):
    c = lax.axis_index("c")
    peer = 1 - c
    v = x_ref[...] + c.astype(jnp.float32)
    plgpu.async_store_smem(v, smem, bar, cluster_idx=peer, cluster_dim="c")
    plgpu.barrier_wait(bar)
    o_ref[c] = smem[...]

k = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((2, 128), jnp.float32),
                 scratch_types=(plgpu.SMEM((128,), jnp.float32), plgpu.ClusterBarrier(collective_axes=("c",))),
                 grid=(1,), grid_names=("g",), cluster=(2,), cluster_names=("c",),
                 interpret=plgpu.InterpretGPUParams())
try:
    print(k(jnp.arange(128, dtype=jnp.float32)))
except Exception as e:
    print("ERROR", type(e).__name__, str(e)[:300])
