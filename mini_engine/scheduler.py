"""Requests, their states, and the scheduler that decides what runs at each step (chapter 04). Pure Python.

A request's tokens are its prompt then its output so far; `num_computed` of them have their keys and values
in the cache. Each step runs, for every scheduled request, a chunk of its uncomputed tokens: its prompt
(prefill), part of it (chunked prefill), or the token it sampled last (decode); a chunk that reaches the
last token samples the next. Admission policies (below) decide when, and in what order (chapter 08), requests start.
Chunked prefill caps a step at `token_budget` tokens, so a long prompt cannot stall everyone's decodes:
decodes first (one token each, never skipped), then prompt chunks in arrival order, then new admissions.

Paged KV cache (chapter 07): the scheduler owns the `paging.BlockManager`; a chunk takes the blocks its tokens fill,
a finished request returns them. When no block is free, the most recently admitted request is preempted by recompute
(as in vLLM): its blocks go back to the pool, it goes first in the queue, and once readmitted recomputes prompt and
output in one prefill. A block manager may choose the victims (lab 07's does: `_make_room`). Prefix caching (chapter
08): admission first takes the cached blocks a request's tokens start with; after each step the full blocks now
computed join the cache. Parallel sampling (`SamplingParams(n=...)`): sample 0 carries the others in `forks` and
prefills the prompt once; then they fork, sharing its blocks, and run alone. Speculative decoding (chapter 06):
decodes grow by their drafts (`spec_token_ids`) with what the step leaves; `update` keeps the accepted ones.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from .paging import BlockManager
from .sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the queue; its cache is dropped and recomputed on readmission
    FINISHED = "finished"


@dataclass
class Request:
    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    arrival_time: float
    output_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed: int = 0          # tokens whose keys/values are in the cache
    slot: int | None = None        # lane while running: its row of a contiguous cache
    finish_reason: str | None = None  # "stop", "length" (max_tokens or max_model_len) or "abort"
    num_preemptions: int = 0
    num_cached_tokens: int | None = None  # prompt tokens served from the prefix cache at first admission
    num_tier_cached_tokens: tuple[int, int] = (0, 0)  # chapter 12: of those, copied back from host memory, disk
    num_cached_hint: int = 0       # what a prefix-cache lookup would serve now (for the policy's budget)
    index: int = 0                 # which of its prompt's n samples this is (parallel sampling)
    forks: list[Request] = field(default_factory=list)  # samples to fork once the prompt is computed
    first_scheduled_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # when each output token was sampled
    spec_token_ids: list[int] = field(default_factory=list)  # the proposer's drafts for the next step
    num_draft_tokens: int = 0      # drafts verified by the target
    num_accepted_tokens: int = 0   # of those, accepted and emitted
    logprobs: list[dict[int, float]] = field(default_factory=list)  # params.logprobs: per output token
    prompt_logprobs: list[dict[int, float]] = field(default_factory=list)  # params.prompt_logprobs: tokens 1..

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def lookup_tokens(self) -> list[int]:
        """What a prefix-cache lookup may match: nothing while the prompt's log-probabilities are wanted (a hit
        would skip the rows that score them)."""
        wanted = self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_ids) - 1
        return [] if wanted else self.tokens

    @property
    def is_prefill(self) -> bool:
        """Still computing its prompt (or, after a preemption, recomputing prompt and output)."""
        return self.num_uncomputed > 1 or not self.output_ids and self.num_uncomputed == 1


@dataclass(frozen=True)
class Chunk:
    """Tokens start .. start + num_tokens − 1 of `request`, run in this step; `samples`: it reaches the last
    token. A speculative decode adds `draft_token_ids` (not in `request.tokens` yet), with logits at each."""
    request: Request
    start: int
    num_tokens: int
    samples: bool
    draft_token_ids: tuple[int, ...] = ()

    @property
    def token_ids(self) -> list[int]:
        end = self.start + self.num_tokens - len(self.draft_token_ids)
        return self.request.tokens[self.start:end] + list(self.draft_token_ids)

    @property
    def num_logits(self) -> int:
        return len(self.draft_token_ids) + 1 if self.samples else 0


class StaticPolicy:
    """A new batch only once the previous one has finished: every batch moves at its longest request's pace."""
    name = "static"

    def admit(self, waiting, running, free_slots, budget, now) -> list[Request]:
        return [] if running else waiting[:free_slots]

    def seconds_until_admission(self, waiting, running, now) -> float:
        return 0.0


