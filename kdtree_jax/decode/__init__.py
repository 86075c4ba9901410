"""One speculative round and the batch engine: a request's parameters, sampling, budgets, the round, the engine."""
