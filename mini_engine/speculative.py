"""Speculative decoding (chapter 06): proposers that guess the next k tokens cheaply, and the rejection
sampler that turns the target model's verdict on those guesses into tokens, losslessly.

One step for a sequence: a proposer drafts up to k tokens x_1..x_k; the target runs once over
[last token, x_1..x_k] and gives k + 1 distributions p_0..p_k (p_j: its next-token distribution after j
drafts); `rejection_sample` keeps the drafts the target agrees with and adds one token of its own.

Why it is lossless (Leviathan et al. 2023, Chen et al. 2023): draft x is drawn from the proposer's q and
accepted with probability min(1, p(x)/q(x)); on rejection the token is drawn from max(0, p − q), renormalised.
Token y then comes out with probability
    min(p(y), q(y))  [drafted and accepted]  +  (1 − Σ min(p, q)) · max(0, p(y) − q(y)) / Σ max(0, p − q)
and since Σ max(0, p − q) = 1 − Σ min(p, q), that is exactly p(y). A deterministic proposer (n-gram lookup,
a greedy draft model) is q one-hot at its guess: accept x with probability p(x), else sample p without x.
α = Σ min(p, q) is the acceptance rate (`formulas.acceptance_rate`); a step yields (1 − α^(k+1)) / (1 − α)
tokens on average.

Randomness is drawn up front (`draw_randoms`) and handed to a pure function (`rejection_sample_from_randoms`),
so the Triton kernel (kernels/rejection_sampler.py) and this torch form make the same choices, bit for bit.
"""
from __future__ import annotations

import os
from typing import Protocol

import numpy as np
import torch

from .attention import AttentionMetadata
from .kv_cache import ContiguousKVCache
from .sampling import SamplingParams, apply_top_k, apply_top_p

PAD_TOKEN_ID = -1  # pads draft_token_ids after a sequence's last draft (vLLM's placeholder convention)


# ---------------------------------------------------------------- proposers

class Proposer(Protocol):
    """Anything that drafts: up to k guesses (fewer, or none, is fine) for what follows `token_ids` (prompt +
    output so far), a deterministic function of them, so verified with q one-hot (draft_probs=None)."""

    def propose(self, token_ids: list[int], k: int) -> list[int]: ...


def _check_k(k) -> None:
    if not isinstance(k, int) or k < 0:
        raise ValueError(f"k must be an int >= 0, got {k!r}")


class NgramProposer:
    """Prompt lookup: when the text repeats itself (summaries quoting their source, code edits, extraction),
    what followed the sequence's last n tokens the previous time they appeared is a good guess for what
    follows now. Tries n from `ngram_max` down to `ngram_min` (longer matches are more specific) and proposes
    the (up to) k tokens after the latest earlier match. No model, no state: a scan of the sequence."""

    def __init__(self, ngram_min: int = 1, ngram_max: int = 4):
        if not isinstance(ngram_min, int) or ngram_min < 1:
            raise ValueError(f"ngram_min must be an int >= 1, got {ngram_min!r}")
        if not isinstance(ngram_max, int) or ngram_max < ngram_min:
            raise ValueError(f"ngram_max must be an int >= ngram_min ({ngram_min}), got {ngram_max!r}")
        self.ngram_min, self.ngram_max = ngram_min, ngram_max

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        _check_k(k)
        tokens = np.asarray(token_ids, dtype=np.int64)
        length = len(tokens)
        if k == 0 or length < 2:
            return []
        for n in range(min(self.ngram_max, length - 1), self.ngram_min - 1, -1):
            # Windows of tokens[:-1] start at i = 0 .. length - n - 1: every occurrence but the suffix itself.
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
            starts = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
            if starts.size:
                follow = starts[-1] + n  # the latest occurrence: the most recent context is the best guide
                return tokens[follow:follow + k].tolist()
        return []


