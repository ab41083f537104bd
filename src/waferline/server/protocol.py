"""OpenAI request bodies (validated strictly: a wrong type is a 400, not a silent coercion) and error objects."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from waferline.errors import RequestError


class APIError(RequestError):
    """A request the server refuses: HTTP ``status`` with an OpenAI-style error object."""

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.type, self.param, self.code = status, type, param, code
        self.headers = headers  # extra response headers (Retry-After, Connection: close)

    def body(self) -> dict[str, Any]:
        return error_body(str(self), self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# strict: no coercion; allow_inf_nan=False: a number such as 1e999 (which JSON decoding makes infinite) is refused
_STRICT = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


# Lists checked up to their first bad item (pydantic's fail_fast): the errors of every item of a long list (a body holds
# 200,000 of them), each union branch's, took seconds to build, on the event loop's interpreter lock that everyone's
# tokens wait for.
_Ints = Annotated[list[int], Field(fail_fast=True)]
_Strs = Annotated[list[str], Field(fail_fast=True)]


class _Strict(BaseModel):
    model_config = _STRICT


class StreamOptions(_Strict):
    include_usage: bool = False


class StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs`` (one of): a JSON Schema, a regular expression, a choice of strings, a grammar
    (Lark or GBNF), or any JSON object. An unknown key is refused: a misspelt constraint would otherwise run
    unconstrained."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)
    json_: Any = Field(None, alias="json")  # (pydantic's BaseModel has a "json" method)
    regex: str | None = None
    choice: _Strs | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _Sampling(_Strict):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | _Strs | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # extensions (as in vLLM): pass with extra_body=
    stop_token_ids: _Ints | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False
    skip_special_tokens: bool = True
    repetition_penalty: float | None = None
    # {"type": "text"}, {"type": "json_object"} (JSON mode) or {"type": "json_schema", "json_schema": {"schema": ...}}
    response_format: Any = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: Any = None  # (vLLM's older spelling of structured_outputs: one of these four)
    guided_regex: str | None = None
    guided_choice: _Strs | None = None
    guided_grammar: str | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    # vLLM's sampling extensions this server does not do: named so that a request asking for one is refused (400),
    # not answered as if it had not (their defaults, as vLLM's, are accepted)
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None
    allowed_token_ids: _Ints | None = None
    bad_words: _Strs | None = None
    truncate_prompt_tokens: int | None = None
    spaces_between_special_tokens: bool = True
    priority: int = 0
    use_beam_search: bool = False


class CompletionRequest(_Sampling):
    prompt: str | _Ints | _Strs | Annotated[list[_Ints], Field(fail_fast=True)]
    logprobs: int | None = None  # the N most likely tokens' log-probabilities with each generated token's (0-20)
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True  # (a text prompt with the tokenizer's BOS etc., as vLLM and transformers encode it)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str  # (JSON text, as OpenAI sends it)


class ToolCall(_Strict):
    """A call an assistant message made (sent back in the conversation's history)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDef(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema of the arguments (an object)
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[TextPart], Field(fail_fast=True)] | None = None
    name: str | None = None
    tool_calls: Annotated[list[ToolCall], Field(fail_fast=True)] | None = None  # (assistant)
    tool_call_id: str | None = None  # (tool: the call this answers)

    @model_validator(mode="after")
    def _has_content(self) -> ChatMessage:
        # (as OpenAI's API: only an assistant message that calls tools may leave its content out)
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs its content"
                             + (" (or tool_calls)" if self.role == "assistant" else ""))
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text for p in self.content)  # (parts are lines, as vLLM joins them)


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1, fail_fast=True)
    max_completion_tokens: int | None = None
    add_special_tokens: bool = False  # (on the rendered chat text: its template writes the special tokens it wants)
    logprobs: bool | None = None  # each generated token's log-probability ...
    top_logprobs: int | None = None  # ... and the N most likely tokens' (0-20; needs logprobs: true)
    tools: Annotated[list[Tool], Field(fail_fast=True)] | None = None  # function calling (server/tools.py)
    tool_choice: str | dict[str, Any] | None = None  # "none" | "auto" | "required" | {"type": "function", ...}
    parallel_tool_calls: bool | None = None
    # (vLLM's) how the chat template renders the conversation (server/chat.py)
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # the deprecated function-calling fields and audio are not supported: parsed only to be refused (400)
    functions: Any = None
    function_call: Any = None
    modalities: _Strs | None = None
    audio: Any = None


class TokenizeRequest(_Strict):
    """``POST /tokenize`` (as vLLM's): a prompt, or chat messages rendered as a chat completion would render them."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1, fail_fast=True)
    tools: Annotated[list[Tool], Field(fail_fast=True)] | None = None  # (with messages: as the template renders them)
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool | None = None  # (default: a prompt with them, as the completions encode it; chat without)


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: _Ints


def parse(cls: type[_Strict], data: Any) -> Any:
    """Validate a decoded JSON body; a mismatch becomes a 400 naming the first offending field."""
    if not isinstance(data, dict):
        raise APIError("the request body must be a JSON object")
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        errors = e.errors()
        err = errors[0]
        if isinstance(err.get("input"), list) and err["loc"] and err["loc"][-1] == "str":
            # (a list where a string or one kind of list may be, as a message's content parts: the list's own error,
            # e.g. a part that is not text, not "should be a valid string")
            at = len(err["loc"]) - 1
            branches = [x for x in errors if x["loc"][:at] == err["loc"][:at] and len(x["loc"]) > at
                        and str(x["loc"][at]).startswith("list[")]
            if len({x["loc"][at] for x in branches}) == 1:
                err = branches[0]
        loc = ".".join(
            str(x)
            for x in err["loc"]
            if not str(x).startswith(("function-", "union["))
            and x not in ("str", "int", "list[int]", "list[str]", "list[list[int]]", "list[TextPart]", "float", "bool")
        )
        param = str(err["loc"][0]) if err["loc"] else None
        raise APIError(
            f"invalid value for '{loc or param}': {err['msg']} (got {_short(err.get('input'))})", param=param
        ) from None


def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."
