"""Switchyard in-house inference engine (PyTorch)."""
