"""The emulator's tokenizer: deterministic, cheap, reversible, and prefix-preserving.

Theory of operation
-------------------
A real tokenizer costs milliseconds per 100k-token prompt and needs model files; the emulator
only needs token *counts* that are plausible and token *prefixes* that are shared exactly when
the requests share a text prefix. So:

Rule 1: one token = 4 bytes of UTF-8. The rendered prompt is encoded, zero-padded to a multiple
        of 4 bytes, and token ``i`` is the little-endian ``uint32`` of bytes ``[4i, 4i+4)``.
        ``/detokenize`` is therefore exact (trailing NUL padding is stripped).
Rule 2: ``input_ids`` are accepted as-is (each must fit in ``uint32``); they are packed into the
        same 4-byte little-endian form, so ``tokenize(text)`` fed back as ``input_ids`` hashes to
        the same blocks as the text.
Rule 3: chat messages are rendered by one fixed Kimi-like template (:func:`render_chat`). Each
        message renders independently and the generation prompt is a prefix of a rendered
        assistant message, so turn T+1 (history + assistant answer + new user message) starts
        with the bytes of turn T's prompt: a shared message prefix is a shared token prefix.
Rule 4: block hashes are *chained*: block ``i``'s hash is ``mmh3.hash64`` of its bytes seeded with
        (a 32-bit fold of) block ``i-1``'s hash, so one hash names a whole prefix. Only full
        blocks are hashed; hashing is one C call per block, no per-token Python work.

A ``cache_salt``/``extra_key`` changes the chain's initial seed, which namespaces the cache as
SGLang does.
"""

from __future__ import annotations

import json
import sys
from array import array
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import mmh3

__all__ = [
    "BYTES_PER_TOKEN",
    "GENERATION_PROMPT",
    "ChainMemo",
    "Prompt",
    "block_hashes",
    "decode_ids",
    "encode_ids",
    "encode_text",
    "output_text",
    "render_chat",
    "salt_seed",
    "token_ids",
]

BYTES_PER_TOKEN = 4
GENERATION_PROMPT = "<|im_assistant|>assistant<|im_middle|>"
_LITTLE = sys.byteorder == "little"
_MASK32 = 0xFFFFFFFF


@dataclass(frozen=True, slots=True)
class Prompt:
    """A tokenized prompt: ``data`` is its bytes zero-padded to a multiple of 4 (one token each)."""

    data: bytes
    raw_len: int = -1  # bytes before padding (-1: same as ``len(data)``)

    @property
    def num_tokens(self) -> int:
        return len(self.data) // BYTES_PER_TOKEN

    @property
    def raw(self) -> bytes:
        return self.data if self.raw_len < 0 else self.data[: self.raw_len]


def _pad(raw: bytes) -> bytes:
    rem = len(raw) % BYTES_PER_TOKEN
    return raw if rem == 0 else raw + b"\0" * (BYTES_PER_TOKEN - rem)


def encode_text(text: str) -> Prompt:
    raw = text.encode("utf-8", "surrogatepass")
    return Prompt(_pad(raw), len(raw))


def encode_ids(ids: Sequence[int]) -> Prompt:
    """Pack token ids (each ``0 <= id < 2**32``) into a :class:`Prompt`. Raises ``ValueError``."""
    try:
        arr = array("I", ids)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"input_ids must be a list of integers in [0, 2**32): {exc}") from None
    if arr.itemsize != BYTES_PER_TOKEN:  # pragma: no cover - exotic platforms
        arr = array("L", ids)
    if not _LITTLE:  # pragma: no cover
        arr.byteswap()
    return Prompt(arr.tobytes())


def token_ids(prompt: Prompt) -> list[int]:
    arr = array("I")
    arr.frombytes(prompt.data)
    if not _LITTLE:  # pragma: no cover
        arr.byteswap()
    return arr.tolist()


def decode_ids(ids: Sequence[int]) -> str:
    """Inverse of tokenization (exact for ids produced by :func:`encode_text`)."""
    return encode_ids(ids).data.rstrip(b"\0").decode("utf-8", "replace")


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for part in content:
            if isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                parts.append(json.dumps(part, separators=(",", ":"), sort_keys=True))
        return "".join(parts)
    return json.dumps(content, separators=(",", ":"), sort_keys=True)


