"""Tokenizer: byte-level BPE (via the `tokenizers` library) plus the model's chat template (jinja2)."""
from __future__ import annotations

from dataclasses import dataclass

import jinja2
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers
from tokenizers import AddedToken


@dataclass
class Tokenizer:
    backend: HFTokenizer
    chat_template: str | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def encode(self, text: str) -> list[int]:
        # encode_batch gives encode's ids and releases the GIL while it works, so a server thread tokenizing a
        # long prompt does not pause the engine's thread.
        return self.backend.encode_batch([text], add_special_tokens=False)[0].ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render a conversation into the prompt string the instruct model was trained on."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat_template; pass a plain prompt instead")
        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)  # the settings HF renders with
        template = env.from_string(self.chat_template)
        special = {"bos_token": self._token(self.bos_token_id), "eos_token": self._token(self.eos_token_id)}
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt, **special)

    def _token(self, token_id: int | None) -> str:
        return "" if token_id is None else self.backend.id_to_token(token_id)


def bpe_from_gguf_metadata(tokens: list[str], merges: list[str], token_types: list[int],
                           pre: str) -> HFTokenizer:
    """Rebuild the GPT-2 style byte-level BPE that a GGUF file describes in its metadata."""
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merge_pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merge_pairs, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm", "starcoder", "refact"):
        # These split every digit on its own before the GPT-2 regex (llama.cpp's pre-tokenizer for them).
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in ("gpt2", "default", "smaug-bpe", "llama-bpe"):
        tok.pre_tokenizer = byte_level
    else:
        raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r}; known: smollm, starcoder, refact, gpt2")
    tok.decoder = decoders.ByteLevel()
    control = 3  # GGUF token type of special/control tokens (<|im_start|> and friends)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, token_types) if kind == control])
    return tok
