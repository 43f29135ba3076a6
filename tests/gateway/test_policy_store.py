"""Hot reload: a valid edit goes live atomically; an invalid edit is rejected and the old policy keeps serving."""
from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

import pytest

from gateway.policy import PolicyError
from gateway.policy_store import PolicyStore

BASE = """\
backends:
  a:
    kind: engine
    api_base: http://127.0.0.1:9/v1
    model: demo
routes:
  demo:
    backend: a
"""


def bump_mtime(path: Path) -> None:
    st = path.stat()  # make sure the watcher sees a new stamp even on coarse-mtime filesystems
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))


async def wait_for(cond, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


async def test_bad_file_at_start_raises(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(BASE.replace("backend: a", "backend: b"))
    store = PolicyStore(path)
    with pytest.raises(PolicyError, match="unknown backend 'b'"):
        await store.start()
    await store.stop()


async def test_valid_edit_is_swapped_in_and_invalid_edit_rejected(tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.INFO, logger="switchyard.policy")
    path = tmp_path / "p.yaml"
    path.write_text(BASE)
    store = PolicyStore(path, poll_interval_s=0.05)
    seen: list[str] = []

    async def on_change(policy) -> None:
        seen.append(policy.version)

    store.on_change(on_change)
    first = await store.start()
    assert store.current is first and list(first.routes) == ["demo"]
    try:
        # valid edit: a new route appears, with a new version, and listeners hear about it
        path.write_text(BASE + "  other:\n    backend: a\n")
        bump_mtime(path)
        await wait_for(lambda: store.current.version != first.version)
        second = store.current
        assert set(second.routes) == {"demo", "other"}
        assert seen == [second.version]
        assert any(second.version in r.getMessage() for r in caplog.records)

        # invalid edit: rejected, counted, logged; the last good policy keeps serving
        path.write_text(BASE.replace("backend: a", "backend: zz"))
        bump_mtime(path)
        await wait_for(lambda: store.reload_errors == 1)
        assert store.current is second
        assert "unknown backend 'zz'" in store.last_error
        assert any("unknown backend 'zz'" in r.getMessage() and r.levelno == logging.ERROR
                   for r in caplog.records)
        assert seen == [second.version]

        # fixing the file brings the watcher back on track
        path.write_text(BASE.replace("model: demo", "model: demo2"))
        bump_mtime(path)
        await wait_for(lambda: store.current.backends["a"].model == "demo2")
        assert store.reloads == 2 and len(seen) == 2
    finally:
        await store.stop()


async def test_touch_without_change_keeps_version_and_failing_callback_does_not_stop_watch(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(BASE)
    store = PolicyStore(path, poll_interval_s=10, settle_s=0)  # drive it by hand
    await store.start()
    v1 = store.current

    def broken(_policy) -> None:
        raise RuntimeError("listener bug")

    store.on_change(broken)
    bump_mtime(path)
    assert await store.check_now() is False and store.current is v1
    path.write_text(BASE + "  r2:\n    backend: a\n")
    bump_mtime(path)
    assert await store.check_now() is True
    assert "r2" in store.current.routes
    assert await store.check_now() is False  # nothing changed since
    path.unlink()
    bump_mtime_missing = await store.check_now()
    assert bump_mtime_missing is False and store.reload_errors == 1 and "r2" in store.current.routes
    await store.stop()