@dataclass
class DynamicPolicy:
    """Static batches of similar prompt length (buckets of `bucket_width` tokens): a full bucket runs at once,
    a partial one when its oldest request has waited `timeout_s`. Less padding, more queueing."""
    batch_size: int
    bucket_width: int = 64
    timeout_s: float = 0.05
    name = "dynamic"

    def _buckets(self, waiting: list[Request]) -> list[list[Request]]:
        buckets: dict[int, list[Request]] = {}
        for r in waiting:  # in arrival order, so each bucket's head is its oldest
            buckets.setdefault((r.num_tokens - 1) // self.bucket_width, []).append(r)
        return sorted(buckets.values(), key=lambda b: b[0].arrival_time)

    def _ready(self, bucket: list[Request], now: float) -> bool:
        return len(bucket) >= self.batch_size or now - bucket[0].arrival_time >= self.timeout_s

    def admit(self, waiting, running, free_slots, budget, now) -> list[Request]:
        if running:
            return []
        ready = [b for b in self._buckets(waiting) if self._ready(b, now)]
        ready.sort(key=lambda b: (len(b) < self.batch_size, b[0].arrival_time))  # full ones first, then oldest
        return ready[0][:free_slots] if ready else []

    def seconds_until_admission(self, waiting, running, now) -> float:
        buckets = self._buckets(waiting)
        if running or not buckets or any(self._ready(b, now) for b in buckets):
            return 0.0
        return min(b[0].arrival_time + self.timeout_s for b in buckets) - now


class ContinuousPolicy:
    """Orca's iteration-level scheduling: every step, waiting requests take the free slots in arrival order."""
    name = "continuous"

    def admit(self, waiting, running, free_slots, budget, now) -> list[Request]:
        admitted = []
        for r in waiting:
            if len(admitted) == free_slots or budget <= 0:
                break
            admitted.append(r)
            budget -= r.num_uncomputed - r.num_cached_hint  # prefix-cache hits cost the step nothing
        return admitted

    def seconds_until_admission(self, waiting, running, now) -> float:
        return 0.0


class CacheAwarePolicy(ContinuousPolicy):
    """SGLang's longest-prefix-match order (chapter 08): preempted requests first, then the waiting requests with
    the most tokens in the prefix cache (they cost the step least, and start before their prefix is evicted), ties
    in arrival order. A queue longer than `max_ranked` is taken in arrival order, as SGLang does, for cost: its
    comment says "turn off the expensive prefix matching and sorting when the queue is large". Not against
    starvation: in a shorter queue a request with no hit waits behind a stream of hits. Options against that and
    for bursts sharing an uncached prefix, aging_s and prefix_holding: `prefix.policies.HoldAndAgePolicy`."""
    name = "cache_aware"

    def __init__(self, max_ranked: int = 128):
        self.max_ranked = max_ranked

    def admit(self, waiting, running, free_slots, budget, now) -> list[Request]:
        if len(waiting) <= self.max_ranked:
            waiting = sorted(waiting, key=lambda r: (r.status is not RequestStatus.PREEMPTED, -r.num_cached_hint))
        return super().admit(waiting, running, free_slots, budget, now)


def make_policy(name, num_slots: int, bucket_width: int = 64, timeout_s: float = 0.05, prefix_holding: bool = False,
                aging_s: float | None = None):
    if name == "cache_aware" and (prefix_holding or aging_s is not None):
        from .prefix.policies import HoldAndAgePolicy  # beside the core: loaded only when asked for
        return HoldAndAgePolicy(prefix_holding, aging_s)
    if name in ("static", "continuous", "cache_aware"):
        return {"static": StaticPolicy, "continuous": ContinuousPolicy, "cache_aware": CacheAwarePolicy}[name]()
    if name == "dynamic":
        return DynamicPolicy(num_slots, bucket_width, timeout_s)
    if not isinstance(name, str):
        return name  # a policy object of your own (see EngineConfig)
    raise ValueError(f"scheduling must be 'static', 'dynamic', 'continuous' or 'cache_aware', got {name!r}")


class Scheduler:
    """Owns the queue, the running set, the slots and the block manager; plans each step, applies its results."""

    def __init__(self, policy, num_slots: int, max_model_len: int, token_budget: int | None = None,
                 block_manager: BlockManager | None = None):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if token_budget is not None and token_budget < 1:
            raise ValueError(f"token_budget must be >= 1 or None (no chunking), got {token_budget}")
        self.policy, self.num_slots, self.max_model_len, self.token_budget = policy, num_slots, max_model_len, token_budget
        self.blocks = block_manager
        if block_manager is not None:
            # Capped at the whole pool, so a request running alone can always take its next block.
            self.max_model_len = min(max_model_len, block_manager.num_blocks * block_manager.block_size)
        self.waiting: list[Request] = []
        self.running: list[Request] = []  # in admission order
        self.free_slots = list(range(num_slots - 1, -1, -1))  # a stack: pop() hands out slot 0 first
        self.num_preemptions = 0
        self.block_copies: list[tuple[int, int]] = []  # the last step's copy-on-write: (src, dst) blocks

    def add(self, request: Request) -> None:
        if request.forks and self.blocks is None:
            raise ValueError("forked samples share the prompt's blocks: they need the paged KV cache")
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def seconds_until_admission(self, now: float) -> float:
        """How long nothing can start: a dynamic batcher waiting for its bucket to fill (0 otherwise)."""
        return self.policy.seconds_until_admission(self.waiting, self.running, now)

    def schedule(self, now: float) -> list[Chunk]:
        """Spend the step's token budget: decodes, prompt chunks of running requests, then admit what the
        policy allows (and, with a paged cache, what the free blocks hold)."""
        budget = math.inf if self.token_budget is None else self.token_budget
        chunks: list[Chunk] = []
        self._copies: list[tuple[int, int, int]] = []  # (request_id, src, dst) copy-on-write made this step
        preemptions_before = self.num_preemptions
        # Oldest first: a request that must make room preempts only requests admitted after it.
        for r in [r for r in self.running if not r.is_prefill]:
            if r.status is RequestStatus.RUNNING and self._make_room(r, chunks):
                chunks.append(self._chunk(r, 1))
        budget -= len(chunks)
        for r in list(self.running):
            if r.is_prefill and budget > 0 and r.status is RequestStatus.RUNNING and self._make_room(r, chunks):
                n = int(min(r.num_uncomputed, budget, self._room(r)))  # shrink to the free blocks first
                chunks.append(self._chunk(r, n))
                budget -= n
        if self.num_preemptions == preemptions_before:  # blocks freed by a preemption go to running requests
            self._admit(budget, chunks, now)
        # Decodes in slot order: with every slot busy their contiguous-cache rows are adjacent, one slice.
        decodes = sorted((c for c in chunks if not c.request.is_prefill), key=lambda c: c.request.slot)
        # A request preempted after its copy-on-write in this step gave the copy back: its copy must not run.
        scheduled = {c.request.request_id for c in chunks}
        self.block_copies = [(src, dst) for rid, src, dst in self._copies if rid in scheduled]
        chunks = decodes + [c for c in chunks if c.request.is_prefill]
        spent = sum(c.num_tokens for c in chunks)
        return self._add_drafts(chunks, budget if self.token_budget is None else self.token_budget - spent)

    def _add_drafts(self, chunks: list[Chunk], budget: float) -> list[Chunk]:
        """Grow decodes by their drafts with the budget and blocks left over: never at a prefill's expense."""
        for i, c in enumerate(chunks):
            r = c.request
            extra = int(min(len(r.spec_token_ids), budget, self._room(r) - c.num_tokens)) if c.samples else 0
            if extra > 0 and c.num_tokens == 1 and not r.is_prefill:
                chunks[i] = self._chunk(r, 1 + extra, tuple(r.spec_token_ids[:extra]))
                budget -= extra
        return chunks

    def _admit(self, budget: float, chunks: list[Chunk], now: float) -> None:
        # Each candidate's lookup tokens are built once and passed as the same list to every lookup below, so a block
        # manager can match once per admission (the radix tree remembers a match until it changes).
        probes: dict[int, list[int]] = {}

        def probe(r: Request) -> list[int]:
            if r.request_id not in probes:
                probes[r.request_id] = r.lookup_tokens
            return probes[r.request_id]

        if self.blocks is not None and self.blocks.enable_prefix_caching:
            # Tell the policy what each candidate will really compute (lookups change nothing): those it may start
            # in arrival order, or every waiting request when it ranks them by their hits (CacheAwarePolicy).
            ranks = len(self.waiting) <= getattr(self.policy, "max_ranked", -1)
            left = budget
            for i, r in enumerate(self.waiting):
                if not ranks and (i == len(self.free_slots) or left <= 0):
                    break
                r.num_cached_hint = self.blocks.num_cached_tokens(probe(r))
                left -= r.num_uncomputed - r.num_cached_hint
        promised = 0  # blocks the requests admitted in this step will still need for the rest of their prompts
        for r in self.policy.admit(self.waiting, self.running, len(self.free_slots), budget, now):
            if len(self.free_slots) < 1 + len(r.forks):
                break  # a slot for every sample it will fork
            if self.blocks is not None:
                # A hit on an evictable block leaves the free count; a fork copies (or starts) one at its first
                # decode. Each running request keeps a block to grow into, or the newcomer would be preempted.
                hits = self.blocks.lookup(probe(r))
                full = self.blocks.num_cached_tokens(probe(r)) // self.blocks.block_size  # a partly matched
                need = self.blocks.blocks_for(r.num_tokens) - full + len(r.forks)  # last block is copied: a new one
                if need + len(self.running) > self.blocks.num_free_blocks - self.blocks.num_evictable(hits) - promised:
                    break  # first come, first served: nobody overtakes a request that does not fit yet
                promised += need
            self.waiting.remove(r)
            r.status, r.slot = RequestStatus.RUNNING, self.free_slots.pop()
            for f in r.forks:  # reserved now: the fork happens steps later, when other requests want slots too
                f.slot = self.free_slots.pop()
            r.first_scheduled_time = now if r.first_scheduled_time is None else r.first_scheduled_time
            if self.blocks is not None:
                r.num_computed = self.blocks.allocate_cached(r.request_id, probe(r))
                if r.num_cached_tokens is None:
                    r.num_cached_tokens = r.num_computed
                    r.num_tier_cached_tokens = getattr(self.blocks, "tier_hits", (0, 0))  # chapter 12's tiers
            self.running.append(r)
            if budget > 0:  # a static batch admits all its requests at once; the budget starts what it can
                n = int(min(r.num_uncomputed, budget))
                if self.blocks is not None:
                    promised -= self.blocks.num_new_blocks(r.request_id, r.num_computed + n)
                chunks.append(self._chunk(r, n))
                budget -= n

    def _room(self, r: Request) -> float:
        """Tokens r can still compute: its blocks and the free ones, less one per shared block it must copy."""
        if self.blocks is None:
            return math.inf
        return self.blocks.capacity(r.request_id, r.num_computed) - r.num_computed

    def _make_room(self, r: Request, chunks: list[Chunk]) -> bool:
        """Preempt the latest admitted holders of blocks until r has room, dropping their chunks; False if r went."""
        if self._room(r) >= 1:
            return True
        if own := getattr(self.blocks, "make_room", None):  # a hook: own(scheduler, r) calls self.preempt(victim)
            own(self, r)  # for each victim it chooses, until r has room or went (lab 07 plugs the student's in)
        while not own and r.status is RequestStatus.RUNNING and self._room(r) < 1:
            self.preempt(next(v for v in reversed(self.running) if v is r or self.blocks.block_table(v.request_id)))
        chunks[:] = [c for c in chunks if c.request.status is RequestStatus.RUNNING]
        return r.status is RequestStatus.RUNNING

    def _chunk(self, r: Request, num_tokens: int, drafts: tuple[int, ...] = ()) -> Chunk:
        """r's next `num_tokens` tokens (ending with `drafts`), after growing its block table to hold them."""
        if self.blocks is not None and num_tokens != 0:
            total = r.num_computed + num_tokens
            if r.request_id in self.blocks.block_tables:
                copies = self.blocks.copy_on_write(r.request_id, r.num_computed, total)
                self._copies += [(r.request_id, src, dst) for src, dst in copies]
                self.blocks.append_slots(r.request_id, total)
            else:
                self.blocks.allocate(r.request_id, total)
        start = r.num_computed
        return Chunk(r, start, num_tokens, bool(drafts) or start + num_tokens == r.num_tokens, drafts)

    @staticmethod
    def samplers(chunks: list[Chunk]) -> list[tuple[int, Request]]:
        """Who samples this step, with its row of logits: each sampling chunk's request, then its new forks."""
        rows = [c.request for c in chunks if c.samples]
        return [(row, s) for row, r in enumerate(rows) for s in (r, *r.forks)]

    def update(self, chunks: list[Chunk], sampled: list, now: float) -> list[Request]:
        """Apply a step's results: `sampled` holds, per request of `samplers(chunks)`, its token (or the tokens
        the rejection sampler kept). Returns the requests that finished, their slots and blocks already free."""
        samplers = [r for _, r in self.samplers(chunks)]
        if len(sampled) != len(samplers):
            raise ValueError(f"sampled has {len(sampled)} tokens for {len(samplers)} sampling requests")
        speculative = {c.request.request_id: c for c in chunks if c.draft_token_ids}
        for c in chunks:
            if c.request.request_id not in speculative:  # a speculative chunk counts what was accepted, below
                self._computed(c.request, c.request.num_computed + c.num_tokens)
        for parent in [c.request for c in chunks if c.samples and c.request.forks]:
            self._fork(parent)
        finished = []
        for r, tokens in zip(samplers, sampled):
            tokens = [tokens] if isinstance(tokens, int) else list(tokens)
            reason, emitted = None, 0
            for emitted, token in enumerate(tokens, 1):  # nothing past a stop, max_tokens or max_model_len
                r.output_ids.append(token)
                r.token_times.append(now)
                if reason := self._finish_reason(r, token):
                    break
            if r.request_id in speculative:
                self._accept(speculative[r.request_id], emitted, len(tokens) - 1)
            if reason:
                r.finish_reason, r.status = reason, RequestStatus.FINISHED
                self._release(r)
                finished.append(r)
        return finished

    def _computed(self, r: Request, num_computed: int) -> None:
        r.num_computed = num_computed
        if self.blocks is not None:
            self.blocks.cache_blocks(r.request_id, r.tokens, num_computed)

    def _accept(self, c: Chunk, emitted: int, accepted: int) -> None:
        """Roll a speculative chunk back to what was accepted, freeing the blocks past it, and only then
        register full blocks: no cached hash ever covers a rejected draft."""
        r = c.request
        r.num_draft_tokens += len(c.draft_token_ids)
        r.num_accepted_tokens += min(accepted, emitted)  # drafts past a stop token were not emitted
        self._computed(r, min(c.start + 1 + accepted, r.num_tokens))
        if self.blocks is not None:
            self.blocks.trim(r.request_id, r.num_computed)
        r.spec_token_ids = []

    def _fork(self, parent: Request) -> None:
        """The parent's prompt is computed: its other samples start running, sharing its blocks."""
        for f in parent.forks:
            self.blocks.fork(parent.request_id, f.request_id)
            f.num_computed, f.status = parent.num_computed, RequestStatus.RUNNING
            f.first_scheduled_time, f.num_cached_tokens = parent.first_scheduled_time, parent.num_cached_tokens
            self.running.append(f)
        parent.forks = []

    def preempt(self, request: Request) -> None:
        """Free a running request's slot and blocks and queue it first: it recomputes everything when readmitted."""
        if request.status is not RequestStatus.RUNNING:
            raise ValueError(f"request {request.request_id} is {request.status.value}, not running")
        self._release(request)
        request.status, request.num_computed, request.spec_token_ids = RequestStatus.PREEMPTED, 0, []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.insert(0, request)

    def abort(self, request: Request) -> None:
        """Drop an unfinished request (a client went away) with the samples it has not forked yet: they
        finish with "abort" and give back their slots and blocks. Forked samples are aborted one by one."""
        if request.status is RequestStatus.FINISHED:
            return
        if request.status is RequestStatus.RUNNING:
            self._release(request)
        else:  # waiting, or preempted (queued again): it holds no slot and no block
            self.waiting = [r for r in self.waiting if r is not request]
        for r in (request, *request.forks):
            r.status, r.finish_reason, r.spec_token_ids = RequestStatus.FINISHED, "abort", []
        request.forks = []

    def _release(self, request: Request) -> None:
        self.running.remove(request)
        for r in (request, *request.forks):  # samples not forked yet give back the slots reserved for them
            self.free_slots.append(r.slot)
            r.slot = None
        if self.blocks is not None and request.request_id in self.blocks.block_tables:
            self.blocks.free(request.request_id)

    def _finish_reason(self, r: Request, token: int) -> str | None:
        if token in r.stop_ids:
            return "stop"
        full = len(r.output_ids) >= r.params.max_tokens or r.num_tokens >= self.max_model_len
        return "length" if full else None
