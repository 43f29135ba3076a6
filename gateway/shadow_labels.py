"""The ledger's shadow evaluations as a labelled set for the router (`switchyard router retrain --from-ledger`).

Reads the `shadow_evals` table (rows the gateway labelled by mirroring requests; gateway/shadow.py) from
the ledger database the operator names, the gateway's default URL otherwise.
"""
from __future__ import annotations

import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # numpy, SQLAlchemy and the router load lazily, so `switchyard --help` stays fast
    from router.dataset import LabelledSet


def load_shadow_set(database_url: str, route: str | None = None) -> LabelledSet:
    """shadow_evals rows (optionally one route's) as a LabelledSet; chat rows keep their messages."""
    import numpy as np

    from router.dataset import LabelledSet

    rows = _read_rows(database_url, route)
    requests = [json.loads(r.messages_json) if r.messages_json else r.prompt_text for r in rows]
    return LabelledSet(requests, np.array([bool(r.weak_correct) for r in rows], dtype=bool),
                       np.array([bool(r.strong_correct) for r in rows], dtype=bool),
                       [r.route for r in rows], f"shadow_evals{f' (route {route})' if route else ''}")


def _read_rows(database_url: str, route: str | None) -> list:
    """The rows in id order; a ledger that cannot be read, or has no such table, is a DataError."""
    import sqlalchemy as sa

    from gateway import db
    from gateway.ledger.models import ShadowEvalRow
    from router.dataset import DataError

    t = ShadowEvalRow.__table__
    query = sa.select(t.c.prompt_text, t.c.messages_json, t.c.weak_correct, t.c.strong_correct, t.c.route)
    if route is not None:
        query = query.where(t.c.route == route)
    engine = sa.create_engine(db.sync_url(database_url))
    try:
        with engine.connect() as conn:
            if not sa.inspect(conn).has_table("shadow_evals"):
                raise DataError(f"{db.redact_url(database_url)}: no shadow_evals table; run `switchyard db upgrade` "
                                f"and let a route with `shadow:` collect labels")
            return conn.execute(query.order_by(t.c.id)).all()
    except sa.exc.OperationalError as e:
        raise DataError(f"{db.redact_url(database_url)}: cannot read the ledger ({e.orig or e})") from e
    finally:
        engine.dispose()
