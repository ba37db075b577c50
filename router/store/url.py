"""``check_redis_url``: the one validation of a Redis URL, shared by the gateway (``redis_url``,
``kvroute serve --redis``) and the replica sidecar (``kvroute sidecar --redis``).

What redis-py would refuse only later (with a traceback: a port out of range) or silently ignore (a
database that is not a number: it used db 0) is refused at start-up, naming the problem. The URL in
the message is shown through :func:`redact_url`: never its password. Query flags (``?cluster=1``,
``?db=0``) are left to the store.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from router.observability.logging import redact_url

__all__ = ["check_redis_url"]


def check_redis_url(url: str) -> str:
    """``url`` unchanged when redis-py can use it as meant; else ``ValueError`` naming the problem."""
    parts = urlsplit(url)
    shown = redact_url(url)
    if parts.scheme not in {"redis", "rediss", "unix"}:
        raise ValueError(f"expected redis://, rediss:// or unix://, got {shown!r}")
    if parts.scheme == "unix":
        if not parts.path:
            raise ValueError(f"a unix:// URL needs the socket's path, got {shown!r}")
        return url
    if not parts.hostname:
        raise ValueError(f"no host in {shown!r}")
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"bad port in {shown!r} (expected 1..65535)") from None
    if port == 0:
        raise ValueError(f"bad port in {shown!r} (expected 1..65535)")
    db = parts.path.removeprefix("/")
    if db and not db.isdigit():
        raise ValueError(f"the database must be a number (redis://host:6379/0), got {shown!r}")
    return url
