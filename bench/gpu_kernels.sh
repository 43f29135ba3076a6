#!/usr/bin/env bash
# Kernel tests (compiled, not interpreted) and kernel benchmarks on a CUDA machine (H100/H200).
#
#   bench/gpu_kernels.sh              # on the GPU machine; installs nothing, uses the venv it finds
#   bench/gpu_kernels.sh --cpu-smoke  # on a CPU machine: runs the same Python code paths with tiny shapes
#
# Results: bench/results/kernels/<device>.{json,md,txt} and bench/results/engine_decode/<device>.{json,md}
# (bench/store.py; <device> as bench.machine_info.gpu_slug: h200, h100-80gb-hbm3, ...). The CPU smoke writes
# under BENCH_RESULTS_DIR (default /tmp/switchyard-gpu-smoke) instead.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-}
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
SMOKE_RESULTS=${BENCH_RESULTS_DIR:-/tmp/switchyard-gpu-smoke}

if [[ "${1:-}" == "--cpu-smoke" ]]; then
  # Every Python file the GPU run uses must at least import and run here.
  mkdir -p "$SMOKE_RESULTS"
  env -u TRITON_INTERPRET SWITCHYARD_KERNELS=reference "$PY" -m bench.kernels_bench --cpu-smoke \
    --out "$SMOKE_RESULTS/kernels_cpu_smoke"
  "$PY" -m bench.engine_decode --cpu-smoke --out "$SMOKE_RESULTS/engine_decode_cpu_smoke"
  "$PY" -c "import ast, sys; [ast.parse(open(f).read(), f) for f in sys.argv[1:]]" \
    bench/kernels_bench.py bench/engine_decode.py kernels/compile_check.py tests/kernels/test_kernel_triton.py
  echo "cpu smoke OK"
  exit 0
fi

unset TRITON_INTERPRET SWITCHYARD_KERNELS
"$PY" - <<'PY'
import torch, triton
print(f"torch {torch.__version__}  triton {triton.__version__}  cuda {torch.version.cuda}")
assert torch.cuda.is_available(), "no CUDA device visible"
p = torch.cuda.get_device_properties(0)
print(f"device {p.name}  SMs {p.multi_processor_count}  memory {p.total_memory / 2**30:.0f} GiB  sm_{p.major}{p.minor}")
PY
TAG=$("$PY" -c "import torch; from bench.machine_info import gpu_slug; print(gpu_slug(torch.cuda.get_device_name(0)))")
mkdir -p bench/results/kernels

echo "== kernel tests, compiled on the GPU"
SWITCHYARD_KERNEL_TEST_DEVICE=cuda "$PY" -m pytest tests/kernels -q -p no:cacheprovider \
  2>&1 | tee "bench/results/kernels/${TAG}.txt"

echo "== kernel benchmarks"
"$PY" -m bench.kernels_bench

echo "== engine end-to-end decode (8B-shape Llama: bf16, int8, int4; batch 1 MBU and batch 64)"
"$PY" -m bench.engine_decode --device cuda
