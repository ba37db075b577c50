"""A tool or service a test needs is missing: under CI (``CI=true``, where ``scripts/test.sh`` installs
everything) that is a failure; on a developer's machine a skip that names what to install."""

from __future__ import annotations

import os
from typing import NoReturn

import pytest


def under_ci() -> bool:
    return os.environ.get("CI", "").lower() in {"1", "true", "yes"}


def missing(what: str) -> NoReturn:
    if under_ci():
        pytest.fail(f"required under CI: {what}", pytrace=False)
    pytest.skip(what)
