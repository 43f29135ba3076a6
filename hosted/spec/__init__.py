"""Speculative decoding: proposers (prompt-lookup n-grams, a draft model), the rejection sampler that keeps
the target's output distribution exactly, and the goodput planner that picks how many draft tokens to verify."""
