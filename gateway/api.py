"""The OpenAI HTTP API as this gateway accepts it: request bodies, validated, and how they map to sampling.

Unknown fields are refused; OpenAI's fields that pagedkv does not implement are accepted only at their neutral
value; the extensions (vLLM's names and meaning) are listed in docs/architecture.md ("A request", step 1).
Structured output (`response_format`, `structured_outputs`, `guided_*`) is gateway.structured's.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from executor.params import (
    MAX_BAD_WORD_TOKENS,
    MAX_BAD_WORDS,
    MAX_GRAMMAR_CHARS,
    MAX_LOGPROBS,
    GrammarSpec,
    SamplingParams,
)
from gateway.errors import invalid_request
from gateway.generation import OutputOptions
from gateway.structured import StructuredOutputFields

if TYPE_CHECKING:
    from gateway.text import Tokenizer

MAX_STOP_STRINGS = 16
MAX_N = 64
MAX_BAD_WORD_STRINGS = MAX_BAD_WORDS // 2  # each gives up to two token sequences: with and without a leading space
MAX_LOGIT_BIAS = 1024


class ParamError(ValueError):
    """A request-level check that names the parameter it is about (pydantic leaves those without a location)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage (so far) in every chunk


class GenerationRequest(StructuredOutputFields):
    """The fields every request that generates has (completions and chat completions): sampling, stop,
    streaming and vLLM's output settings."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(default=None, max_length=MAX_LOGIT_BIAS)
    user: str | None = None
    # extensions
    top_k: int = Field(default=0, ge=0)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    repetition_penalty: float = Field(default=1.0, gt=0.0, allow_inf_nan=False)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    min_tokens: int = Field(default=0, ge=0)
    # Each word banned with and without a leading space, as vLLM does.
    bad_words: list[str] | None = Field(default=None, max_length=MAX_BAD_WORD_STRINGS)
    allowed_token_ids: list[int] | None = Field(default=None, min_length=1)
    # vLLM's: lower is served sooner, by executors with --scheduling-policy priority (others refuse non-zero)
    priority: int = Field(default=0, ge=-(2**63), lt=2**63)
    request_id: str | None = Field(default=None, max_length=200)
    # vLLM's output settings
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # what vLLM does with a fast tokenizer: nothing (transformers too)
    return_tokens_as_token_ids: bool = False
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    # vLLM's: requests share cached prefixes only with requests of the same salt (a tenant's isolation)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    # vLLM's: each prompt token's logprob (after the first) and the k most likely there; not streamed
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # vLLM's beam search (executor.beam): best_of beams (n without it), the n best returned; not streamed
    use_beam_search: bool = False
    length_penalty: float = Field(default=1.0, allow_inf_nan=False)
    early_stopping: bool | str = False  # true, false or "never" (transformers' meaning)

    _bad_words_ids: tuple[tuple[int, ...], ...] | None = PrivateAttr(default=None)

    @field_validator("early_stopping", mode="before")
    @classmethod
    def _early_stopping(cls, value: Any) -> Any:
        if not isinstance(value, bool) and value != "never":
            raise ValueError(f'early_stopping must be true, false or "never", got {value!r}')
        return value

    @model_validator(mode="after")
    def _supported(self) -> GenerationRequest:
        self._check_logit_bias()
        if self.bad_words is not None and any(not word.strip() for word in self.bad_words):
            raise ParamError("bad_words", "bad_words must not contain empty strings")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ParamError(
                "min_tokens", f"min_tokens ({self.min_tokens}) must be at most max_tokens ({self.max_tokens})"
            )
        if self.prompt_logprobs is not None and self.stream:
            raise ParamError("prompt_logprobs", "prompt_logprobs are not available when stream is true")
        if self.stream_options is not None and not self.stream:
            raise ParamError("stream_options", "stream_options is only allowed with stream: true")
        if len(self.stop_strings()) > MAX_STOP_STRINGS:
            raise ParamError("stop", f"stop accepts at most {MAX_STOP_STRINGS} strings")
        if self.use_beam_search:
            self._check_beam_search()
        return self

    def _check_beam_search(self) -> None:
        """What beam search cannot be combined with, each refused by its name (the executor checks the rest)."""
        refused = {
            "stream": self.stream,
            "temperature": "temperature" in self.model_fields_set and self.temperature > 0.0,
            "top_p": self.top_p != 1.0,
            "top_k": self.top_k != 0,
            "stop": bool(self.stop_strings()),
            "prompt_logprobs": self.prompt_logprobs is not None,
            "structured output": self.grammar_spec() is not None,
        }
        for name, asked in refused.items():
            if asked:
                why = {
                    "stream": "beams are ranked only once the search ends: stream must be false",
                    "temperature": "beam search is deterministic: leave temperature out or set it to 0",
                    "stop": "beam search stops at end-of-sequence and stop_token_ids only, not at stop strings",
                }.get(name, f"{name} is not available with beam search")
                raise ParamError("response_format" if name == "structured output" else name, why)

    @property
    def beam_width(self) -> int:
        """Beams searched per prompt (0: no beam search): n here; completions' best_of where given."""
        return self.n if self.use_beam_search else 0

    def _check_logit_bias(self) -> None:
        for key, bias in (self.logit_bias or {}).items():
            try:
                int(key)
            except ValueError:
                raise ParamError("logit_bias", f"logit_bias keys must be token ids, got {key!r}") from None
            if not -100.0 <= bias <= 100.0:  # NaN too
                raise ParamError("logit_bias", f"logit_bias values must be in [-100, 100], got {bias} for {key}")

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def prompt_logprobs_k(self) -> int | None:
        """How many alternatives the executor scores at each prompt token (None: prompt not scored)."""
        return self.prompt_logprobs

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling(self, max_tokens: int, logprobs: int | None, tokenizer: Tokenizer | None = None) -> SamplingParams:
        """What the executor is asked to do. With the tokenizer, token ids are checked against its vocabulary and
        bad words become token sequences (raises APIError); without it, bad_words are not allowed."""
        if self.min_tokens > max_tokens:
            raise invalid_request(
                f"min_tokens ({self.min_tokens}) must be at most the completion's token limit ({max_tokens})",
                param="min_tokens",
            )
        logit_bias = tuple((int(key), bias) for key, bias in (self.logit_bias or {}).items())
        if tokenizer is not None:
            vocab = tokenizer.vocab_size
            for param, ids in (
                ("logit_bias", [t for t, _ in logit_bias]),
                ("allowed_token_ids", self.allowed_token_ids),
            ):
                bad = [t for t in ids or () if not 0 <= t < vocab]
                if bad:
                    raise invalid_request(f"{param} must name token ids in [0, {vocab}), got {bad[:3]}", param=param)
        if len({t for t, _ in logit_bias}) != len(logit_bias):
            raise invalid_request("logit_bias names a token more than once", param="logit_bias")
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0 if self.use_beam_search else self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            n=self.n,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs_k,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            min_p=self.min_p,
            min_tokens=self.min_tokens,
            logit_bias=logit_bias,
            bad_words_token_ids=self.bad_words_token_ids(tokenizer),
            allowed_token_ids=None if self.allowed_token_ids is None else tuple(self.allowed_token_ids),
            structured=self.grammar_spec(),
            priority=self.priority,
            beam_width=self.beam_width,
            length_penalty=self.length_penalty,
            early_stopping=self.early_stopping,
        )

    def bad_words_token_ids(self, tokenizer: Tokenizer | None) -> tuple[tuple[int, ...], ...]:
        """bad_words as token sequences, as vLLM makes them: each word (left-stripped) with and without a leading
        space, so that it is banned both at the start of the text and after a space."""
        if not self.bad_words:
            return ()
        if self._bad_words_ids is None:
            if tokenizer is None:
                raise ValueError("bad_words need the tokenizer")
            sequences: dict[tuple[int, ...], None] = {}
            for word in self.bad_words:
                for text in (word.lstrip(), " " + word.lstrip()):
                    ids = tuple(tokenizer.encode(text, add_special_tokens=False))
                    if len(ids) > MAX_BAD_WORD_TOKENS:
                        raise invalid_request(
                            f"each of bad_words must be at most {MAX_BAD_WORD_TOKENS} tokens long, {word[:40]!r} is "
                            f"{len(ids)}",
                            param="bad_words",
                        )
                    if ids:
                        sequences[ids] = None
            self._bad_words_ids = tuple(sequences)
        return self._bad_words_ids

    @model_validator(mode="after")
    def _output_supported(self) -> GenerationRequest:
        if self.truncate_prompt_tokens == 0:
            raise ParamError("truncate_prompt_tokens", "truncate_prompt_tokens must be -1 (the context) or at least 1")
        return self

    @property
    def continuous_usage(self) -> bool:
        """vLLM's continuous_usage_stats: with include_usage, usage so far in every chunk too."""
        options = self.stream_options
        return options is not None and options.include_usage and options.continuous_usage_stats

    def output_options(self) -> OutputOptions:
        return OutputOptions(
            skip_special_tokens=self.skip_special_tokens, include_stop_str_in_output=self.include_stop_str_in_output
        )

    def truncate(self, prompt: list[int], max_model_len: int | None) -> list[int]:
        """vLLM's truncate_prompt_tokens: the last N tokens of the prompt (-1: as many as the context holds)."""
        keep = self.truncate_prompt_tokens
        if keep == -1:
            keep = max_model_len
        return prompt[-keep:] if keep is not None and len(prompt) > keep else prompt


