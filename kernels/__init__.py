"""Triton kernels with plain-torch references; ops.py dispatches by device."""
