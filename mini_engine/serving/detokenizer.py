"""Text out of token ids, for the server (server.py): an incremental detokenizer that never sends half a character
and cuts OpenAI's stop strings (never sent in part), and each token's own text and bytes, as log-probabilities
show them (`TokenText`)."""
from __future__ import annotations

import re


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


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE spells each byte as one printable character (`bytes_to_unicode`): printable bytes
    as themselves, the others shifted past 255. Returns character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, shift = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + shift)] = b
            shift += 1
    return chars


class TokenText:
    """Each token on its own, as log-probabilities show it: `text(id)` is its text, or, when it holds only part of
    a character, "bytes:" and its bytes escaped (OpenAI's convention: "bytes:\\xf0\\x9f"); `bytes(id)` its UTF-8
    bytes (chat's `bytes` field). Special tokens show as themselves ("<|im_end|>"). Both are cached."""

    _BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a sentencepiece byte-fallback token

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._alphabet = _byte_level_alphabet()
        self._text: dict[int, str] = {}
        self._bytes: dict[int, bytes] = {}

    def bytes(self, token_id: int) -> bytes:
        if token_id not in self._bytes:
            self._bytes[token_id] = self._raw(token_id)
        return self._bytes[token_id]

    def text(self, token_id: int) -> str:
        if token_id not in self._text:
            raw = self.bytes(token_id)
            try:
                self._text[token_id] = raw.decode()
            except UnicodeDecodeError:
                self._text[token_id] = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        return self._text[token_id]

    def _raw(self, token_id: int) -> bytes:
        piece = self.tokenizer.decode([token_id], skip_special_tokens=False)
        if "\ufffd" not in piece:
            return piece.encode()
        # Part of a character: its bytes from the vocabulary entry (byte-level or byte-fallback spelling).
        entry = self.tokenizer.backend.id_to_token(token_id) if hasattr(self.tokenizer, "backend") else None
        if entry and all(c in self._alphabet for c in entry):
            return bytes(self._alphabet[c] for c in entry)
        if entry and (m := self._BYTE_TOKEN.fullmatch(entry)):
            return bytes([int(m.group(1), 16)])
        return piece.encode()  # no way to tell: the replacement character's own bytes
