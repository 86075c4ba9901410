"""Pallas GPU kernels of one DDTree round: tree_build, verify_attn, tree_accept (+ float64/numpy references)."""
