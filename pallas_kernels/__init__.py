"""Pallas GPU kernels of one DDTree round (tree_build, topk, verify_attn, tree_accept) and of the INT4 expert FFN
(int4_moe, with its weight layout in int4_layout), plus float64/numpy references. Imports nothing from kdtree_jax."""
