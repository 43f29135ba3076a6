"""What the native CPU kernel tests share: whether a C compiler exists, and a fixture that turns the native path
on (whatever the environment says) with a freshly resolved library before and after each test."""
from __future__ import annotations

import shutil

import pytest

from kernels import cpu_native

HAVE_COMPILER = any(shutil.which(c) for c in ("cc", "gcc", "clang"))
needs_compiler = pytest.mark.skipif(not HAVE_COMPILER, reason="no C compiler on this machine: the native path is off")


@pytest.fixture(autouse=True)
def native_on(monkeypatch):
    monkeypatch.delenv("SWITCHYARD_CPU_NATIVE", raising=False)
    monkeypatch.delenv("SWITCHYARD_KERNELS", raising=False)
    cpu_native.reset()
    yield
    cpu_native.reset()
