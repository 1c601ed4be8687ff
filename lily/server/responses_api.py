"""The Responses API (POST /v1/responses) over the chat machinery.

A Responses request becomes a chat request (instructions -> system message, function_call items ->
an assistant message's tool_calls, function_call_output -> tool messages, a reasoning item -> the
reasoning_content of the assistant turn it opens: the template shows it where it shows a chat turn's, after
the last user message, as inside a tool loop), so the prompt, sampling and output parsing are the chat
endpoint's.
`ResponseAssembler` turns the parsed output (reasoning, text, tool calls) into output items, and into
the stream's typed events (response.created ... response.completed) as it arrives.
"""

from __future__ import annotations

import copy
import json
import time
import uuid

from pydantic import ValidationError

from lily.server.chat_parsing import ParsedDelta, ParsedToolCall
from lily.server.errors import APIError
from lily.server.protocol import (ChatCompletionRequest, RefusalPart, ResponsesFunctionCall, ResponsesFunctionOutput,
                                  ResponsesMessage, ResponsesNamedTool, ResponsesReasoning, ResponsesRequest)
from lily.server.structured import holds_strictly


def tool_strict(tool) -> bool:
    """A Responses function tool's strict: what it says, or, left out or null, strict where the call grammar can
    hold its parameters (structured.holds_strictly)."""
    return tool.strict if tool.strict is not None else holds_strictly(tool.parameters)


def _text(content) -> str:
    """A message's text: its parts joined, a refusal part's refusal among them (as chat reads an assistant's)."""
    if isinstance(content, str):
        return content
    return "".join(p.refusal if isinstance(p, RefusalPart) else p.text for p in content)


def _json_object(text: str) -> bool:
    try:
        return not text.strip() or isinstance(json.loads(text), dict)
    except ValueError:
        return False


def _reasoning_text(item: ResponsesReasoning) -> str:
    """A reasoning item's text: its content's reasoning_text parts (one text in pieces), else its summary's parts
    (paragraphs)."""
    return "".join(p.text for p in item.content or []) or "\n\n".join(p.text for p in item.summary or [])


