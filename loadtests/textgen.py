"""Prompt text for live load tests: deterministic, cheap, prefix-stable.

Rules:
  1. Same inputs, same bytes: a session's text is a pure function of (session id, turn index, sizes),
     so two runs of the same workload (one per policy) send byte-identical requests.
  2. Shared prefix first: every conversation starts with the same system + tools text, so a replica's
     prefix cache sees the cross-session sharing real coding agents have (docs/WORKLOADS.md).
  3. Append only: turn T's messages are turn T-1's messages plus new ones, so the rendered prompt of
     turn T-1 is a prefix of turn T's (what a prefix cache needs to hit).
  4. Sizes are in *emulated* tokens of 4 bytes each (the emulator's tokenizer: 1 token = 4 UTF-8 bytes
     of the rendered prompt). A workload in model tokens is divided by ``token_unit`` first.
  5. A conversation's first user message never changes: it is the conversation's id alone, as a real
     agent's first task message stays put while later messages append. The gateway names a
     conversation by that message (``router.policy.prefix_key.chain_key``); a growing first message
     shorter than the key's block (every sub-agent's at ``token_unit`` 100) would get a new name
     every turn.

Text is base64 of seeded random bytes with ``+``/``/`` turned into spaces: ASCII-only (so byte length
equals character length), JSON-safe without escapes, and generated in C, so 100 kB costs microseconds.
"""

from __future__ import annotations

import base64
import hashlib
import random
from dataclasses import dataclass, field
from functools import lru_cache

from replica.emulator.tokenizer import render_chat

