"""Training code for the kdtree-mini target and its DFlash drafter, kept out of the runtime modules: the engine,
model and kernels import nothing from here (tests/test_layering.py). Used by scripts/train_target.py,
scripts/train_drafter.py, scripts/eval_pair.py and benchmarks/dtype_agreement.py, as `from kdtree_jax import train`.

- `data`: the stdlib corpus tokenized once (cached next to the text), packed into shuffled fixed-length windows.
- `target`: a training forward that also reports each MoE layer's expert load (for the aux-loss-free bias rule),
  AdamW with the router correction bias frozen out of the optimizer, and an exporter to the exact HF Kimi layout
  (the inverse of `weights.params_from_hf`); greedy target continuations for `regen` data and evaluation.
- `dflash`: DFlash anchors, position-decayed block CE (+ optional KL to the target), chain acceptance.
- `common`: config-dataclass CLI flags, atomic JSON, curve logging.

Needs the `train` extra (optax; matplotlib for the curve PNGs).
"""
from __future__ import annotations

from kdtree_jax.train.common import (
                                     CurveLog,
                                     add_config_args,
                                     config_from_args,
                                     device_summary,
                                     global_norm,
                                     perplexity,
                                     write_json,
)
from kdtree_jax.train.data import (
                                     FINGERPRINT_CHARS,
                                     TOKEN_CACHE_SUFFIX,
                                     PackedBatches,
                                     corpus_info,
                                     eval_windows,
                                     load_tokens,
                                     tokenizer_fingerprint,
                                     unigram_log_probs,
                                     unigram_nll,
)
from kdtree_jax.train.dflash import (
                                     block_labels,
                                     block_target_logits,
                                     chain_acceptance,
                                     chain_walk,
                                     dflash_loss,
                                     dflash_position_weights,
                                     drafter_agreement,
                                     drafter_block_argmax_fn,
                                     sample_anchors,
)
from kdtree_jax.train.target import (
                                     BF16,
                                     DECAY,
                                     FROZEN,
                                     NO_DECAY,
                                     ROUTER_BIAS,
                                     OptimConfig,
                                     TrainForward,
                                     apply_bias_updates,
                                     aux_free_bias_update,
                                     expert_load,
                                     greedy_continue,
                                     greedy_continue_fn,
                                     heldout_nll,
                                     hf_tensors_from_model,
                                     init_target,
                                     make_optimizer,
                                     moe_layers,
                                     param_labels,
                                     round_params_bf16,
                                     save_target_hf,
                                     target_forward,
                                     token_nll,
)

__all__ = [
    "BF16", "CurveLog", "DECAY", "FINGERPRINT_CHARS", "FROZEN", "NO_DECAY", "OptimConfig", "PackedBatches",
    "ROUTER_BIAS", "TOKEN_CACHE_SUFFIX", "TrainForward", "add_config_args", "apply_bias_updates",
    "aux_free_bias_update", "block_labels", "block_target_logits", "chain_acceptance", "chain_walk", "config_from_args",
    "corpus_info", "device_summary", "dflash_loss", "dflash_position_weights", "drafter_agreement",
    "drafter_block_argmax_fn", "eval_windows", "expert_load", "global_norm", "greedy_continue", "greedy_continue_fn",
    "heldout_nll", "hf_tensors_from_model", "init_target", "load_tokens", "make_optimizer", "moe_layers",
    "param_labels", "perplexity", "round_params_bf16", "sample_anchors", "save_target_hf", "target_forward",
    "token_nll", "tokenizer_fingerprint", "unigram_log_probs", "unigram_nll", "write_json",
]
