"""Cheaper model (issue 10): SmolLM2-135M-Instruct made cheaper, one benchmark in four sections.

  precision  per precision (fp32, bf16, int8, int4 g32): batch-1 decode tok/s, memory bandwidth, perplexity
             (bench/cheaper/precision.py)
  spec       speculative decoding: ngram, untrained and distilled drafts, batch 1/8/32, with the cost bound
             (bench/cheaper/spec.py)
  stack      one request at a time -> continuous batching -> + prefix cache -> + int8 -> + speculation, tok/s
             and $/Mtok (bench/cheaper/stack.py)
  peers      llama.cpp (llama-server) and vLLM's CPU build on the same weights (bench/cheaper/peers.py; each
             peer in a virtualenv / build of the benchmark's own under bench/.peers, see bench/peers.py)

    python -m bench.cheaper                      # every section; files bench/results/cheaper/<machine>.{json,md}
    python -m bench.cheaper --section spec       # one section (repeatable; 'model' = precision)
    python -m bench.cheaper --sections precision --ppl-tokens 1024 --runs 2 --new-tokens 64   # quicker
    python -m bench.cheaper.peers --smoke        # the peers section alone, with its own prompts

`python -m bench.cheaper_model` is the same benchmark under the name issue 35 uses.
"""
