"""One HTTP request's answer, built from the engine's token events (chapter 09): text, log-probabilities, finish
reasons and usage, in OpenAI's shapes for /v1/completions and /v1/chat/completions, whole or as server-sent
events. The server calls `feed`, `sse`, `sse_end` and `whole` on a worker thread, never on the event loop:
detokenizing and formatting cost grows with the answer, and no answer may hold up the others.

Log-probabilities, as vLLM gives them by default, are the model's raw ones: log_softmax of its logits in fp32,
before temperature, top-k or top-p (`sampling.logprobs_of`), computed from the logits the step sampled from.
  - /v1/completions, `logprobs: k`: `choices[i].logprobs` = {tokens, token_logprobs, top_logprobs, text_offset},
    one entry per token; `top_logprobs[j]` maps token text to log-probability for the k most likely tokens and
    the chosen one (so k or k + 1 entries); `text_offset[j]` is where token j's text starts in the choice's
    `text`. With `echo: true` the prompt comes first, in the text and in the four lists (its first token has
    None: nothing precedes it to score it).
  - /v1/chat/completions, `logprobs: true, top_logprobs: k`: `choices[i].logprobs.content` = one
    {token, logprob, bytes, top_logprobs: [{token, logprob, bytes}] * k} per token.
A token holding only part of a character shows as "bytes:\\xNN..." (`TokenText`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from .detokenizer import IncrementalDetokenizer, TokenText

LOGPROB_FLOOR = -9999.0  # vLLM's stand-in for -inf, which JSON cannot carry


@dataclass
class Prompt:
    """One prompt of a request, as the engine got it."""
    ids: list[int]
    text: str | None = None  # what echo shows (the prompt string, or its token ids decoded)


@dataclass
class _Choice:
    """One choice: prompt p's sample s, at index p * n + s."""
    detok: IncrementalDetokenizer
    base: int = 0                    # echo: the prompt's characters before the generated text
    text: list[str] = field(default_factory=list)
    entries: list[tuple] = field(default_factory=list)  # (token id, {id: logprob} | None, text offset)
    reason: str | None = None
    ended: bool = False              # nothing more is sent (finished, or cut at a stop string)
    engine_done: bool = False        # the engine has finished it (else it is aborted when the answer ends)
    num_tokens: int = 0              # output tokens in the answer


