"""SGLang 0.5.23's Anthropic Messages API (``/v1/messages``), the pure part: request checks and the
conversion to an OpenAI chat request, as ``sglang/srt/entrypoints/anthropic/`` does them.

Rule 1: SGLang answers Anthropic requests by converting them to a chat request and running its chat
        serving; so does the emulator. :func:`to_chat` builds that chat body (system prompt first,
        content blocks flattened, ``tool_use`` -> ``tool_calls``, ``tool_result`` -> ``tool``
        messages, tools -> functions), and the server feeds it to its own chat parsing: a messages
        request and the equivalent chat request render the same prompt and share cache blocks.
Rule 2: validation messages are pydantic's, as SGLang's ``_anthropic_validation_message`` digests
        them (``loc: msg`` joined by ``"; "``), for the fields and mistakes clients actually make;
        exotic shapes (images in tool results, server tools' own fields) are taken as they come.
Rule 3: the emulated model has no reasoning parser, as the tiny real model has none: ``thinking``
        enabled or adaptive is refused, earlier thinking blocks in the history are dropped.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping
from typing import Any

__all__ = ["STOP_REASONS", "AnthropicRequestError", "error_body", "error_type", "sse_event", "to_chat", "usage"]

# SGLang's STOP_REASON_MAP: anything else (abort) is end_turn; a matched stop string is "stop" there
# too, so "stop_sequence" never comes back
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
_ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    408: "request_timeout_error", 429: "rate_limit_error", 503: "overloaded_error",
}
_BLOCK_FIELDS = {  # each block type's required string fields (protocol.py)
    "text": ("text",), "image": (), "tool_use": ("id", "name"), "tool_result": (), "tool_reference": (),
    "search_result": (), "thinking": ("thinking",), "redacted_thinking": (),
}
_BLOCK_UNION = (
    "list[tagged-union[TextBlock,ImageBlock,ToolUseBlock,ToolResultBlock,ToolReferenceBlock,SearchResultBlock,"
    "ThinkingBlock,RedactedThinkingBlock]]"
)
_SERVER_TOOL = re.compile(r"^(web_search|computer|bash|text_editor)_")


class AnthropicRequestError(ValueError):
    """A request SGLang refuses with 400 ``invalid_request_error`` before running it."""


def error_type(status: int) -> str:
    return _ERROR_TYPES.get(status, "api_error")


def error_body(type_: str, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": type_, "message": message}}


def sse_event(obj: Mapping[str, Any]) -> bytes:
    """One Anthropic SSE frame: the event's type on its own line, then its compact JSON."""
    data = json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    return f"event: {obj['type']}\ndata: {data}\n\n".encode()


def usage(prompt: int, cached: int, output: int | None, *, with_input: bool = True) -> dict[str, int]:
    """SGLang's Anthropic usage: input is the uncached part of the prompt; the cached part is
    reported only when there is one."""
    out: dict[str, int] = {}
    if with_input:
        out["input_tokens"] = max(prompt - cached, 0)
    if output is not None:
        out["output_tokens"] = output
    if with_input and cached:
        out["cache_read_input_tokens"] = cached
    return out


# ---- validation (pydantic's messages) ----------------------------------------------------------


def _lax_int(v: Any) -> tuple[int | None, str | None]:
    if isinstance(v, bool | int):
        return int(v), None
    if isinstance(v, float):
        return (int(v), None) if v.is_integer() else (None, "Input should be a valid integer, got a number with a fractional part")
    if isinstance(v, str):
        try:
            return int(v.strip()), None
        except ValueError:
            return None, "Input should be a valid integer, unable to parse string as an integer"
    return None, "Input should be a valid integer"


def lax_bool(v: Any) -> bool | None:
    """pydantic's lax ``Optional[bool]``: None (missing) is False; None back means not a bool
    (also what the server's OpenAI routes read their flags with)."""
    if v is None or isinstance(v, bool):
        return bool(v)
    if isinstance(v, int | float) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.strip().lower() in _TRUE | _FALSE:
        return v.strip().lower() in _TRUE
    return None


_TRUE = frozenset({"1", "true", "t", "yes", "y", "on"})
_FALSE = frozenset({"0", "false", "f", "no", "n", "off"})


def _lax_float(v: Any) -> str | None:
    if isinstance(v, bool | int | float):
        return None
    if isinstance(v, str):
        try:
            float(v)
        except ValueError:
            return "Input should be a valid number, unable to parse string as a number"
        return None
    return "Input should be a valid number"