def render_chat(
    messages: Iterable[Mapping[str, Any]],
    tools: Sequence[Any] | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """Render chat messages with the emulator's fixed template (Kimi-like markers).

    ``<|im_{role}|>{name}<|im_middle|>{content}<|im_end|>`` per message; tools first as a system
    block; ``GENERATION_PROMPT`` last. Raises ``ValueError`` on a malformed message.
    """
    out: list[str] = []
    if tools:
        out.append("<|im_system|>tool_declare<|im_middle|>")
        out.append(json.dumps(list(tools), separators=(",", ":"), sort_keys=True))
        out.append("<|im_end|>")
    for msg in messages:
        if not isinstance(msg, Mapping):
            raise ValueError("each message must be an object")  # noqa: TRY004 - one error type for bad input
        role = msg.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError("each message needs a string 'role'")
        name = msg.get("name")
        out.append(f"<|im_{role}|>{name if isinstance(name, str) else role}<|im_middle|>")
        out.append(_content_text(msg.get("content")))
        for key in ("tool_calls", "tool_call_id"):
            if msg.get(key) is not None:
                out.append(json.dumps(msg[key], separators=(",", ":"), sort_keys=True))
        out.append("<|im_end|>")
    if add_generation_prompt:
        out.append(GENERATION_PROMPT)
    return "".join(out)


def salt_seed(salt: str | None) -> int:
    """Initial chain seed for a cache namespace (``cache_salt`` / ``extra_key``); 0 for none."""
    return 0 if not salt else mmh3.hash(salt.encode("utf-8"), 0x5EED, signed=False)


def block_hashes(
    prompt: Prompt | bytes,
    page_size: int,
    seed: int = 0,
    start_block: int = 0,
    prev_hash: int | None = None,
) -> list[int]:
    """Chained hashes of the full ``page_size``-token blocks of ``prompt``.

    ``hash[i] = mmh3.hash64(block_i, seed=fold32(hash[i-1]))[0]`` (unsigned 64 bit); block 0 is
    seeded with ``seed``. To extend an existing chain (e.g. prompt + generated output), pass
    ``start_block`` and the chain's last hash as ``prev_hash``.
    """
    if page_size <= 0:
        raise ValueError("page_size must be positive")
    data = prompt.data if isinstance(prompt, Prompt) else prompt
    step = page_size * BYTES_PER_TOKEN
    n_blocks = len(data) // step
    h = seed & _MASK32 if prev_hash is None else prev_hash
    first = prev_hash is None
    out: list[int] = []
    append = out.append
    hash64 = mmh3.hash64
    for i in range(start_block, n_blocks):
        s = h if first else (h ^ (h >> 32)) & _MASK32
        first = False
        h = hash64(data[i * step : (i + 1) * step], s, signed=False)[0]
        append(h)
    return out


class ChainMemo:
    """Remembers recent hash chains so a growing conversation is not rehashed every turn.

    Keyed by a caller-chosen key (session id, else the first block's bytes). A remembered chain
    is reused only after its whole prefix is verified byte-exact against the new prompt by one
    128-bit mmh3 digest (a single C pass, ~10x cheaper than rehashing block by block); then
    only the new blocks are hashed. Results are identical to :func:`block_hashes`.
    """

    def __init__(self, max_entries: int = 1024) -> None:
        self.max_entries = max_entries
        # chains kept as array('Q') (8 B per block, ~13 KB for a 100k-token prompt)
        self._memo: OrderedDict[Hashable, tuple[int, int, bytes, array[int]]] = OrderedDict()
        self.reused_blocks = 0
        self.hashed_blocks = 0

    def hashes(self, prompt: Prompt, page_size: int, seed: int = 0, key: Hashable | None = None) -> list[int]:
        data = prompt.data
        step = page_size * BYTES_PER_TOKEN
        n_full = len(data) // step
        if n_full == 0:
            return []
        view = memoryview(data)
        if key is None:
            key = data[:step]
        key = (key, page_size, seed)
        old = self._memo.get(key)
        out: list[int] | None = None
        if old is not None:
            n_old, _, digest, old_hashes = old
            if 0 < n_old <= n_full and mmh3.mmh3_x64_128_digest(view[: n_old * step], seed) == digest:
                out = old_hashes[:n_old].tolist()
                out += block_hashes(data, page_size, seed, start_block=n_old, prev_hash=out[-1])
                self.reused_blocks += n_old
                self.hashed_blocks += n_full - n_old
        if out is None:
            out = block_hashes(data, page_size, seed)
            self.hashed_blocks += n_full
        self._memo[key] = (n_full, seed, mmh3.mmh3_x64_128_digest(view[: n_full * step], seed), array("Q", out))
        self._memo.move_to_end(key)
        if len(self._memo) > self.max_entries:
            self._memo.popitem(last=False)
        return out


# 64 four-byte "words": output text is a deterministic walk over them (4 bytes = 1 token).
_WORDS = (
    "def ", "var ", "int ", "for ", "ret ", "val ", "if x", " = 1", "; y ", "()\n ", "pass", " ok,",
    "the ", "fix ", "bug ", "test", " run", " and", " add", " new", "code", " API", " map", " key",
    "read", "file", " now", " use", " log", " err", " nil", " end", "call", "load", "save", "sort",
    "list", "dict", " set", " get", "init", "main", "next", "last", "from", "with", "else", "elif",
    "yes ", "done", "line", "data", "node", "tree", "path", "port", "host", "user", "mode", "type",
    "size", "time", "step", "\n   ",
)
_WHEEL = "".join(_WORDS)
_WHEEL_TOKENS = len(_WORDS)


def output_text(n_tokens: int, seed: int = 0) -> str:
    """``n_tokens`` tokens (4 ASCII bytes each) of deterministic filler starting at ``seed``."""
    if n_tokens <= 0:
        return ""
    start = (seed % _WHEEL_TOKENS) * BYTES_PER_TOKEN
    need = start + n_tokens * BYTES_PER_TOKEN
    reps = need // len(_WHEEL) + 1
    return (_WHEEL * reps)[start:need]
