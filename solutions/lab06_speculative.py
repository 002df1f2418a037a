"""Lab 06: speculative decoding: the n-gram proposer, the lossless rejection sampler, and the loop around them.

A decode step reads every weight to produce one token. Speculative decoding lets something cheap guess the
next k tokens, then checks all k guesses in one target forward pass: the target's distributions
p_0 .. p_k at the k + 1 positions come out of that one pass. You write:
  1. `ngram_propose`: the cheapest guesser there is. Find the latest earlier place where the sequence's last
     n tokens occurred (n from ngram_max down to ngram_min) and propose the tokens that followed it there.
  2. `residual_distribution`: where to draw from after a rejection, max(0, p − q) normalised.
  3. `rejection_sample`: accept draft x with probability min(1, p(x) / q(x)); at the first rejection draw
     one token from the residual and stop; if every draft passes, draw a bonus token from p_k. The tokens
     that come out follow the target's distribution exactly, whatever the guesser proposed.
  4. `generate_speculative`: the loop that makes it pay. Each round drafts, verifies the drafts in ONE
     forward pass of the target, keeps what the rejection sampler accepts, and rolls the KV cache back to
     the tokens kept. `Target` (given) wraps the real model and its cache in the two operations you need.

Fill in every function marked TODO in labs/lab06_speculative.py, then grade your work with

    pytest tests/labs/test_lab06.py --impl=labs

The tests draw 100,000 samples from your sampler and compare their frequencies with p: a sampler that
skips the residual, or accepts too eagerly, emits a different distribution and fails them. Your loop must
give the engine's tokens on the real model, and the lab notebook ends by serving requests with the real
engine (`LLM`) drafting with your `ngram_propose`.
"""
from __future__ import annotations

import torch

from mini_engine.attention import AttentionMetadata
from mini_engine.kv_cache import ContiguousKVCache


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
      3. a sequence keeps its drafts up to its first rejection, and none after it, even those that would pass;
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


def probs_from_logits(logits: torch.Tensor, temperature: float = 0.0) -> torch.Tensor:
    """Given: the distributions a request samples from, [..., V] in fp32: softmax(logits / temperature), or
    one-hot at the argmax when temperature is 0 (greedy)."""
    logits = logits.float()
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).float()
    return torch.softmax(logits / temperature, dim=-1)


class Target:
    """Given: the target model and the KV cache of ONE sequence, behind the two operations the loop needs.

    `forward(token_ids)` runs the tokens at positions num_cached, num_cached + 1, ... in one forward pass: their
    keys and values join the cache, and the logits at every position come back, [len(token_ids), V] (row i:
    the next-token logits after token_ids[i]). `rollback(num_tokens)` keeps the first num_tokens positions and
    forgets the rest: attention never reads past num_cached, and the next forward overwrites those rows.
    State: `num_cached`, the positions the cache holds; `num_passes`, forward passes so far."""

    def __init__(self, model, max_len: int):
        self.model, self.max_len = model, max_len
        self.kv_cache = ContiguousKVCache(model.config, 1, max_len, model.device, model.dtype)
        self.num_cached = self.num_passes = 0

    def forward(self, token_ids: list[int]) -> torch.Tensor:
        n = len(token_ids)
        if n == 0 or self.num_cached + n > self.max_len:
            raise ValueError(f"forward: {n} tokens after {self.num_cached} cached positions (the cache holds "
                             f"{self.max_len}; at least one token)")
        meta = AttentionMetadata.build([n], [self.num_cached + n], slots=[0], device=self.model.device)
        logits = self.model(torch.tensor(token_ids, device=self.model.device), meta, self.kv_cache)
        self.num_cached += n
        self.num_passes += 1
        return logits

    def rollback(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self.num_cached:
            raise ValueError(f"rollback: keep {num_tokens} positions of the {self.num_cached} the cache holds?")
        self.num_cached = num_tokens


def generate_speculative(target: Target, prompt_ids: list[int], propose, k: int, max_new_tokens: int,
                         temperature: float = 0.0, stop_token_id: int | None = None,
                         generator: torch.Generator | None = None) -> tuple[list[int], list[tuple[int, int]]]:
    """Speculative decoding of one sequence on `target` (its cache empty). Returns the new tokens and, for each
    verify round, (drafts proposed, drafts accepted): every round after the prefill is recorded, and a round with
    no drafts (the proposer found none, or one token was left) as (0, 0).

      1. Prefill: run the prompt; the first new token is drawn from its last row's distribution.
      2. Each round: `propose(token_ids, n)` (the prompt and the output so far) guesses up to n tokens, with
         n = min(k, max_new_tokens - len(output) - 1), since a round yields its accepted drafts plus one token:
         never more than are left. Verify the drafts in ONE `target.forward` pass, turn its logits into
         distributions with `probs_from_logits`, and keep what your `rejection_sample` returns. With no draft,
         the round's one token is drawn from p_0 (torch.multinomial).
      3. Roll back: the cache must hold keys and values for every token kept but the newest (the next round
         runs that one), and none for a rejected draft.
    Tokens join the output one at a time: stop after max_new_tokens of them, or right after stop_token_id.
    Draw every random number from `generator`."""
    out: list[int] = []
    rounds: list[tuple[int, int]] = []

    def keep(tokens: list[int]) -> bool:  # True once the output is complete
        for token in tokens:
            out.append(token)
            if token == stop_token_id or len(out) == max_new_tokens:
                return True
        return False

    logits = target.forward(list(prompt_ids))
    done = keep([int(torch.multinomial(probs_from_logits(logits[-1], temperature), 1, generator=generator))])
    while not done:
        tokens = list(prompt_ids) + out  # the cache holds all of them but the last
        n = min(k, max_new_tokens - len(out) - 1)
        drafts = list(propose(tokens, n))[:n] if n > 0 else []
        probs = probs_from_logits(target.forward([tokens[-1]] + drafts), temperature)  # p_0 .. p_n, one pass
        if drafts:
            kept = rejection_sample(probs[None], torch.tensor([drafts]), None, generator)[0]
        else:
            kept = [int(torch.multinomial(probs[0], 1, generator=generator))]
        rounds.append((len(drafts), len(kept) - 1))
        target.rollback(len(tokens) + len(kept) - 1)  # the accepted drafts stay; rejected ones are forgotten
        done = keep(kept)
    return out, rounds
