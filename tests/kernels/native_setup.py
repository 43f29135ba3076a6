"""What the native CPU kernel tests share: whether a C compiler exists, a fixture that turns the native path
on (whatever the environment says) with a freshly resolved library before and after each test, and running a
block on a given number of torch (OpenMP) threads."""
from __future__ import annotations

import contextlib
import dataclasses
import shutil
from collections.abc import Iterator

import pytest
import torch

from kernels import cpu_native, switches

HAVE_COMPILER = any(shutil.which(c) for c in ("cc", "gcc", "clang"))
needs_compiler = pytest.mark.skipif(not HAVE_COMPILER, reason="no C compiler on this machine: the native path is off")


@pytest.fixture(autouse=True)
def native_on():
    with switches.using(**dataclasses.asdict(switches.Switches())):  # the defaults, whatever the environment said
        cpu_native.reset()
        yield
    cpu_native.reset()


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's (and so the native kernels') thread count set to n inside the block, restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
