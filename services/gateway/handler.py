"""The gateway's core, without I/O: one served model, the checks a request passes before it
reaches the pipeline, and the text of a token for logprobs.

    handler.open(chat, body) -> Opened: the checked request, the generate requests to send (one
                                         per prompt) and a Choice to gather each one's events

A request is refused here (GatewayError, in OpenAI's shape) when its body or a parameter is
invalid (400), it names another model (404), or a prompt cannot run on the model (empty, too
long for it alone or with the max_tokens the client set, ids outside its vocabulary: 400; the
context-length ones in vLLM's words and shape), so that such a request never travels through
Kafka. What
passes is tokenized here, once (a chat rendered by its template, the bad words too): it travels
as token ids, which the tokenizer service takes as they are.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from parkade.models import DEFAULT_MODEL
from parkade.schemas import SamplingParams
from parkade.services.common import context, prompts
from parkade.services.common.model_config import ModelConfig, resolve_max_model_len
from parkade.services.common.model_files import MODEL_METADATA, check_model_folder, load_tokenizer
from parkade.services.common.simulation import SIMULATE_METADATA, max_positions
from parkade.services.gateway.protocol import (
    Answer,
    Choice,
    GatewayError,
    OpenAIRequest,
    Prompt,
    context_length_error,
    parse_chat,
    parse_completion,
)

# Kafka's default record size limit is 1 MiB: a body near it could not travel as a request.
DEFAULT_MAX_BODY_BYTES = 1_000_000


@dataclass(frozen=True, kw_only=True)
class GatewayOptions:
    model: str | Path = field(default=DEFAULT_MODEL, metadata=MODEL_METADATA)
    tokenizer: str | Path | None = field(
        default=None, metadata={"help": "folder of the tokenizer (tokenizer.json); unset: the model's"}
    )
    served_model_name: str | None = field(
        default=None, metadata={"help": "the model's name in the API; unset: the model folder's name"}
    )
    max_model_len: int | None = field(
        default=None, metadata={"help": "longest prompt + output served; unset: the model's own limit"}
    )
    simulate: str | None = field(default=None, metadata=SIMULATE_METADATA)  # for its length limit
    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on (0.0.0.0: every one)"})
    http_port: int = field(default=8000, metadata={"help": "HTTP port (0: a free one)"})
    max_body_bytes: int = field(
        default=DEFAULT_MAX_BODY_BYTES, metadata={"help": "larger request bodies are refused (413)"}
    )
    trust_request_chat_template: bool = field(
        default=False,
        metadata={"help": "let requests carry their own chat_template (code that runs: see the tokenizer's)"},
    )


@dataclass
class Opened:
    """A checked request, ready to send: `submits[i]` is choice i's `RequestClient.submit` keywords."""

    request: OpenAIRequest
    answer: Answer
    submits: list[dict[str, Any]]
    choices: list[Choice]


