"""The token that lets a driver send calls straight to workers (``dask_agents/direct.py``):
computed by the scheduler, which gives it to the driver, and by each worker, which checks it."""

from __future__ import annotations

import hashlib
import hmac


def direct_token(secret: str, client: str) -> str:
    """A keyed hash of ``client``'s id under the scheduler's secret, which only the scheduler
    and its workers know (the scheduler sends it to each worker on the worker's own stream)."""
    return hmac.new(secret.encode(), f"direct|{client}".encode(), hashlib.sha256).hexdigest()[:32]
