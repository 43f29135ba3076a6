"""`switchyard serve`: migrate the ledger, make sure an admin key exists, run the gateway on uvicorn."""
from __future__ import annotations

import argparse
import asyncio
import logging
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


def snippet(base_url: str, key: str, model: str) -> str:
    """The first-start snippet, as in the README: greedy, so pasting it prints the same answer every time
    (a small model sampled at temperature 1 may wander, or answer nothing)."""
    return (
        "from openai import OpenAI\n"
        f'client = OpenAI(base_url="{base_url}", api_key="{key}")\n'
        f'reply = client.chat.completions.create(model="{model}", temperature=0,\n'
        '                                       messages=[{"role": "user", "content": '
        '"What is the capital of France?"}])\n'
        "print(reply.choices[0].message.content)"
    )


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
        if new_key:
            banner += ("\nGenerated an admin API key. It is shown ONCE (only its hash is stored):\n\n"
                       f"    {new_key}\n\nPaste this to try it:\n\n{snippet(base_url, new_key, model)}\n")
        else:
            banner += ("Using the admin key generated on first start (create more with `switchyard keys create`).\n"
                       + snippet(base_url, "<your key>", model) + "\n")
    # Printed once the gateway (and any embedded engine) is ready, so the snippet works when pasted.
    config = GatewayConfig(policy_path=policy_path, database_url=url, data_dir=settings.data_dir(),
                           master_key=master, banner=banner)
    uvicorn.run(create_app(config), host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=30, access_log=False)
    return 0