__all__ = [
    "BYTES_PER_TOKEN",
    "Conversation",
    "conversation_prefix_key",
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


_CHUNK = 4096


@lru_cache(maxsize=4096)
def _canonical_chunk(namespace: str, i: int) -> str:
    return filler(f"{namespace}/{i}", _CHUNK)


@lru_cache(maxsize=64)
def shared_prefix(n_bytes: int, namespace: str = "kvroute-shared-system-and-tools") -> str:
    """The system + tools prompt sessions share: the first ``n_bytes`` of ONE canonical text, so a
    shorter shared prefix is a prefix of a longer one (one canonical shared prefix, as the public agent traces show;
    sessions whose tool definitions differ in size still share what they have in common)."""
    head = "You are a coding agent. Tools follow.\n"
    if n_bytes <= len(head):
        return head[: max(n_bytes, 0)]
    need = n_bytes - len(head)
    body = "".join(_canonical_chunk(namespace, i) for i in range((need + _CHUNK - 1) // _CHUNK))
    return head + body[:need]


@lru_cache(maxsize=2)
def _template_bytes(with_system: bool) -> int:
    """Bytes the emulator's chat template adds to a conversation's messages (system, id, history)."""
    system = [{"role": "system", "content": ""}] if with_system else []
    return len(render_chat([*system, {"role": "user", "content": ""}, {"role": "user", "content": ""}]))


@lru_cache(maxsize=1)
def _common_template_bytes() -> int:
    """Bytes of the template that every conversation renders alike around the shared prompt: the
    system message's markers and the opening of the first user message (``<|im_end|><|im_user|>...``)."""
    text = render_chat([{"role": "system", "content": ""}, {"role": "user", "content": "#"}],
                       add_generation_prompt=False)
    return text.index("#")


def _conversation_id(key: str) -> str:
    """The id message: a digest of the conversation's key, so that two conversations' prompts part
    at its first character (ids such as ``s00007-...`` would share their first bytes)."""
    return "[" + hashlib.blake2b(key.encode(), digest_size=5).hexdigest() + "]"


@dataclass(slots=True)
class Conversation:
    """A growing transcript for one session (or one branch / one context after a compaction).

    Sizes are given in *model* tokens; the text has ``4 / token_unit`` bytes per model token, computed
    on the running total so that rounding never drifts (1000 turns of 30 tokens stay 30,000 tokens).

    The request has three messages: the shared system + tools prompt, the conversation's id (its
    first user message, rule 5), and ONE user message holding the whole history, which grows
    append-only turn by turn (tool results, the model's previous replies, user text). One history
    message instead of one per turn keeps the chat template's per-message markers (~10 emulated
    tokens each, i.e. ~1000 model tokens at ``token_unit`` 100) from inflating the context. The id
    message and the template's markers (the emulator's, ``render_chat``) count within the prompt's
    size, so the rendered prompt is as long as the workload says (a trace's prompt sizes include its
    template, and the simulator takes them as they are): the markers every conversation renders
    alike (the system message's and the first user message's opening, ~18 emulated tokens) within
    the shared prefix, so that conversations share exactly ``shared_prefix_tokens``; the id and the
    rest (~25 emulated tokens, ~2,500 model tokens at ``token_unit`` 100) within the history, so a
    conversation whose own part is smaller than that is sent at that size. The rendered prompt of
    turn T-1 is a prefix of turn T's up to its closing marker, which is what a prefix cache needs.
    """

    key: str  # seed namespace: conversation id, so no two conversations share history text
    shared_prefix_tokens: int  # model tokens
    token_unit: int = 1
    _shared: str = ""
    _marker: str = ""
    _chunks: list[str] = field(default_factory=list)
    _chunks_made: int = 1  # chunks ever appended (+ the first): a new one is never named as a cut one
    _history_model_tokens: int = 0
    _history_bytes: int = 0

    def __post_init__(self) -> None:
        if self.token_unit < 1:
            raise ValueError(f"token_unit must be >= 1, got {self.token_unit}")
        n = self._bytes_for(self.shared_prefix_tokens)
        if n > 0:
            self._shared = shared_prefix(max(n - _common_template_bytes(), 1))
        self._marker = _conversation_id(self.key)  # AgentX-style cache-bust id right after the shared prefix
        # the history message is never empty (routers may refuse an empty message: sglang-router
        # answers 400): its first character is there from the start and never truncated
        self._chunks = [filler(f"{self.key}/0", 1)]
        self._history_bytes = self._lead_bytes + 1

    @property
    def _lead_bytes(self) -> int:
        """Bytes the history's budget spends besides the history text: the id and the template
        (markers, generation prompt) but for what the shared prefix's budget holds."""
        shared = bool(self._shared)
        return len(self._marker) + _template_bytes(shared) - (_common_template_bytes() if shared else 0)

    def _bytes_for(self, model_tokens: int) -> int:
        return (max(model_tokens, 0) * BYTES_PER_TOKEN + self.token_unit // 2) // self.token_unit

    def add(self, model_tokens: int) -> None:
        """Append ``model_tokens`` of new context (tool output, user text or the previous reply)."""
        self._history_model_tokens += max(model_tokens, 0)
        target = max(self._bytes_for(self._history_model_tokens), self._history_bytes)
        n = target - self._history_bytes
        if n > 0:
            # named by how many were ever made, not by how many are kept: after a truncation to a
            # chunk's start, a name by position would repeat the cut text, which no trace shares
            self._chunks_made += 1
            self._chunks.append(filler(f"{self.key}/{self._chunks_made}", n))
            self._history_bytes = target

    def truncate(self, model_tokens: int) -> None:
        """Keep only the first ``model_tokens`` of history (a trace that rewrites the tail of its
        context: the next turn reuses a prefix and replaces the rest). Never grows it, and never
        touches the id message."""
        lead = self._lead_bytes
        keep = max(min(self._bytes_for(max(model_tokens, 0)), self._history_bytes), lead + 1)
        if keep >= self._history_bytes:
            return
        kept: list[str] = []
        n = lead
        for chunk in self._chunks:
            if n + len(chunk) >= keep:
                kept.append(chunk[: keep - n])
                break
            kept.append(chunk)
            n += len(chunk)
        self._chunks = [c for c in kept if c]
        self._history_bytes = keep
        self._history_model_tokens = min(self._history_model_tokens, max(model_tokens, 0))

    # kept for readability at call sites
    add_user = add
    add_assistant = add

    @property
    def messages(self) -> list[dict[str, str]]:
        out = [{"role": "system", "content": self._shared}] if self._shared else []
        out.append({"role": "user", "content": self._marker})
        out.append({"role": "user", "content": "".join(self._chunks)})
        return out

    @property
    def history_model_tokens(self) -> int:
        """Model tokens of history so far (what ``add`` and ``truncate`` count)."""
        return self._history_model_tokens

    @property
    def prompt_tokens(self) -> int:
        """Emulated tokens of the prompt as the emulator renders it."""
        shared = len(self._shared) + _common_template_bytes() if self._shared else 0  # with the markers around it
        return (shared + self._history_bytes) // BYTES_PER_TOKEN


def conversation_prefix_key(
    session_id: str, start: int, shared_prefix_tokens: int, *, token_unit: int, model: str, block_chars: int,
    blocks: int,
) -> str:
    """The gateway's key (rule 7, ``router.policy.prefix_key``) for a request without a session id
    that continues the conversation ``session_id`` began at turn ``start``, as ``loadtests.live``
    renders it: the key reads the model and the messages up to the first user message, which are
    the same on every turn of the conversation."""
    from router.policy.prefix_key import prefix_key

    conv = Conversation(key=f"{session_id}~{start}", shared_prefix_tokens=shared_prefix_tokens, token_unit=token_unit)
    key = prefix_key({"model": model, "messages": conv.messages}, "/v1/chat/completions", block_chars, blocks)
    assert key is not None  # a chat body with a user message always has one
    return key
