"""SGLang 0.5.23's OpenAI Responses API (``/v1/responses``) for a non-harmony model, the pure part:
request checks, the conversion to a chat request, and the response and stream-event builders, as
``sglang/srt/entrypoints/openai/serving_responses.py`` and ``protocol.py``'s ``ResponsesRequest``
do them.

Rule 1: SGLang answers a Responses request by building chat messages (``instructions`` first as a
        system message, then the ``input`` items: messages, ``function_call`` -> an assistant
        ``tool_calls`` message, ``function_call_output`` -> a ``tool`` message, ``reasoning`` ->
        ``reasoning_content``, consecutive assistant turns merged) and running its chat template;
        so does the emulator: :func:`to_chat` builds that chat body and the server feeds it to its
        own chat parsing. A Responses request and the equivalent chat request render the same
        prompt and share cache blocks.
Rule 2: the checks run in SGLang's order: pydantic's on the body (:func:`validate`, FastAPI's 400
        ``"Bad Request"``), the serving layer's (:func:`check`: shell tools, the response store,
        the model name, ``tool_choice``), the conversion's (:func:`to_chat`: item types, the chat
        request's own validation, an empty conversation), then the engine's (context and sampling
        values, in the server). Unlike chat, the model must be the served one (404 otherwise).
Rule 3: the response store is off by default, as the engine's: ``previous_response_id``,
        ``background`` and GET / cancel of a stored response are refused as SGLang refuses them
        (400). With it on (``--enable-response-store``) :class:`ResponseStore` keeps what SGLang's
        ``response_store`` and ``msg_store`` keep: every response asked to be stored (``store``,
        true by default) whatever its status, and each one's conversation (the earlier turns' items,
        its input, its output items), which a ``previous_response_id`` continuation puts before its
        own input (:meth:`ResponseStore.prompt_body`). The store is in memory and unbounded, as
        SGLang's.
Rule 4: the emulated model writes text only and has no reasoning or tool-call parser (as the tiny
        real model): the output is one ``message`` item, none for an empty answer. SGLang keeps two
        tokens of headroom (``max_new_tokens = max_output_tokens - 2``): ``max_output_tokens`` 4
        gives 2 output tokens and status ``incomplete``; under 2 is refused by the engine.
Rule 5: bytes are compact JSON. Lifecycle events (``response.created`` ... ``response.failed``)
        are ``{"type","response","sequence_number"}``; the others carry their fields in the OpenAI
        SDK's (alphabetical) order; ``sequence_number`` counts from 0; no ``[DONE]``. ``usage`` is
        OpenAI's: ``input_tokens`` is the whole prompt, cached tokens included. When the model could
        call a tool, SGLang holds a message's events back until the stream ends (it learns the
        message's ``phase`` only then): :func:`holds_message_events`.
"""

from __future__ import annotations

import base64
import json
import uuid
import zlib
from collections.abc import Mapping
from typing import Any

from replica.emulator.anthropic import lax_bool

__all__ = [
    "BACKGROUND_NEEDS_STORE",
    "STORE_DISABLED",
    "EventStream",
    "ResponseStore",
    "ResponsesRequestError",
    "ResponsesValidationError",
    "body_error",
    "chat_tools",
    "check",
    "content_type_error",
    "effective_tool_choice",
    "error_body",
    "holds_message_events",
    "message_item",
    "outcome",
    "response_doc",
    "stores",
    "to_chat",
    "usage",
    "validate",
]

STORE_DISABLED = (
    "Response store is disabled. Stateful Responses require --enable-response-store on a standalone "
    "server; response storage is unavailable in PD mode."
)
BACKGROUND_NEEDS_STORE = "background=true requires store=true."
_ENDPOINT = "POST /v1/responses"
_PYDANTIC_DOCS = "https://errors.pydantic.dev/2.14/v/"
_TOOL_TYPES = (
    "function", "web_search", "web_search_preview", "code_interpreter", "file_search", "image_generation",
    "computer_use_preview", "local_shell", "shell", "mcp", "custom", "namespace", "tool_search",
)
_INCLUDES = (
    "code_interpreter_call.outputs", "computer_call_output.output.image_url", "file_search_call.results",
    "message.input_image.image_url", "message.output_text.logprobs", "reasoning.encrypted_content",
)
_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "ultra", "max")
_ECHOED_EFFORTS = frozenset({"minimal", "low", "medium", "high"})  # what the response may carry back
_CHAT_ROLES = ("system", "assistant", "tool", "function", "developer", "latest_reminder", "root")
_DEVELOPER_LABEL = "Developer instructions:"
_REASONING_STATE = "sglang-reasoning-v1."
_CUSTOM_INPUT_KEY = "input"


class ResponsesValidationError(ValueError):
    """pydantic refused the body: FastAPI's 400 with ``"type": "Bad Request"``; the message is
    FastAPI's text (the error dicts, then the endpoint)."""


