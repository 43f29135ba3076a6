"""The cheaper-model benchmark under its earlier name (issue 35 cites `bench/cheaper_model.py`, spec section):
`python -m bench.cheaper_model --sections spec` is `python -m bench.cheaper --sections spec`. Code: bench/cheaper/."""
from bench.cheaper.run import main

if __name__ == "__main__":
    raise SystemExit(main())