class DraftModelProposer:
    """A smaller model with the target's tokenizer drafts k tokens, one cheap decode step each.

    It has its own KV cache, one slot per sequence. Each call keeps the common prefix of the slot's cached
    tokens and `token_ids` (dropping the drafts the target rejected) and runs the rest in one catch-up pass.
    Rolling back by prefix, not by a count, is deliberate: the two caches differ by a token or two after
    every step (the draft never computes its own last guess; the target's bonus token is new to it), and
    counting those by hand is the off-by-one several engines shipped. `propose` drafts greedily (q one-hot);
    `propose_sampled` samples, returning q for `rejection_sample`: more accepted when the target samples too.
    """

    def __init__(self, model, vocab_size: int | None = None, max_len: int = 2048, num_slots: int = 1):
        if vocab_size is not None and model.config.vocab_size != vocab_size:
            raise ValueError(f"model: the draft's vocabulary has {model.config.vocab_size} tokens but the target's "
                             f"has {vocab_size}; a draft must share the target's tokenizer")
        if not isinstance(max_len, int) or max_len < 2:
            raise ValueError(f"max_len must be an int >= 2, got {max_len!r}")
        if not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"num_slots must be an int >= 1, got {num_slots!r}")
        self.model, self.max_len = model, min(max_len, model.config.max_position_embeddings)
        self.kv_cache = ContiguousKVCache(model.config, num_slots, self.max_len, model.device, model.dtype)
        self.cached: list[list[int]] = [[] for _ in range(num_slots)]  # per slot: the tokens its cache holds

    def propose(self, token_ids: list[int], k: int, slot: int = 0) -> list[int]:
        """Up to k greedy drafts after `token_ids`; fewer near `max_len`."""
        return self.propose_sampled(token_ids, k, None, None, slot)[0]

    def propose_sampled(self, token_ids: list[int], k: int, params: SamplingParams,
                        generator: torch.Generator | None = None, slot: int = 0) -> tuple[list[int], torch.Tensor]:
        """Up to k drafts drawn from the draft's distribution processed with `params` (as the target's will
        be), and that distribution for each: (tokens, probs [n, V] fp32). params=None: greedy, probs None."""
        _check_k(k)
        if not token_ids:
            raise ValueError("token_ids must not be empty")
        if not 0 <= slot < len(self.cached):
            raise ValueError(f"slot must be in [0, {len(self.cached)}), got {slot}")
        k = min(k, self.max_len - len(token_ids))  # never past the cache: draft n sits at len(token_ids) + n - 1
        if k <= 0:
            return [], None if params is None else torch.empty(0, self.model.config.vocab_size)
        # Catch up: keep the common prefix; the last token always runs, its logits give the first draft.
        cached, tokens = self.cached[slot], list(token_ids)
        keep = 0
        while keep < min(len(cached), len(tokens) - 1) and cached[keep] == tokens[keep]:
            keep += 1
        logits = self._forward(tokens[keep:], len(tokens), slot)
        self.cached[slot] = tokens
        drafts, probs = [], []
        for n in range(k):
            if n:
                logits = self._forward([drafts[-1]], len(tokens) + 1, slot)
                tokens.append(drafts[-1])
            if params is None:
                drafts.append(int(logits[-1].argmax()))
            else:
                probs.append(target_probs_from_logits(logits[-1], params))
                drafts.append(int(torch.multinomial(probs[-1], 1, generator=generator)))
        return drafts, torch.stack(probs) if params is not None else None

    def release(self, slot: int = 0) -> None:
        """The sequence in `slot` is finished: forget its tokens (its cache rows are simply overwritten)."""
        self.cached[slot] = []

    def _forward(self, new_tokens: list[int], context_len: int, slot: int) -> torch.Tensor:
        """Run `new_tokens`, the last of a `context_len`-token context, through the draft against its cache."""
        meta = AttentionMetadata.build([len(new_tokens)], [context_len], slots=[slot], device=self.model.device,
                                       last_only=True)
        return self.model(torch.tensor(new_tokens, device=self.model.device), meta, self.kv_cache)


def make_proposer(spec, target, max_len: int, num_slots: int):
    """The proposer an engine's `SpeculativeConfig` asks for, next to `target` (a draft model is checked against
    it, or loaded on its device): one draft cache slot per engine slot, each `max_len` positions."""
    if spec.method != "draft":  # prompt lookup, or a proposer of your own (`Proposer`)
        return NgramProposer(spec.ngram_min, spec.ngram_max) if spec.method == "ngram" else spec.method
    draft, dtype_of = spec.model, lambda m: str(m.dtype).removeprefix("torch.")
    if isinstance(draft, (str, os.PathLike)):
        from .loading.loader import load_model
        draft, _ = load_model(str(draft), device=str(target.device), dtype=spec.dtype or dtype_of(target),
                              quantization=spec.quantization)
    elif spec.dtype is not None and dtype_of(draft) != spec.dtype:
        raise ValueError(f"speculative['dtype']={spec.dtype!r} but the draft model given is in {dtype_of(draft)}")
    if draft.device.type != target.device.type:
        raise ValueError(f"speculative['model'] is on {draft.device} but the target is on {target.device}")
    try:
        return DraftModelProposer(draft, target.config.vocab_size, max_len, num_slots)
    except ValueError as e:
        raise ValueError(f"speculative['model']: {str(e).removeprefix('model: ')}") from None