class ResponsesRequestError(ValueError):
    """A request SGLang's serving layer refuses before running it: ``{"error": {...}}`` with
    ``invalid_request_error``, this status and ``param``."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: int = 400) -> dict[str, Any]:
    """The Responses routes' error envelope (the ``error`` key nests, unlike the chat routes')."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


# ---- validation (pydantic's, with FastAPI's wording) ---------------------------------------------


def _fastapi_message(errors: list[dict[str, Any]], endpoint: str | None) -> str:
    """``f"{RequestValidationError} {exc.errors()}"`` as SGLang's handler writes it. (A real server
    names its source file and line before the endpoint; the emulator has none to name.)"""
    n = len(errors)
    text = f"{n} validation error{'s' if n != 1 else ''}:\n" + "".join(f"  {e!r}\n" for e in errors)
    if endpoint is not None:
        text += f"\n  Endpoint: {endpoint}"
    return f"{text.rstrip()} {errors!r}"


def content_type_error() -> str:
    """The message of SGLang's ``validate_json_request`` (no endpoint: it is raised by hand)."""
    err = {"loc": ["header", "content-type"], "msg": "Unsupported Media Type: Only 'application/json' is allowed",
           "type": "value_error"}
    return _fastapi_message([err], None)


def body_error(kind: str, loc: tuple[Any, ...], msg: str, value: Any, ctx: dict[str, Any] | None = None) -> str:
    """One error about the body as a whole (empty, not JSON, not an object)."""
    return _fastapi_message([_err(kind, loc, msg, value, ctx)], _ENDPOINT)


def _err(kind: str, loc: tuple[Any, ...], msg: str, value: Any, ctx: dict[str, Any] | None = None) -> dict[str, Any]:
    e: dict[str, Any] = {"type": kind, "loc": ("body", *loc), "msg": msg, "input": value}
    if ctx is not None:
        e["ctx"] = ctx
    return e


def _literal_msg(options: tuple[str, ...]) -> str:
    quoted = [f"'{o}'" for o in options]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " or " + quoted[-1]


def _check_literal(v: Any, loc: tuple[Any, ...], options: tuple[str, ...], errors: list[dict[str, Any]]) -> None:
    if v not in options:
        expected = _literal_msg(options)
        errors.append(_err("literal_error", loc, f"Input should be {expected}", v, {"expected": expected}))


def _check_scalar(v: Any, loc: tuple[Any, ...], kind: str, errors: list[dict[str, Any]]) -> None:
    """pydantic's lax ``bool`` / ``int`` / ``float`` / ``str`` / ``dict`` / ``list`` (None: the
    caller has already let an optional field's null through)."""
    err: tuple[str, str] | None = None
    if kind == "bool" and lax_bool(v) is None:
        err = (("bool_parsing", "Input should be a valid boolean, unable to interpret input")
               if isinstance(v, str | int | float) else ("bool_type", "Input should be a valid boolean"))
    elif kind == "int" and not isinstance(v, int):
        if isinstance(v, float):
            err = None if v.is_integer() else (
                "int_from_float", "Input should be a valid integer, got a number with a fractional part")
        elif isinstance(v, str):
            try:
                int(v.strip())
            except ValueError:
                err = ("int_parsing", "Input should be a valid integer, unable to parse string as an integer")
        else:
            err = ("int_type", "Input should be a valid integer")
    elif kind == "float" and not isinstance(v, int | float):
        if isinstance(v, str):
            try:
                float(v)
            except ValueError:
                err = ("float_parsing", "Input should be a valid number, unable to parse string as a number")
        else:
            err = ("float_type", "Input should be a valid number")
    elif kind == "str" and not isinstance(v, str):
        err = ("string_type", "Input should be a valid string")
    elif kind == "dict" and not isinstance(v, dict):
        err = ("dict_type", "Input should be a valid dictionary")
    elif kind == "list" and not isinstance(v, list):
        err = ("list_type", "Input should be a valid list")
    if err is not None:
        errors.append(_err(err[0], loc, err[1], v))


def _model_type(v: Any, loc: tuple[Any, ...], cls: str, errors: list[dict[str, Any]]) -> bool:
    if isinstance(v, dict):
        return True
    errors.append(_err("model_type", loc, f"Input should be a valid dictionary or instance of {cls}", v,
                       {"class_name": cls}))
    return False


def _check_input(body: Mapping[str, Any], errors: list[dict[str, Any]]) -> None:
    """``Union[str, List[Dict[str, Any]], List[ResponseInputOutputItem]]``, left to right: any list
    of objects passes. (pydantic also reports the SDK item union's failures; left out here.)"""
    if "input" not in body:
        errors.append(_err("missing", ("input",), "Field required", dict(body)))
        return
    v = body["input"]
    if isinstance(v, str) or (isinstance(v, list) and all(isinstance(i, dict) for i in v)):
        return
    errors.append(_err("string_type", ("input", "str"), "Input should be a valid string", v))
    if not isinstance(v, list):
        errors.append(_err("list_type", ("input", "list[dict[str,any]]"), "Input should be a valid list", v))
        return
    errors += [_err("dict_type", ("input", "list[dict[str,any]]", i), "Input should be a valid dictionary", item)
               for i, item in enumerate(v) if not isinstance(item, dict)]


