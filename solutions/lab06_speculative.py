"""Lab 06: speculative decoding's two small pieces, the n-gram proposer and the lossless rejection sampler.

A decode step reads every weight to produce one token. Speculative decoding lets something cheap guess the
next k tokens, then checks all k guesses in one target forward pass: the target's distributions
p_0 .. p_k at the k + 1 positions come out of that one pass. You write:
  1. `ngram_propose`: the cheapest guesser there is. Find the latest earlier place where the sequence's last
     n tokens occurred (n from ngram_max down to ngram_min) and propose the tokens that followed it there.
  2. `residual_distribution`: where to draw from after a rejection, max(0, p − q) normalised.
  3. `rejection_sample`: accept draft x with probability min(1, p(x) / q(x)); at the first rejection draw
     one token from the residual and stop; if every draft passes, draw a bonus token from p_k. The tokens
     that come out follow the target's distribution exactly, whatever the guesser proposed.

Fill in every function marked TODO in labs/lab06_speculative.py, then grade your work with

    pytest tests/labs/test_lab06.py --impl=labs

The tests draw 100,000 samples from your sampler and compare their frequencies with p: a sampler that
skips the residual, or accepts too eagerly, emits a different distribution and fails them.
"""
from __future__ import annotations

import torch


def ngram_propose(token_ids: list[int], k: int, ngram_min: int = 1, ngram_max: int = 3) -> list[int]:
    """Prompt lookup: up to k tokens guessed from the sequence's own past.

    For n = ngram_max, ngram_max - 1, ..., ngram_min (longer matches first: they are more specific), look for
    the last n tokens of `token_ids` at an earlier start, i.e. token_ids[i:i + n] == token_ids[-n:] with
    i < len(token_ids) - n. At the first n that has a match, take the latest such i and return the tokens
    that followed it, token_ids[i + n : i + n + k] (fewer than k when the sequence ends sooner). Return []
    when no n matches, and when k is 0."""
    length = len(token_ids)
    for n in range(min(ngram_max, length - 1), ngram_min - 1, -1):
        suffix = token_ids[length - n:]
        for start in range(length - n - 1, -1, -1):  # latest first
            if token_ids[start:start + n] == suffix:
                return token_ids[start + n:start + n + k]
    return []


def residual_distribution(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """max(0, p − q), normalised to sum to 1 over the last axis (shapes [..., V]): what the target wanted more
    often than the draft offered it, the only place a rejected position may draw from.

    Rows where nothing is left (p ≤ q everywhere, which happens when p = q up to rounding) return p itself."""
    residual = (target_probs - draft_probs).clamp_min(0)
    total = residual.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, residual / total.clamp_min(1e-30), target_probs)


def one_hot_drafts(draft_token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Given: q for a deterministic proposer (n-gram lookup, a greedy draft model), [S, k, V] fp32: all its
    probability on the token it proposed."""
    return torch.nn.functional.one_hot(draft_token_ids, vocab_size).float()


def rejection_sample(target_probs: torch.Tensor, draft_token_ids: torch.Tensor,
                     draft_probs: torch.Tensor | None = None,
                     generator: torch.Generator | None = None) -> list[list[int]]:
    """Verify k >= 1 drafts for each of S sequences at once; per sequence, the accepted drafts and then one
    token of the target's (1 to k + 1 ids).

    target_probs [S, k + 1, V]: row j is p_j, the target's distribution after j drafts; draft_token_ids
    [S, k] int64; draft_probs [S, k, V], the q each draft was drawn from, or None for a deterministic proposer
    (then q = `one_hot_drafts`). Draw every random number from `generator`.
      1. p(x_j) and q(x_j) for each draft (torch.gather on the last axis);
      2. accept draft j when u_j · q(x_j) < p(x_j) with u_j uniform in [0, 1) (torch.rand): probability
         min(1, p/q), written without dividing by a q that may be 0;
      3. a sequence keeps drafts up to its first rejection: num_accepted = the accepted flags' cumulative
         product (cumprod), summed along k;
      4. the last token: at a rejected position j, drawn from residual_distribution(p_j, q_j); when all k
         passed, from p_k (the bonus token). torch.multinomial draws one index per row.
    """
    s, k = draft_token_ids.shape
    if draft_probs is None:
        draft_probs = one_hot_drafts(draft_token_ids, target_probs.shape[-1])
    ids = draft_token_ids[..., None]
    p_x = target_probs[:, :k].gather(-1, ids).squeeze(-1)
    q_x = draft_probs.gather(-1, ids).squeeze(-1)
    accepted = torch.rand(s, k, generator=generator) * q_x < p_x
    num_accepted = accepted.int().cumprod(dim=1).sum(dim=1)

    rows = torch.arange(s)
    p_next = target_probs[rows, num_accepted]
    q_next = draft_probs[rows, num_accepted.clamp(max=k - 1)]  # only read where a draft was rejected
    rejected = (num_accepted < k)[:, None]
    dist = torch.where(rejected, residual_distribution(p_next, q_next), p_next)
    last = torch.multinomial(dist, 1, generator=generator).squeeze(1)
    return [row[:n] + [t] for row, n, t in zip(draft_token_ids.tolist(), num_accepted.tolist(), last.tolist())]