def target_probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a request samples from, [..., V] in fp32: temperature, top-k and top-p applied to the
    logits, then softmax; one-hot at the argmax when greedy. Target and draft must both go through this
    (same processing, same precision), or the accept test compares distributions the sampler never uses."""
    logits = logits.float()
    if params.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = apply_top_p(apply_top_k(logits / params.temperature, params.top_k), params.top_p)
    return torch.softmax(logits, dim=-1)


# ---------------------------------------------------------------- the rejection sampler

def num_drafts_of(draft_token_ids: torch.Tensor) -> torch.Tensor:
    """Drafts per sequence: the leading run of ids >= 0 in each row (rows are padded with -1). [S] int32,
    computed on the tensor's device, so a GPU caller does not wait for the host."""
    return (draft_token_ids >= 0).int().cumprod(dim=1).sum(dim=1, dtype=torch.int32)


def draw_randoms(num_drafts: list[int], k: int, vocab_size: int, generator=None, device="cpu"):
    """The random numbers one step consumes: `uniforms` [S, k] (one per draft, for the accept test) and
    `inv_exponentials` [S, V] (1 / E, E ~ Exp(1)). The token is drawn as argmax(w · (1 / E)), an exponential
    race: it picks i with probability w_i / Σ w for any w ≥ 0 without normalising, so kernel and torch cannot
    disagree on a rounding. `generator`: one torch.Generator (or None: the global one) for the whole batch,
    or one per sequence, so a seeded request's stream advances by its own drafts' uniforms and one row of
    exponentials per step, whatever else is in the batch."""
    s = len(num_drafts)
    if isinstance(generator, (list, tuple)):
        if len(generator) != s:
            raise ValueError(f"generator: one per sequence needed, got {len(generator)} for {s} sequences")
        uniforms = torch.zeros(s, k, device=device, dtype=torch.float32)
        exponentials = torch.empty(s, vocab_size, device=device, dtype=torch.float32)
        for i, (n, gen) in enumerate(zip(num_drafts, generator)):
            uniforms[i, :n] = torch.rand(n, generator=gen, device=device, dtype=torch.float32)
            exponentials[i].exponential_(generator=gen)
    else:
        uniforms = torch.rand(s, k, generator=generator, device=device, dtype=torch.float32)
        exponentials = torch.empty(s, vocab_size, device=device, dtype=torch.float32).exponential_(generator=generator)
    # exponential_ can return 0; the smallest normal float keeps 1 / E finite.
    return uniforms, 1.0 / exponentials.clamp_min_(torch.finfo(torch.float32).tiny)


def rejection_sample_from_randoms(target_probs: torch.Tensor, draft_token_ids: torch.Tensor,
                                  num_drafts: torch.Tensor, draft_probs: torch.Tensor | None,
                                  uniforms: torch.Tensor, inv_exponentials: torch.Tensor) -> torch.Tensor:
    """The torch reference of the step, batched over sequences (all fp32): [S, k + 1] int64, each row the
    accepted drafts, then the target's token, then -1 padding. Draft j is accepted when
    u_j · q_j(x_j) < p_j(x_j), with probability min(1, p/q); an id outside the vocabulary never is (p = 0).
    With a drafts accepted the last token is drawn at position a: from max(0, p_a − q_a) after a rejection
    (from p_a if rounding left that empty), from p_a (the bonus token) when all were accepted."""
    (s, k), vocab = draft_token_ids.shape, target_probs.shape[-1]
    rows = torch.arange(s, device=target_probs.device)
    in_vocab = (draft_token_ids >= 0) & (draft_token_ids < vocab)
    ids = draft_token_ids.long().clamp(0, vocab - 1)  # a safe index; out-of-vocab ids are masked off below
    p_x = target_probs[:, :k].gather(-1, ids[..., None]).squeeze(-1) * in_vocab
    q_x = draft_probs.gather(-1, ids[..., None]).squeeze(-1) if draft_probs is not None else torch.ones_like(p_x)
    drafted = torch.arange(k, device=ids.device) < num_drafts[:, None]
    accepted = ((uniforms * q_x < p_x) & drafted).int().cumprod(dim=1)  # stop at the first rejection
    num_accepted = accepted.sum(dim=1)
    p_last = target_probs[rows, num_accepted]
    rejected = num_accepted < num_drafts
    at = num_accepted.clamp(max=max(k - 1, 0))  # the rejected draft's position (any valid one when none)
    if k == 0:
        q_last = torch.zeros_like(p_last)
    elif draft_probs is not None:
        q_last = draft_probs[rows, at]
    else:  # one-hot at the rejected guess: the residual is p without that token
        q_last = torch.zeros_like(p_last).scatter_(-1, ids[rows, at, None], in_vocab[rows, at, None].float())
    residual = (p_last - q_last).clamp_min(0)
    dist = torch.where((rejected & (residual.amax(dim=-1) > 0))[:, None], residual, p_last)
    last = (dist * inv_exponentials).argmax(dim=-1)
    out = torch.where(accepted.bool(), draft_token_ids.long(), PAD_TOKEN_ID)
    out = torch.cat([out, torch.full((s, 1), PAD_TOKEN_ID, device=out.device)], dim=1)
    out[rows, num_accepted] = last
    return out


