"""One speculative round and the batch engine: sampling, budgets, the round, the engine."""
