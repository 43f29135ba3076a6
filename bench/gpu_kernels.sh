#!/usr/bin/env bash
# Kernel tests (compiled, not interpreted) and kernel benchmarks on a CUDA machine (H100/H200).
#
#   bench/gpu_kernels.sh              # on the GPU machine; installs nothing, uses the venv it finds
#   bench/gpu_kernels.sh --cpu-smoke  # on a CPU machine: runs the same Python code paths with tiny shapes
#
# Results: bench/results/kernels_<device>.{json,md} (BENCH_RESULTS_DIR overrides the folder).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-}
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
RESULTS=${BENCH_RESULTS_DIR:-bench/results}
mkdir -p "$RESULTS"

if [[ "${1:-}" == "--cpu-smoke" ]]; then
  # Every Python file the GPU run uses must at least import and run here.
  env -u TRITON_INTERPRET SWITCHYARD_KERNELS=reference "$PY" -m bench.kernels_bench --cpu-smoke \
    --out "$RESULTS/kernels_cpu_smoke"
  "$PY" -m bench.engine_decode --cpu-smoke --out "$RESULTS/engine_decode_cpu_smoke"
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
TAG=$("$PY" -c "import torch, re; print(re.sub(r'[^A-Za-z0-9]+', '_', torch.cuda.get_device_name(0)).strip('_').lower())")

echo "== kernel tests, compiled on the GPU"
SWITCHYARD_KERNEL_TEST_DEVICE=cuda "$PY" -m pytest tests/kernels -q -p no:cacheprovider \
  2>&1 | tee "$RESULTS/kernels_tests_${TAG}.txt"

echo "== kernel benchmarks"
"$PY" -m bench.kernels_bench --out "$RESULTS/kernels_${TAG}"

echo "== engine end-to-end decode (8B-shape Llama: bf16, int8, int4; batch 1 MBU and batch 64)"
"$PY" -m bench.engine_decode --device cuda --out "$RESULTS/engine_decode_${TAG}"
