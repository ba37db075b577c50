"""Discrete-event fleet simulator: the real ``router.policy`` code against emulated replicas.

Rules:
  1. One heap loop over ``(time, seq, handler, arg)`` (``engine.py``); ``seq`` makes ties
     deterministic, so a seed reproduces a run exactly.
  2. Replicas are the emulator's PURE cache and time model (``replica.emulator.cache`` /
     ``replica.emulator.timemodel``), driven by virtual time; nothing here sleeps or reads a clock.
  3. Gateways call ``router.policy`` and ``router.store.memory.MemoryCore`` exactly as the live
     gateway calls its store: snapshot -> route -> acquire -> (replica) -> release.
  4. No aiohttp, no asyncio.

Modules: ``engine`` (event loop), ``prompts`` (block hash names of a workload's prompts),
``replica_model`` (one simulated replica), ``run`` (``SimConfig``, ``run_sim``), ``cli``
(``kvroute sim``). docs/SIMULATOR.md describes the model and the numbers.
"""

from __future__ import annotations

__all__: list[str] = []
