"""The OpenAI-compatible request bodies the router accepts, as pydantic models.

Unknown fields are refused (400 naming them). A field of the OpenAI API that Tandem does not honour may
hold only its default (or null), anything else is refused naming the field: nothing a client asks for
is silently dropped. ``user`` is accepted and ignored.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from router_svc.frontends.openai_tools import Tool, ToolUse, call_message, result_message
from tandem.errors import InvalidRequestError
from tandem.protocol import CHAT_ROLES
from tandem.sampling import MAX_LOGPROBS, MAX_SAMPLES

MAX_STOP_STRINGS = 16
MAX_PROMPTS = 256  # in one completions request


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _only_when(field: str, other: str, value: str, message: str):
    """A validator: ``field`` may be set only where the field ``other`` (declared before it) is ``value``."""

    def check(cls, given, info: ValidationInfo):
        if given is not None and info.data.get(other) != value:
            raise ValueError(message)
        return given

    return field_validator(field)(classmethod(check))


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's extension: usage so far in every chunk


class TandemOptions(_Strict):
    """Tandem's own extension: ``{"tandem": {"policy": "finish_time", "length_key": "summaries"}}``
    (``length_key``: see RouteRequest.length_key)."""

    policy: str | None = None
    length_key: str = ""


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text


class ToolCall(_Strict):
    """A call an assistant message made, as the history repeats it."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal[(*CHAT_ROLES, "tool")]  # type: ignore[valid-type]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's
    tool_call_id: str | None = None  # a tool's: the call it answers

    _answers_a_call = _only_when("tool_call_id", "role", "tool", "only on a tool message")

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "\n".join(part.text for part in self.content)


FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"


class FunctionDefinition(_Strict):
    name: Annotated[str, Field(pattern=FUNCTION_NAME)]
    description: str = ""
    parameters: dict | None = None  # a JSON schema; none: no arguments
    strict: bool | None = None  # calls are held to the schema either way under required or a named function


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


# Fields of the OpenAI API that Tandem does not honour: the value each may take, which is what it means
# when left out.
_UNSUPPORTED_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "suffix": (None,),
    "functions": (None, []),
    "function_call": (None, "none"),
    "prompt_logprobs": (None,),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "service_tier": (None, "auto", "default"),
    "store": (None, False),
    "metadata": (None, {}),
    "web_search_options": (None,),
}


