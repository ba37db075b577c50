"""The aiohttp shell of the gateway. Thin: it parses, asks the pure policy, calls the store, forwards.

Rule 1: nothing here decides *where* a request goes; ``router.policy`` does (one ``route()`` call).
Rule 2: ``forward.py`` is the only module that touches aiohttp's client and maps its errors.
Rule 3: every ``store.acquire`` is matched by exactly one ``store.release``, whatever happens.
Rule 4: ``serve.py`` is the only reader of argv, the environment and signals.

Modules: ``app`` (``make_app``, app keys), ``handlers`` (routes; ``serve_inference``, the inference
core both servers run), ``dataplane`` (the raw HTTP/1.1 listener of the inference routes),
``forward`` (upstream client, SSE relay, usage sniffer), ``upstream_raw`` (the raw upstream client),
``middleware`` (request id, errors, limits), ``serve`` (``kvroute serve``, ``start_gateway``),
``keys`` (typed app state), ``admin`` (``/admin`` sub-app).
Submodules are imported explicitly (``from router.gateway.serve import start_gateway``) so that
importing the package stays cheap.
"""

from __future__ import annotations

__all__: list[str] = []
