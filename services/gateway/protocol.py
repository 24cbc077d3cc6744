"""OpenAI's completions and chat completions in Parkade's terms. Pure: no I/O.

    body bytes --parse_completion / parse_chat-->  OpenAIRequest (checked; SamplingParams built)
    TokenEvents of each choice --Choice.add-->      text, logprobs, finish of that choice
    Choices --completion_response / chat_response / *_chunk-->  OpenAI's JSON shapes

Requests follow OpenAI's fields as vLLM's server takes them, with vLLM's extensions (`top_k`,
`min_p`, `repetition_penalty`, `min_tokens`, `ignore_eos`, `stop_token_ids`, ...) and Parkade's
`priority`. A known field Parkade does not implement with a value that would change the answer
(`n` > 1, `echo`, `logit_bias`, `tools`, ...) is refused by name (400); a field this module does
not know is ignored, as vLLM's server does (OpenAI's clients send fields such as `metadata` and
`store` that change nothing here).
"""

from __future__ import annotations

import dataclasses
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from parkade.schemas import ChatMessage, ErrorKind, FinishReason, SamplingParams, TokenEvent, TokenLogprobs
from parkade.services.common.prompts import ChatOptions

# OpenAI's error `type` for each status we answer with.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}
# How a pipeline error maps to a status: the request's fault, a queue bound, a missing service.
STATUS_OF_ERROR_KIND = {
    ErrorKind.INVALID_REQUEST: 400,
    ErrorKind.OVERLOADED: 429,
    ErrorKind.UNAVAILABLE: 503,
    ErrorKind.INTERNAL: 500,
}


class GatewayError(Exception):
    """An answer in OpenAI's error shape: `{"error": {"message", "type", "param", "code"}}`.
    `error_type`: in place of OpenAI's type for the status (see `context_length_error`)."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | int | None = None,
        error_type: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.error_type = error_type or _ERROR_TYPES.get(status, "server_error")

    def body(self) -> dict[str, Any]:
        error = {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}
        return {"error": error}


def context_length_error(message: str, param: str | None) -> GatewayError:
    """A request over the model's context length, answered word for word as vLLM's server does
    (`"type": "BadRequestError", "code": 400`), so that clients written against vLLM that look
    for it find it."""
    return GatewayError(400, message, param, code=400, error_type="BadRequestError")


def pipeline_error(event: TokenEvent) -> GatewayError:
    """The answer to a request that the pipeline ended with an error event (the field to blame,
    when the event names one, as `param`)."""
    status = STATUS_OF_ERROR_KIND.get(event.error_kind or ErrorKind.INTERNAL, 500)
    return GatewayError(status, event.error or "the request failed", event.error_param, code=event.error_kind)


# ---- request bodies --------------------------------------------------------------------------
class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage on every chunk


class _Common(msgspec.Struct, kw_only=True):
    """Fields both endpoints take. None: the SamplingParams default."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    best_of: int | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    priority: int = 0
    max_tokens: int | None = None
    # vLLM's extra parameters
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    spaces_between_special_tokens: bool = True
    cache_salt: str | None = None
    prompt_logprobs: int | None = None  # vLLM's; refused here (see `_refuse_unsupported`)


