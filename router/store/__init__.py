"""Shared state behind one Protocol (``base.StateStore``): in memory (``memory``) or in Redis
(``redis``). Rule: ``store`` never imports ``gateway``."""

from __future__ import annotations

from router.store.base import StateStore, StoreConfig
from router.store.memory import MemoryCore, MemoryStore

__all__ = ["MemoryCore", "MemoryStore", "StateStore", "StoreConfig"]
