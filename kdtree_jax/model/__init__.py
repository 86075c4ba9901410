"""The target model: config, layers, MLA, MoE, quantization, paged caches and the drafter."""