class CompletionBody(_Common, kw_only=True):
    # str, [str], [int] or [[int]]: checked by `_prompts` (msgspec takes one array type a union).
    prompt: Any = None
    echo: bool = False
    suffix: str | None = None
    logprobs: int | None = None


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class MessageBody(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatBody(_Common, kw_only=True):
    messages: list[MessageBody] | None = None
    chat_template: str | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None


@dataclass(frozen=True)
class Prompt:
    """One choice's prompt: text, token ids or a chat (exactly one set)."""

    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    messages: tuple[ChatMessage, ...] | None = None


@dataclass(frozen=True)
class OpenAIRequest:
    """A checked request: what to run, and how to answer."""

    chat: bool
    model: str | None
    prompts: list[Prompt]
    params: SamplingParams
    stream: bool
    include_usage: bool
    continuous_usage: bool
    priority: int
    user: str | None = None
    cache_salt: str | None = None
    chat_options: ChatOptions | None = None  # for a chat
    # The field that set `params.max_tokens` ("max_tokens", "max_completion_tokens"); None when
    # the client set none: then no prompt is refused for it (see GatewayHandler.open).
    max_tokens_field: str | None = None


MAX_N = 128  # OpenAI's limit on n

_PARAM_AT = re.compile(r"at `\$\.([A-Za-z_]+)")


def _decode(body: bytes, kind: type[msgspec.Struct]) -> Any:
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as error:
        found = _PARAM_AT.search(str(error))
        raise GatewayError(400, f"invalid request: {error}", found.group(1) if found else None) from None
    except msgspec.DecodeError as error:
        raise GatewayError(400, f"the body is not valid JSON: {error}") from None


def _refuse_unsupported(body: _Common) -> None:
    if not 1 <= body.n <= MAX_N:
        raise GatewayError(400, f"n must be in [1, {MAX_N}]", "n")
    if body.best_of not in (None, body.n):
        raise GatewayError(400, "best_of is not supported (as in vLLM V1): use n", "best_of")
    if body.prompt_logprobs is not None:
        raise GatewayError(
            400,
            "prompt_logprobs is not served over HTTP: use the Python API or the Kafka topics",
            "prompt_logprobs",
        )


def _logit_bias(body: _Common) -> dict[int, float] | None:
    if body.logit_bias is None:
        return None
    try:
        return {int(k): v for k, v in body.logit_bias.items()}
    except ValueError:
        raise GatewayError(400, "logit_bias keys must be token ids", "logit_bias") from None


def _sampling_params(body: _Common, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    given = {
        name: getattr(body, name)
        for name in (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
            "seed",
            "stop",
            "stop_token_ids",
            "allowed_token_ids",
            "bad_words",
            "truncate_prompt_tokens",
        )
        if getattr(body, name) is not None
    }
    try:
        return SamplingParams(
            **given,
            max_tokens=max_tokens,
            min_tokens=body.min_tokens,
            ignore_eos=body.ignore_eos,
            include_stop_str_in_output=body.include_stop_str_in_output,
            skip_special_tokens=body.skip_special_tokens,
            spaces_between_special_tokens=body.spaces_between_special_tokens,
            logprobs=logprobs,
            n=body.n,
            logit_bias=_logit_bias(body),
        )
    except (ValueError, TypeError) as error:
        # SamplingParams' messages start with the field's name.
        raise GatewayError(400, str(error), str(error).split(" ", 1)[0]) from None


def _request(
    body: _Common,
    chat: bool,
    prompts: list[Prompt],
    params: SamplingParams,
    chat_options: ChatOptions | None = None,
) -> OpenAIRequest:
    if body.cache_salt is not None and not body.cache_salt:
        raise GatewayError(400, "cache_salt must be a non-empty string", "cache_salt")
    options = body.stream_options
    if options is not None and not body.stream:
        raise GatewayError(400, "stream_options is only allowed with stream: true", "stream_options")
    return OpenAIRequest(
        chat=chat,
        model=body.model,
        prompts=prompts,
        params=params,
        stream=body.stream,
        include_usage=options is not None and options.include_usage,
        continuous_usage=options is not None and options.continuous_usage_stats,
        priority=body.priority,
        user=body.user,
        cache_salt=body.cache_salt,
        chat_options=chat_options,
    )


def _prompts(prompt: Any) -> list[Prompt]:
    if prompt is None:
        raise GatewayError(400, "prompt is required", "prompt")
    if isinstance(prompt, str):
        return [Prompt(text=prompt)]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return [Prompt(text=p) for p in prompt]
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [Prompt(token_ids=tuple(prompt))]
        if all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompt):
            return [Prompt(token_ids=tuple(p)) for p in prompt]
    raise GatewayError(
        400, "prompt must be a string, a list of strings, a list of token ids or a list of those", "prompt"
    )


def parse_completion(body: bytes) -> OpenAIRequest:
    """A `/v1/completions` body, checked (GatewayError 400 naming the field)."""
    request = _decode(body, CompletionBody)
    _refuse_unsupported(request)
    if request.echo:
        raise GatewayError(400, "echo is not supported", "echo")
    if request.suffix:
        raise GatewayError(400, "suffix is not supported", "suffix")
    max_tokens = 16 if request.max_tokens is None else request.max_tokens  # OpenAI's default
    params = _sampling_params(request, max_tokens, request.logprobs)
    checked = _request(request, False, _prompts(request.prompt), params)
    return dataclasses.replace(checked, max_tokens_field=None if request.max_tokens is None else "max_tokens")


def _message(message: MessageBody) -> ChatMessage:
    if message.content is None or isinstance(message.content, str):
        return ChatMessage(role=message.role, content=message.content or "")
    texts = []
    for part in message.content:
        if part.type != "text" or part.text is None:
            raise GatewayError(400, f"content parts of type {part.type!r} are not supported", "messages")
        texts.append(part.text)
    return ChatMessage(role=message.role, content="\n".join(texts))


def parse_chat(body: bytes) -> OpenAIRequest:
    """A `/v1/chat/completions` body, checked (GatewayError 400 naming the field)."""
    request = _decode(body, ChatBody)
    _refuse_unsupported(request)
    if request.messages is None:
        raise GatewayError(400, "messages is required", "messages")
    if not request.messages:
        raise GatewayError(400, "messages must be a non-empty list", "messages")
    if request.tools:
        raise GatewayError(400, "tools are not supported", "tools")
    if request.response_format and request.response_format.get("type", "text") != "text":
        raise GatewayError(400, "only the text response_format is supported", "response_format")
    if request.top_logprobs is not None and not request.logprobs:
        raise GatewayError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    # max_completion_tokens is OpenAI's current name; max_tokens its deprecated one.
    field_ = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
    max_tokens = getattr(request, field_)
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    params = _sampling_params(request, max_tokens, logprobs)
    messages = tuple(_message(m) for m in request.messages)
    try:
        options = ChatOptions(
            chat_template=request.chat_template,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            chat_template_kwargs=request.chat_template_kwargs,
        )
    except ValueError as error:
        raise GatewayError(400, str(error), "continue_final_message") from None
    checked = _request(request, True, [Prompt(messages=messages)], params, options)
    return dataclasses.replace(checked, max_tokens_field=None if max_tokens is None else field_)


# ---- answers ---------------------------------------------------------------------------------
TokenText = Callable[[int], str]


@dataclass
class Choice:
    """What one choice (one prompt's request) has produced so far."""

    index: int
    num_prompt_tokens: int  # 0 on samples after a prompt's first: usage counts a prompt once
    text: str = ""
    num_tokens: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    last_event_at: float | None = None  # when its last event with tokens came (the gateway's clock)
    logprob_text_offset: int = 0  # where the next logprob token's text starts (streaming)

    def add(self, event: TokenEvent) -> None:
        self.text += event.text
        self.num_tokens = max(self.num_tokens, event.index + len(event.token_ids))
        self.logprobs.extend(event.logprobs or ())
        if event.finish_reason is not None:
            self.finish_reason, self.stop_reason = str(event.finish_reason), event.stop_reason
        if event.usage is not None:
            # On the request's last event: for all its samples, so counted on one choice only.
            self.num_cached_tokens = event.usage.cached_tokens


def joins(event: TokenEvent, then: TokenEvent) -> bool:
    """Whether `then`, the next event of `event`'s choice, can go out in the same streamed chunk:
    neither fails or carries logprobs (whose text offsets go event by event), `event` does not
    end its choice, and `then` starts where `event` ends."""
    return (
        event.finish_reason is None
        and _plain(event)
        and _plain(then)
        and then.index == event.index + len(event.token_ids)
    )


def _plain(event: TokenEvent) -> bool:
    return (
        not event.logprobs
        and event.prompt_logprobs is None
        and event.error is None
        and event.finish_reason is not FinishReason.ERROR
    )


def joined(event: TokenEvent, then: TokenEvent) -> TokenEvent:
    """One event for two that `joins` accepts: a client reads the same text and tokens."""
    return msgspec.structs.replace(
        event,
        token_ids=event.token_ids + then.token_ids,
        text=event.text + then.text,
        finish_reason=then.finish_reason,
        stop_reason=then.stop_reason,
        usage=then.usage,
    )


def usage(choices: list[Choice]) -> dict[str, Any]:
    prompt = sum(c.num_prompt_tokens for c in choices)
    completion = sum(c.num_tokens for c in choices)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(c.num_cached_tokens for c in choices)},
    }


