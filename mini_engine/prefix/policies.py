"""Two options of the cache-aware admission order (chapter 08): in-batch prefix holding and aging.

`scheduler.CacheAwarePolicy` admits the waiting requests with the most cached tokens first. That leaves two gaps,
which `LLM(scheduling="cache_aware", prefix_holding=True, aging_s=...)` closes:

- A burst of requests sharing a prefix nobody has computed yet all miss: admitted in the same step, each computes
  the prefix itself. With `prefix_holding`, a request that would gain at least `hold_tokens` cached tokens by
  waiting, because a request admitted earlier in this step (or one still computing its prompt) shares them, is
  held back and admitted when they are cached. SGLang's in-batch prefix caching has the idea: a waiting request
  with at most 32 cached tokens that shares at least 32 tokens with a request before it in the waiting queue is
  sorted to the queue's end for this step, and still starts in this batch if room is left (schedule_policy.py,
  IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD and _DEPRIORITIZE_THRESHOLD, both 32). This engine holds instead of
  sorting last, tests the gain beyond the request's own hit, and against requests being computed rather than
  waiting: a burst sharing a 40-token prefix in blocks of 16 is held once, where holding by "at most 32 cached, at
  least 32 shared" would hold all but one again on the next step, the 32 cached tokens being still at most 32
  (checked in tests/engine/test_prefix_policies.py).
- Longest prefix first can starve a request with no hit behind a steady stream of hits while the queue stays short
  (past `max_ranked` waiting requests the order is arrival order anyway). With `aging_s`, a request that has
  waited `aging_s` seconds goes before every request ranked by its hits, oldest first, and is never held.
  Recent SGLang offers a policy of its own for that, "hrrn" (highest response ratio next: waiting counted in
  prefill tokens processed since arrival, over the request's uncached tokens), and user-set priorities.

Both only reorder or delay admissions: every request computes what it would alone, so greedy tokens are unchanged.
"""
from __future__ import annotations

from ..scheduler import CacheAwarePolicy, Request, RequestStatus

# SGLang's default for both of its in-batch thresholds: holding a request a step for a few tokens costs more than it
# saves, and short prefixes (a chat template's first tokens) are shared by nearly every request.
HOLD_TOKENS = 32


def check_options(scheduling, prefix_holding, aging_s) -> None:
    """The checks `EngineConfig` makes of the two options (a `ValueError` naming the argument)."""
    if not isinstance(prefix_holding, bool):
        raise ValueError(f"prefix_holding must be True or False, got {prefix_holding!r}")
    if aging_s is not None and (isinstance(aging_s, bool) or not isinstance(aging_s, (int, float))
                                or not aging_s >= 0):
        raise ValueError(f"aging_s must be a number of seconds >= 0 or None, got {aging_s!r}")
    for name, on in (("prefix_holding", prefix_holding), ("aging_s", aging_s is not None)):
        if on and scheduling != "cache_aware":
            raise ValueError(f"{name} is an option of scheduling='cache_aware' (it reorders by prefix-cache hits), "
                             f"got scheduling={scheduling!r}")


class HoldAndAgePolicy(CacheAwarePolicy):
    """Longest prefix first, with in-batch prefix holding and aging (see the module's docstring)."""

    def __init__(self, prefix_holding: bool = False, aging_s: float | None = None, max_ranked: int = 128,
                 hold_tokens: int = HOLD_TOKENS):
        check_options("cache_aware", prefix_holding, aging_s)
        if not isinstance(hold_tokens, int) or hold_tokens < 1:
            raise ValueError(f"hold_tokens must be an int >= 1, got {hold_tokens!r}")
        super().__init__(max_ranked)
        self.prefix_holding, self.aging_s, self.hold_tokens = prefix_holding, aging_s, hold_tokens

    def aged(self, r: Request, now: float) -> bool:
        return self.aging_s is not None and now - r.arrival_time >= self.aging_s

    def admit(self, waiting, running, free_slots, budget, now) -> list[Request]:
        if len(waiting) > self.max_ranked:  # arrival order: nothing ranked, so nothing to age or hold (cost)
            return super().admit(waiting, running, free_slots, budget, now)

        def rank(r: Request):  # preempted first, then the aged oldest first, then the most cached tokens
            aged = self.aged(r, now)
            return r.status is not RequestStatus.PREEMPTED, not aged, r.arrival_time if aged else -r.num_cached_hint

        # The prompts being computed now: a waiting request sharing them is cached once they are.
        computing = [r.lookup_tokens for r in running if r.is_prefill] if self.prefix_holding else []
        admitted = []
        for r in sorted(waiting, key=rank):  # sorted() is stable: ties stay in arrival order
            if len(admitted) == free_slots or budget <= 0:
                break
            if self.prefix_holding:
                tokens = r.lookup_tokens
                if not self.aged(r, now) and self.gains_by_waiting(tokens, r.num_cached_hint, computing):
                    continue  # held: admitted at a later step, with those tokens cached
                computing.append(tokens)
            admitted.append(r)
            budget -= r.num_uncomputed - r.num_cached_hint
        return admitted

    def gains_by_waiting(self, tokens: list[int], cached: int, computing: list[list[int]]) -> bool:
        """Whether a prompt being computed shares `hold_tokens` tokens of `tokens` beyond the `cached` ones (a
        lookup never serves a prompt's last token). One slice comparison per prompt being computed, at C speed;
        at most `max_ranked` candidates a step."""
        k = cached + self.hold_tokens
        if k >= len(tokens):
            return False
        head = tokens[:k]
        return any(other[:k] == head for other in computing)