def _check_blocks(v: Any, loc: str, errors: list[str]) -> None:
    """``Union[str, list[AnthropicContentBlock]]``: pydantic reports both variants' failures."""
    if isinstance(v, str):
        return
    if not isinstance(v, list):
        errors += [f"{loc}.str: Input should be a valid string", f"{loc}.{_BLOCK_UNION}: Input should be a valid list"]
        return
    errs: list[str] = []
    for i, b in enumerate(v):
        at = f"{loc}.{_BLOCK_UNION}.{i}"
        if not isinstance(b, dict):
            errs.append(f"{at}: Input should be a valid dictionary or object to extract fields from")
        elif not isinstance(b.get("type"), str):
            errs.append(f"{at}: Unable to extract tag using discriminator 'type'")
        elif b["type"] not in _BLOCK_FIELDS:
            tags = ", ".join(f"'{t}'" for t in _BLOCK_FIELDS)
            errs.append(f"{at}: Input tag '{b['type']}' found using 'type' does not match any of the expected tags: {tags}")
        else:
            for name in _BLOCK_FIELDS[b["type"]]:
                if name not in b:
                    errs.append(f"{at}.{b['type']}.{name}: Field required")
                elif not isinstance(b[name], str):
                    errs.append(f"{at}.{b['type']}.{name}: Input should be a valid string")
    if errs:
        errors += [f"{loc}.str: Input should be a valid string", *errs]


def _check_messages(v: Any, errors: list[str]) -> None:
    if not isinstance(v, list):
        errors.append("messages: Input should be a valid list")
        return
    for i, m in enumerate(v):
        if not isinstance(m, dict):
            errors.append(f"messages.{i}: Input should be a valid dictionary or instance of AnthropicMessage")
            continue
        if "role" not in m:
            errors.append(f"messages.{i}.role: Field required")
        elif m["role"] not in ("user", "assistant", "system"):
            errors.append(f"messages.{i}.role: Input should be 'user', 'assistant' or 'system'")
        if "content" not in m:
            errors.append(f"messages.{i}.content: Field required")
        else:
            _check_blocks(m["content"], f"messages.{i}.content", errors)


def _check_tools(v: Any, errors: list[str]) -> None:
    if not isinstance(v, list):
        errors.append("tools: Input should be a valid list")
        return
    for i, t in enumerate(v):
        if not isinstance(t, dict):
            errors.append(f"tools.{i}: Input should be a valid dictionary or object to extract fields from")
            continue
        if _is_server_tool(t):
            continue
        for name, kind, what in (("name", str, "string"), ("input_schema", dict, "dictionary")):
            if name not in t:
                errors.append(f"tools.{i}.custom.{name}: Field required")
            elif not isinstance(t[name], kind):
                errors.append(f"tools.{i}.custom.{name}: Input should be a valid {what}")


def _check_thinking(v: Any, errors: list[str]) -> None:
    if not isinstance(v, dict):
        errors.append("thinking: Input should be a valid dictionary or instance of AnthropicThinkingParam")
        return
    kind, budget, display = v.get("type"), v.get("budget_tokens"), v.get("display")
    if kind not in ("enabled", "disabled", "adaptive"):
        errors.append("thinking.type: " + ("Field required" if "type" not in v else
                                           "Input should be 'enabled', 'disabled' or 'adaptive'"))
        return
    msg = None
    if kind == "enabled" and budget is None:
        msg = "thinking.budget_tokens is required when thinking.type is 'enabled'"
    elif kind == "enabled" and isinstance(budget, int) and budget < 1024:
        msg = f"thinking.budget_tokens must be >= 1024 (got {budget})"
    elif kind != "enabled" and budget is not None:
        msg = f"thinking.budget_tokens is not allowed when thinking.type is '{kind}'"
    elif kind == "disabled" and display is not None:
        msg = "thinking.display is not allowed when thinking.type is 'disabled'"
    if msg is not None:
        errors.append(f"thinking: Value error, {msg}")


def _check_tool_choice(v: Any, errors: list[str]) -> None:
    if not isinstance(v, dict):
        errors.append("tool_choice: Input should be a valid dictionary or instance of AnthropicToolChoice")
    elif "type" not in v:
        errors.append("tool_choice.type: Field required")
    elif v["type"] not in ("auto", "any", "tool", "none"):
        errors.append("tool_choice.type: Input should be 'auto', 'any', 'tool' or 'none'")


