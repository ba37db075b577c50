"""What runs beside an engine: the sidecar agent, the SGLang launcher, and the emulator.

Rules:
  1. ``replica`` may import ``router.model``, ``router.store``, ``router.engine_metrics`` and
     ``router.errors``; never ``router.gateway`` (a sidecar must not drag the gateway in).
  2. Nothing here imports sglang: ``kvroute launch`` execs it in its own process.

Modules: ``agent`` (``kvroute sidecar``: register, heartbeat, health probes, drain), ``probe``
(async engine probes), ``config`` (``AgentConfig``), ``launch`` (``kvroute launch``),
``emulator`` (SGLang-compatible replica).
"""

from __future__ import annotations

__all__: list[str] = []
