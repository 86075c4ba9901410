"""Small random target + drafter pairs for engine tests (numpy-drawn weights: no per-op compiles on CPU)."""
from __future__ import annotations

import contextlib
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kdtree_jax.checkpoint.weights import init_random
from kdtree_jax.model import config
from kdtree_jax.model.drafter import DFlashDrafter
from kdtree_jax.model.drafter_config import DrafterConfig

# Three targets that differ in routing groups, dense layers, YaRN and head dims.
TARGET_CONFIGS = {  # no stop token, so every request runs to max_new_tokens unless a test sets one
    "grouped": config.tiny(eos_token_id=()),
    "flat_dense2": config.tiny(eos_token_id=(), n_group=1, topk_group=1, first_k_dense_replace=2, num_hidden_layers=3,
                               rope_scaling=config.RopeScaling(factor=4.0, original_max_position_embeddings=32,
                                                               beta_fast=8.0, beta_slow=1.0, mscale=1.0,
                                                               mscale_all_dim=1.0)),
    "heads": config.tiny(eos_token_id=(), num_attention_heads=2, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, kv_lora_rank=16,
                         n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
                         first_k_dense_replace=0, num_hidden_layers=2, rope_scaling=config.RopeScaling()),
}


def drafter_config(target: config.ModelConfig, *, block_size: int = 4, layers: int = 1) -> DrafterConfig:
    taps = (0, target.num_hidden_layers - 1) if target.num_hidden_layers > 1 else (0,)
    return DrafterConfig(
        hidden_size=target.hidden_size, intermediate_size=2 * target.hidden_size, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=target.vocab_size,
        target_layer_ids=taps, mask_token_id=target.vocab_size - 1, block_size=block_size,
        num_target_layers=target.num_hidden_layers, rope_theta=10000.0,
        max_position_embeddings=target.max_position_embeddings,
    )


def random_drafter(cfg: DrafterConfig, seed: int, *, scale: float = 1.0) -> DFlashDrafter:
    """Linear weights ~ N(0, 1/fan_in) * scale, norms ~ 1 + N(0, 0.2)."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: DFlashDrafter(cfg, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(seed)

    def fill(x):
        if x.ndim == 1:
            return jnp.asarray(1.0 + 0.2 * rng.standard_normal(x.shape), x.dtype)
        return jnp.asarray(scale * rng.standard_normal(x.shape) / np.sqrt(x.shape[0]), x.dtype)

    return nnx.merge(graphdef, jax.tree.map(fill, state))


def random_pair(name: str, seed: int, *, block_size: int = 4):
    target_cfg = TARGET_CONFIGS[name]
    return init_random(target_cfg, seed=seed), random_drafter(drafter_config(target_cfg, block_size=block_size), seed)


def nucleus_probs(logits: np.ndarray, temperature: float, top_p: float) -> np.ndarray:
    """float64 numpy temperature + top-p: the smallest top set whose mass before each kept token is < top_p."""
    x = logits / temperature
    p = np.exp(x - x.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    mass_before = np.cumsum(p[order]) - p[order]
    kept = np.zeros_like(p)
    kept[order[mass_before < top_p]] = p[order[mass_before < top_p]]
    return kept / kept.sum()


def exact_pair_distribution(cfg, weight_seed, prompt, temperature, top_p):
    """P(t2, t3) for the 2nd and 3rd generated tokens, summed over t1, from the float64 numpy reference.

    Not from the JAX model: a float32 forward can flip a near-tied MoE group choice (seen: group scores 3e-4
    apart), which changes the next-token distribution outright and would fail the test for the wrong reason.
    """
    from kdtree_jax.checkpoint.weights import random_hf_weights
    from kdtree_jax.oracles.reference import reference_forward

    weights = random_hf_weights(cfg, weight_seed)
    v = cfg.vocab_size

    def probs(seq):
        return nucleus_probs(reference_forward(cfg, weights, seq)[-1], temperature, top_p)

    p1 = probs(prompt)
    p2 = np.stack([probs(prompt + [a]) for a in range(v)])  # [t1, t2]
    p3 = np.stack([probs(prompt + [a, b]) for a, b in itertools.product(range(v), range(v))]).reshape(v, v, v)
    return np.einsum("a,ab,abc->bc", p1, p2, p3)


# Four sampling tests draw fresh models and seeds each run: at this bar a correct engine fails one of them about once
# in 2500 runs, while a sampler that ignores its temperature still fails at chi-square's full power.
SAME_DISTRIBUTION_ALPHA = 1e-4


def chi_square_p(counts: np.ndarray, expected: np.ndarray) -> tuple[float, float]:
    """Pearson chi-square of observed (t2, t3) counts against expected probabilities; cells expected below 5 are
    pooled into one."""
    from scipy import stats

    exp = expected.ravel() * counts.sum()
    obs = counts.ravel()
    big = exp >= 5
    f_obs = np.append(obs[big], obs[~big].sum())
    f_exp = np.append(exp[big], exp[~big].sum())
    keep = f_exp > 0
    chi2, p = stats.chisquare(f_obs[keep], f_exp[keep] * f_obs[keep].sum() / f_exp[keep].sum())
    return float(chi2), float(p)


def assert_same_distribution(counts: np.ndarray, expected: np.ndarray) -> None:
    """Counts drawn from `expected`: none where it is zero (top-p and masks cut exactly), and a chi-square that a
    true sampler passes but for SAME_DISTRIBUTION_ALPHA."""
    outside = counts[expected == 0].sum()
    assert outside == 0, f"{outside:.0f} draws where the distribution is zero"
    chi2, p = chi_square_p(counts, expected)
    assert p > SAME_DISTRIBUTION_ALPHA, f"chi2={chi2:.1f} p={p:.2e}"


COMPILE_EVENTS = (jax._src.dispatch.JAXPR_TRACE_EVENT, jax._src.dispatch.BACKEND_COMPILE_EVENT)


class CompileCounter:
    """Counts jit traces and backend compiles while `counting`. JAX's monitoring listeners cannot be removed, so a
    test module registers one for the module."""

    def __init__(self):
        self.events: list[str] = []
        self.counting = False
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, name, *_args, **_kw):
        if self.counting and name in COMPILE_EVENTS:
            self.events.append(name)

    @contextlib.contextmanager
    def count(self):
        self.events.clear()
        self.counting = True
        try:
            yield self.events
        finally:
            self.counting = False
