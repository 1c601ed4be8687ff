"""From an OpenAI chat request to the prompt text, through the checkpoint's own chat template.

OpenAI carries tool-call arguments as a JSON string; Hugging Face templates (Qwen's included) iterate
them as a mapping, so they are decoded here. Tools reach the template as OpenAI function specs; the legacy
functions API's history (an assistant's function_call, a role "function" result) as the tool_calls and tool
message it stands for.
"""

from __future__ import annotations

import json

from lily.server.errors import APIError
from lily.server.output_rules import output_rule
from lily.server.protocol import ChatPrompt, NamedToolChoice, message_text, thinks
from lily.tokenizer import Tokenizer, opens_thinking


def template_messages(body: ChatPrompt) -> list[dict]:
    out = []
    for i, m in enumerate(body.messages):
        # the legacy API's function result is a tool's
        role = {"developer": "system", "function": "tool"}.get(m.role, m.role)
        msg: dict = {"role": role, "content": message_text(m)}
        for optional in ("name", "tool_call_id"):
            if getattr(m, optional, None) is not None:
                msg[optional] = getattr(m, optional)
        reasoning = _reasoning(m, i)
        if reasoning is not None:
            msg["reasoning_content"] = reasoning
        calls = [(c.id, c.function, f"messages[{i}].tool_calls[{j}].function.arguments")
                 for j, c in enumerate(getattr(m, "tool_calls", None) or [])]
        if getattr(m, "function_call", None) is not None:  # the legacy API's one call
            param = f"messages[{i}].function_call"
            if calls:
                raise APIError(400, f"{param}: the turn's calls go in tool_calls or in function_call, not both",
                               param=param)
            calls = [(None, m.function_call, f"{param}.arguments")]
        if calls:
            msg["tool_calls"] = [{"id": call_id, "type": "function",
                                  "function": {"name": f.name, "arguments": _arguments(f.arguments, param)}}
                                 for call_id, f, param in calls]
        out.append(msg)
    return _one_leading_system(out)


def _one_leading_system(messages: list[dict]) -> list[dict]:
    """The messages with their leading run of system messages (system and developer roles, a Responses request's
    instructions) joined into one, a blank line between: Qwen's template refuses a system message after the first
    message ("System message must be at the beginning"), and Codex-style requests send instructions and a
    developer message."""
    n = 0
    while n < len(messages) and messages[n]["role"] == "system" and set(messages[n]) == {"role", "content"}:
        n += 1
    if n < 2:
        return messages
    joined = "\n\n".join(m["content"] for m in messages[:n] if m["content"])
    return [{"role": "system", "content": joined}] + messages[n:]


def _arguments(arguments: str, param: str) -> dict:
    """OpenAI's arguments (a JSON object in a string) as the mapping templates iterate."""
    try:
        args = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        args = None
    if not isinstance(args, dict):
        raise APIError(400, f"{param}: must be a JSON object in a string", param=param)
    return args


def _reasoning(m, i: int) -> str | None:
    """An assistant turn's reasoning: reasoning_content (older vLLM's name, the one templates read), or
    reasoning (current vLLM's)."""
    old, new = getattr(m, "reasoning_content", None), getattr(m, "reasoning", None)
    if old is not None and new is not None and old != new:
        param = f"messages[{i}].reasoning"
        raise APIError(400, f"{param}: differs from reasoning_content; both name the turn's reasoning, send one "
                       "(or the same text in both)", param=param)
    return old if old is not None else new


def request_tools(body: ChatPrompt) -> list[dict] | None:
    """The tools the template should show: none for tool_choice 'none', only the named one if named
    (structured.py then holds the answer to a call to it)."""
    if not body.tools or body.tool_choice == "none":
        return None
    tools = [t.model_dump(exclude_none=True) for t in body.tools]
    if isinstance(body.tool_choice, NamedToolChoice):  # only that one, if it exists
        named = [t for t in tools if t["function"]["name"] == body.tool_choice.function.name]
        tools = named or tools
    return tools


def prompt_ending(body) -> tuple[bool, bool]:
    """(add_generation_prompt, continue_final_message) of a chat request or /tokenize: continuing the final
    message opens no new turn, so add_generation_prompt then defaults to false; both asked for is a
    contradiction (vLLM refuses it too)."""
    if not body.continue_final_message:
        return body.add_generation_prompt is not False, False
    if body.add_generation_prompt:
        raise APIError(400, "add_generation_prompt: cannot be true with continue_final_message, which continues "
                       "the final message instead of opening a new turn; leave add_generation_prompt out or false",
                       param="add_generation_prompt")
    if output_rule(body) is not None or body.tool_choice == "required" or isinstance(
            body.tool_choice, NamedToolChoice):
        # (their grammar holds an answer from its start: a continued message has begun already)
        raise APIError(400, "continue_final_message: cannot be combined with a response_format (structured_outputs, "
                       "guided_*) or a tool_choice that holds the answer to a grammar from its start; send the "
                       "message without it", param="continue_final_message")
    return False, True


def build_chat_prompt(body: ChatPrompt, tokenizer: Tokenizer, thinking_default: bool | None,
                      add_generation_prompt: bool = True,
                      continue_final_message: bool = False) -> tuple[str, bool, list[dict] | None]:
    """(prompt text, whether the model starts inside a <think> block, tools for the output parser).
    A chat request always opens the assistant's turn; /tokenize may leave it off or continue the final message,
    as vLLM's does."""
    kwargs = dict(body.chat_template_kwargs.model_dump(exclude_none=True)) if body.chat_template_kwargs else {}
    for reserved in ("messages", "tools", "add_generation_prompt"):
        if reserved in kwargs:
            raise APIError(400, f"chat_template_kwargs.{reserved}: may not be set here",
                           param=f"chat_template_kwargs.{reserved}")
    effort = body.reasoning_effort
    if "enable_thinking" not in kwargs and effort is not None:
        kwargs["enable_thinking"] = thinks(effort)
    if "enable_thinking" not in kwargs and thinking_default is not None:
        kwargs["enable_thinking"] = thinking_default
    tools = request_tools(body)
    messages = template_messages(body)
    text = tokenizer.render_chat(messages, tools=tools, add_generation_prompt=add_generation_prompt, **kwargs)
    if continue_final_message:
        text = cut_after_final_message(text, messages[-1]["content"])
    return text, opens_thinking(text), _parser_tools(body, tools)


def _parser_tools(body: ChatPrompt, tools: list[dict] | None) -> list[dict] | None:
    """The template's tools with each one's applied strict (FunctionDef.applied_strict, a Responses tool's
    decided where it left strict out), which the output parser reads values by."""
    if tools is None:
        return None
    applied = {t.function.name: t.function.applied_strict for t in body.tools}
    return [{**t, "function": {**t["function"], "strict": applied[t["function"]["name"]]}} for t in tools]


def cut_after_final_message(text: str, final: str) -> str:
    """The rendered chat up to the end of the final message's text, its end of turn left off, as transformers'
    continue_final_message cuts it (vLLM's /tokenize): the model goes on with that text."""
    param = "continue_final_message"
    if not final.strip():
        raise APIError(400, f"{param}: the final message has no text to continue", param=param)
    at = text.rfind(final.strip())
    if at < 0:
        raise APIError(400, f"{param}: the chat template does not show the final message's text as sent, so "
                       "there is no place to continue it from", param=param)
    # the template may trim the message's trailing whitespace; if it kept it, so does the cut
    kept = final.lstrip()
    return text[:at + (len(kept) if text.startswith(kept, at) else len(final.strip()))]
