"""Switchyard's benchmarks, one module each, run from the repository root as `python -m bench.<name>`.

Shared pieces: machine_info (where it ran, the machine slug, free_port), roofline (the memory-bandwidth probe),
servers (start / wait ready / stop a process with its log), fixtures (the random SmolLM-shaped checkpoint and
the real model paths) and store (results filed as bench/results/<bench>/<machine>.json|md, stamped).
"""
