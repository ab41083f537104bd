"""A chat conversation rendered to the prompt text the model continues: the model's chat template (its tokenizer's,
or ``waferline serve --chat-template``) with the request's tools, earlier tool calls and tool answers, and the
request's ``chat_template_kwargs``, ``add_generation_prompt`` and ``continue_final_message`` (as vLLM takes them); a
model without a template gets a plain one (``FALLBACK_CHAT_TEMPLATE``)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from waferline.errors import ConfigError
from waferline.server.protocol import APIError

# the chat prompt when the model has no chat template: one block per message, then the assistant's
FALLBACK_CHAT_TEMPLATE = "<|{role}|>\n{content}\n"
FALLBACK_GENERATION_PROMPT = "<|assistant|>\n"
# a template that names the "developer" role renders it; others get such a message as a "system" one
_DEVELOPER = re.compile(r"""["']developer["']""")
# a template that loops over a message's content ("{% for part in message['content'] %}", as Llama 4's and Gemma 3's
# do) reads content parts (the loop is over the content itself, not e.g. its .split()); others take the content as a
# string
_PARTS_LOOP = re.compile(r"""\bfor\s+\w+\s+in\s+\w+\s*(?:\[\s*["']content["']\s*\]|\.\s*content\b)\s*(?:-?%}|if\b)""")
# what apply_chat_template takes from the server, not from chat_template_kwargs
RESERVED = frozenset({"conversation", "messages", "tools", "chat_template", "tokenize", "return_dict",
                      "tokenizer_kwargs", "add_generation_prompt", "continue_final_message",
                      "return_assistant_tokens_mask", "padding", "truncation", "max_length", "return_tensors"})


def template_messages(req: Any, parts: bool = False) -> list[dict[str, Any]]:
    """The conversation as chat templates take it: assistant calls with their arguments as objects (as Hugging Face
    templates read ``tool_call.function.arguments``), a tool's answer with the id of the call it answers; content
    parts as sent where the template reads them (``parts``), else their texts as lines."""
    out = []
    for m in req.messages:
        content = [p.model_dump() for p in m.content] if parts and isinstance(m.content, list) else m.text()
        d: dict[str, Any] = {"role": m.role, "content": content}
        if getattr(m, "tool_calls", None):
            d["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                               for c in m.tool_calls]
        if getattr(m, "tool_call_id", None):
            d["tool_call_id"] = m.tool_call_id
        if m.name:
            d["name"] = m.name
        out.append(d)
    return out


def _arguments(text: str) -> Any:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):  # (not JSON, or nested deeper than Python decodes: the text as sent)
        return text
    if "\\u" in text:  # (an escape may make a lone surrogate, which no prompt text may hold: refused as in the body)
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise APIError("a tool call's arguments hold a string that is not valid Unicode (a lone surrogate escape)",
                           param="messages") from None
        except (ValueError, RecursionError):  # (written back deeper than Python writes: the template's to judge)
            pass
    return value


def render(tokenizer: Any, template: str | dict[str, str] | None, req: Any) -> str:
    """The prompt text of a chat request (or a /tokenize request with messages); ``tokenizer`` renders ``template``
    (the caller holds the tokenizer's lock; of named templates, "tool_use" where tools are given, else "default"). A
    400 where the request's options do not fit or the template rejects the conversation."""
    if not req.messages:
        raise APIError("messages: give at least one", param="messages")
    add_prompt = getattr(req, "add_generation_prompt", True)
    cont = getattr(req, "continue_final_message", False)
    if cont and add_prompt:
        raise APIError("continue_final_message continues the last message: send add_generation_prompt: false with it",
                       param="continue_final_message")
    if cont and req.messages[-1].role != "assistant":
        raise APIError("continue_final_message needs the last message to be the assistant's",
                       param="continue_final_message")
    extra = dict(getattr(req, "chat_template_kwargs", None) or {})
    bad = sorted(set(extra) & RESERVED)
    if bad:
        raise APIError(f"chat_template_kwargs may not set {', '.join(bad)} (the request's own fields do)",
                       param="chat_template_kwargs")
    if not template:
        msgs = template_messages(req)
        body = "".join(FALLBACK_CHAT_TEMPLATE.format(role=m["role"], content=m["content"]) for m in msgs)
        if cont:  # (the last message left open: no newline after it)
            return body[:-1]
        return body + (FALLBACK_GENERATION_PROMPT if add_prompt else "")
    tools = [t.model_dump(exclude_none=True) for t in getattr(req, "tools", None) or []] or None
    if isinstance(template, dict):  # (named templates, as tokenizer_config.json may list them: transformers' choice)
        name = "tool_use" if tools and "tool_use" in template else "default"
        if name not in template:
            raise APIError(f"the model has chat templates {', '.join(sorted(template))} but none named \"default\": "
                           "start the server with --chat-template", param="messages")
        template = template[name]
    msgs = template_messages(req, parts=bool(_PARTS_LOOP.search(template)))
    if not _DEVELOPER.search(template):  # (OpenAI's newer name for system instructions: a template that does not know
        # the role would drop such a message silently, as Qwen's and DeepSeek's do, or refuse it)
        msgs = [dict(m, role="system") if m["role"] == "developer" else m for m in msgs]
    try:
        return tokenizer.apply_chat_template(msgs, chat_template=template, tools=tools, tokenize=False,
                                             add_generation_prompt=add_prompt, continue_final_message=cont, **extra)
    except Exception as e:  # a template that rejects this conversation (e.g. roles out of order)
        raise APIError(f"the model's chat template rejected the messages: {e}", param="messages") from None


def load_template(value: str, tokenizer: Any) -> str:
    """``--chat-template``: a file holding a Jinja chat template, or the template itself; checked by rendering a
    two-message conversation with the model's tokenizer."""
    path = Path(value)
    try:
        is_file = "\n" not in value and path.is_file()
    except OSError:  # (a template longer than a file name may be)
        is_file = False
    try:
        text = path.read_text(encoding="utf-8") if is_file else value
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--chat-template {value}: cannot read it as UTF-8 text "
                          f"({e.reason if isinstance(e, UnicodeDecodeError) else e.strerror or e})") from None
    if not is_file and "{" not in text:
        raise ConfigError(f"--chat-template {value[:80]}: no such file, and not a Jinja template")
    if not text.strip():  # (an empty template was taken as none: chat went on with the fallback rendering, silently)
        raise ConfigError(f"--chat-template {value}: the file is empty; give a Jinja chat template")
    if tokenizer is None:
        raise ConfigError("--chat-template needs the model's tokenizer (tokenizer.json)")
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
                                      chat_template=text, add_generation_prompt=True, tokenize=False)
    except Exception as e:
        raise ConfigError(f"--chat-template: the template does not render: {e}") from None
    return text