class Responder:
    """Turns engine events ("tokens", prompt index, [(sample, new ids, finish reason, logprobs)], prompt
    logprobs) into an answer. `feed` then `whole()` for a JSON body, or `sse_start`, `sse(event)` and `sse_end`
    for a stream. `top`: the k of logprobs (None: none asked); `drop_output`: max_tokens 0 with echo, where the
    one token the engine was asked for is not part of the answer."""

    def __init__(self, head: dict, prompts: list[Prompt], n: int, tokenizer, token_text: TokenText,
                 stops: list[str], chat: bool, top: int | None = None, echo: bool = False,
                 drop_output: bool = False, include_usage: bool = False):
        self.head, self.prompts, self.n, self.chat, self.top = head, prompts, n, chat, top
        self.echo, self.drop_output, self.include_usage = echo, drop_output, include_usage
        self.tokenizer, self.token_text = tokenizer, token_text
        self.choices = [_Choice(IncrementalDetokenizer(tokenizer, stops),
                                len(prompts[c // n].text) if echo else 0) for c in range(len(prompts) * n)]
        self.prompt_entries: list[list[tuple] | None] = [None] * len(prompts)
        self.echoed = [False] * len(self.choices)

    @property
    def done(self) -> bool:
        return all(c.ended for c in self.choices)

    def unfinished_prompts(self) -> list[int]:
        """Prompts with a sample the engine has not finished (to abort when the answer ends early)."""
        return sorted({i // self.n for i, c in enumerate(self.choices) if not c.engine_done})

    # ------------------------------------------------------------ consuming events

    def feed(self, event) -> list[tuple]:
        """Take one engine event; returns the updates (choice, text delta, entries, finish reason | None), echo's
        prompt first when it is due."""
        _, p, deltas, prompt_logprobs = event
        if prompt_logprobs is not None or (self.echo and self.top is None and self.prompt_entries[p] is None):
            self.prompt_entries[p] = self._prompt_entries(p, prompt_logprobs)
        updates = []
        for s, ids, reason, logprobs in deltas:
            c = p * self.n + s
            choice = self.choices[c]
            if self.echo and not self.echoed[c]:
                self.echoed[c] = True
                updates.append((c, self.prompts[p].text, self.prompt_entries[p] or [], None))
                choice.text.append(self.prompts[p].text)
            choice.engine_done = choice.engine_done or reason is not None
            if not choice.ended:
                updates.append(self._consume(choice, c, ids, reason, logprobs))
        return updates

    def _prompt_entries(self, p: int, logprobs) -> list[tuple]:
        if logprobs is None:
            return []
        ids, detok, entries = self.prompts[p].ids, IncrementalDetokenizer(self.tokenizer), []
        for t, lp in zip(ids, logprobs):
            entries.append((t, lp, len(detok.text)))
            detok.add([t])
        return entries

    def _consume(self, choice: _Choice, c: int, ids: list[int], reason: str | None, logprobs) -> tuple:
        if self.drop_output:  # max_tokens 0: the prompt was all that was asked for
            choice.ended, choice.reason = reason is not None, reason and "length"
            return c, "", [], choice.reason
        delta, entries = "", []
        for j, t in enumerate(ids):
            offset = choice.base + len(choice.detok.text)
            delta += choice.detok.add([t])
            choice.num_tokens += 1
            if logprobs is not None:
                entries.append((t, logprobs[j], offset))
            if choice.detok.stopped:  # a stop string ends the choice here; later tokens are not sent
                reason = "stop"
                break
        if reason is not None and not choice.detok.stopped:
            delta += choice.detok.finish()
        choice.ended, choice.reason = reason is not None, reason
        choice.text.append(delta)
        choice.entries += entries
        return c, delta, entries, reason

    # ------------------------------------------------------------ formatting

    def _logprobs(self, entries: list[tuple]) -> dict | None:
        if self.top is None:
            return None
        text = self.token_text.text
        if not self.chat:
            return {"tokens": [text(t) for t, _, _ in entries],
                    "token_logprobs": [None if lp is None else _floor(lp[t]) for t, lp, _ in entries],
                    "top_logprobs": [None if lp is None else {text(i): _floor(v) for i, v in _by_value(lp)}
                                     for _, lp, _ in entries],
                    "text_offset": [offset for _, _, offset in entries]}
        return {"content": [{**self._token(t, lp[t]),
                             "top_logprobs": [self._token(i, v) for i, v in _by_value(lp)[:self.top]]}
                            for t, lp, _ in entries]}

    def _token(self, token_id: int, logprob: float) -> dict:
        return {"token": self.token_text.text(token_id), "logprob": _floor(logprob),
                "bytes": list(self.token_text.bytes(token_id))}

    def usage(self) -> dict:
        prompt = sum(len(p.ids) for p in self.prompts)
        completion = sum(c.num_tokens for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def whole(self) -> bytes:
        """The JSON body of a non-streamed answer, once every choice has ended."""
        choices = []
        for i, c in enumerate(self.choices):
            entries = (self.prompt_entries[i // self.n] or []) + c.entries if self.echo else c.entries
            logprobs = self._logprobs(entries)
            if self.chat:
                if logprobs is not None:
                    logprobs["refusal"] = None
                choices.append({"index": i, "message": {"role": "assistant", "content": "".join(c.text)},
                                "logprobs": logprobs, "finish_reason": c.reason})
            else:
                choices.append({"index": i, "text": "".join(c.text), "logprobs": logprobs,
                                "finish_reason": c.reason})
        return _dumps({**self.head, "choices": choices, "usage": self.usage()})

    def sse_start(self) -> str:
        """Chat opens each choice with the assistant's role."""
        if not self.chat:
            return ""
        return self._event([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None} for i in range(len(self.choices))])

    def sse(self, event) -> str:
        """The events for one engine event: text (and log-probabilities) first, then the choices that ended."""
        merged: dict[int, tuple] = {}  # one entry per choice in a chunk (echo's prompt and the first tokens join)
        for c, delta, entries, reason in self.feed(event):
            text, before, _ = merged.get(c, ("", [], None))
            merged[c] = (text + delta, before + entries, reason)
        texts, ends = [], []
        for c, (delta, entries, reason) in merged.items():
            if delta or entries:
                logprobs = self._logprobs(entries)
                texts.append({"index": c, "delta": {"content": delta}, "logprobs": logprobs, "finish_reason": None}
                             if self.chat else {"index": c, "text": delta, "logprobs": logprobs, "finish_reason": None})
            if reason is not None:
                ends.append({"index": c, "delta": {}, "logprobs": None, "finish_reason": reason} if self.chat
                            else {"index": c, "text": "", "logprobs": None, "finish_reason": reason})
        return (self._event(texts) if texts else "") + (self._event(ends) if ends else "")

    def sse_end(self) -> str:
        """The usage chunk (choices []) when asked for, then [DONE]."""
        usage = self._event([], usage=self.usage()) if self.include_usage else ""
        return usage + "data: [DONE]\n\n"

    def _event(self, choices: list, **more) -> str:
        head = {**self.head, "object": "chat.completion.chunk" if self.chat else "text_completion"}
        extra = {"usage": None} if self.include_usage else {}
        return f"data: {_dumps({**head, 'choices': choices, **extra, **more}).decode()}\n\n"


def _by_value(logprobs: dict[int, float]) -> list[tuple[int, float]]:
    return sorted(logprobs.items(), key=lambda item: -item[1])


def _floor(logprob: float) -> float:
    return logprob if logprob > LOGPROB_FLOOR else LOGPROB_FLOOR  # also NaN, should a model ever give one


def _dumps(obj) -> bytes:
    return json.dumps(obj, ensure_ascii=False, allow_nan=False).encode()
