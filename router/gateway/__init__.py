"""The aiohttp shell of the gateway. Thin: it parses, asks the pure policy, calls the store, forwards.

Rule 1: nothing here decides *where* a request goes; ``router.policy`` does (one ``route()`` call).
Rule 2: ``upstream.py`` is the only module that talks HTTP to replicas and maps its errors.
Rule 3: every ``store.acquire`` is matched by exactly one ``store.release``, whatever happens.
Rule 4: ``serve.py`` is the only reader of argv, the environment and signals.
Rule 5: one HTTP stack per side, public API only: aiohttp's server for every route, ``upstream.py``'s
        client towards replicas; tracing and metrics plug into them and change neither.

Modules: ``app`` (``make_app``), ``runtime`` (typed app state), ``handlers`` (routes; the inference
core), ``forward`` (the ``ReplicaClient`` seam, header hygiene, usage sniffer), ``upstream`` (the
client towards replicas), ``middleware`` (request id, errors, limits), ``serve`` (``kvroute serve``,
``start_gateway``, the listener), ``egress`` (which replica URLs may be reached), ``admin`` and
``admin_openapi`` (the ``/admin`` sub-app and its spec).
Submodules are imported explicitly (``from router.gateway.serve import start_gateway``) so that
importing the package stays cheap.
"""

from __future__ import annotations

__all__: list[str] = []
