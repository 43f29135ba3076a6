"""Policy reload that cannot hurt traffic (issue 30, defect 9): bounded parsing off the event loop, changes
taken only once the file has stopped changing (or arrives by atomic rename), failures visible in the store's
status and in metrics; and non-finite prices refused by `policy check`."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from gateway.policy import PolicyError, load_policy
from gateway.policy_diagnostics import MAX_POLICY_BYTES, MAX_YAML_NODES
from gateway.policy_store import PolicyStore

ROOT = Path(__file__).resolve().parents[2]

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
MORE = """\
  second:
    backend: a
  third:
    backend: a
"""


def alias_bomb(width: int, levels: int) -> str:
    """A valid policy plus a "billion laughs" under an `x-` key (ignored by the schema, so only the YAML
    reader stands between it and the gateway): `width ** levels` values from a few hundred bytes."""
    lines = ["x-lol:", '  l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, levels):
        lines.append(f"  l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * width) + "]")
    return "\n".join(lines) + "\n" + BASE


def large_valid_policy(nbytes: int, base: str = BASE) -> str:
    """`base` grown close to `nbytes` with operator notes under an `x-` key (still valid)."""
    line = "  - note {:06d} on how this gateway routes its traffic, kept here for the operators\n"
    count = (nbytes - len(base) - 20) // len(line.format(0))
    return base + "x-notes:\n" + "".join(line.format(i) for i in range(count))


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def wait_for(cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


def bump_mtime(path: Path) -> None:
    st = path.stat()  # a stamp the watcher cannot miss on filesystems with coarse mtimes
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))


# ---------------------------------------------------------------- bounded parsing


def test_alias_bomb_is_rejected_quickly_with_its_line(tmp_path: Path) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text(alias_bomb(9, 7))  # 9**7 = 4.8 M values; the reader before this change took ~8 s and accepted
    started = time.perf_counter()
    with pytest.raises(PolicyError) as err:
        load_policy(path)
    elapsed = time.perf_counter() - started
    assert elapsed < 1.0, f"took {elapsed:.2f}s"
    msg = str(err.value)
    assert f"{path}:" in msg and "alias" in msg and f"{MAX_YAML_NODES:,}" in msg
    assert msg.startswith(f"{path}:") and msg.split(":")[1].isdigit()  # file:line


def test_policy_check_refuses_a_billion_laughs_in_bounded_time(tmp_path: Path) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text(alias_bomb(9, 10))  # 3.5 billion values
    run = subprocess.run([sys.executable, "-m", "gateway.cli", "policy", "check", str(path)], check=False,
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert run.returncode == 1, run.stdout + run.stderr
    assert f"{path}:" in run.stderr and "alias" in run.stderr and "Traceback" not in run.stderr


def test_recursive_alias_names_its_place(tmp_path: Path) -> None:
    path = tmp_path / "rec.yaml"
    path.write_text("x-loop: &a\n  x: [1, *a]\n" + BASE)
    with pytest.raises(PolicyError, match=r"rec\.yaml:2:\d+: x-loop\.x\[1\]: the alias \*a is used inside"):
        load_policy(path)


def test_deep_nesting_is_an_error_not_a_crash(tmp_path: Path) -> None:
    path = tmp_path / "deep.yaml"
    path.write_text("x-deep: " + "[" * 3000 + "]" * 3000 + "\n" + BASE)  # a RecursionError before this change
    with pytest.raises(PolicyError, match=r"deep\.yaml:1:\d+: .*nested deeper than"):
        load_policy(path)


def test_file_over_the_size_limit_is_refused_before_parsing(tmp_path: Path) -> None:
    path = tmp_path / "big.yaml"
    path.write_text(BASE + "#" * MAX_POLICY_BYTES)  # valid YAML (a comment), just too big
    with pytest.raises(PolicyError, match=r"big\.yaml: the file is larger than 1 MiB"):
        load_policy(path)
    path.write_text(large_valid_policy(MAX_POLICY_BYTES - 4096))  # just under the limit is fine
    assert list(load_policy(path).routes) == ["demo"]


def test_anchors_within_the_limits_still_work(tmp_path: Path) -> None:
    path = tmp_path / "ok.yaml"
    path.write_text(alias_bomb(3, 4).replace("    model: demo\n", "    model: demo\n    <<: *shared\n")
                    .replace("x-lol:", "x-shared: &shared {timeout_s: 7}\nx-lol:"))  # 3**4 values: inside the limit
    policy = load_policy(path)
    assert list(policy.routes) == ["demo"] and policy.backends["a"].timeout_s == 7


# ---------------------------------------------------------------- prices must be finite numbers


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan", "-1", "1.0e+999", '"inf"'])
@pytest.mark.parametrize("field", ["input_usd_per_mtok", "output_usd_per_mtok", "cached_input_usd_per_mtok"])
def test_non_finite_or_negative_api_prices_are_file_line_errors(tmp_path: Path, field: str, value: str) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(f"backends:\n  m:\n    kind: litellm\n    model: openai/gpt-4o-mini\n    {field}: {value}\n"
                    "routes:\n  r: {backend: m}\n")
    with pytest.raises(PolicyError, match=rf"p\.yaml:5:\d+: backends\.m\.{field}: "):
        load_policy(path)


@pytest.mark.parametrize("field", ["gpu_hour_usd", "cpu_hour_usd", "reserve_usd_per_mtok"])
def test_infinite_engine_prices_are_file_line_errors(tmp_path: Path, field: str) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(f"backends:\n  e:\n    kind: engine\n    api_base: http://h:1/v1\n    model: m\n"
                    f"    {field}: .inf\nroutes:\n  r: {{backend: e}}\n")
    with pytest.raises(PolicyError, match=rf"p\.yaml:6:\d+: backends\.e\.{field}: .*finite"):
        load_policy(path)


def test_policy_check_refuses_an_infinite_price(tmp_path: Path) -> None:
    path = tmp_path / "inf.yaml"
    path.write_text("backends:\n  m: {kind: litellm, model: openai/gpt-4o-mini, input_usd_per_mtok: .inf}\n"
                    "routes:\n  r: {backend: m}\n")
    run = subprocess.run([sys.executable, "-m", "gateway.cli", "policy", "check", str(path)], check=False,
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert run.returncode == 1, run.stdout
    assert f"{path}:2:" in run.stderr and "backends.m.input_usd_per_mtok" in run.stderr and "finite" in run.stderr


# ---------------------------------------------------------------- the store


async def test_start_refuses_a_bomb(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(alias_bomb(9, 7))
    store = PolicyStore(path)
    started = time.perf_counter()
    with pytest.raises(PolicyError, match="alias"):
        await store.start()
    assert time.perf_counter() - started < 1.0
    await store.stop()


async def test_reload_parses_off_the_event_loop(tmp_path: Path) -> None:
    """While a ~1 MiB valid file is read and validated, the event loop keeps turning."""
    path = tmp_path / "p.yaml"
    path.write_text(BASE)
    store = PolicyStore(path, poll_interval_s=3600, settle_s=0)  # driven by hand
    await store.start()
    gaps: list[float] = []
    stop = asyncio.Event()

    async def ticker() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    path.write_text(large_valid_policy(MAX_POLICY_BYTES - 4096))
    bump_mtime(path)
    tick = asyncio.create_task(ticker())
    await asyncio.sleep(0.05)
    started = time.perf_counter()
    assert await store.check_now() is True
    took = time.perf_counter() - started
    stop.set()
    await tick
    await store.stop()
    # Before: the whole parse ran on the loop (one gap as long as the reload). A thread shares the GIL,
    # so the loop waits a few switch intervals at a time, never for the parse.
    assert max(gaps) < max(0.1, 0.4 * took), f"loop stalled {max(gaps):.3f}s during a {took:.3f}s reload"


async def test_bomb_reload_is_rejected_and_reported(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(BASE)
    store = PolicyStore(path, poll_interval_s=3600, settle_s=0)
    live = await store.start()
    errors_before = metric("switchyard_policy_reload_errors_total", reason="invalid")
    path.write_text(alias_bomb(9, 7))
    bump_mtime(path)
    started = time.perf_counter()
    assert await store.check_now() is False
    assert time.perf_counter() - started < 1.0
    assert store.current is live
    status = store.status()
    assert status["version"] == live.version and status["reload_failing"] is True
    err = status["last_reload_error"]
    assert "alias" in err["message"] and err["at"] and err["file"]["size"] == path.stat().st_size
    assert err["file"]["inode"] == path.stat().st_ino and err["file"]["mtime_ns"] == path.stat().st_mtime_ns
    assert metric("switchyard_policy_reload_errors_total", reason="invalid") == errors_before + 1
    assert metric("switchyard_policy_reload_failing") == 1
    path.write_text(BASE + MORE)
    bump_mtime(path)
    assert await store.check_now() is True
    assert store.status()["reload_failing"] is False and metric("switchyard_policy_reload_failing") == 0
    assert store.status()["last_reload_error"]["message"] == err["message"]  # kept as history
    await store.stop()


# ---------------------------------------------------------------- only whole files go live


async def test_a_valid_prefix_written_in_place_never_goes_live(tmp_path: Path) -> None:
    """A slow in-place write whose first half is itself a valid policy (routes missing): the half never
    serves. Before this change the watcher took the prefix at its next poll and `second` vanished."""
    path = tmp_path / "p.yaml"
    path.write_text(BASE + MORE)
    store = PolicyStore(path, poll_interval_s=0.05, settle_s=1.0)  # wide: the box is shared and noisy
    seen: list[set[str]] = []
    store.on_change(lambda policy: seen.append(set(policy.routes)))
    await store.start()
    new = BASE.replace("model: demo", "model: demo2") + MORE
    prefix = new[:new.index("  second:")]  # valid on its own: only the `demo` route
    try:
        with open(path, "w") as f:  # noqa: ASYNC230 (in place, same inode, as most editors save)
            f.write(prefix)
            f.flush()
            for _ in range(10):  # the writer pauses (0.2 s) inside the settle interval
                await asyncio.sleep(0.02)
                seen_now = set(store.current.routes)
                assert seen_now == {"demo", "second", "third"}, "a half-written file went live"
            f.write(new[len(prefix):])
        await wait_for(lambda: store.current.backends["a"].model == "demo2")
        assert seen == [{"demo", "second", "third"}]
        assert store.reload_errors == 0  # the empty and half states were never judged
    finally:
        await store.stop()


async def test_an_atomic_rename_goes_live_without_waiting_to_settle(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(BASE)
    store = PolicyStore(path, poll_interval_s=0.05, settle_s=30)  # a settle wait would time the test out
    await store.start()
    try:
        tmp = tmp_path / "p.yaml.tmp"
        tmp.write_text(BASE + MORE)
        os.replace(tmp, path)
        await wait_for(lambda: "second" in store.current.routes, timeout=3)
        assert store.status()["file"] == "ok"
    finally:
        await store.stop()


async def test_deleted_file_keeps_serving_and_a_restored_file_reloads(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(BASE)
    store = PolicyStore(path, poll_interval_s=0.05, settle_s=0.2)
    live = await store.start()
    missing_before = metric("switchyard_policy_reload_errors_total", reason="missing")
    try:
        path.unlink()
        await wait_for(lambda: store.status()["file"] == "missing")
        await asyncio.sleep(0.2)  # several polls: counted once, still serving
        assert store.current is live and store.status()["reload_failing"] is True
        assert "missing" in store.status()["last_reload_error"]["message"]
        assert metric("switchyard_policy_reload_errors_total", reason="missing") == missing_before + 1
        path.write_text(BASE + MORE)  # restored (with an edit): a new file, so it settles first
        await wait_for(lambda: "second" in store.current.routes)
        status = store.status()
        assert status["file"] == "ok" and status["reload_failing"] is False and status["reloads"] == 1
    finally:
        await store.stop()
