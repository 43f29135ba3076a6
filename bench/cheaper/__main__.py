"""python -m bench.cheaper: see bench/cheaper/__init__.py."""
from bench.cheaper.run import main

raise SystemExit(main())