class CompletionRequest(GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=0)  # OpenAI's default for completions; 0 only with echo
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _completion_supported(self) -> CompletionRequest:
        if self.suffix:
            raise ParamError("suffix", "suffix is not supported by pagedkv (no fill-in-the-middle); leave it out")
        return self

    # extension (vLLM)
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _echo_and_best_of(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise ParamError("max_tokens", "max_tokens: 0 is only allowed with echo: true (the prompt only)")
        if self.echo and self.stream and self.logprobs is not None:
            raise ParamError("echo", "echo with logprobs is not available when stream is true")
        if self.best_of is not None:
            if not self.n <= self.best_of <= MAX_N:
                raise ParamError("best_of", f"best_of must be at least n ({self.n}) and at most {MAX_N}")
            if self.best_of > self.n and self.stream and not self.use_beam_search:
                raise ParamError("best_of", "best_of greater than n cannot be streamed")
        if self.use_beam_search and self.logprobs is not None:
            raise ParamError("logprobs", "logprobs is not available with beam search")
        if self.use_beam_search and self.echo:
            raise ParamError("echo", "echo is not available with beam search")
        if self.max_tokens == 0 and self.prompt_logprobs_k is not None and self.sampled_choices != 1:
            # The executor scores the prompt once; echo alone (no logprobs) is answered by the gateway, any n.
            raise ParamError("n", "max_tokens 0 with the prompt's logprobs (the prompt only) needs n = 1")
        return self

    @property
    def sampled_choices(self) -> int:
        """How many choices are sampled per prompt: best_of, of which the n best are returned (beam search: the
        executor ranks its beams itself and returns n)."""
        if self.use_beam_search:
            return self.n
        return self.best_of if self.best_of is not None else self.n

    @property
    def beam_width(self) -> int:
        if not self.use_beam_search:
            return 0
        return self.best_of if self.best_of is not None else self.n

    @property
    def prompt_logprobs_k(self) -> int | None:
        """echo with logprobs scores the prompt too (its first token's logprob is null, as OpenAI's)."""
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs

    @property
    def gateway_only(self) -> bool:
        """echo with max_tokens 0 and nothing to score: the answer is the prompt's text, no executor runs."""
        return self.max_tokens == 0 and self.prompt_logprobs_k is None

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request: a string, token ids, or a batch of either."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            return []
        if isinstance(prompt[0], int):
            return [prompt]  # type: ignore[list-item]
        return list(prompt)  # type: ignore[arg-type]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: str  # a JSON object, as text (OpenAI's shape)


class ToolCallItem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall

    def for_template(self) -> dict[str, Any]:
        """As vLLM hands it to templates: the arguments parsed (templates write them with `tojson`)."""
        try:
            arguments: Any = json.loads(self.function.arguments)
        except json.JSONDecodeError:
            arguments = self.function.arguments
        call: dict[str, Any] = {"type": "function", "function": {"name": self.function.name, "arguments": arguments}}
        if self.id is not None:
            call["id"] = self.id
        return call


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"] = "function"
    function: dict[str, str]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallItem] | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content: Any) -> Any:
        if isinstance(content, list):
            kinds = {part.get("type") for part in content if isinstance(part, dict)} - {"text"}
            if kinds:
                raise ParamError(
                    "messages",
                    f"content parts of type {', '.join(sorted(map(str, kinds)))} are not supported by pagedkv "
                    "(text only: no images, audio or files)",
                )
        return content

    def for_template(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": content or "",
        }
        if self.name:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [call.for_template() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    add_generation_prompt: bool = True  # extension
    # extensions (vLLM)
    add_special_tokens: bool = False
    parallel_tool_calls: bool = True

    @property
    def parses_tool_calls(self) -> bool:
        """Tool calls are looked for in the output: tools are given and the model may call them ('auto')."""
        return bool(self.tools) and self.tool_choice in (None, "auto")

    @model_validator(mode="after")
    def _chat_supported(self) -> ChatCompletionRequest:
        if self.forces_tool_call:
            if not self.tools:
                raise ParamError("tool_choice", "tool_choice 'required' or a named function needs tools")
            if isinstance(self.tool_choice, NamedToolChoice):
                name = self.tool_choice.function.get("name")
                if name not in {tool.function.name for tool in self.tools}:
                    raise ParamError("tool_choice", f"tool_choice names a function not among the tools: {name!r}")
            constraints = self.constraint_fields()
            if constraints:
                raise ParamError(
                    "tool_choice",
                    "tool_choice 'required' or a named function constrains the output already: it cannot be "
                    f"combined with {constraints[0]}",
                )
        if self.top_logprobs is not None and not self.logprobs:
            raise ParamError("top_logprobs", "top_logprobs requires logprobs: true")
        if self.use_beam_search and self.logprobs:
            raise ParamError("logprobs", "logprobs is not available with beam search")
        return self

    @property
    def forces_tool_call(self) -> bool:
        """tool_choice 'required' or a named function: the output is constrained to the call(s) (vLLM's way)."""
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)

    @property
    def named_tool(self) -> str | None:
        """The function a named tool_choice forces (None: not a named choice)."""
        return self.tool_choice.function.get("name") if isinstance(self.tool_choice, NamedToolChoice) else None

    def grammar_spec(self) -> GrammarSpec | None:
        """With a forced tool call, the JSON schema of its output, as vLLM builds it: a named function's
        parameters; for 'required', an array (at least one item; one only without parallel_tool_calls) of
        {"name": one of the tools, "parameters": its schema}."""
        if not self.forces_tool_call or not self.tools:
            return super().grammar_spec()
        schema = forced_tool_schema(self.tools, self.named_tool, self.parallel_tool_calls)
        source = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
        if len(source) > MAX_GRAMMAR_CHARS:
            raise invalid_request(f"the tools' schemas are over {MAX_GRAMMAR_CHARS} characters", param="tools")
        return GrammarSpec("json", source, any_whitespace=False, param="tool_choice")  # compact: see structured

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """One sentence (and the offending parameter) from pydantic's errors: the first one says enough."""
    error = errors[0]
    cause = (error.get("ctx") or {}).get("error")
    if isinstance(cause, ParamError):
        return str(cause), cause.param
    location = [str(part) for part in error.get("loc", ()) if part != "body"]
    # Union members show up in the location ("str", "list[int]"): they name types, not parameters.
    location = [part for part in location if not any(ch in part for ch in "[]") and part not in ("str", "int")]
    param = ".".join(location) or None
    message = str(error.get("msg", "invalid request")).removeprefix("Value error, ")
    if error.get("type") == "extra_forbidden":
        message = f"Unrecognized request argument supplied: {param}"
    elif error.get("type") == "missing":
        message = f"Missing required parameter: {param}"
    elif param:
        message = f"{param}: {message}"
    return message, param


