"""Fixtures of the hardening tests: reuse the gateway tests' real replicas and gateway factory."""

from __future__ import annotations

from tests.router.conftest import fake_replicas, gateway_factory

__all__ = ["fake_replicas", "gateway_factory"]