def _check_tools(v: Any, errors: list[dict[str, Any]]) -> None:
    if not isinstance(v, list):
        _check_scalar(v, ("tools",), "list", errors)
        return
    for i, t in enumerate(v):
        if not _model_type(t, ("tools", i), "ResponseTool", errors):
            continue
        n = len(errors)
        if "type" not in t:
            errors.append(_err("missing", ("tools", i, "type"), "Field required", t))
        else:
            _check_literal(t["type"], ("tools", i, "type"), _TOOL_TYPES, errors)
        for name, kind in (("name", "str"), ("description", "str"), ("parameters", "dict"), ("strict", "bool"),
                           ("tools", "list"), ("defer_loading", "bool"), ("format", "dict")):
            if t.get(name) is not None:
                _check_scalar(t[name], ("tools", i, name), kind, errors)
        if "strict" in t and t["strict"] is None:  # strict: bool, not Optional
            errors.append(_err("bool_type", ("tools", i, "strict"), "Input should be a valid boolean", None))
        if len(errors) == n and t["type"] == "function" and not t.get("name"):
            msg = "Function tools must include a name."
            errors.append(_err("value_error", ("tools", i), f"Value error, {msg}", t, {"error": ValueError(msg)}))


def validate(body: Mapping[str, Any]) -> None:
    """``ResponsesRequest``'s fields in their order, for the mistakes clients make. Raises
    :class:`ResponsesValidationError` with every problem found."""
    errors: list[dict[str, Any]] = []

    def opt(name: str, kind: str) -> None:
        if body.get(name) is not None:
            _check_scalar(body[name], (name,), kind, errors)

    opt("background", "bool")
    inc = body.get("include")
    if inc is not None:
        if isinstance(inc, list):
            for i, x in enumerate(inc):
                _check_literal(x, ("include", i), _INCLUDES, errors)
        else:
            _check_scalar(inc, ("include",), "list", errors)
    _check_input(body, errors)
    for name, kind in (("instructions", "str"), ("max_output_tokens", "int"), ("max_tool_calls", "int"),
                       ("metadata", "dict"), ("model", "str"), ("parallel_tool_calls", "bool"),
                       ("previous_response_id", "str")):
        opt(name, kind)
    r = body.get("reasoning")
    if r is not None and _model_type(r, ("reasoning",), "ResponseReasoningParam", errors):
        if r.get("effort") is not None:
            _check_literal(r["effort"], ("reasoning", "effort"), _EFFORTS, errors)
        if r.get("summary") is not None:
            _check_literal(r["summary"], ("reasoning", "summary"), ("auto", "concise", "detailed"), errors)
    if "service_tier" in body:
        _check_literal(body["service_tier"], ("service_tier",), ("auto", "default", "flex", "scale", "priority"),
                       errors)
    for name, kind in (("store", "bool"), ("stream", "bool"), ("temperature", "float")):
        opt(name, kind)
    if body.get("text") is not None:
        _model_type(body["text"], ("text",), "ResponseTextConfig", errors)
    tc = body.get("tool_choice", "auto")
    if not isinstance(tc, dict) and tc not in ("auto", "required", "none"):
        _check_literal(tc, ("tool_choice", "literal['auto','required','none']"), ("auto", "required", "none"),
                       errors)
        errors.append(_err("dict_type", ("tool_choice", "dict[str,any]"), "Input should be a valid dictionary", tc))
    if "tools" in body:
        _check_tools(body["tools"], errors)
    for name, kind in (("top_logprobs", "int"), ("top_p", "float")):
        opt(name, kind)
    if body.get("truncation") is not None:
        _check_literal(body["truncation"], ("truncation",), ("auto", "disabled"), errors)
    for name, kind in (("user", "str"), ("chat_template_kwargs", "dict"), ("request_id", "str"),
                       ("session_id", "str"), ("priority", "int"), ("extra_key", "str"), ("cache_salt", "str")):
        opt(name, kind)
    for name in ("frequency_penalty", "presence_penalty"):  # float, not Optional
        if name in body:
            _check_scalar(body[name], (name,), "float", errors)
    for name, kind in (("top_k", "int"), ("min_p", "float"), ("repetition_penalty", "float")):
        opt(name, kind)
    if errors:
        raise ResponsesValidationError(_fastapi_message(errors, _ENDPOINT))


# ---- the serving layer's checks (create_responses) -----------------------------------------------


def _tools(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    return list(body.get("tools") or [])


def effective_tool_choice(body: Mapping[str, Any]) -> str | dict[str, Any]:
    """``tool_choice`` as the server can honor it: of the object forms only a named ``function`` /
    ``custom`` tool survives, the rest become ``auto``."""
    tc = body.get("tool_choice", "auto")
    if not isinstance(tc, dict):
        return str(tc)
    fn = tc.get("function")
    name = tc.get("name") or (fn.get("name") if isinstance(fn, dict) else None)
    if tc.get("type") in ("function", "custom") and name:
        choice = {"type": tc["type"], "name": name}
        if "namespace" in tc:
            choice["namespace"] = tc["namespace"]
        return choice
    return "auto"


def _served(model: str, served: str) -> bool:
    """The served name, or ``served:adapter`` (SGLang's LoRA form, ``_parse_model_parameter``)."""
    if model == served or ":" not in model:
        return model == served
    base = served if model.startswith(f"{served}:") else model.split(":", 1)[0]
    return base.strip() == served


def stores(body: Mapping[str, Any]) -> bool:
    """Whether the response is to be kept (``store``: true when absent, a null is false)."""
    return bool(lax_bool(body.get("store", True)))


def check(body: Mapping[str, Any], served_model: str, *, store: bool = False) -> None:
    """``create_responses``' checks before it builds the prompt, in its order; ``store``: the
    server keeps responses (``--enable-response-store``). Raises :class:`ResponsesRequestError`.
    (A ``previous_response_id`` is looked up after these: :meth:`ResponseStore.get`.)"""
    tools = _tools(body)
    if any(t.get("type") == "shell" for t in tools):
        raise ResponsesRequestError("Shell tools are not supported by this model", param="tools")
    background = lax_bool(body.get("background"))
    if not store and body.get("previous_response_id") is not None:
        raise ResponsesRequestError(STORE_DISABLED, param="previous_response_id")
    if not store and background:
        raise ResponsesRequestError(STORE_DISABLED, param="background")
    if background and not stores(body):
        raise ResponsesRequestError(BACKGROUND_NEEDS_STORE, param="store")
    model = body.get("model")
    if model is not None and not _served(model, served_model):
        raise ResponsesRequestError(f"The model '{model}' does not exist", status=404, param="model")
    callable_tools = [t for t in tools if t.get("type") in ("function", "custom")]
    if body.get("tool_choice") == "required" and not callable_tools:
        raise ResponsesRequestError(
            'tool_choice="required" requires at least one tool with type="function" or type="custom"; '
            "other built-in tool types cannot be forced."
        )
    choice = effective_tool_choice(body)
    if isinstance(choice, dict) and not any(t.get("name") == choice["name"] for t in callable_tools):
        raise ResponsesRequestError(f"Tool {choice['name']!r} is not declared in tools", param="tool_choice")
    if lax_bool(body.get("stream")) and "message.output_text.logprobs" in (body.get("include") or []):
        raise ResponsesRequestError("logprobs are not supported in streaming mode", param="logprobs")


# ---- conversion (_construct_input_messages and friends) ------------------------------------------


def _label_developer(content: Any) -> Any:
    if isinstance(content, str):
        return f"{_DEVELOPER_LABEL}\n{content}"
    if isinstance(content, list):
        for i, part in enumerate(content):
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                return [*content[:i], {**part, "text": f"{_DEVELOPER_LABEL}\n{part['text']}"}, *content[i + 1 :]]
        return [{"type": "input_text", "text": _DEVELOPER_LABEL}, *content]
    return content


def _chat_part(part: Any) -> Any:
    """``_normalize_response_content_part_for_chat``: text parts become chat ``text`` parts, images
    ``image_url`` parts; anything else goes as it came."""
    if not isinstance(part, dict):
        return part
    kind = part.get("type")
    if kind in ("input_text", "output_text"):
        return {"type": "text", "text": part.get("text", "")}
    if kind == "input_image":
        url = part.get("image_url")
        obj = dict(url) if isinstance(url, dict) else {"url": url}
        if not obj.get("detail"):
            obj["detail"] = part.get("detail") or "auto"
        return {"type": "image_url", "image_url": obj}
    return part


def _decode_reasoning(blob: Any) -> str | None:
    """SGLang's own ``encrypted_content`` (an encoded trace, not a secret); others' blobs are opaque."""
    if not isinstance(blob, str) or not blob.startswith(_REASONING_STATE):
        return None
    try:
        return zlib.decompress(base64.urlsafe_b64decode(blob[len(_REASONING_STATE) :])).decode("utf-8")
    except (ValueError, zlib.error, UnicodeDecodeError):
        return None


def _call_message(item: Mapping[str, Any], name: Any, arguments: str) -> dict[str, Any]:
    return {"role": "assistant", "tool_calls": [{"id": item.get("call_id") or item.get("id"), "type": "function",
                                                 "function": {"name": name, "arguments": arguments}}]}


def _call_arguments(raw: Any) -> str:
    """A ``function_call``'s arguments as a JSON-object string (anything else is ``{}``)."""
    if isinstance(raw, dict):
        return json.dumps(raw, separators=(",", ":"), ensure_ascii=False)
    if isinstance(raw, str) and raw:
        try:
            parsed = json.loads(raw)
        except ValueError:
            return "{}"
        return raw if isinstance(parsed, dict) else "{}"
    return "{}"


def _texts(parts: Any) -> list[str]:
    return [p["text"] for p in parts or [] if isinstance(p, dict) and p.get("text")]


def _chat_message(item: dict[str, Any]) -> dict[str, Any] | None:
    """``_normalize_response_message_for_chat``: one input item as a chat message (None: dropped)."""
    if isinstance(item.get("id"), str) and item.get("content") is not None:  # an output item replayed
        item = {k: v for k, v in item.items() if k != "id"}
    if item.get("role") == "developer":  # templates know no developer: a labelled system message
        item = {**item, "role": "system", "content": _label_developer(item.get("content"))}
    kind = item.get("type")
    if kind == "function_call":
        return _call_message(item, item.get("name"), _call_arguments(item.get("arguments")))
    if kind == "custom_tool_call":
        payload = json.dumps({_CUSTOM_INPUT_KEY: item.get("input") or ""}, ensure_ascii=False)
        return _call_message(item, item.get("name"), payload)
    if kind in ("function_call_output", "custom_tool_call_output"):
        out = item.get("output", "")
        if isinstance(out, list):
            out = "".join(p.get("text", "") for p in out if isinstance(p, dict))
        return {"role": "tool", "tool_call_id": item.get("call_id"), "content": out}
    if kind == "reasoning":  # the summary, else the content, else SGLang's own encoded trace
        texts = _texts(item.get("summary")) or _texts(item.get("content"))
        if not texts and (restored := _decode_reasoning(item.get("encrypted_content"))):
            texts = [restored]
        return {"role": "assistant", "reasoning_content": "\n".join(texts)} if texts else None
    if kind not in (None, "message"):
        raise ResponsesRequestError(f"Unsupported Responses API input item type: {kind!r} None")
    content = item.get("content")
    if isinstance(content, list):
        item = {**item, "content": [_chat_part(p) for p in content]}
    return {k: v for k, v in item.items() if v is not None and k not in ("id", "status", "type")}


def _as_parts(c: Any) -> list[Any]:
    if isinstance(c, list):
        return list(c)
    return [{"type": "text", "text": c}] if isinstance(c, str) and c else []


def _merge_assistant_turns(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``_merge_consecutive_assistant_messages``: one Responses turn is several items (message,
    function calls); consecutive assistant messages of the same ``phase`` (or after a bare
    reasoning one) become one chat message."""
    merged: list[dict[str, Any]] = []
    for msg in messages:
        prev = merged[-1] if merged else None
        if not (msg.get("role") == "assistant" and prev is not None and prev.get("role") == "assistant"
                and (prev.get("phase") == msg.get("phase") or set(prev) == {"role", "reasoning_content"})):
            merged.append(msg)
            continue
        prev = merged[-1] = dict(prev)
        if msg.get("phase") is not None:
            prev["phase"] = msg["phase"]
        new = msg.get("content")
        if new is not None and new != "":
            old = prev.get("content")
            if old is None or old == "":
                prev["content"] = new
            elif isinstance(old, str) and isinstance(new, str):
                prev["content"] = old + "\n\n" + new
            else:
                prev["content"] = _as_parts(old) + _as_parts(new)
        if msg.get("tool_calls"):
            prev["tool_calls"] = list(prev.get("tool_calls") or []) + list(msg["tool_calls"])
        if msg.get("reasoning_content"):
            old_r = prev.get("reasoning_content")
            prev["reasoning_content"] = f"{old_r}\n{msg['reasoning_content']}" if old_r else msg["reasoning_content"]
    return merged


def _messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if body.get("instructions"):
        out.append({"role": "system", "content": body["instructions"]})
    items = body["input"]
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    for item in items:
        if (m := _chat_message(item)) is not None:
            out.append(m)
    # the emulator's template renders a system message anywhere (as the tiny real model's does), so
    # developer messages stay where they are; SGLang coalesces them only for templates that cannot
    return _merge_assistant_turns(out)


def _as_int(v: Any) -> int:
    """A value :func:`validate` let through as an ``int`` (lax: ``4.0`` and ``"4"`` are 4)."""
    return int(v.strip()) if isinstance(v, str) else int(v)


def _pydantic_repr(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 50 else r[:25] + "..." + r[-24:]


def _pydantic_error(loc: str, msg: str, kind: str, value: Any) -> list[str]:
    """One error of a ``ValidationError``'s text (the input truncated as pydantic-core does)."""
    return [loc, f"  {msg} [type={kind}, input_value={_pydantic_repr(value)}, input_type={type(value).__name__}]",
            f"    For further information visit {_PYDANTIC_DOCS}{kind}"]


def _chat_request_errors(messages: list[dict[str, Any]], model: Any) -> None:
    """``ChatCompletionRequest``'s validation of what the conversion built: each message's role
    (its union reports both variants) and the model."""
    lines: list[str] = []
    for i, m in enumerate(messages):
        role = m.get("role")
        if role == "user" or (isinstance(role, str) and role.lower() in _CHAT_ROLES):
            continue
        at = f"messages.{i}.function-after[validate_thinking_parts_role(), ChatCompletionMessage{{}}Param].role"
        if role is None:
            lines += _pydantic_error(at.format("Generic"), "Field required", "missing", m)
            lines += _pydantic_error(at.format("User"), "Field required", "missing", m)
            continue
        roles = ", ".join(f"'{r}'" for r in _CHAT_ROLES)
        lines += _pydantic_error(at.format("Generic"), f"Value error, 'role' must be one of {roles} (case-insensitive).",
                                 "value_error", role)
        lines += _pydantic_error(at.format("User"), "Input should be 'user'", "literal_error", role)
    if not isinstance(model, str):
        lines += _pydantic_error("model", "Input should be a valid string", "string_type", model)
    if lines:
        n = len(lines) // 3
        text = "\n".join(lines)
        raise ResponsesRequestError(f"{n} validation error{'s' if n != 1 else ''} for ChatCompletionRequest\n{text} None")


def _custom_tool_description(description: Any, fmt: Any) -> str | None:
    parts = [description] if description else []
    if isinstance(fmt, dict) and fmt.get("type") == "grammar":
        parts.append(f"The payload must conform to this {fmt.get('syntax') or 'lark'} grammar:\n"
                     f"{fmt.get('definition') or ''}")
    return "\n\n".join(parts) or None


_CUSTOM_TOOL_PARAMETERS = {
    "type": "object",
    "properties": {_CUSTOM_INPUT_KEY: {"type": "string", "description": "The freeform text payload for this tool."}},
    "required": [_CUSTOM_INPUT_KEY],
    "additionalProperties": False,
}


def chat_tools(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """``_response_tools_to_chat_tools``: function tools as chat functions, a ``custom`` tool as a
    function taking one string; built-in tools (web search, local shell ...) have no chat form."""
    out: list[dict[str, Any]] = []
    for t in _tools(body):
        if t.get("type") == "function":
            description, parameters = t.get("description"), t.get("parameters")
        elif t.get("type") == "custom" and t.get("name"):
            description = _custom_tool_description(t.get("description"), t.get("format"))
            parameters = _CUSTOM_TOOL_PARAMETERS
        else:
            continue
        fn: dict[str, Any] = {"name": t["name"]}
        if description is not None:
            fn["description"] = description
        if parameters is not None:
            fn["parameters"] = parameters
        fn["strict"] = bool(lax_bool(t.get("strict")))
        out.append({"type": "function", "function": fn})
    return out


def holds_message_events(body: Mapping[str, Any]) -> bool:
    """Whether a stream's message events wait for its end (``responses_stream_generator_non_harmony``
    buffers them until a tool call or the terminal event decides the ``phase``): whenever a function
    or custom tool is offered and ``tool_choice`` is not ``none``. Built-in tools alone stream live."""
    return bool(chat_tools(body)) and effective_tool_choice(body) != "none"


def to_chat(body: Mapping[str, Any]) -> dict[str, Any]:
    """The chat body SGLang's ``_make_request`` builds and runs for a validated, checked request,
    plus what the emulator's chat parsing reads (``rid``, the cache namespace). ``max_tokens`` is
    the engine's ``max_new_tokens`` (Rule 4). Raises :class:`ResponsesRequestError`."""
    messages = _messages(body)
    _chat_request_errors(messages, body.get("model"))
    if not messages:  # the chat template's own refusal, with SGLang's " {e.__cause__}" after it
        raise ResponsesRequestError(
            "Cannot apply chat template to an empty conversation. Provide at least one message. None")
    rid = body.get("request_id")
    chat: dict[str, Any] = {
        "model": body["model"], "messages": messages, "stream": bool(lax_bool(body.get("stream"))),
        "rid": rid if isinstance(rid, str) and rid else f"resp_{uuid.uuid4().hex}",
    }
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = _as_int(body["max_output_tokens"]) - 2
    for key in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty"):
        if body.get(key) is not None:
            chat[key] = float(body[key])
    if body.get("top_k") is not None:
        chat["top_k"] = _as_int(body["top_k"])
    if body.get("stop") is not None:
        chat["stop"] = body["stop"]
    tools = chat_tools(body)
    if tools:
        chat["tools"] = tools
        choice = effective_tool_choice(body)
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}} if isinstance(
            choice, dict) else choice
    else:
        chat["tool_choice"] = "none"
    ptc = lax_bool(body.get("parallel_tool_calls", True))
    chat["parallel_tool_calls"] = True if body.get("parallel_tool_calls") is None else bool(ptc)
    for key in ("session_id", "cache_salt", "extra_key"):
        if isinstance(body.get(key), str):
            chat[key] = body[key]
    return chat


# ---- responses and events ------------------------------------------------------------------------


def usage(prompt: int, cached: int, output: int) -> dict[str, Any]:
    """OpenAI's Responses usage: the whole prompt is ``input_tokens``, its cached part in the details
    (SGLang reports it whatever ``--enable-cache-report`` says)."""
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + output,
    }


def outcome(finish_reason: str, message: str | None = None) -> tuple[str, dict[str, Any] | None]:
    """(status, error) for an engine finish reason: ``length`` is ``incomplete``, an abort ``failed``."""
    if finish_reason == "length":
        return "incomplete", None
    if finish_reason in ("abort", "error"):
        return "failed", {"code": "server_error", "message": message or "Generation aborted"}
    return "completed", None


def _output_text(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}


def message_item(item_id: str, text: str | None, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The assistant's ``message`` output item; ``text`` None: the item as it opens (no content yet)."""
    return {
        "id": item_id,
        "content": [] if text is None else [_output_text(text, logprobs)],
        "role": "assistant",
        "status": "in_progress" if text is None else "completed",
        "type": "message",
        "phase": "final_answer",
    }


def _tool_echo(t: Mapping[str, Any]) -> dict[str, Any]:
    """A ``ResponseTool`` as pydantic dumps it: its fields, then any extra ones as they came."""
    fields = ("type", "name", "description", "parameters", "strict", "tools", "defer_loading", "format")
    out = {k: t.get(k) for k in fields}
    out["strict"] = bool(lax_bool(t.get("strict")))
    return out | {k: v for k, v in t.items() if k not in fields}


def _drop_none(d: dict[str, Any]) -> dict[str, Any]:
    """pydantic's ``exclude_none``, all the way down."""
    return {k: _drop_none(v) if isinstance(v, dict) else v for k, v in d.items() if v is not None}


def _float(v: Any) -> float | None:
    return None if v is None else float(v)


def response_doc(
    body: Mapping[str, Any], *, rid: str, model: str, created: int, output: list[dict[str, Any]], status: str,
    usage: dict[str, Any] | None, error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``ResponsesResponse.from_request`` dumped: the request's settings echoed beside the output."""
    text = body.get("text")
    if isinstance(text, dict):
        text = _drop_none(text)
    elif output:  # a text-only answer says so
        text = {"format": {"type": "text"}}
    reasoning = body.get("reasoning")
    effort = reasoning.get("effort", "medium") if isinstance(reasoning, dict) else None
    mot = body.get("max_output_tokens")
    store = body.get("store", True)
    return {
        "id": rid, "object": "response", "created_at": created, "model": model, "output": output, "status": status,
        "usage": usage,
        "parallel_tool_calls": True if body.get("parallel_tool_calls") is None
        else bool(lax_bool(body["parallel_tool_calls"])),
        "tool_choice": effective_tool_choice(body),
        "tools": [_tool_echo(t) for t in _tools(body)],
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.get("instructions"),
        "max_output_tokens": None if mot is None else _as_int(mot),
        "previous_response_id": body.get("previous_response_id"),
        "reasoning": {"effort": effort if effort in _ECHOED_EFFORTS else None, "summary": None},
        "store": None if store is None else bool(lax_bool(store)),
        "temperature": _float(body.get("temperature")),
        "text": text,
        "top_p": _float(body.get("top_p")),
        "truncation": body.get("truncation", "disabled"),
        "user": body.get("user"),
        "metadata": body.get("metadata") or {},
    }


def _frame(type_: str, payload: Mapping[str, Any]) -> bytes:
    data = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    return f"event: {type_}\ndata: {data}\n\n".encode()


class EventStream:
    """One response's SSE events, numbered from 0 as they are framed. The emulated answer is one
    message item (output index 0) with one text part (content index 0)."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def _next(self) -> int:
        n = self.sequence_number
        self.sequence_number += 1
        return n

    def lifecycle(self, type_: str, response: dict[str, Any]) -> bytes:
        """``response.created`` / ``in_progress`` / ``completed`` / ``incomplete`` / ``failed``."""
        return _frame(type_, {"type": type_, "response": response, "sequence_number": self._next()})

    def event(self, type_: str, **fields: Any) -> bytes:
        """An item or part event: its fields in the SDK's alphabetical order."""
        payload = {**fields, "sequence_number": self._next(), "type": type_}
        return _frame(type_, dict(sorted(payload.items())))

    def open_message(self, item_id: str) -> list[bytes]:
        return [
            self.event("response.output_item.added", item=message_item(item_id, None), output_index=0),
            self.event("response.content_part.added", content_index=0, item_id=item_id, output_index=0,
                       part=_output_text("")),
        ]

    def delta(self, item_id: str, text: str) -> bytes:
        return self.event("response.output_text.delta", content_index=0, delta=text, item_id=item_id, logprobs=[],
                          output_index=0)

    def close_message(self, item_id: str, text: str) -> list[bytes]:
        return [
            self.event("response.output_text.done", content_index=0, item_id=item_id, logprobs=[], output_index=0,
                       text=text),
            self.event("response.content_part.done", content_index=0, item_id=item_id, output_index=0,
                       part=_output_text(text)),
            self.event("response.output_item.done", item=message_item(item_id, text), output_index=0),
        ]


# ---- the response store (--enable-response-store) ------------------------------------------------


def _stored_item(item: Mapping[str, Any]) -> dict[str, Any]:
    """An output item as SGLang keeps it in a conversation (``model_dump(exclude_none=True)``)."""
    out = {k: v for k, v in item.items() if v is not None}
    if isinstance(out.get("content"), list):
        out["content"] = [{k: v for k, v in p.items() if v is not None} if isinstance(p, dict) else p
                          for p in out["content"]]
    return out


class ResponseStore:
    """SGLang's ``response_store`` (id -> the response, the very object GET and cancel answer and
    a background run updates in place) and ``msg_store`` (id -> the conversation up to and with
    that response, as Responses items). Pure: the server drives it (Rule 3)."""

    def __init__(self) -> None:
        self._responses: dict[str, dict[str, Any]] = {}
        self._items: dict[str, list[Any]] = {}

    def __len__(self) -> int:
        return len(self._responses)

    def get(self, response_id: str) -> dict[str, Any]:
        """The stored response (``retrieve_responses``; a ``previous_response_id`` too). Raises
        :class:`ResponsesRequestError`: 400 for an id not starting ``resp_``, 404 for an unknown one."""
        if not response_id.startswith("resp_"):
            raise ResponsesRequestError(
                f"Invalid 'response_id': '{response_id}'. Expected an ID that begins with 'resp'.",
                param="response_id",
            )
        doc = self._responses.get(response_id)
        if doc is None:
            raise ResponsesRequestError(f"Response with id '{response_id}' not found.", status=404,
                                        param="response_id")
        return doc

    def input_history(self, body: Mapping[str, Any]) -> list[Any]:
        """``_response_input_history``: the previous response's conversation (when continuing one),
        then this request's input as items."""
        prev = body.get("previous_response_id")
        history = list(self._items[prev]) if prev is not None else []
        if isinstance(body["input"], str):
            history.append({"role": "user", "content": body["input"]})
        else:
            history.extend(body["input"])
        return history

    def prompt_body(self, body: Mapping[str, Any]) -> Mapping[str, Any]:
        """The request whose conversion gives the prompt SGLang's ``_make_request`` builds: the
        stored conversation before the input (this request's ``instructions`` first, as always;
        the earlier turns' are not kept). ``previous_response_id`` must have passed :meth:`get`."""
        if body.get("previous_response_id") is None:
            return body
        return {**body, "input": self.input_history(body)}

    def begin(self, response_id: str, body: Mapping[str, Any]) -> None:
        """A request to be stored has been converted: its conversation so far is kept (what a
        continuation of it finds while it is still queued or running)."""
        self._items[response_id] = self.input_history(body)

    def queue(self, doc: dict[str, Any]) -> None:
        """A background request's ``queued`` response, kept at once."""
        self._responses[doc["id"]] = doc

    def finish(self, body: Mapping[str, Any], doc: dict[str, Any]) -> None:
        """A response has its final form: kept with its conversation (its output items after the
        input), unless a cancel came first."""
        stored = self._responses.get(doc["id"])
        if stored is not None and stored["status"] == "cancelled":
            return
        self._responses[doc["id"]] = doc
        self._items[doc["id"]] = self.input_history(body) + [_stored_item(i) for i in doc["output"]]

    def fail(self, response_id: str) -> None:
        """A background run ended in an error: its response (still without output) is ``failed``."""
        doc = self._responses[response_id]
        if doc["status"] not in ("completed", "cancelled"):
            doc["status"] = "failed"

    def cancel(self, response_id: str) -> tuple[dict[str, Any], bool]:
        """``cancel_responses``: (the response, whether it was queued or running and is now
        ``cancelled``: its run must be aborted). A finished one is returned as it is. Raises as
        :meth:`get` does."""
        doc = self.get(response_id)
        if doc["status"] not in ("queued", "in_progress"):
            return doc, False
        doc["status"] = "cancelled"
        return doc, True