def _check_inputs(target_probs, draft_token_ids, draft_probs) -> None:
    if not isinstance(target_probs, torch.Tensor) or target_probs.dim() != 3:
        raise ValueError("target_probs must be a 3-D tensor [S, k + 1, V]")
    if (not isinstance(draft_token_ids, torch.Tensor) or draft_token_ids.dim() != 2
            or draft_token_ids.dtype not in (torch.int32, torch.int64)):
        raise ValueError("draft_token_ids must be a 2-D integer tensor [S, k] (pad short rows with -1)")
    (s, k), vocab = draft_token_ids.shape, target_probs.shape[-1]
    if target_probs.shape[:2] != (s, k + 1):
        raise ValueError(f"target_probs must be [S, k + 1, V] = [{s}, {k + 1}, V] for draft_token_ids [{s}, {k}], "
                         f"got {list(target_probs.shape)}")
    if draft_probs is not None and draft_probs.shape != (s, k, vocab):
        raise ValueError(f"draft_probs must be [S, k, V] = {[s, k, vocab]}, got {list(draft_probs.shape)}")
    for name, t in (("draft_token_ids", draft_token_ids), ("draft_probs", draft_probs)):
        if t is not None and t.device != target_probs.device:
            raise ValueError(f"{name} is on {t.device} but target_probs is on {target_probs.device}")
    if draft_token_ids.device.type == "cpu":  # cheap on the host; on a GPU it would wait for the device
        if ((draft_token_ids < -1) | (draft_token_ids >= vocab)).any():
            raise ValueError(f"draft_token_ids must be token ids in [0, {vocab}) or -1 (padding)")
        if (draft_token_ids[:, 1:] >= 0).logical_and(draft_token_ids[:, :-1] < 0).any():
            raise ValueError("draft_token_ids: -1 may only pad the end of a row")


def rejection_sample(target_probs: torch.Tensor, draft_token_ids: torch.Tensor,
                     draft_probs: torch.Tensor | None = None, generator=None) -> list[list[int]]:
    """Verify drafts against the target: for each sequence, the accepted drafts and one more token (1 to
    k + 1 ids), distributed exactly as sampling the target one token at a time would be.

    target_probs [S, k + 1, V]: row j is the target's processed distribution (`target_probs_from_logits`)
      after j drafts; draft_token_ids [S, k]: the drafts, a row with fewer padded at its end with -1;
    draft_probs [S, k, V]: the distributions the drafts were drawn from, or None for a deterministic
      proposer; generator: a torch.Generator, one per sequence, or None. CUDA tensors run the Triton kernel.
    """
    _check_inputs(target_probs, draft_token_ids, draft_probs)
    s, k = draft_token_ids.shape
    num_drafts = num_drafts_of(draft_token_ids)
    counts = num_drafts.tolist() if isinstance(generator, (list, tuple)) else [k] * s
    uniforms, inv_exponentials = draw_randoms(counts, k, target_probs.shape[-1], generator, target_probs.device)
    draft_probs = draft_probs.float() if draft_probs is not None else None
    args = (target_probs.float(), draft_token_ids, num_drafts, draft_probs, uniforms, inv_exponentials)
    if target_probs.is_cuda:
        from .kernels import rejection_sampler  # imported here: only a GPU run needs triton
        out = rejection_sampler(*args)
    else:
        out = rejection_sample_from_randoms(*args)
    lengths = (out >= 0).sum(dim=1).tolist()  # every row is its tokens, then -1 padding
    return [row[:n] for row, n in zip(out.tolist(), lengths)]


def verify(logits: torch.Tensor, drafts: list[int], draft_probs: torch.Tensor | None, params: SamplingParams,
           generator) -> list[int]:
    """The tokens one sequence keeps from its 1 + len(drafts) rows of target logits: the accepted drafts,
    then one token of the target's own (with no drafts, an ordinary sample). `draft_probs` [>= len(drafts),
    V]: a sampling draft model's distributions (None: a deterministic proposer)."""
    if params.greedy:  # one-hot target rows: accept while the draft is the argmax, then the argmax
        best = logits.argmax(dim=-1).tolist()
        accepted = next((i for i, (d, b) in enumerate(zip(drafts, best)) if d != b), len(drafts))
        return best[:accepted + 1]
    probs = target_probs_from_logits(logits, params)[None]
    ids = torch.tensor([drafts], dtype=torch.int64, device=logits.device).view(1, len(drafts))
    q = None if draft_probs is None else draft_probs[:len(drafts)].to(logits.device)[None]
    return rejection_sample(probs, ids, q, [generator])[0]  # only the drafts proposed consume uniforms