def chat_request(fields: dict[str, Any]) -> ChatCompletionRequest:
    """The chat request another API's body is made into (gateway.messages_api, gateway.responses_api): what it
    refuses is a 400 naming the parameter, as for a chat body."""
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        message, param = validation_message(exc.errors())
        raise invalid_request(message, param=param) from None


def require_json_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise invalid_request("The request body must be a JSON object.")
    return body


def chat_tools(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    """The tools as the chat template sees them (transformers' `tools=`): OpenAI's tool objects, or None."""
    return [tool.model_dump(exclude_none=True) for tool in tools] if tools else None


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def forced_tool_schema(tools: list[Tool], named: str | None, parallel: bool) -> dict[str, Any]:
    """The output schema of tool_choice 'required' (named None) or a named function, as vLLM's
    `get_json_schema_from_tools`: `$defs` of the tools' parameters are gathered at the top for 'required'."""
    if named is not None:
        return next(_parameters(tool) for tool in tools if tool.function.name == named)
    defs: dict[str, Any] = {}
    items = []
    for tool in tools:
        parameters = dict(_parameters(tool))
        for key, value in (parameters.pop("$defs", None) or {}).items():
            if key in defs and defs[key] != value:
                raise invalid_request(f"the tools define $defs {key!r} differently", param="tools")
            defs[key] = value
        items.append(
            {
                "properties": {"name": {"type": "string", "enum": [tool.function.name]}, "parameters": parameters},
                "required": ["name", "parameters"],
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema
