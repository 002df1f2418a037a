"""What a page boundary costs three prefix-cache designs, counted by replaying requests (chapter 08, section 7).

A request can reuse the keys and values of its first L tokens when an earlier request computed the same L tokens
(never its own last token, whose logits the step needs). The designs differ in what they make of an L that ends
inside a page (a KV block) of P tokens:

- "rounded": SGLang's RadixCache with page_size P > 1. `match_prefix` truncates the lookup key to whole pages
  (`len(key) // page_size * page_size`) and a finished request inserts whole pages only, freeing its unaligned
  tail: it serves P * floor(L / P). At page_size 1 it serves L.
- "hashed": vLLM's automatic prefix caching. A full block is cached under the hash of its whole prefix, a partly
  filled block never: it serves P * floor(L / P) too.
- "partial": this engine's radix tree (`prefix_cache="radix"`). Blocks of P tokens, but a match may end at any
  token: the partly matched last block is shared and copied on the new request's first write into it (one block
  copy), and a finished request inserts its last partial block too. It serves L at every P.

So at one page size "rounded" and "hashed" serve the same tokens; the loss is the page size's, not a tree's or a
hash's. Under the assumption that L mod P is spread evenly over 0 .. P - 1 (L ranges over many pages), a hit of the
rounding designs loses (P - 1) / 2 tokens on average: `formulas.expected_block_boundary_loss`.

`replay` counts what each design serves when requests arrive one at a time, each after every earlier one finished,
and nothing is evicted: that isolates the page size from scheduling (requests admitted in the same step cannot share
what neither has computed yet) and from eviction. Served one at a time (`max_num_seqs=1`) on a pool that evicts
nothing, the engine's `num_cached_tokens` equals `replay`'s count for "hashed" and "partial", request by request.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..bench.radix import ideal_reuse
from .formulas import expected_block_boundary_loss

DESIGNS = ("rounded", "hashed", "partial")
LABELS = {"rounded": "SGLang, rounded to pages", "hashed": "vLLM, hashed blocks",
          "partial": "this engine, shared partial block"}


def served(matchable: int, page_size: int, design: str) -> int:
    """Tokens a design serves from the cache when `matchable` tokens (at most the prompt's length less one) were
    computed before by one earlier request."""
    if design not in DESIGNS:
        raise ValueError(f"design must be one of {DESIGNS}, got {design!r}")
    if not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
    if matchable < 0:
        raise ValueError(f"matchable must be >= 0, got {matchable}")
    return matchable if design == "partial" else matchable // page_size * page_size


@dataclass(frozen=True)
class Reuse:
    """One design at one page size over one workload: per request, the tokens it serves and the ideal."""
    design: str
    page_size: int
    cached: list[int]    # served from the cache, per request
    ideal: list[int]     # every earlier-computed token (page size 1), per request

    @property
    def reused(self) -> int:
        return sum(self.cached)

    @property
    def lost(self) -> int:
        return sum(self.ideal) - self.reused

    @property
    def hits(self) -> int:
        """Requests with something to reuse at token granularity."""
        return sum(1 for i in self.ideal if i)

    @property
    def share_of_ideal(self) -> float:
        return self.reused / sum(self.ideal) if sum(self.ideal) else 1.0

    @property
    def copies(self) -> int:
        """Block copies the design pays at admission: one per match ending inside a block ("partial" only)."""
        if self.design != "partial":
            return 0
        return sum(1 for c in self.cached if c % self.page_size)


def replay(prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]], page_size: int,
           design: str) -> Reuse:
    """Serve `prompts` one at a time in arrival order, request k after requests 0 .. k - 1 finished with `outputs`,
    on a cache that evicts nothing: what `design` serves each request at `page_size`."""
    if len(prompts) != len(outputs):
        raise ValueError(f"prompts and outputs must pair up, got {len(prompts)} and {len(outputs)}")
    ideal = ideal_reuse(prompts, [list(p) + list(o)[:-1] for p, o in zip(prompts, outputs)])
    return Reuse(design, page_size, [served(m, page_size, design) for m in ideal], ideal)


def expected_loss(hits: int, page_size: int) -> float:
    """The formula: each hit of a rounding design loses (page_size - 1) / 2 tokens when L mod page_size is spread
    evenly over 0 .. page_size - 1."""
    return hits * float(expected_block_boundary_loss(page_size))
