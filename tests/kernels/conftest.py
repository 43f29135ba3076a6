"""Kernel tests run the Triton kernels on CPU under the interpreter (TRITON_INTERPRET=1) by default.

Set SWITCHYARD_KERNEL_TEST_DEVICE=cuda (with TRITON_INTERPRET unset) to run the same tests compiled on
a GPU; bench/gpu_kernels.sh does that.
"""

from __future__ import annotations

import importlib
import os
import sys

KERNEL_TEST_DEVICE = os.environ.get("SWITCHYARD_KERNEL_TEST_DEVICE", "cpu")
if KERNEL_TEST_DEVICE == "cpu":
    # Must be set before any @triton.jit decoration runs.
    os.environ["TRITON_INTERPRET"] = "1"
elif os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    raise RuntimeError("SWITCHYARD_KERNEL_TEST_DEVICE=cuda needs TRITON_INTERPRET unset (compiled kernels)")

# If another test package imported the Triton modules first (decorated without the interpreter),
# re-execute them now so their kernels pick the mode set above.
for _name in ("kernels.triton_common", "kernels.triton_pointwise", "kernels.triton_attention",
              "kernels.triton_quant", "kernels.triton_ops"):
    if _name in sys.modules:
        importlib.reload(sys.modules[_name])
