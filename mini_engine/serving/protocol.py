"""What the server accepts (chapter 09): OpenAI's request bodies, checked strictly, and the limits that keep one
request from costing the others.

Nothing is silently ignored. A body is parsed in strict mode (no "3" for 3, no true for 1, no NaN or infinity),
every field the server does not implement is refused with a 400 that names it, and fields of OpenAI's API that
the server implements only at their default value (`best_of`, `logit_bias`, the penalties) are refused at any
other value. Numbers out of range get a 400 too, from here or from the engine's own checks (`LLMEngine.validate`).
"""
from __future__ import annotations

import re
from typing import Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAX_STOPS, MAX_STOP_CHARS = 16, 256  # OpenAI takes up to 4 stop strings; vLLM sets no bound
MAX_LOGPROBS = 20                    # top log-probabilities per token, as OpenAI's top_logprobs


class APIError(Exception):
    """An error answered as OpenAI does: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Body(_Strict):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0   # OpenAI's default: sampling
    top_p: float = 1.0
    top_k: int = 0             # vLLM's extension; -1 (vLLM's "off") is taken as 0
    seed: int | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False   # vLLM's extension: generate max_tokens whatever the model says
    # OpenAI's fields implemented only at their default (no bias, no penalties): any other value is refused.
    logit_bias: dict[str, float] | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0

    def check(self) -> None:
        """Refuse what the parser lets through but the server does not do; raises APIError."""
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported by this server", "logit_bias")
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name) != 0:
                raise APIError(400, f"{name} is not supported by this server (only 0)", name)
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream: true", "stream_options")
        self.stops  # noqa: B018 (checks the stop strings)

    @property
    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in stops):
            raise APIError(400, "stop strings must not be empty", "stop")
        # Each is searched for after every token: a bound keeps one request from slowing every other one.
        if len(stops) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stops):
            raise APIError(400, f"stop: at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters", "stop")
        return stops


class CompletionBody(_Body):
    # One prompt (a string or a list of token ids), or a batch of them: a list of strings or of token-id lists.
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions; 0 is allowed with echo (score the prompt)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check(self) -> None:
        super().check()
        if self.suffix is not None:
            raise APIError(400, "suffix is not supported by this server (it completes a prompt, it does not insert "
                                "text before a suffix)", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, f"best_of={self.best_of} is not supported by this server: it returns the n samples "
                                "it draws, so best_of must equal n or be left out", "best_of")
        if self.max_tokens == 0 and not self.echo:
            raise APIError(400, "max_tokens must be >= 1 (0 only with echo: true, to score the prompt)",
                           "max_tokens")

    @property
    def prompts(self) -> list[str | list[int]]:
        """The batch: one request per prompt."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p) or [[]]  # [] is one empty prompt, refused as such


class _TextPart(_Strict):
    type: Literal["text"]
    text: str


class _Message(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str | list[_TextPart]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatBody(_Body):
    messages: list[_Message]
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def check(self) -> None:
        super().check()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        if not self.messages:
            raise APIError(400, "messages must not be empty", "messages")


class TokenizeBody(_Strict):
    """vLLM's /tokenize (lm-evaluation-harness's remote tokenizer calls it)."""
    model: str | None = None
    prompt: str
    add_special_tokens: bool = False

    def check(self) -> None:
        if self.add_special_tokens:
            raise APIError(400, "add_special_tokens: this server adds no special tokens to a prompt; /tokenize "
                                "tokenizes as /v1/completions does", "add_special_tokens")


class DetokenizeBody(_Strict):
    model: str | None = None
    tokens: list[int]


# ---------------------------------------------------------------- parsing

_TYPE_TAG = re.compile(r"^(str|int|float|bool|list|dict|none|.*\[.*\])$")  # pydantic's names of union members
_SHAPES = {"prompt": "prompt must be a string, a list of token ids, or a list of strings or of token-id lists",
           "stop": "stop must be a string or a list of strings",
           "content": "content must be a string or a list of {\"type\": \"text\", \"text\": ...} parts"}


def parse(model: type[BaseModel], raw: bytes):
    """The body as `model`, or an APIError naming the field at fault (400)."""
    try:
        body = model.model_validate_json(raw, strict=True)
    except ValidationError as e:
        raise _as_api_error(e) from None
    if hasattr(body, "check"):
        body.check()
    return body


def _as_api_error(e: ValidationError) -> APIError:
    errors = e.errors()
    # An unknown field first: a client that sent `messages` to /tokenize learns that, not that `prompt` is missing.
    first = next((err for err in errors if err["type"] == "extra_forbidden"), errors[0])
    if first["type"] == "json_invalid":
        return APIError(400, f"the body is not valid JSON: {first['msg']}")
    if first["type"] in ("model_type", "model_attributes_type") and not first["loc"]:
        return APIError(400, "the body must be a JSON object")
    loc = []
    for part in first["loc"]:
        if isinstance(part, str) and _TYPE_TAG.match(part):
            break  # a union's member: the error is about the field as a whole
        loc.append(str(part))
    param = ".".join(loc) or None
    if first["type"] == "extra_forbidden":
        return APIError(400, f"{param}: unknown or unsupported field (this server refuses the fields it does not "
                             "implement rather than ignore them)", param)
    if len(loc) < len(first["loc"]) and loc and loc[-1] in _SHAPES:
        return APIError(400, _SHAPES[loc[-1]], param)
    return APIError(400, f"{param or 'body'}: {first['msg']}", param)


def max_prompt_chars(tokenizer, max_model_len: int) -> int | None:
    """An upper bound on the characters of a prompt of fewer than `max_model_len` tokens, so a longer string can be
    refused without tokenizing it: no token stands for more characters than its vocabulary entry has (a byte-level
    token's entry has one character per byte, a byte-fallback token's more). A normalizer that merges characters
    (NFC, NFKC) can fold a few into one, hence the margin of 4 when there is one. None when the tokenizer's
    vocabulary cannot be read (then only the body limit bounds a prompt)."""
    backend = getattr(tokenizer, "backend", None)
    try:
        longest = max(len(t) for t in backend.get_vocab(with_added_tokens=True))
    except AttributeError:
        return None
    return max_model_len * longest * (4 if getattr(backend, "normalizer", None) is not None else 1)
