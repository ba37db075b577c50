"""kvroute: a KV-cache-aware routing gateway for coding-agent LLM traffic.

Packages: ``router.policy`` (pure routing), ``router.store`` (shared state), ``router.gateway``
(aiohttp shell), ``router.observability`` (metrics, tracing hooks).
"""

from __future__ import annotations

__all__ = ["__version__"]
__version__ = "0.1.0"
