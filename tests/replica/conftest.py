"""Fixtures for the emulator tests: real replicas on free ports, real HTTP clients."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import aiohttp
import pytest

from replica.emulator.profiles import get_profile
from replica.emulator.runner import Running, running_emulators
from replica.emulator.server import EmulatorConfig

EmuFactory = Callable[..., AbstractAsyncContextManager[list[Running]]]


def small_config(**changes: Any) -> EmulatorConfig:
    """small-test profile, 20x faster than modelled; profile fields via ``profile_overrides``."""
    overrides = changes.pop("profile_overrides", {})
    prof = get_profile("small-test").with_overrides(**overrides)
    return dataclasses.replace(EmulatorConfig(profile=prof, time_scale=0.05), **changes)


@pytest.fixture
def emulators() -> EmuFactory:
    def factory(n: int = 1, **changes: Any) -> AbstractAsyncContextManager[list[Running]]:
        return running_emulators(n, config=small_config(**changes))

    return factory


@pytest.fixture
async def emu() -> AsyncIterator[Running]:
    async with running_emulators(1, config=small_config()) as reps:
        yield reps[0]


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        yield s
