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
    # TODO: for n from min(ngram_max, len - 1) down to ngram_min, scan starts i = len - n - 1 down to 0; at the
    #       first i with token_ids[i:i + n] == token_ids[-n:], return token_ids[i + n:i + n + k]; else []
    raise NotImplementedError("lab06 ngram_propose: for n from ngram_max down to ngram_min, find the LATEST earlier "
                              "i with token_ids[i:i+n] == token_ids[-n:] and return token_ids[i+n:i+n+k]; [] if none")


def residual_distribution(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """max(0, p − q), normalised to sum to 1 over the last axis (shapes [..., V]): what the target wanted more
    often than the draft offered it, the only place a rejected position may draw from.

    Rows where nothing is left (p ≤ q everywhere, which happens when p = q up to rounding) return p itself."""
    # TODO: (p - q).clamp_min(0), divided by its sum over the last axis (keepdim); torch.where(sum > 0, ..., p)
    raise NotImplementedError("lab06 residual_distribution: (p - q).clamp_min(0) / its sum over the last axis, "
                              "or p itself in rows where that sum is 0")


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
    # TODO: follow steps 1-4. Useful: rows = torch.arange(S); target_probs[rows, num_accepted] picks p_j per
    #       sequence; torch.where(rejected[:, None], residual, p) chooses per row; then one list per sequence:
    #       its first num_accepted drafts + [the drawn token]
    raise NotImplementedError("lab06 rejection_sample: accept draft j when u * q(x_j) < p(x_j); keep drafts up to the "
                              "first rejection; draw the last token from the residual there, or from p_k if all passed")