def chat_request_from(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that renders the same prompt."""
    if body.include and "message.output_text.logprobs" in body.include:
        raise APIError(400, "include: message.output_text.logprobs is not supported in the Responses API; use "
                       "/v1/chat/completions with logprobs", param="include")
    messages: list[dict] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    items = [ResponsesMessage(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    opened: dict | None = None  # the assistant turn a reasoning item opened, until its text or calls come
    for i, item in enumerate(items):
        if isinstance(item, ResponsesReasoning):
            text = _reasoning_text(item)
            if text and opened is None:  # (an encrypted or empty item has nothing to show)
                opened = {"role": "assistant", "content": "", "reasoning_content": text}
                messages.append(opened)
            elif text:
                opened["reasoning_content"] += "\n\n" + text
            continue
        if isinstance(item, ResponsesMessage) and item.role == "assistant" and opened is not None:
            opened["content"] = _text(item.content)
        elif isinstance(item, ResponsesMessage):
            messages.append({"role": item.role, "content": _text(item.content)})
        elif isinstance(item, ResponsesFunctionCall):
            if not _json_object(item.arguments):
                raise APIError(400, f"input[{i}].arguments: must be a JSON object in a string",
                               param=f"input[{i}].arguments")
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if messages and messages[-1]["role"] == "assistant":  # calls after (or beside) its text or reasoning
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, ResponsesFunctionOutput):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
        opened = None  # (reasoning that nothing of its turn followed, a turn cut short, stays a turn of its own)
    if not messages:
        raise APIError(400, "input: holds no message", param="input")
    chat: dict = {"model": body.model, "messages": messages}
    for name, value in (("max_tokens", body.max_output_tokens), ("temperature", body.temperature),
                        ("top_p", body.top_p), ("seed", body.seed), ("prompt_cache_key", body.prompt_cache_key)):
        if value is not None:  # sampling and limits: the chat request's own fields
            chat[name] = value
    if body.tools:
        chat["tools"] = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
                         for t in body.tools]
    if body.parallel_tool_calls is not None:
        chat["parallel_tool_calls"] = body.parallel_tool_calls
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type == "json_schema":  # the chat API nests the schema one level down
        chat["response_format"] = {"type": "json_schema", "json_schema": fmt.model_dump(
            by_alias=True, exclude_none=True, exclude={"type"})}
    elif fmt is not None:
        chat["response_format"] = {"type": fmt.type}
    if isinstance(body.tool_choice, ResponsesNamedTool):
        chat["tool_choice"] = {"type": "function", "function": {"name": body.tool_choice.name}}
    elif body.tool_choice is not None:
        chat["tool_choice"] = body.tool_choice
    if body.reasoning is not None and body.reasoning.effort is not None:
        chat["reasoning_effort"] = body.reasoning.effort
    try:
        request = ChatCompletionRequest.model_validate(chat)
    except ValidationError as e:  # what the chat request checks beyond the Responses schema
        first = e.errors()[0]
        raise APIError(400, f"input: {first['msg']}", param="input") from None
    for tool, sent in zip(request.tools or [], body.tools or []):
        # (strict left out: decided here, and kept out of the prompt, which shows the tool as it was sent)
        tool.function._strict_default = tool_strict(sent)
    return request


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class ResponseAssembler:
    """Output items from parsed deltas, and the stream events that announce them. Each method returns
    the events it made (a non-streamed response ignores them); items in events are copies, since the
    open item keeps growing."""

    def __init__(self, body: ResponsesRequest, model_name: str, sampling=None,
                 chat: ChatCompletionRequest | None = None):
        # each tool's strict as applied: the chat request's (chat_request_from decided it once), else decided here
        strict = ([t.function.applied_strict for t in chat.tools or []] if chat is not None
                  else [tool_strict(t) for t in body.tools or []])
        self.response = {
            "id": _id("resp"), "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "model": model_name, "output": [], "error": None, "incomplete_details": None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "parallel_tool_calls": body.parallel_tool_calls is not False, "previous_response_id": None,
            "reasoning": {"effort": body.reasoning.effort if body.reasoning else None, "summary": None},
            # what it samples with (lily.engine.sampling.SamplingParams: the request's own or the server's
            # defaults), as vLLM reports them
            "temperature": (sampling.temperature if sampling is not None else
                            1.0 if body.temperature is None else body.temperature),
            "top_p": sampling.top_p if sampling is not None else 1.0 if body.top_p is None else body.top_p,
            "text": {"format": (body.text.format.model_dump(by_alias=True, exclude_none=True)
                                if body.text is not None and body.text.format is not None else {"type": "text"}),
                     "verbosity": body.text.verbosity if body.text is not None else None},
            "tool_choice": (body.tool_choice.model_dump() if isinstance(body.tool_choice, ResponsesNamedTool)
                            else body.tool_choice or "auto"),
            "tools": [{**t.model_dump(exclude_none=True), "strict": applied}
                      for t, applied in zip(body.tools or [], strict)],
            "truncation": body.truncation or "disabled",
            "usage": None, "metadata": body.metadata or {}, "store": False,
            "user": body.user, "safety_identifier": body.safety_identifier, "prompt_cache_key": body.prompt_cache_key,
            "service_tier": "default"}  # (one way of serving: whatever tier was asked for)
        self._seq = 0
        self._open: dict | None = None  # the reasoning or message item still receiving text

    @property
    def output(self) -> list[dict]:
        return self.response["output"]

    def _event(self, kind: str, **fields) -> dict:
        ev = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return ev

    def _snapshot(self) -> dict:
        return copy.deepcopy(self.response)

    def start(self) -> list[dict]:
        return [self._event("response.created", response=self._snapshot()),
                self._event("response.in_progress", response=self._snapshot())]

    def feed(self, d: ParsedDelta) -> list[dict]:
        events = []
        if d.reasoning:
            events += self._append("reasoning", d.reasoning)
        if d.content:
            events += self._append("message", d.content)
        for call in d.tool_calls:
            events += self._tool_call(call)
        return events

    def _append(self, kind: str, text: str) -> list[dict]:
        events = []
        if self._open is None or self._open["type"] != kind:
            events += self._close("completed")
            if kind == "reasoning":
                item = {"id": _id("rs"), "type": "reasoning", "summary": [], "status": "in_progress",
                        "content": [{"type": "reasoning_text", "text": ""}]}
            else:
                item = {"id": _id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                        "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}
            self.output.append(item)
            self._open = item
            index = len(self.output) - 1
            part = {**item["content"][0]}
            events += [self._event("response.output_item.added", output_index=index,
                                   item={**item, "content": []}),
                       self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                   content_index=0, part=part)]
        item, index = self._open, len(self.output) - 1
        item["content"][0]["text"] += text
        delta = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        events.append(self._event(delta, item_id=item["id"], output_index=index, content_index=0, delta=text,
                                  **extra))
        return events

    def _close(self, status: str) -> list[dict]:
        item, self._open = self._open, None
        if item is None:
            return []
        index = self.output.index(item)
        item["status"] = status
        part = copy.deepcopy(item["content"][0])
        if item["type"] == "reasoning":
            done = self._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                               content_index=0, text=part["text"])
        else:
            done = self._event("response.output_text.done", item_id=item["id"], output_index=index,
                               content_index=0, text=part["text"], logprobs=[])
        return [done,
                self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                            part=part),
                self._event("response.output_item.done", output_index=index, item=copy.deepcopy(item))]

    def _tool_call(self, call: ParsedToolCall) -> list[dict]:
        events = self._close("completed")
        # a call cut short goes out unclosed, as chat sends it: a client's JSON parse refuses it, never runs half
        item = {"id": _id("fc"), "type": "function_call", "call_id": call.id, "name": call.name,
                "arguments": call.sent_arguments, "status": "completed" if call.complete else "incomplete"}
        self.output.append(item)
        index = len(self.output) - 1
        return events + [
            self._event("response.output_item.added", output_index=index,
                        item={**item, "arguments": "", "status": "in_progress"}),
            self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                        delta=item["arguments"]),
            self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                        arguments=item["arguments"]),
            self._event("response.output_item.done", output_index=index, item=copy.deepcopy(item))]

    def finish(self, finish_reason: str, usage: dict) -> list[dict]:
        """Close what is open; `length` makes the response (and its last item) incomplete."""
        incomplete = finish_reason == "length"
        events = self._close("incomplete" if incomplete else "completed")
        self.response.update(status="incomplete" if incomplete else "completed", usage=usage,
                             incomplete_details={"reason": "max_output_tokens"} if incomplete else None)
        kind = "response.incomplete" if incomplete else "response.completed"
        return events + [self._event(kind, response=self._snapshot())]

    def fail(self, code: str = "server_error", message: str = "internal server error") -> list[dict]:
        self._open = None
        self.response.update(status="failed", error={"code": code, "message": message})
        return [self._event("response.failed", response=self._snapshot())]