def validate(body: Mapping[str, Any], *, count_tokens: bool = False) -> int:
    """Checks the fields in the model's order; returns ``max_tokens`` (1 for count_tokens).
    Raises :class:`AnthropicRequestError` with every problem found."""
    errors: list[str] = []
    max_tokens = 1
    model = body.get("model")
    if "model" not in body:
        errors.append("model: Field required")
    elif not isinstance(model, str):
        errors.append("model: Input should be a valid string")
    elif not model:
        errors.append("model: Value error, Model is required")
    if "messages" not in body:
        errors.append("messages: Field required")
    else:
        _check_messages(body["messages"], errors)
    if not count_tokens:
        if "max_tokens" not in body:
            errors.append("max_tokens: Field required")
        else:
            n, err = _lax_int(body["max_tokens"])
            if err is not None:
                errors.append(f"max_tokens: {err}")
            elif n is not None and n <= 0:
                errors.append("max_tokens: Value error, max_tokens must be positive")
            elif n is not None:
                max_tokens = n
        if body.get("metadata") is not None and not isinstance(body["metadata"], dict):
            errors.append("metadata: Input should be a valid dictionary")
        stop = body.get("stop_sequences")
        if stop is not None and not isinstance(stop, list):
            errors.append("stop_sequences: Input should be a valid list")
        elif stop is not None:
            errors += [f"stop_sequences.{i}: Input should be a valid string"
                       for i, s in enumerate(stop) if not isinstance(s, str)]
        if lax_bool(body.get("stream")) is None:
            errors.append("stream: Input should be a valid boolean, unable to interpret input")
    if body.get("system") is not None:
        _check_blocks(body["system"], "system", errors)
    if not count_tokens and body.get("temperature") is not None and (err := _lax_float(body["temperature"])):
        errors.append(f"temperature: {err}")
    if body.get("thinking") is not None:
        _check_thinking(body["thinking"], errors)
    if body.get("tool_choice") is not None:
        _check_tool_choice(body["tool_choice"], errors)
    if body.get("tools") is not None:
        _check_tools(body["tools"], errors)
    if not count_tokens:
        if body.get("top_k") is not None and (err := _lax_int(body["top_k"])[1]):
            errors.append(f"top_k: {err}")
        if body.get("top_p") is not None and (err := _lax_float(body["top_p"])):
            errors.append(f"top_p: {err}")
    if errors:
        text = "; ".join(errors)
        raise AnthropicRequestError(text[:500] + "…" if len(text) > 500 else text)
    return max_tokens


# ---- conversion (serving.py's _convert_to_chat_completion_request) -----------------------------


def _is_server_tool(tool: Mapping[str, Any]) -> bool:
    t = tool.get("type")
    return isinstance(t, str) and bool(_SERVER_TOOL.match(t))


def _image_part(source: Any) -> dict[str, Any] | None:
    if not isinstance(source, dict):
        return None
    if source.get("type") == "base64":
        data = source.get("data", "")
        if not data:
            return None
        return {"type": "image_url", "image_url": {"url": f"data:{source.get('media_type', 'image/png')};base64,{data}"}}
    url = source.get("url")
    return {"type": "image_url", "image_url": {"url": url}} if url else None


def _tool_result(content: Any) -> tuple[list[Any], str]:
    """A ``tool_result``'s content as ``tool`` message contents, and as plain text. (SGLang's
    ``tool_reference`` grouping is left out: without references everything is one group.)"""
    if not isinstance(content, list):
        text = str(content) if content else ""
        return [text], text
    parts: list[dict[str, Any]] = []
    texts: list[str] = []
    for item in content:
        if not isinstance(item, dict):
            continue
        if item.get("type") == "text" and item.get("text"):
            texts.append(item["text"])
            parts.append({"type": "text", "text": item["text"]})
        elif item.get("type") == "image" and (img := _image_part(item.get("source"))) is not None:
            parts.append(img)
    if not parts:
        return [""], "\n".join(texts)
    if len(parts) == 1 and parts[0]["type"] == "text":
        return [parts[0]["text"]], "\n".join(texts)
    return [parts], "\n".join(texts)


def _system_text(system: Any) -> str | None:
    if isinstance(system, str):
        return system if system.strip() else None
    parts = [b["text"] for b in system or [] if b.get("type") == "text" and b.get("text")]
    return "\n".join(parts) if parts else None


