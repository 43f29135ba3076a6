"""`switchyard serve`: migrate the ledger, make sure an admin key exists, run the gateway on uvicorn."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path

from gateway import db, settings
from gateway.keys import create_key, has_admin_key
from gateway.policy import Policy, PolicyError, load_policy


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
    import uvicorn

    from gateway.app import GatewayConfig, create_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("alembic").setLevel(logging.WARNING)
    policy_path = Path(args.policy) if args.policy else settings.DEFAULT_POLICY
    try:
        policy = load_policy(policy_path)
    except PolicyError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    url = settings.database_url(args.database_url)
    db.upgrade(url)
    base_url = f"http://{args.host}:{args.port}/v1"
    model = _example_model(policy)
    master = settings.master_key()
    banner = f"\nSwitchyard is ready at {base_url}\n"
    if master is None:
        new_key = asyncio.run(_bootstrap_admin_key(url))
        banner += admin_key_banner(new_key, settings.data_dir(), base_url, model, tty=sys.stdout.isatty())
    # Printed once the gateway (and any embedded engine) is ready, so the snippet works when pasted.
    config = GatewayConfig(policy_path=policy_path, database_url=url, data_dir=settings.data_dir(),
                           master_key=master, banner=banner)
    uvicorn.run(create_app(config), host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=30, access_log=False)
    return 0