def completion_logprobs(logprobs: list[TokenLogprobs], token_text: TokenText, offset: int) -> dict[str, Any]:
    """The completions API's (legacy) logprobs: `offset` is where this text starts in the choice."""
    tokens, token_logprobs, top, text_offset = [], [], [], []
    for position in logprobs:
        text = token_text(position.token_ids[0])
        tokens.append(text)
        token_logprobs.append(position.logprobs[0])
        top.append(
            {token_text(t): lp for t, lp in zip(position.token_ids[1:], position.logprobs[1:], strict=True)}
        )
        text_offset.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": text_offset,
    }


def _chat_token(token_id: int, logprob: float, token_text: TokenText) -> dict[str, Any]:
    text = token_text(token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def chat_logprobs(logprobs: list[TokenLogprobs], token_text: TokenText) -> dict[str, Any]:
    content = []
    for position in logprobs:
        entry = _chat_token(position.token_ids[0], position.logprobs[0], token_text)
        entry["top_logprobs"] = [
            _chat_token(t, lp, token_text)
            for t, lp in zip(position.token_ids[1:], position.logprobs[1:], strict=True)
        ]
        content.append(entry)
    return {"content": content}


@dataclass(frozen=True)
class Answer:
    """The fields every response and chunk of one HTTP request share."""

    id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def new(cls, chat: bool, model: str) -> Answer:
        return cls(f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", model)

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def completion_response(self, choices: list[Choice], token_text: TokenText) -> dict[str, Any]:
        return {
            **self._head("text_completion"),
            "choices": [
                {
                    "index": c.index,
                    "text": c.text,
                    "logprobs": completion_logprobs(c.logprobs, token_text, 0) if c.logprobs else None,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
                for c in choices
            ],
            "usage": usage(choices),
        }

    def chat_response(self, choices: list[Choice], token_text: TokenText) -> dict[str, Any]:
        return {
            **self._head("chat.completion"),
            "choices": [
                {
                    "index": c.index,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": chat_logprobs(c.logprobs, token_text) if c.logprobs else None,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
                for c in choices
            ],
            "usage": usage(choices),
        }

    def chunk(
        self,
        chat: bool,
        choice: Choice,
        event: TokenEvent,
        token_text: TokenText,
        text_offset: int,
        first: bool,
    ) -> dict[str, Any]:
        """One streamed chunk for `event` of `choice` (already added to it)."""
        logprobs = event.logprobs or None
        if chat:
            delta: dict[str, Any] = (
                {"role": "assistant", "content": event.text} if first else {"content": event.text}
            )
            entry: dict[str, Any] = {
                "index": choice.index,
                "delta": delta,
                "logprobs": chat_logprobs(list(logprobs), token_text) if logprobs else None,
            }
        else:
            entry = {
                "index": choice.index,
                "text": event.text,
                "logprobs": completion_logprobs(list(logprobs), token_text, text_offset)
                if logprobs
                else None,
            }
        entry["finish_reason"] = None if event.finish_reason is None else str(event.finish_reason)
        entry["stop_reason"] = event.stop_reason
        return {**self._head("chat.completion.chunk" if chat else "text_completion"), "choices": [entry]}

    def usage_chunk(self, chat: bool, choices: list[Choice]) -> dict[str, Any]:
        return {
            **self._head("chat.completion.chunk" if chat else "text_completion"),
            "choices": [],
            "usage": usage(choices),
        }

    def error_chunk(self, error: GatewayError) -> dict[str, Any]:
        return error.body()
