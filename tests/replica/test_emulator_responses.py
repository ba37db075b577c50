"""The Responses -> chat conversion, the request checks and the response/event builders
(replica/emulator/responses.py), as SGLang 0.5.23's ``serving_responses.py`` and pydantic do them."""

from __future__ import annotations

import base64
import json
import zlib
from typing import Any

import pytest

from replica.emulator.responses import (
    BACKGROUND_NEEDS_STORE,
    STORE_DISABLED,
    EventStream,
    ResponsesRequestError,
    ResponseStore,
    ResponsesValidationError,
    check,
    content_type_error,
    holds_message_events,
    message_item,
    outcome,
    response_doc,
    stores,
    to_chat,
    usage,
    validate,
)

M = "served/model"
FN = {"type": "function", "name": "get_weather", "description": "The weather",
      "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
CALL = [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]


def req(input_: Any = "hi", **kw: Any) -> dict[str, Any]:
    return {"model": M, "input": input_, **kw}


def msgs(body: dict[str, Any]) -> list[dict[str, Any]]:
    return list(to_chat(body)["messages"])


def text_item(role: str, text: str, kind: str = "input_text", **kw: Any) -> dict[str, Any]:
    return {"type": "message", "role": role, "content": [{"type": kind, "text": text}], **kw}


def blob(text: str) -> str:
    return "sglang-reasoning-v1." + base64.urlsafe_b64encode(zlib.compress(text.encode())).decode()


@pytest.mark.parametrize(
    ("body", "messages"),
    [
        (req("hi"), [{"role": "user", "content": "hi"}]),
        (req("hi", instructions="be brief"), [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]),
        (req("hi", instructions=""), [{"role": "user", "content": "hi"}]),  # empty instructions: no system message
        # content parts become chat text parts; a developer message is a labelled system message, kept in place
        (req([text_item("user", "a"), text_item("developer", "b")]),
         [{"role": "user", "content": [{"type": "text", "text": "a"}]},
          {"role": "system", "content": [{"type": "text", "text": "Developer instructions:\nb"}]}]),
        (req([{"role": "developer", "content": "rules"}]),
         [{"role": "system", "content": "Developer instructions:\nrules"}]),
        # a replayed output item: id, status and type go, phase stays
        (req([text_item("assistant", "ok", "output_text", id="msg_1", status="completed", phase="final_answer")]),
         [{"role": "assistant", "content": [{"type": "text", "text": "ok"}], "phase": "final_answer"}]),
        # a function call and its output; arguments kept as sent when they are a JSON object
        (req([{"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Paris"}'},
              {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]),
         [{"role": "assistant", "tool_calls": CALL}, {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]),
        # a tool output given as parts is flattened to its text
        (req([{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_text", "text": "a"},
                                                                          {"type": "input_text", "text": "b"}]}]),
         [{"role": "tool", "tool_call_id": "c", "content": "ab"}]),
        # reasoning then a message then calls of the same (absent) phase: one assistant turn
        (req([{"type": "reasoning", "summary": [{"type": "summary_text", "text": "think"}]},
              {"type": "message", "role": "assistant", "content": "Let me look."},
              {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Paris"}'}]),
         [{"role": "assistant", "reasoning_content": "think", "content": "Let me look.", "tool_calls": CALL}]),
        # ... but a message with a phase and a call without one are two turns (as SGLang renders them)
        (req([{"type": "reasoning", "summary": [{"type": "summary_text", "text": "think"}]},
              text_item("assistant", "Let me look.", "output_text", phase="commentary"),
              {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Paris"}'}]),
         [{"role": "assistant", "reasoning_content": "think", "content": [{"type": "text", "text": "Let me look."}],
           "phase": "commentary"}, {"role": "assistant", "tool_calls": CALL}]),
        # two assistant strings merge with a blank line
        (req([{"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]),
         [{"role": "assistant", "content": "a\n\nb"}]),
        # reasoning: content when the summary is empty; SGLang's own encoded trace; others' blobs drop
        (req([{"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "c"}]}]),
         [{"role": "assistant", "reasoning_content": "c"}]),
        (req([{"type": "reasoning", "summary": [], "encrypted_content": blob("traced")}]),
         [{"role": "assistant", "reasoning_content": "traced"}]),
        (req([{"type": "reasoning", "summary": [], "encrypted_content": "gAAAA-opaque"}, {"role": "user", "content": "u"}]),
         [{"role": "user", "content": "u"}]),
        # arguments that are not a JSON object become {}; an object is dumped compactly
        (req([{"type": "function_call", "call_id": "c", "name": "f", "arguments": "not json"}]),
         [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]),
        (req([{"type": "function_call", "id": "fc_1", "name": "f", "arguments": {"a": 1}}]),
         [{"role": "assistant", "tool_calls": [{"id": "fc_1", "type": "function",
                                                "function": {"name": "f", "arguments": '{"a":1}'}}]}]),
        # a custom tool's call replays through its one-string shim
        (req([{"type": "custom_tool_call", "call_id": "c", "name": "apply_patch", "input": "*** Begin"}]),
         [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
             "name": "apply_patch", "arguments": '{"input": "*** Begin"}'}}]}]),
    ],
)
def test_messages(body: dict[str, Any], messages: list[dict[str, Any]]) -> None:
    assert msgs(body) == messages


def test_chat_body_and_sampling() -> None:
    chat = to_chat(req("hi", max_output_tokens=4, temperature=0, top_p="0.5", top_k=1, stream="yes",
                       request_id="resp_mine", cache_salt="s", prompt_cache_key="ignored", store=False))
    assert chat == {
        "model": M, "messages": [{"role": "user", "content": "hi"}], "stream": True, "rid": "resp_mine",
        # two tokens of headroom: max_new_tokens = max_output_tokens - 2
        "max_tokens": 2, "temperature": 0.0, "top_p": 0.5, "top_k": 1, "tool_choice": "none",
        "parallel_tool_calls": True, "cache_salt": "s",
    }
    plain = to_chat(req("hi"))
    assert "max_tokens" not in plain and plain["stream"] is False
    assert plain["rid"].startswith("resp_") and len(plain["rid"]) == 5 + 32
    assert to_chat(req("hi", max_output_tokens=1))["max_tokens"] == -1  # the engine refuses it


def test_tools_become_chat_functions() -> None:
    custom = {"type": "custom", "name": "apply_patch", "description": "patch",
              "format": {"type": "grammar", "syntax": "lark", "definition": "start: x"}}
    chat = to_chat(req("hi", tools=[FN, custom, {"type": "local_shell"}, {"type": "web_search"}],
                       parallel_tool_calls=False))
    assert chat["tools"] == [
        {"type": "function", "function": {"name": "get_weather", "description": "The weather",
                                          "parameters": FN["parameters"], "strict": False}},
        {"type": "function", "function": {
            "name": "apply_patch", "description": "patch\n\nThe payload must conform to this lark grammar:\nstart: x",
            "parameters": {"type": "object", "properties": {"input": {
                "type": "string", "description": "The freeform text payload for this tool."}},
                "required": ["input"], "additionalProperties": False}, "strict": False}},
    ]
    assert chat["tool_choice"] == "auto" and chat["parallel_tool_calls"] is False
    named = to_chat(req("hi", tools=[FN], tool_choice={"type": "function", "name": "get_weather"}))
    assert named["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert to_chat(req("hi", tools=[{"type": "web_search"}]))["tool_choice"] == "none"


@pytest.mark.parametrize(
    ("body", "held"),
    [
        (req(), False),
        (req(tools=[FN]), True),
        (req(tools=[{"type": "custom", "name": "apply_patch"}]), True),
        (req(tools=[{"type": "web_search"}, {"type": "local_shell"}]), False),  # nothing the model could call
        (req(tools=[FN], tool_choice="none"), False),
        (req(tools=[FN], tool_choice={"type": "web_search"}), True),  # reduced to auto
    ],
)
def test_message_events_held_while_a_tool_call_may_follow(body: dict[str, Any], held: bool) -> None:
    assert holds_message_events(body) is held


@pytest.mark.parametrize(
    ("body", "status", "param", "message"),
    [
        (req(tools=[{"type": "shell"}]), 400, "tools", "Shell tools are not supported by this model"),
        (req(previous_response_id="resp_1"), 400, "previous_response_id", STORE_DISABLED),
        (req(background=True), 400, "background", STORE_DISABLED),
        (req(model="other"), 404, "model", "The model 'other' does not exist"),
        (req(tool_choice="required", tools=[{"type": "web_search"}]), 400, None,
         ('tool_choice="required" requires at least one tool with type="function" or type="custom"; other built-in '
         "tool types cannot be forced.")),
        (req(tools=[FN], tool_choice={"type": "function", "name": "g"}), 400, "tool_choice",
         "Tool 'g' is not declared in tools"),
        (req(stream=True, include=["message.output_text.logprobs"]), 400, "logprobs",
         "logprobs are not supported in streaming mode"),
    ],
)
def test_serving_checks(body: dict[str, Any], status: int, param: str | None, message: str) -> None:
    with pytest.raises(ResponsesRequestError) as e:
        check(body, M)
    assert (e.value.status, e.value.param, str(e.value)) == (status, param, message)


@pytest.mark.parametrize(
    ("body", "status", "param", "message"),
    [
        # with the store on: background needs the response stored (checked before the model)
        (req(background=True, store=False, model="other"), 400, "store", BACKGROUND_NEEDS_STORE),
        (req(background="yes", store=None), 400, "store", BACKGROUND_NEEDS_STORE),
        (req(background=True, tools=[{"type": "shell"}]), 400, "tools", "Shell tools are not supported by this model"),
        (req(previous_response_id="resp_1", model="other"), 404, "model", "The model 'other' does not exist"),
    ],
)
def test_serving_checks_with_the_store(body: dict[str, Any], status: int, param: str | None, message: str) -> None:
    with pytest.raises(ResponsesRequestError) as e:
        check(body, M, store=True)
    assert (e.value.status, e.value.param, str(e.value)) == (status, param, message)


@pytest.mark.parametrize("body", [req(previous_response_id="resp_1"), req(background=True),
                                  req(background=True, store="true", previous_response_id="x"), req(store=False)])
def test_serving_checks_pass_with_the_store(body: dict[str, Any]) -> None:
    check(body, M, store=True)  # the previous id is looked up later (ResponseStore.get)


@pytest.mark.parametrize(("body", "stored"), [(req(), True), (req(store=True), True), (req(store=False), False),
                                              (req(store=None), False), (req(store="no"), False)])
def test_stores(body: dict[str, Any], stored: bool) -> None:
    assert stores(body) is stored


@pytest.mark.parametrize("body", [req(), req(model=None), {"input": "hi"}, req(model=f"{M}:adapter"),
                                  req(tool_choice={"type": "web_search"}), req(include=["message.output_text.logprobs"])])
def test_serving_checks_pass(body: dict[str, Any]) -> None:
    check(body, M)  # no model means "whatever is loaded"; a LoRA-style suffix names the served model


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (req([{"type": "local_shell_call", "call_id": "c"}]), "Unsupported Responses API input item type: 'local_shell_call' None"),
        (req([]), "Cannot apply chat template to an empty conversation. Provide at least one message. None"),
        (req([{"type": "reasoning", "summary": []}]),
         "Cannot apply chat template to an empty conversation. Provide at least one message. None"),
        (req(model=None), ("1 validation error for ChatCompletionRequest\nmodel\n  Input should be a valid string "
         "[type=string_type, input_value=None, input_type=NoneType]\n    For further information visit "
         "https://errors.pydantic.dev/2.14/v/string_type None")),
        (req([{"content": "hi"}]),
         ("2 validation errors for ChatCompletionRequest\n"
         "messages.0.function-after[validate_thinking_parts_role(), ChatCompletionMessageGenericParam].role\n"
         "  Field required [type=missing, input_value={'content': 'hi'}, input_type=dict]\n"
         "    For further information visit https://errors.pydantic.dev/2.14/v/missing\n"
         "messages.0.function-after[validate_thinking_parts_role(), ChatCompletionMessageUserParam].role\n"
         "  Field required [type=missing, input_value={'content': 'hi'}, input_type=dict]\n"
         "    For further information visit https://errors.pydantic.dev/2.14/v/missing None")),
    ],
)
def test_conversion_errors(body: dict[str, Any], message: str) -> None:
    with pytest.raises(ResponsesRequestError) as e:
        to_chat(body)
    assert (e.value.status, e.value.param, str(e.value)) == (400, None, message)


def test_validation_messages_are_fastapis() -> None:
    with pytest.raises(ResponsesValidationError) as e:
        validate({"instructions": "x"})
    err = "{'type': 'missing', 'loc': ('body', 'input'), 'msg': 'Field required', 'input': {'instructions': 'x'}}"
    assert str(e.value) == f"1 validation error:\n  {err}\n\n  Endpoint: POST /v1/responses [{err}]"
    assert content_type_error() == (
        "1 validation error:\n  {'loc': ['header', 'content-type'], 'msg': \"Unsupported Media Type: Only "
        "'application/json' is allowed\", 'type': 'value_error'} [{'loc': ['header', 'content-type'], 'msg': "
        "\"Unsupported Media Type: Only 'application/json' is allowed\", 'type': 'value_error'}]"
    )


@pytest.mark.parametrize(
    ("body", "first"),
    [
        (req(tools=[{"type": "nope"}]), ("{'type': 'literal_error', 'loc': ('body', 'tools', 0, 'type'), 'msg': \"Input "
         "should be 'function', 'web_search', 'web_search_preview', 'code_interpreter', 'file_search', "
         "'image_generation', 'computer_use_preview', 'local_shell', 'shell', 'mcp', 'custom', 'namespace' or "
         "'tool_search'\"")),
        (req(tools=[{"type": "function"}]), ("{'type': 'value_error', 'loc': ('body', 'tools', 0), 'msg': 'Value error, "
         "Function tools must include a name.', 'input': {'type': 'function'}, 'ctx': {'error': ValueError('Function "
         "tools must include a name.')}}")),
        (req(stream="maybe"), ("{'type': 'bool_parsing', 'loc': ('body', 'stream'), 'msg': 'Input should be a valid "
         "boolean, unable to interpret input', 'input': 'maybe'}")),
        (req(max_output_tokens=2.5), ("{'type': 'int_from_float', 'loc': ('body', 'max_output_tokens'), 'msg': 'Input "
         "should be a valid integer, got a number with a fractional part', 'input': 2.5}")),
        (req(model=1), ("{'type': 'string_type', 'loc': ('body', 'model'), 'msg': 'Input should be a valid string', "
         "'input': 1}")),
        (req(include=["nope"]), ("{'type': 'literal_error', 'loc': ('body', 'include', 0), 'msg': \"Input should be "
         "'code_interpreter_call.outputs'")),
        (req(5), ("{'type': 'string_type', 'loc': ('body', 'input', 'str'), 'msg': 'Input should be a valid string', "
         "'input': 5}")),
        (req(reasoning={"effort": "huge"}), "{'type': 'literal_error', 'loc': ('body', 'reasoning', 'effort')"),
    ],
)
def test_validation_errors(body: dict[str, Any], first: str) -> None:
    with pytest.raises(ResponsesValidationError) as e:
        validate(body)
    assert str(e.value).split("\n")[1].startswith("  " + first), str(e.value)


@pytest.mark.parametrize(
    "body",
    [req(), req([]), req(stream="yes", store=0, parallel_tool_calls="false", max_output_tokens="4",
                                temperature="0.5", tools=[FN, {"type": "local_shell"}], include=[
                                    "reasoning.encrypted_content"], reasoning={"effort": "medium", "summary": "auto"},
                                prompt_cache_key="k", text={"verbosity": "low"}, service_tier="auto")],
)
def test_validation_passes(body: dict[str, Any]) -> None:
    validate(body)  # Codex's fields, lax values, unknown keys (prompt_cache_key) ignored


def test_response_doc_echoes_the_request() -> None:
    body = req("hi", temperature=0, top_p=1, max_output_tokens="4", store=False, instructions="i",
               reasoning={"effort": "xhigh"}, tools=[{"type": "web_search", "extra": 1}], metadata={"a": "b"},
               tool_choice={"type": "function", "function": {"name": "f"}}, parallel_tool_calls=None)
    doc = response_doc(body, rid="resp_1", model=M, created=7, output=[message_item("msg_1", "ok")], status="incomplete",
                       usage=usage(10, 4, 2))
    assert list(doc) == [
        "id", "object", "created_at", "model", "output", "status", "usage", "parallel_tool_calls", "tool_choice",
        "tools", "error", "incomplete_details", "instructions", "max_output_tokens", "previous_response_id",
        "reasoning", "store", "temperature", "text", "top_p", "truncation", "user", "metadata",
    ]
    assert doc["output"] == [{"id": "msg_1", "content": [{"annotations": [], "text": "ok", "type": "output_text",
                                                          "logprobs": None}],
                              "role": "assistant", "status": "completed", "type": "message", "phase": "final_answer"}]
    assert doc["usage"] == {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 4, "cache_write_tokens": 0},
                            "output_tokens": 2, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 12}
    assert doc["tools"] == [{"type": "web_search", "name": None, "description": None, "parameters": None,
                             "strict": False, "tools": None, "defer_loading": None, "format": None, "extra": 1}]
    assert (doc["parallel_tool_calls"], doc["tool_choice"]) == (True, {"type": "function", "name": "f"})
    assert doc["incomplete_details"] == {"reason": "max_output_tokens"} and doc["max_output_tokens"] == 4
    # floats as pydantic makes them; an effort the SDK's event types cannot hold is not echoed
    assert json.dumps([doc["temperature"], doc["top_p"]]) == "[0.0, 1.0]"
    assert doc["reasoning"] == {"effort": None, "summary": None} and doc["store"] is False
    assert doc["text"] == {"format": {"type": "text"}} and doc["metadata"] == {"a": "b"}
    empty = response_doc(req("hi", reasoning={}, text={"format": {"type": "text"}, "verbosity": None}), rid="r",
                         model=M, created=0, output=[], status="completed", usage=None)
    assert empty["reasoning"] == {"effort": "medium", "summary": None}  # the param's default
    assert empty["text"] == {"format": {"type": "text"}} and empty["incomplete_details"] is None
    assert response_doc(req("hi"), rid="r", model=M, created=0, output=[], status="in_progress",
                        usage=None)["text"] is None  # nothing written yet: not text-only


@pytest.mark.parametrize(
    ("finish", "status", "error"),
    [("length", "incomplete", None), ("stop", "completed", None),
     ("abort", "failed", {"code": "server_error", "message": "why"})],
)
def test_outcome(finish: str, status: str, error: dict[str, Any] | None) -> None:
    assert outcome(finish, "why") == (status, error)


def test_event_stream_frames_and_numbers() -> None:
    ev = EventStream()
    frames = [ev.lifecycle("response.created", {"id": "resp_1"}), *ev.open_message("msg_1"), ev.delta("msg_1", "ab"),
              *ev.close_message("msg_1", "ab")]
    docs = []
    for i, frame in enumerate(frames):
        head, data, tail = frame.split(b"\n", 2)
        doc = json.loads(data.removeprefix(b"data: "))
        assert tail == b"\n" and head == b"event: " + doc["type"].encode() and doc["sequence_number"] == i
        assert data.removeprefix(b"data: ") == json.dumps(doc, separators=(",", ":")).encode()
        docs.append(doc)
    assert list(docs[0]) == ["type", "response", "sequence_number"]
    assert [d["type"] for d in docs[1:]] == [
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
    ]
    for d in docs[1:]:  # the SDK's field order: alphabetical
        assert list(d) == sorted(d)
    assert docs[1]["item"] == message_item("msg_1", None) and docs[1]["item"]["status"] == "in_progress"
    assert docs[3] == {"content_index": 0, "delta": "ab", "item_id": "msg_1", "logprobs": [], "output_index": 0,
                       "sequence_number": 3, "type": "response.output_text.delta"}
    assert docs[4]["text"] == "ab" and docs[6]["item"] == message_item("msg_1", "ab")


def _answer(store: ResponseStore, body: dict[str, Any], rid: str, text: str | None,
            status: str = "incomplete") -> dict[str, Any]:
    """A response to ``body`` as the server keeps it: begun, then finished with one message."""
    store.begin(rid, body)
    output = [message_item(f"msg_{rid}", text)] if text is not None else []
    doc = response_doc(body, rid=rid, model=M, created=1, output=output, status=status, usage=usage(5, 0, 2))
    store.finish(body, doc)
    return doc


@pytest.mark.parametrize(
    ("response_id", "status", "message"),
    [("resp_nope", 404, "Response with id 'resp_nope' not found."),
     ("nope", 400, "Invalid 'response_id': 'nope'. Expected an ID that begins with 'resp'."),
     ("respnope", 400, "Invalid 'response_id': 'respnope'. Expected an ID that begins with 'resp'."),
     ("resp", 400, "Invalid 'response_id': 'resp'. Expected an ID that begins with 'resp'.")],
)
def test_store_lookup_errors(response_id: str, status: int, message: str) -> None:
    store = ResponseStore()
    _answer(store, req(), "resp_1", "ok")
    for lookup in (store.get, store.cancel):
        with pytest.raises(ResponsesRequestError) as e:
            lookup(response_id)
        assert (e.value.status, e.value.param, str(e.value)) == (status, "response_id", message)


def test_store_keeps_responses_of_any_status_as_answered() -> None:
    store = ResponseStore()
    doc = _answer(store, req(), "resp_1", "ok")
    failed = _answer(store, req(), "resp_2", None, status="failed")
    assert store.get("resp_1") is doc and store.get("resp_2") is failed and len(store) == 2


def test_previous_response_id_builds_the_conversation_sglang_builds() -> None:
    """``_make_request``: this request's instructions, then the stored conversation (each earlier
    turn's input items and output items, exclude_none), then this input; earlier instructions are
    not kept."""
    store = ResponseStore()
    first = req("Q", instructions="be brief")
    _answer(store, first, "resp_1", "A1")
    second = req([text_item("user", "Q2")], previous_response_id="resp_1", instructions="other")
    assert store.input_history(second) == [
        {"role": "user", "content": "Q"},
        {"id": "msg_resp_1", "content": [{"annotations": [], "text": "A1", "type": "output_text"}],
         "role": "assistant", "status": "completed", "type": "message", "phase": "final_answer"},
        text_item("user", "Q2"),
    ]
    assert msgs(dict(store.prompt_body(second))) == [
        {"role": "system", "content": "other"},
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": [{"type": "text", "text": "A1"}], "phase": "final_answer"},
        {"role": "user", "content": [{"type": "text", "text": "Q2"}]},
    ]
    _answer(store, second, "resp_2", "A2")
    third = req("Q3", previous_response_id="resp_2")
    assert msgs(dict(store.prompt_body(third))) == [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": [{"type": "text", "text": "A1"}], "phase": "final_answer"},
        {"role": "user", "content": [{"type": "text", "text": "Q2"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A2"}], "phase": "final_answer"},
        {"role": "user", "content": "Q3"},
    ]
    assert store.prompt_body(req("Q")) == req("Q")  # nothing to continue: the request as it came
    # an empty answer adds no item; the request's own input is all that is new
    _answer(store, req("Q4", previous_response_id="resp_2"), "resp_3", None)
    assert store.input_history(req([], previous_response_id="resp_3"))[-2:] == [
        {"id": "msg_resp_2", "content": [{"annotations": [], "text": "A2", "type": "output_text"}],
         "role": "assistant", "status": "completed", "type": "message", "phase": "final_answer"},
        {"role": "user", "content": "Q4"},
    ]


def test_background_lifecycle_and_cancel() -> None:
    """queued -> (in_progress, set by the run) -> final; a cancel of a queued or running response
    makes it ``cancelled`` for good (its run's end is not kept), of a finished one changes nothing."""
    store = ResponseStore()
    body = req("Q", background=True)
    store.begin("resp_1", body)
    queued = response_doc(body, rid="resp_1", model=M, created=1, output=[], status="queued", usage=None)
    store.queue(queued)
    assert store.get("resp_1") is queued and queued["status"] == "queued"
    # a continuation of a response still running finds its input only
    assert store.input_history(req("more", previous_response_id="resp_1")) == [
        {"role": "user", "content": "Q"}, {"role": "user", "content": "more"}]
    queued["status"] = "in_progress"
    doc, running = store.cancel("resp_1")
    assert doc is queued and running and doc["status"] == "cancelled"
    final = response_doc(body, rid="resp_1", model=M, created=1, output=[message_item("msg_1", "A")],
                         status="completed", usage=usage(5, 0, 1))
    store.finish(body, final)
    store.fail("resp_1")
    assert store.get("resp_1") is queued and queued["status"] == "cancelled" and queued["output"] == []
    assert store.cancel("resp_1") == (queued, False)  # cancelled already: as it is
    assert store.input_history(req("more", previous_response_id="resp_1"))[:-1] == [{"role": "user", "content": "Q"}]

    done = _answer(store, req("Q"), "resp_2", "A")
    assert store.cancel("resp_2") == (done, False) and done["status"] == "incomplete"
    # a failed run marks anything but completed or cancelled (_run_background_request's rule)
    store.fail("resp_2")
    assert done["status"] == "failed"
    completed = _answer(store, req("Q"), "resp_3", "A", status="completed")
    store.fail("resp_3")
    assert completed["status"] == "completed"

    refused = response_doc(body, rid="resp_4", model=M, created=1, output=[], status="in_progress", usage=None)
    store.begin("resp_4", body)
    store.queue(refused)
    store.fail("resp_4")
    assert store.get("resp_4")["status"] == "failed" and refused["usage"] is None
