"""Observability of the gateway: hooks over its frozen events, and the operator surface.

Rules:
  1. The core (policy, store, handlers) never imports this package's heavy parts; it emits events
     (``router.events``) and these modules consume them as hooks.
  2. ``metrics.py``: prometheus_client objects in a per-app registry, ``kvroute_*`` names with units,
     low-cardinality labels (never session ids). ``stats.py``: pure rolling-window fleet stats for
     ``/admin/stats``. ``tracing.py``: OpenTelemetry behind a lazy import, a no-op when off.
     ``logging.py``: JSON logs with the request id, secrets redacted. ``surface.py``: wires them and
     the admin sub-app onto a gateway app.
  3. Importing this package imports nothing else (submodules are imported by name).
"""

from __future__ import annotations

__all__: list[str] = []
