"""`switchyard serve`: bind the port, migrate the ledger (or, with the database down, serve and migrate once it
answers), make sure an admin key exists, run the gateway on uvicorn."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
import os
import socket
import sys
from pathlib import Path

from gateway import db, listen_address, settings
from gateway.keys import create_key, has_admin_key
from gateway.policy import Policy, PolicyError, load_policy

log = logging.getLogger("switchyard.serve")


async def _bootstrap_admin_key(url: str) -> str | None:
    """On first start with no SWITCHYARD_MASTER_KEY, create an admin key; return it (it is shown once)."""
    engine = db.create_engine(url)
    try:
        if await has_admin_key(engine):
            return None
        key, _ = await create_key(engine, "admin", is_admin=True)
        return key
    finally:
        await engine.dispose()


def _example_model(policy: Policy) -> str:
    for name, route in policy.routes.items():
        if policy.backends[route.backend].kind == "engine":
            return name
    return next(iter(policy.routes))


ADMIN_KEY_FILE = "admin-key.txt"  # in the data dir: the first-start key when stdout is not a terminal


def snippet(base_url: str, key: str, model: str, *, key_file: Path | None = None) -> str:
    """The first-start snippet, as in the README: greedy, so pasting it prints the same answer every time
    (a small model sampled at temperature 1 may wander, or answer nothing). With `key_file`, the snippet
    reads the key from that file instead of quoting it."""
    api_key = f"open({str(key_file)!r}).read().strip()" if key_file is not None else f'"{key}"'
    return (
        "from openai import OpenAI\n"
        f'client = OpenAI(base_url="{base_url}", api_key={api_key})\n'
        f'reply = client.chat.completions.create(model="{model}", temperature=0,\n'
        '                                       messages=[{"role": "user", "content": '
        '"What is the capital of France?"}])\n'
        "print(reply.choices[0].message.content)"
    )


def _write_private(path: Path, text: str) -> None:
    """Write `text` to a file only its owner can read (mode 0600, also when the file was already there)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def admin_key_banner(new_key: str | None, data_dir: Path, base_url: str, model: str, *, tty: bool) -> str:
    """The banner's key part. A new key is printed only to a terminal: stdout that is a pipe or a file ends up
    in logs, so then the key goes to a 0600 file in the data dir and only its path is printed."""
    key_file = (data_dir / ADMIN_KEY_FILE).resolve()
    if new_key is None:
        where = f" It is in {key_file}: store it and delete that file." if key_file.exists() else ""
        return (f"Using the admin key generated on first start.{where} Create more with `switchyard keys create`.\n"
                + snippet(base_url, "<your key>", model) + "\n")
    if tty:
        key_file.unlink(missing_ok=True)  # an earlier key's file (that key was revoked, or this is a new database)
        return ("\nGenerated an admin API key. It is shown ONCE (only its hash is stored):\n\n"
                f"    {new_key}\n\nPaste this to try it:\n\n{snippet(base_url, new_key, model)}\n")
    try:
        _write_private(key_file, new_key + "\n")
    except OSError as exc:
        return (f"\nGenerated an admin API key, but stdout is not a terminal (so it is not printed: logs keep "
                f"stdout) and {key_file} could not be written ({exc.strerror}). Make one on a terminal with "
                "`switchyard keys create --team admin --admin`.\n")
    return ("\nGenerated an admin API key. stdout is not a terminal, so it is not printed (logs keep stdout): it "
            f"is in {key_file} (mode 0600). Store it, then delete that file.\n\nPaste this to try it:\n\n"
            f"{snippet(base_url, '', model, key_file=key_file)}\n")


def serve(args: argparse.Namespace) -> int:
    from gateway.app import GatewayConfig, create_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("alembic").setLevel(logging.WARNING)
    policy_path = Path(args.policy) if args.policy else settings.DEFAULT_POLICY
    try:
        policy = load_policy(policy_path)
    except PolicyError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    try:
        redis_url = settings.redis_url(getattr(args, "redis_url", None))
        workers = _workers_allowed(getattr(args, "workers", 1), redis_url, policy)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    try:  # before anything is announced: a port in use is this one line, not a banner and an exit
        sock = listen_address.bind(args.host, args.port)
    except listen_address.BindError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    try:
        url = settings.database_url(args.database_url)
        reachable = _migrate_or_defer(url)
        base_url = f"http://{args.host}:{args.port}/v1"
        model = _example_model(policy)
        master = settings.master_key()
        banner = f"\nSwitchyard is ready at {base_url}\n"
        later = None
        if master is None:
            new_key = _bootstrap_or_defer(url) if reachable else _NO_DATABASE
            if new_key is _NO_DATABASE:
                key_file = (settings.data_dir() / ADMIN_KEY_FILE).resolve()
                banner += NO_KEY_YET.format(key_file=key_file)
                later = functools.partial(bootstrap_admin_key_later, url, key_file)
            else:
                banner += admin_key_banner(new_key, settings.data_dir(), base_url, model, tty=sys.stdout.isatty())
        # Printed once the gateway (and any embedded engine) is ready, so the snippet works when pasted.
        config = GatewayConfig(policy_path=policy_path, database_url=url, data_dir=settings.data_dir(),
                               master_key=master, banner=banner, migrate_when_reachable=not reachable or
                               later is not None, on_database_ready=later, redis_url=redis_url)
        if workers > 1:
            return _run_workers(config, sock, args.log_level, workers)
        return _run(create_app(config), sock, args.log_level)
    except _StartError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C before uvicorn took over the signals
        return 130
    finally:
        sock.close()