def _messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    system = _system_text(body.get("system"))
    if system is not None:
        out.append({"role": "system", "content": system})
    # the emulator's template renders a system message anywhere, so inline ones stay in place
    # (SGLang merges them into the first only for templates that cannot)
    for msg in body["messages"]:
        role, content = msg["role"], msg["content"]
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if any(b["type"] == "redacted_thinking" for b in content) and role == "assistant":
            raise AnthropicRequestError("Anthropic redacted_thinking history is not supported")
        parts: list[dict[str, Any]] = []
        calls: list[dict[str, Any]] = []
        for b in content:
            kind = b["type"]
            if kind == "text" and b.get("text") is not None:
                parts.append({"type": "text", "text": b["text"]})
            elif kind == "image" and (img := _image_part(b.get("source"))) is not None:
                parts.append(img)
            elif kind == "tool_use":
                calls.append({"id": b.get("id") or f"call_{uuid.uuid4().hex}", "type": "function",
                              "function": {"name": b.get("name") or "", "arguments": json.dumps(b.get("input") or {})}})
            elif kind == "tool_result":
                contents, text = _tool_result(b.get("content"))
                call_id = b.get("tool_use_id") or b.get("id") or ""
                if role == "user":  # a tool message each, after the text that came before it
                    _flush_user(out, parts)
                    out += [{"role": "tool", "tool_call_id": call_id, "content": c} for c in contents]
                else:
                    parts.append({"type": "text", "text": f"Tool result: {text}"})
            # thinking: a model without a reasoning parser drops earlier thinking (Rule 3)
        m: dict[str, Any] = {"role": role}
        if calls:
            m["tool_calls"] = calls
        if parts:
            m["content"] = parts[0]["text"] if len(parts) == 1 and parts[0]["type"] == "text" else parts
            out.append(m)
        elif calls:
            out.append(m)
        elif role != "user":  # an empty assistant turn keeps its place
            out.append({**m, "content": ""})
    return out


def _flush_user(out: list[dict[str, Any]], parts: list[dict[str, Any]]) -> None:
    if parts:
        out.append({"role": "user", "content": parts[0]["text"] if len(parts) == 1 and parts[0]["type"] == "text"
                    else list(parts)})
        parts.clear()


def _tools(body: Mapping[str, Any]) -> tuple[list[dict[str, Any]], Any]:
    """(OpenAI tools, OpenAI tool_choice or None)."""
    tools: list[dict[str, Any]] = []
    for t in body.get("tools") or []:
        if _is_server_tool(t):  # Anthropic runs these itself: nothing a local model can call
            continue
        schema = t["input_schema"] if "type" in t["input_schema"] else {**t["input_schema"], "type": "object"}
        tools.append({"type": "function", "function": {"name": t["name"], "description": t.get("description") or "",
                                                       "parameters": schema, "strict": bool(t.get("strict", False))}})
    choice = body.get("tool_choice")
    if choice is None:
        return tools, "auto" if tools else None
    kind = choice["type"]
    if kind == "none":
        return tools, "none"
    if tools:
        if kind == "tool":
            name = choice.get("name")
            if not any(t["function"]["name"] == name for t in tools):
                raise AnthropicRequestError(
                    f"tool_choice references tool {name!r} but it is not in the forwarded tools list "
                    "(server-side Anthropic tools cannot be selected)"
                )
            return tools, {"type": "function", "function": {"name": name}}
        return tools, {"auto": "auto", "any": "required"}[kind]
    if kind in ("any", "tool"):
        raise AnthropicRequestError(
            f"tool_choice={kind!r} requires at least one custom tool; all supplied tools were server-side "
            "Anthropic built-ins which the OpenAI-compatible backend cannot invoke"
        )
    return tools, None


def to_chat(body: Mapping[str, Any], *, count_tokens: bool = False) -> dict[str, Any]:
    """The OpenAI chat body SGLang builds from an Anthropic request. Raises
    :class:`AnthropicRequestError` (400 ``invalid_request_error``)."""
    max_tokens = validate(body, count_tokens=count_tokens)
    chat: dict[str, Any] = {
        "messages": _messages(body), "model": body["model"], "max_tokens": max_tokens,
        "stream": bool(lax_bool(body.get("stream"))) and not count_tokens,
    }
    if not count_tokens:
        for src, dst in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"),
                         ("stop_sequences", "stop")):
            if body.get(src) is not None:
                chat[dst] = body[src]
    thinking = body.get("thinking")
    if thinking is not None and thinking["type"] != "disabled":
        raise AnthropicRequestError("Anthropic thinking is not supported for models without a reasoning parser")
    tools, choice = _tools(body)
    if tools:
        chat["tools"] = tools
    if choice is not None:
        chat["tool_choice"] = choice
    return chat
