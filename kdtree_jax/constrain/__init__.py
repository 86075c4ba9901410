"""Structured output: regex / JSON schema to a token automaton, and its device tables."""
