"""Units of the egress guard (router/gateway/egress.py): which replica URLs the gateway may talk to."""

from __future__ import annotations

import ipaddress

from router.clock import SystemClock
from router.gateway.admin import DEFAULT_ALLOWED_NETWORKS
from router.gateway.egress import EgressGuard, addresses_allowed


def _nets(*n: str) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    return [ipaddress.ip_network(x) for x in n]


def test_addresses_allowed_needs_every_address_inside() -> None:
    nets = _nets("10.0.0.0/8", "::1/128")
    assert addresses_allowed([ipaddress.ip_address("10.1.2.3")], nets)
    assert addresses_allowed([ipaddress.ip_address("::1")], nets)
    assert not addresses_allowed([ipaddress.ip_address("10.1.2.3"), ipaddress.ip_address("8.8.8.8")], nets)
    assert not addresses_allowed([], nets)  # nothing resolved: refuse


async def test_guard_static_always_and_registry_by_network() -> None:
    g = EgressGuard(["http://203.0.113.7:8000"], DEFAULT_ALLOWED_NETWORKS, SystemClock())
    assert await g.allowed("http://203.0.113.7:8000/")  # static: the operator's own choice
    assert await g.allowed("http://10.2.3.4:30000")
    assert await g.allowed("http://localhost:30000")  # resolved to loopback
    assert await g.allowed("https://[::1]:8443")
    for bad in ("http://203.0.113.8:8000", "http://169.254.169.254", "ftp://10.0.0.1:21", "http://u:p@10.0.0.1:1",
                "http://[2001:db8::1]:80", "http://no-such-host.invalid:80", "not a url"):  # fmt: skip
        assert not await g.allowed(bad), bad
    assert g.refused_total == 7
    # cached: the same verdict again without resolving
    assert not await g.allowed("http://no-such-host.invalid:80")
    assert g.refused_total == 8