class JsonSchemaFormat(_Strict):
    """``response_format.json_schema``: the output is held to ``schema`` whether or not ``strict`` is set."""

    name: str
    schema_: dict | bool = Field(alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    _with_its_type = _only_when("json_schema", "type", "json_schema", "only with type json_schema")


class StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs``: exactly one of these."""

    json_: str | dict | None = Field(None, alias="json")
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _Sampling(_Strict):
    """What chat and completion requests share."""

    model: str
    n: Annotated[int, Field(ge=1, le=MAX_SAMPLES)] = 1  # choices per prompt, generated on one worker
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    allowed_token_ids: list[Annotated[int, Field(ge=0)]] | None = None  # vLLM's extensions: only these may be
    truncate_prompt_tokens: Annotated[int, Field(ge=1)] | None = None  # sampled; keep the prompt's last N tokens
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True  # vLLM's extensions for the text: special tokens add none by default,
    include_stop_str_in_output: bool = False  # and the stop string that ended the output is left out
    return_tokens_as_token_ids: bool = False  # vLLM's extension: logprobs show tokens as "token_id:N"
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    tandem: TandemOptions | None = None
    # Structured output: OpenAI's response_format, or one of vLLM's extensions
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: str | dict | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop: str | list[str] | None) -> list[str]:
        strings = [stop] if isinstance(stop, str) else list(stop or [])
        if len(strings) > MAX_STOP_STRINGS or any(not s for s in strings):
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, none of them empty")
        return strings

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, bias: dict[str, float] | None) -> dict[int, float] | None:
        if bias is None:
            return None
        try:
            ids = {int(token): value for token, value in bias.items()}
        except ValueError:
            raise ValueError("keys must be token ids (integers as strings)") from None
        if any(token < 0 for token in ids):
            raise ValueError("keys must be token ids >= 0")
        return ids

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def structured_output(self) -> tuple[str, str, str | tuple[str, ...]] | None:
        """The output's constraint, if the request sets one: (the field that set it, the kind of
        ``tandem.structured.KINDS``, its spec); None for plain text.

        Raises:
            InvalidRequestError: two fields set one; the second is named.
        """
        given = [item for item in self._structured_outputs() if item is not None]
        if len(given) > 1:
            raise InvalidRequestError(given[1][0], f"only one structured output may be set; {given[0][0]} is set too")
        return given[0] if given else None

    def tool_use(self, template_renders_tools: bool = False) -> ToolUse:
        """The request's tools and how the model may use them: none, unless the API has tools."""
        return ToolUse([], "none", True)

    def _structured_outputs(self):
        """Each field that may set a constraint: (field, kind, spec), or None where it sets none; a forced tool
        call first, as the calls' JSON schema."""
        tool_use = self.tool_use()
        if tool_use.forced:
            yield "tools", "json_schema", json.dumps(tool_use.schema())
        yield from self._format_outputs()

    def _format_outputs(self):
        response_format = self.response_format
        if response_format is not None and response_format.type == "json_object":
            yield "response_format", "json_object", ""
        elif response_format is not None and response_format.type == "json_schema":
            if response_format.json_schema is None:
                raise InvalidRequestError("response_format.json_schema", "is required with type json_schema")
            yield "response_format.json_schema.schema", "json_schema", json.dumps(response_format.json_schema.schema_)
        for field, kind, value in (("guided_json", "json_schema", self.guided_json),
                                   ("guided_regex", "regex", self.guided_regex),
                                   ("guided_choice", "choice", self.guided_choice),
                                   ("guided_grammar", "grammar", self.guided_grammar)):
            yield None if value is None else (field, kind, _spec(value))
        outputs = self.structured_outputs
        if outputs is not None:
            chosen = [(f"structured_outputs.{name}", kind, value) for name, kind, value in (
                ("json", "json_schema", outputs.json_), ("regex", "regex", outputs.regex),
                ("choice", "choice", outputs.choice), ("grammar", "grammar", outputs.grammar),
                ("json_object", "json_object", outputs.json_object or None)) if value is not None]
            if not chosen:
                raise InvalidRequestError("structured_outputs", "set one of json, regex, choice, grammar, json_object")
            for field, kind, value in chosen:
                yield field, kind, "" if kind == "json_object" else _spec(value)

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats

    @property
    def num_logprobs(self) -> int | None:
        """How many top alternatives each token's log-probability comes with; None: no log-probabilities."""
        return self.logprobs

    @property
    def num_prompt_logprobs(self) -> int | None:
        return None

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def budget_field(self) -> str:
        """The field the request set its output budget with."""
        return "max_tokens"

    prompt_field: ClassVar[str] = "prompt"  # where the prompt is, as the router names it in errors


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    # vLLM's extensions for rendering the chat
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, top_logprobs: int | None, info: ValidationInfo) -> int | None:
        if top_logprobs and not info.data.get("logprobs"):
            raise ValueError("needs logprobs set to true")
        return top_logprobs

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def tool_use(self, template_renders_tools: bool = False) -> ToolUse:
        """The request's tools and how the model may use them (``tool_choice`` ``auto`` where tools are given)."""
        choice = self.tool_choice or ("auto" if self.tools else "none")
        return ToolUse([Tool(t.function.name, t.function.description, t.function.parameters or {})
                        for t in self.tools or []],
                       choice.function.name if isinstance(choice, NamedToolChoice) else choice,
                       self.parallel_tool_calls, template_renders_tools)

    def conversation(self, tool_use: ToolUse) -> list[dict]:
        """The messages as the chat template renders them, with the tools described and earlier calls and
        their results as ``tool_use`` writes them (``router_svc.frontends.openai_tools``)."""
        names = {call.id: call.function.name for m in self.messages for call in m.tool_calls or ()}
        conversation = []
        for message in self.messages:
            if message.tool_calls:
                conversation.append(call_message(tool_use, message.text, [
                    (call.id, call.function.name, call.function.arguments) for call in message.tool_calls]))
            elif message.role == "tool":
                call_id = message.tool_call_id or ""
                conversation.append(result_message(tool_use, call_id, names.get(call_id, ""), message.text))
            else:
                conversation.append({"role": message.role, "content": message.text})
        if tool_use.active and not tool_use.native:
            if conversation[0]["role"] == "system":
                conversation[0] = {"role": "system", "content": f"{conversation[0]['content']}\n\n{tool_use.prompt()}"}
            else:
                conversation.insert(0, {"role": "system", "content": tool_use.prompt()})
        return conversation

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def budget_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens else "max_tokens"

    prompt_field: ClassVar[str] = "chat.messages"


TokenIdList = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class CompletionRequest(_Sampling):
    prompt: str | TokenIdList | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)] | \
        Annotated[list[TokenIdList], Field(min_length=1, max_length=MAX_PROMPTS)]
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, prompt):
        if not prompt:
            raise ValueError("must not be empty")
        return prompt

    @property
    def num_prompt_logprobs(self) -> int | None:
        """``echo`` with ``logprobs`` returns the prompt's log-probabilities too."""
        return self.logprobs if self.echo else None

    @property
    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the request, as text or token ids; a choice is generated for each, in order."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)


def _spec(value: str | dict | list) -> str | tuple[str, ...]:
    """A spec as ``tandem.structured.StructuredOutput`` takes it: a schema as JSON text, choices as a tuple."""
    if isinstance(value, list):
        return tuple(value)
    return value if isinstance(value, str) else json.dumps(value)


