"""Egress guard: the gateway talks only to replicas inside the allowed networks.

Rules:
  1. Static replicas (``config.replicas``) are the operator's own choice: always allowed.
  2. Every other replica URL (admin API, sidecars writing the shared registry, anything with write
     access to Redis) must be http(s) and resolve into ``config.admin_networks`` (default: loopback and
     private ranges, as for ``POST /admin/replicas``). A registry entry cannot aim the gateway, its
     health probes or its client traffic at an arbitrary host.
  3. IP literals are decided at once; a host name is resolved once and its verdict cached for
     ``ttl_s`` (the hot path does a dict lookup). A name that does not resolve is refused.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Iterable, Sequence
from urllib.parse import urlsplit

from router.clock import Clock

__all__ = ["EgressGuard", "addresses_allowed"]

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def addresses_allowed(addrs: Iterable[ipaddress.IPv4Address | ipaddress.IPv6Address], networks: Sequence[Network]) -> bool:
    """PURE. True when there is at least one address and every one is inside some network."""
    seen = False
    for a in addrs:
        seen = True
        if not any(a in n for n in networks if n.version == a.version):
            return False
    return seen


class EgressGuard:
    def __init__(
        self,
        static_urls: Iterable[str],
        networks: Iterable[str],
        clock: Clock,
        *,
        ttl_s: float = 30.0,
        resolve_timeout_s: float = 1.0,
    ) -> None:
        self._static = {u.rstrip("/") for u in static_urls}
        self._networks: tuple[Network, ...] = tuple(ipaddress.ip_network(n, strict=False) for n in networks)
        self._clock = clock
        self._ttl_s = ttl_s
        self._resolve_timeout_s = resolve_timeout_s
        self._cache: dict[str, tuple[bool, float]] = {}
        self.refused_total = 0

    async def allowed(self, url: str) -> bool:
        base = url.rstrip("/")
        if base in self._static:
            return True
        now = self._clock.now()
        hit = self._cache.get(base)
        if hit is not None and hit[1] > now:
            ok = hit[0]
        else:
            ok = await self._decide(base)
            if len(self._cache) > 10_000:  # registry churn: never grow without bound
                self._cache.clear()
            self._cache[base] = (ok, now + self._ttl_s)
        if not ok:
            self.refused_total += 1
        return ok

    async def _decide(self, url: str) -> bool:
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError:
            return False
        host = parts.hostname
        if parts.scheme not in ("http", "https") or not host or parts.username or parts.password:
            return False
        try:
            return addresses_allowed([ipaddress.ip_address(host)], self._networks)
        except ValueError:
            pass
        try:
            async with asyncio.timeout(self._resolve_timeout_s):
                infos = await asyncio.get_running_loop().getaddrinfo(host, port or 80, type=socket.SOCK_STREAM)
        except (OSError, TimeoutError):
            return False
        return addresses_allowed((ipaddress.ip_address(str(i[4][0]).split("%")[0]) for i in infos), self._networks)