class GatewayHandler:
    def __init__(
        self,
        tokenizer: Any,
        *,
        model_name: str,
        root: str,
        vocab_size: int,
        max_model_len: int,
        trust_request_chat_template: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.root = root
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.token_bound = context.TokenLowerBound.from_tokenizer(tokenizer)  # see FrontEnd's
        self.trust_request_chat_template = trust_request_chat_template
        self.created = int(time.time())
        self._anchor = tokenizer.encode("a", add_special_tokens=False)[-1]
        self._anchor_text = tokenizer.decode([self._anchor])
        self.token_text = functools.lru_cache(maxsize=65536)(self._token_text)

    @classmethod
    def from_options(cls, options: GatewayOptions) -> GatewayHandler:
        """The model folder's config and tokenizer; ValueError for a folder that cannot serve."""
        check_model_folder(options.model, weights=False, tokenizer=False)
        config = ModelConfig.from_pretrained(options.model)
        return cls(
            load_tokenizer(options.tokenizer or options.model),
            model_name=options.served_model_name or Path(options.model).name,
            root=str(options.model),
            vocab_size=config.vocab_size,
            max_model_len=resolve_max_model_len(
                max_positions(options.model, options.simulate), options.max_model_len
            ),
            trust_request_chat_template=options.trust_request_chat_template,
        )

    def models(self) -> dict[str, Any]:
        """`GET /v1/models`."""
        model = {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "parkade",
            "root": self.root,
            "parent": None,
            "max_model_len": self.max_model_len,
        }
        return {"object": "list", "data": [model]}

    def open(self, chat: bool, body: bytes) -> Opened:
        """Check a `/v1/chat/completions` (chat) or `/v1/completions` body; GatewayError if it
        cannot run."""
        request = parse_chat(body) if chat else parse_completion(body)
        if request.model is not None and request.model != self.model_name:
            raise GatewayError(
                404, f"The model `{request.model}` does not exist.", "model", "model_not_found"
            )
        options = request.chat_options
        if options is not None and options.chat_template is not None and not self.trust_request_chat_template:
            raise GatewayError(
                400,
                "chat_template is refused: this server uses the model's own (start it with "
                "--trust-request-chat-template to allow requests' templates)",
                "chat_template",
            )
        if request.params.truncate_prompt_tokens == -1:
            # -1 is this server's max_model_len: said as a number, so that the tokenizer cuts the
            # same prompt (its own limit may be the model's).
            params = msgspec.structs.replace(request.params, truncate_prompt_tokens=self.max_model_len)
            request = dataclasses.replace(request, params=params)
        answer = Answer.new(chat, self.model_name)
        params = self._resolved(request.params)
        submits, choices = [], []
        n = params.n
        for index, prompt in enumerate(request.prompts):
            token_ids = self._prompt_token_ids(request, prompt, "messages" if chat else "prompt")
            submits.append(
                {
                    # Tokenized here, once: the tokenizer service takes the ids as they are (the
                    # text does not travel too: nothing past here reads it, and it would double
                    # the record's size against the broker's limit).
                    "prompt_token_ids": token_ids,
                    "sampling_params": self._fitted(request, params, len(token_ids)),
                    "priority": request.priority,
                    "cache_salt": request.cache_salt,
                    "session_id": request.user,  # OpenAI's `user`: the session router's key
                    # Unique per HTTP request; the index tells a choice's events apart.
                    "request_id": f"{answer.id}-{index}" if len(request.prompts) > 1 else answer.id,
                }
            )
            # Prompt i's sample s is choice i * n + s (OpenAI's order).
            choices += [Choice(index * n + s, len(token_ids) if s == 0 else 0) for s in range(n)]
        return Opened(request, answer, submits, choices)

    def _resolved(self, params: SamplingParams) -> SamplingParams:
        """`bad_words` as token ids (tokenized here too, like the prompt)."""
        try:
            return prompts.resolve_bad_words(self.tokenizer, params)
        except ValueError as error:
            raise GatewayError(400, str(error), "bad_words") from None

    def _fitted(self, request: OpenAIRequest, params: SamplingParams, num_prompt: int) -> SamplingParams:
        """`params` for one prompt. A max_tokens the client set must fit in the context with the
        prompt (400 in vLLM's words otherwise); the completions default (16) that does not fit
        becomes the rest of the context (max_tokens=None), as when the client sets none."""
        field_ = request.max_tokens_field
        if field_ is not None:
            try:
                context.check_context_length(
                    num_prompt, params.max_tokens, self.max_model_len, max_tokens_name=field_
                )
            except context.ContextLengthError as error:
                raise context_length_error(str(error), error.param) from None
        elif params.max_tokens is not None and num_prompt + params.max_tokens > self.max_model_len:
            return msgspec.structs.replace(params, max_tokens=None)
        return params

    def _prompt_token_ids(self, request: OpenAIRequest, prompt: Prompt, param: str) -> list[int]:
        """The prompt tokenized (a chat rendered first) and checked against the model."""
        try:
            return context.prompt_token_ids(
                self.tokenizer,
                bound=self.token_bound,
                vocab_size=self.vocab_size,
                max_model_len=self.max_model_len,
                prompt=prompt.text,
                prompt_token_ids=prompt.token_ids,
                messages=prompt.messages,
                chat=request.chat_options,
                truncate=request.params.truncate_prompt_tokens,
            )
        except context.ContextLengthError as error:
            raise context_length_error(str(error), param) from None
        except Exception as error:  # a template may raise anything on a chat it refuses
            raise GatewayError(400, str(error), param) from None

    def _token_text(self, token_id: int) -> str:
        # Decoded after another token: alone, a SentencePiece-style tokenizer drops the leading
        # space that the token carries in a text.
        return self.tokenizer.decode([self._anchor, token_id])[len(self._anchor_text) :]