def without_unhonoured(body: dict) -> dict:
    """``body`` without the OpenAI fields Tandem does not honour, each of which must hold its default.

    Raises:
        InvalidRequestError: such a field asks for something else; the field is named.
    """
    for name, accepted in _UNSUPPORTED_DEFAULTS.items():
        if name in body and not any(body[name] is value or (type(body[name]) is type(value) and body[name] == value)
                                    for value in accepted):
            shown = " or ".join("null" if value is None else json.dumps(value) for value in accepted)
            raise InvalidRequestError(name, f"is not supported by this server (accepted: {shown})")
    return {name: value for name, value in body.items() if name not in _UNSUPPORTED_DEFAULTS}


class TokenizeRequest(_Strict):
    """vLLM's /tokenize: a text prompt, or chat messages rendered with the model's template."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


class InputText(_Strict):
    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: list | None = None  # on output_text items a client sends back


class InputMessage(_Strict):
    """An item of a Responses request's ``input``: a message."""

    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[InputText]
    id: str | None = None
    status: str | None = None

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "\n".join(part.text for part in self.content)


class _CallItem(_Strict):
    """What a Responses request's ``input`` items about one function call share."""

    call_id: str
    id: str | None = None
    status: str | None = None


class FunctionCallItem(_CallItem):
    """An item of a Responses request's ``input``: a call the model made earlier."""

    type: Literal["function_call"]
    name: str
    arguments: str


class FunctionCallOutput(_CallItem):
    """An item of a Responses request's ``input``: a call's result."""

    type: Literal["function_call_output"]
    output: str


class ResponsesFunction(_Strict):
    type: Literal["function"]
    name: Annotated[str, Field(pattern=FUNCTION_NAME)]
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ResponsesNamedFunction(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    """``text.format`` of a Responses request: plain text, any JSON object, or a JSON schema (flattened)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict | bool | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextOptions(_Strict):
    format: TextFormat | None = None


class ResponsesRequest(_Sampling):
    """The Responses API, stateless: every request carries its whole conversation."""

    input: str | Annotated[list[InputMessage | FunctionCallItem | FunctionCallOutput], Field(min_length=1)]
    n: Literal[1] = 1  # one output per response
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    text: TextOptions | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    tools: list[ResponsesFunction] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesNamedFunction | None = None
    parallel_tool_calls: bool = True
    truncation: Literal["disabled"] | None = None
    metadata: dict[str, str] | None = None
    include: Annotated[list, Field(max_length=0)] | None = None

    @field_validator("store", "previous_response_id")
    @classmethod
    def _stateless(cls, value):
        if value:
            raise ValueError("this server stores no responses; send the whole conversation as input")
        return value

    @property
    def num_logprobs(self) -> int | None:
        return None

    def tool_use(self, template_renders_tools: bool = False) -> ToolUse:
        choice = self.tool_choice or ("auto" if self.tools else "none")
        return ToolUse([Tool(t.name, t.description or "", t.parameters or {}) for t in self.tools or []],
                       choice.name if isinstance(choice, ResponsesNamedFunction) else choice, self.parallel_tool_calls,
                       template_renders_tools)

    def _format_outputs(self):
        text_format = self.text.format if self.text is not None else None
        if text_format is not None and text_format.type == "json_object":
            yield "text.format", "json_object", ""
        elif text_format is not None and text_format.type == "json_schema":
            if text_format.schema_ is None:
                raise InvalidRequestError("text.format.schema", "is required with type json_schema")
            yield "text.format.schema", "json_schema", json.dumps(text_format.schema_)
        yield from super()._format_outputs()

    def requested_max_tokens(self) -> int | None:
        return self.max_output_tokens

    @property
    def budget_field(self) -> str:
        return "max_output_tokens"

    prompt_field: ClassVar[str] = "input"

    def conversation(self, tool_use: ToolUse) -> list[dict[str, str]]:
        """``instructions`` and ``input`` as chat messages (a developer message is a system one), with the tools
        described and earlier calls and results written as text (``router_svc.frontends.openai_tools``)."""
        system = [self.instructions] if self.instructions is not None else []
        if tool_use.active and not tool_use.native:
            system.append(tool_use.prompt())
        messages = [{"role": "system", "content": "\n\n".join(system)}] if system else []
        if isinstance(self.input, str):
            return [*messages, {"role": "user", "content": self.input}]
        names = {item.call_id: item.name for item in self.input if isinstance(item, FunctionCallItem)}
        for item in self.input:
            if isinstance(item, FunctionCallItem):
                messages.append(call_message(tool_use, "", [(item.call_id, item.name, item.arguments)]))
            elif isinstance(item, FunctionCallOutput):
                messages.append(result_message(tool_use, item.call_id, names.get(item.call_id, ""), item.output))
            else:
                messages.append({"role": "system" if item.role == "developer" else item.role, "content": item.text})
        return messages
