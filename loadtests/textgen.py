"""Prompt text for live load tests: deterministic, cheap, prefix-stable.

Rules:
  1. Same inputs, same bytes: a session's text is a pure function of (session id, turn index, sizes),
     so two runs of the same workload (one per policy) send byte-identical requests.
  2. Shared prefix first: every conversation starts with the same system + tools text, so a replica's
     prefix cache sees the cross-session sharing real coding agents have (calibration.md §5).
  3. Append only: turn T's messages are turn T-1's messages plus new ones, so the rendered prompt of
     turn T-1 is a prefix of turn T's (what a prefix cache needs to hit).
  4. Sizes are in *emulated* tokens of 4 bytes each (the emulator's tokenizer: 1 token = 4 UTF-8 bytes
     of the rendered prompt). A workload in model tokens is divided by ``token_unit`` first.

Text is base64 of seeded random bytes with ``+``/``/`` turned into spaces: ASCII-only (so byte length
equals character length), JSON-safe without escapes, and generated in C, so 100 kB costs microseconds.
"""

from __future__ import annotations

import base64
import random
from dataclasses import dataclass, field
from functools import lru_cache

__all__ = [
    "BYTES_PER_TOKEN",
    "Conversation",
    "emulated_tokens",
    "filler",
    "shared_prefix",
]

BYTES_PER_TOKEN = 4
"""The emulator's tokenizer maps 4 UTF-8 bytes of rendered prompt to one token."""

_SPACES = bytes.maketrans(b"+/", b"  ")


def emulated_tokens(model_tokens: int, token_unit: int) -> int:
    """Model tokens -> emulated tokens (each emulated token stands for ``token_unit`` model tokens).

    Rounds to nearest and keeps at least 1 for a positive input, so small turns are not dropped.
    """
    if token_unit < 1:
        raise ValueError(f"token_unit must be >= 1, got {token_unit}")
    if model_tokens <= 0:
        return 0
    return max(1, (model_tokens + token_unit // 2) // token_unit)


def filler(seed: str, n_bytes: int) -> str:
    """``n_bytes`` of deterministic ASCII text derived from ``seed`` (different seeds diverge at once)."""
    if n_bytes <= 0:
        return ""
    raw = random.Random(seed).randbytes((n_bytes * 3) // 4 + 3)
    return base64.b64encode(raw).translate(_SPACES)[:n_bytes].decode("ascii")


@lru_cache(maxsize=16)
def shared_prefix(n_bytes: int, namespace: str = "kvroute-shared-system-and-tools") -> str:
    """The system + tools prompt every session shares (cached: it is the same string every time)."""
    head = "You are a coding agent. Tools follow.\n"
    if n_bytes <= len(head):
        return head[: max(n_bytes, 0)]
    return head + filler(namespace, n_bytes - len(head))


@dataclass(slots=True)
class Conversation:
    """A growing chat transcript for one session (or one branch of a thicc session).

    ``messages`` is the OpenAI ``messages`` array sent each turn; the caller appends a user message
    before a request and the assistant's reply after it (``add_user`` / ``add_assistant``).
    ``prompt_tokens`` counts emulated tokens of message *contents* (bytes / 4; the chat template adds
    a few more on the replica).
    """

    key: str  # seed namespace: session id + branch, so branches do not share history text
    shared_prefix_tokens: int
    messages: list[dict[str, str]] = field(default_factory=list)
    prompt_tokens: int = 0
    _n: int = 0

    def __post_init__(self) -> None:
        if self.shared_prefix_tokens > 0:
            self.messages.append(
                {"role": "system", "content": shared_prefix(self.shared_prefix_tokens * BYTES_PER_TOKEN)}
            )
            self.prompt_tokens += self.shared_prefix_tokens

    def add_user(self, tokens: int) -> None:
        self._append("user", tokens)

    def add_assistant(self, tokens: int) -> None:
        self._append("assistant", tokens)

    def _append(self, role: str, tokens: int) -> None:
        self._n += 1
        n_bytes = max(tokens, 0) * BYTES_PER_TOKEN
        if self._n == 1:
            # a per-conversation marker up front (AgentX's cache-bust id): no two sessions share text
            # beyond the shared prefix, even if their seeds collided
            marker = f"[{self.key}] "
            content = marker + filler(f"{self.key}/{self._n}", n_bytes - len(marker))
        else:
            content = filler(f"{self.key}/{self._n}", n_bytes)
        self.messages.append({"role": role, "content": content})
        self.prompt_tokens += len(content) // BYTES_PER_TOKEN
