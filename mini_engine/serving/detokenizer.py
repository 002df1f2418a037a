"""Streaming text out of token ids: an incremental detokenizer that never sends half a character, and OpenAI's
stop strings (cut from the text, never sent in part). Used by the server (server.py) for every answer."""
from __future__ import annotations


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that never end inside a UTF-8 character, cut at the
    first stop string.

    A byte-level BPE spells a character it has no token for (most emoji, much CJK) with several byte tokens, and
    decoding the first of them alone gives U+FFFD. So at each new token the text from `prefix_offset` (a few
    tokens back, so the tokenizer sees the boundary it would see in the whole text) is decoded again, and the new
    part is held back while it ends in U+FFFD. (vLLM's incremental detokenizer works the same way.) The deltas
    add up to the decoding of all the tokens at once.

    Stop strings (OpenAI's `stop`): the text ends before the first one, which is not included, and an ending that
    could still grow into one is held back until it cannot."""

    def __init__(self, tokenizer, stop: list[str] = ()):
        self.tokenizer, self.stop = tokenizer, list(stop)
        self.token_ids: list[int] = []
        self.prefix_offset = self.read_offset = 0  # text up to read_offset is in `text`; decode from prefix_offset
        self.text = ""       # complete characters decoded so far, cut at a stop string
        self.num_sent = 0    # characters of `text` handed out
        self.stopped = False  # a stop string was found: nothing more comes

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(self.token_ids[start:end])

    def add(self, token_ids: list[int]) -> str:
        """Take the next tokens; return the text that can be sent now (possibly "")."""
        if self.stopped:
            return ""
        self.token_ids += token_ids
        prefix, text = self._decode(self.prefix_offset, self.read_offset), self._decode(self.prefix_offset)
        if len(text) > len(prefix) and not text.endswith("\ufffd"):
            self.text += text[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return self._take()

    def finish(self) -> str:
        """The tokens have ended: the rest of the text, an unfinished character included (as U+FFFD, as in the
        decoding of the whole output)."""
        if not self.stopped:
            prefix = self._decode(self.prefix_offset, self.read_offset)
            self.text += self._decode(self.prefix_offset)[len(prefix):]
            self.prefix_offset = self.read_offset = len(self.token_ids)
        return self._take(final=True)

    def _take(self, final: bool = False) -> str:
        # A stop string can only start in the unsent text: a sent text never ends with the start of one.
        hits = [i for s in self.stop if (i := self.text.find(s, self.num_sent)) >= 0]
        if hits:
            self.text, self.stopped = self.text[:min(hits)], True
        hold = 0 if final or self.stopped else max(
            (k for s in self.stop for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)
        end = max(self.num_sent, len(self.text) - hold)
        delta, self.num_sent = self.text[self.num_sent:end], end
        return delta
