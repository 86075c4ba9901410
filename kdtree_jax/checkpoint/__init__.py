"""Checkpoints: HF ingestion, the native format, weights, tokenizers and synthetic checkpoints."""
