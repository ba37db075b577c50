"""What the coding agents' APIs look like on the wire, shared by the emulator and real-engine tests:
event-framed SSE (Anthropic's Messages API, OpenAI's Responses API) and a Codex-shaped history."""

from __future__ import annotations

import json
from typing import Any

# what Codex CLI sends as input: a developer message, the user's turn, reasoning, a function call and
# its output
CODEX_INPUT: list[dict[str, Any]] = [
    {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "sandbox: on"}]},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
    {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "look it up"}],
     "encrypted_content": "gAAAA-opaque"},
    {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Paris"}'},
    {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
]  # fmt: skip


def sse_events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    """``event: NAME`` / ``data: JSON`` frames as (name, data) pairs."""
    out = []
    for frame in raw.decode().split("\n\n"):
        if not frame:
            continue
        head, data = frame.split("\n")
        out.append((head.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out