_NO_DATABASE = object()  # the admin-key bootstrap could not reach the database
NO_KEY_YET = ("\nNo admin key was created: the database is unreachable, and the first-start key is made there. "
              "Once it answers, the key is made and written to {key_file} (mode 0600; never printed or logged); "
              "or set SWITCHYARD_MASTER_KEY.\n")


async def bootstrap_admin_key_later(url: str, key_file: Path) -> None:
    """The first-start admin key that start-up could not make (the database was down), once the database answers
    (gateway/migrate_later.py runs this after migrating): written to `key_file` only, mode 0600, whatever stdout
    is (by now stdout may be anything, and a log line would keep the key); the log says where it is."""
    key = await asyncio.wait_for(_bootstrap_admin_key(url), 30)
    if key is None:
        return  # another gateway on this database made one meanwhile
    try:
        _write_private(key_file, key + "\n")
    except OSError as exc:
        log.error("created the first admin key now that the database answers, but %s could not be written (%s); "
                  "make one with `switchyard keys create --team admin --admin`", key_file, exc.strerror)
        return
    log.warning("the database answers: created the first admin key; it is in %s (mode 0600). Store it, then "
                "delete that file", key_file)


class _StartError(Exception):
    """serve cannot start; the message is one line."""


def _one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:300] if lines else ''}"


def _migrate_or_defer(url: str) -> bool:
    """Migrate to head; False when the database is unreachable (the gateway then migrates once it answers)."""
    try:
        db.upgrade(url)
    except Exception as exc:  # noqa: BLE001 - classified: unreachable is survivable, anything else stops serve
        if not db.is_unreachable(exc):
            raise _StartError(f"cannot migrate the database {db.redact_url(url)}: {_one_line(exc)}") from None
        log.warning("database %s unreachable (%s): serving anyway; the master key works, other keys get 503 until "
                    "it answers, ledger rows are spooled, and the schema is migrated once it is back",
                    db.redact_url(url), _one_line(exc))
        return False
    return True


def _bootstrap_or_defer(url: str) -> str | None | object:
    try:
        return asyncio.run(_bootstrap_admin_key(url))
    except Exception as exc:  # the database went away between the migration and now: say so, in one line
        if not db.is_unreachable(exc):
            raise
        log.warning("database unreachable while creating the first admin key: %s", _one_line(exc))
        return _NO_DATABASE


def _workers_allowed(workers: int, redis_url: str | None, policy: Policy) -> int:
    """--workers N: N>1 needs the shared Redis (else each worker keeps its own budgets and windows, and a key gets
    N times its budget and limits), and no embedded engine (each worker would launch its own on one port)."""
    if workers <= 1:
        return 1
    if redis_url is None:
        raise ValueError(f"--workers {workers} needs --redis-url (or SWITCHYARD_REDIS_URL): without a shared Redis "
                         f"each worker keeps its own budgets and RPM/TPM windows, so a key would get {workers}x them")
    embedded = [name for name, spec in policy.backends.items() if spec.launch == "embedded"]
    if embedded:
        raise ValueError(f"--workers {workers} with embedded engines ({', '.join(embedded)}): each worker would "
                         "launch its own; run the engine apart (`switchyard engine serve`) and point the policy at it")
    return workers


def _run_workers(config, sock: socket.socket, log_level: str, workers: int) -> int:
    """N gateway processes accepting on the one socket bound above (the kernel spreads the connections), sharing
    budgets and limits through Redis. Forked before any thread or event loop exists; only this first process
    prints the banner and makes a deferred admin key. A worker that exits is not restarted (partial: no
    supervisor); SIGTERM to this process stops them all."""
    import dataclasses
    import signal
    import threading
    import traceback

    from gateway.app import create_app

    if threading.active_count() > 1:
        raise _StartError(f"cannot fork {workers} workers: {threading.active_count() - 1} thread(s) already run")
    children = []
    for number in range(1, workers):
        pid = os.fork()
        if pid == 0:  # a worker: serve until signalled, never return into the parent's code
            code = 1
            _die_with_parent()
            try:
                # Its own data dir: spools are one writer's each (the same worker number finds its spool again)
                quiet = dataclasses.replace(config, banner=None, on_database_ready=None, migrate_when_reachable=False,
                                            data_dir=config.data_dir / f"worker-{number}")
                code = _run(create_app(quiet), sock, log_level)
            except KeyboardInterrupt:  # Ctrl-C: uvicorn re-raises it once drained
                code = 130
            except BaseException:  # noqa: BLE001 - its traceback, then out
                traceback.print_exc()
            finally:
                os._exit(code)
        children.append(pid)

    def forward(sig: int) -> None:  # as SIGTERM: a second SIGINT (Ctrl-C reaches the group too) would cut the drain
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)

    try:
        return _run(create_app(config), sock, log_level, on_exit=forward)
    finally:
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        for pid in children:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)


def _die_with_parent() -> None:
    """Linux: this worker gets SIGTERM when the first process dies, however it dies (SIGKILL included)."""
    import ctypes
    import signal

    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


# At SIGTERM, in-flight requests get DRAIN_S to finish (then they are cut, and their rows say so); the app's own
# shutdown is bounded too (gateway/app.py _STOP_S), so the process exits within 30 s in every state.
DRAIN_S = 12


def _run(app, sock: socket.socket, log_level: str, on_exit=None) -> int:
    """uvicorn on the socket bound above. A shutdown signal during start-up (embedded engines still loading)
    stops the wait too, so SIGTERM ends the process in seconds in every state."""
    import uvicorn

    from gateway.app import interrupt_startup

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            interrupt_startup(app)
            if on_exit is not None:  # --workers: the signal goes to every worker too (uvicorn re-raises it after
                on_exit(sig)         # its shutdown, so code after server.run() may never run)

    server = Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=DRAIN_S, access_log=False))
    server.run(sockets=[sock])
    return 0 if server.started else 1
