"""Kernel tests run the Triton kernels on CPU under the interpreter (TRITON_INTERPRET=1) by default.

Set SWITCHYARD_KERNEL_TEST_DEVICE=cuda (with TRITON_INTERPRET unset) to run the same tests compiled on
a GPU; bench/gpu_kernels.sh does that.

TRITON_INTERPRET only takes effect if it is set before `triton` is imported. If something collected
earlier in the session already imported triton in compiled mode, the Triton tests cannot run in this
process: they are skipped here and run instead in a fresh process by
test_kernel_tooling.py::test_triton_kernel_tests_in_a_fresh_process.
"""

from __future__ import annotations

import os
import sys

import pytest

KERNEL_TEST_DEVICE = os.environ.get("SWITCHYARD_KERNEL_TEST_DEVICE", "cpu")
_INTERPRET_SET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
TRITON_ALREADY_COMPILED_MODE = KERNEL_TEST_DEVICE == "cpu" and "triton" in sys.modules and not _INTERPRET_SET

if KERNEL_TEST_DEVICE == "cpu":
    if not TRITON_ALREADY_COMPILED_MODE:
        os.environ["TRITON_INTERPRET"] = "1"
elif _INTERPRET_SET:
    raise RuntimeError("SWITCHYARD_KERNEL_TEST_DEVICE=cuda needs TRITON_INTERPRET unset (compiled kernels)")


def pytest_collection_modifyitems(config, items):
    if not TRITON_ALREADY_COMPILED_MODE:
        return
    skip = pytest.mark.skip(reason="triton was imported before TRITON_INTERPRET could be set; these run in "
                                   "a fresh process (test_triton_kernel_tests_in_a_fresh_process)")
    for item in items:
        if item.path.name == "test_kernel_triton.py":
            item.add_marker(skip)
