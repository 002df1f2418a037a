"""Requests, their states, and the scheduler that decides what runs at each step. Pure Python: no tensors.

A request's tokens are its prompt followed by what it has generated so far; `num_computed` of them already
have their keys and values in the cache. One step of the engine runs, for every scheduled request, the
next chunk of its uncomputed tokens: the rest of its prompt (prefill), part of it (a chunked prefill), or
the one token it sampled last (decode). A request gets a new token only from a step that computes its
last uncomputed token.

Three admission policies share the rest of the machinery:

- static: a batch of up to `num_slots` requests is admitted only when the previous batch has fully
  finished, so every batch advances at the pace of its longest request;
- dynamic: like static, but the batch is one length bucket (prompts of similar length), released when it
  is full or when its oldest request has waited `timeout_s`;
- continuous (Orca's iteration-level scheduling): every step evicts finished requests and admits waiting
  ones into the freed slots.

Chunked prefill caps the tokens of one step at `token_budget`: decodes first (one token each, never
skipped, so running requests keep their pace), then prompt chunks in arrival order with what is left, then
the prompts of newly admitted requests.

With a paged KV cache (chapter 07) the scheduler also owns the `paging.BlockManager`: a chunk takes the
blocks its tokens fill when it is scheduled, and a request returns its blocks when it finishes. A step
that needs a block when none is free preempts the most recently admitted running request (vLLM's
recompute mode): its blocks go back to the pool, it goes back to the front of the queue, and when
readmitted it recomputes its prompt and the output so far in one prefill. A prompt chunk shrinks to the
free blocks before it preempts anyone, and a step that preempted admits nobody new. A waiting request is
admitted only when the free blocks can hold everything it has to compute and still leave one block for each
running request to grow into: a prompt admitted into the last free blocks would only be preempted, and
recomputed, a few steps later (on chapter 04's serving workload with the KV memory of 4 slots, this
headroom took the preemptions from 31 to 3, and the tokens computed twice from 25% to 3%).

With prefix caching (chapter 08) a request being admitted first takes the cached blocks its tokens start
with (`BlockManager.allocate_cached`) and starts computing after them; the admission check is sized after
that lookup, and a hit on an evictable cached block counts against the free blocks. After every step the
full blocks whose keys and values are now written join the cache (`BlockManager.cache_blocks`), before a
finished request releases them. The policy's token budget counts only what a request will compute.

Parallel sampling (`SamplingParams(n=...)`, paged cache): the request is queued as its sample 0, which
carries the other samples in `forks`. Admission reserves a slot for every sample, and counts a block for
each fork's first write. Sample 0 prefills the prompt once; the step that computes the prompt's last token
forks the others from it (`BlockManager.fork`: they share all its blocks) and samples n first tokens from
that one row of logits. From then on each sample is a request of its own: it decodes, finishes, or is
preempted and recomputes alone, releasing only its own references. Its first write into the shared, partly
filled last block copies it (`BlockManager.copy_on_write`); `block_copies` lists the step's copies, which
the model runner makes before the step writes.

Speculative decoding (chapter 06): a decoding request may carry drafts (`spec_token_ids`, set by the engine's
proposer). After decodes, prompt chunks and admissions have been planned, each decode chunk grows by as many
drafts as the leftover token budget and free blocks allow (`_add_drafts`): speculation only spends what the
step would leave unused. `update` then appends the sampler's tokens one at a time (a stop, max_tokens or
max_model_len ends the request there), counts as computed the request's last token and its accepted drafts
only, registers full blocks for the prefix cache from those verified tokens, and gives back the blocks past
them (`BlockManager.trim`): rejected drafts leave nothing behind. Preemption drops the drafts with the cache.
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
    PREEMPTED = "preempted"  # sent back to the queue; its cache is dropped and recomputed on readmission
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
    finish_reason: str | None = None  # "stop" (a stop token), "length" (max_tokens or max_model_len) or "abort"
    num_preemptions: int = 0
    num_cached_tokens: int | None = None  # prompt tokens served from the prefix cache at first admission
    num_cached_hint: int = 0       # what a prefix-cache lookup would serve now (set while waiting, for the budget)
    index: int = 0                 # which of its prompt's n samples this is (parallel sampling)
    forks: list[Request] = field(default_factory=list)  # samples that fork from this one once its prompt is computed
    first_scheduled_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # when each output token was sampled
    # Speculative decoding: the proposer's guesses for the tokens after `tokens`, set before each step (the step
    # verifies those the budget and the blocks leave room for), and the running counts for RequestMetrics.
    spec_token_ids: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0      # drafts verified by the target
    num_accepted_tokens: int = 0   # of those, accepted and emitted

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
    def is_prefill(self) -> bool:
        """Still computing its prompt (or, after a preemption, recomputing prompt and output)."""
        return self.num_uncomputed > 1 or not self.output_ids and self.num_uncomputed == 1


@dataclass(frozen=True)
class Chunk:
    """Tokens start .. start + num_tokens − 1 of `request`, run in this step. `samples`: the chunk reaches
    the request's last token, so the step samples its next one. A speculative decode chunk is the request's
    last token followed by `draft_token_ids` (not in `request.tokens` yet): it wants logits at all its
    positions, and the rejection sampler turns them into 1 to len(draft_token_ids) + 1 tokens."""
    request: Request
    start: int
    num_tokens: int
    samples: bool
    draft_token_ids: tuple[int, ...] = ()

    @property
    def token_ids(self) -> list[int]:
        """The ids this chunk runs: its slice of the request's tokens, then its drafts."""
        end = self.start + self.num_tokens - len(self.draft_token_ids)
        return self.request.tokens[self.start:end] + list(self.draft_token_ids)

    @property
    def num_logits(self) -> int:
        """Rows of logits the step produces for this chunk."""
        return len(self.draft_token_ids) + 1 if self.samples else 0

    @classmethod
    def of(cls, request: Request, num_tokens: int) -> "Chunk":
        start = request.num_computed
        return cls(request, start, num_tokens, start + num_tokens == request.num_tokens)


# ---------------------------------------------------------------- admission policies

class StaticPolicy:
    """A new batch, first come first served, only once every request of the previous one has finished."""
    name = "static"

    def admit(self, waiting: list[Request], running: list[Request], free_slots: int, budget: float,
              now: float) -> list[Request]:
        return [] if running else waiting[:free_slots]

    def seconds_until_admission(self, waiting: list[Request], running: list[Request], now: float) -> float:
        return 0.0


@dataclass
class DynamicPolicy:
    """Request-level batches of similar prompt length: requests fall into buckets of `bucket_width` tokens;
    when the previous batch has finished, a full bucket runs at once, and a partial one only after its oldest
    request has waited `timeout_s`: fewer wasted (padded) tokens per batch, paid for in queueing time."""
    batch_size: int
    bucket_width: int = 64
    timeout_s: float = 0.05
    name = "dynamic"

    def _buckets(self, waiting: list[Request]) -> list[list[Request]]:
        buckets: dict[int, list[Request]] = {}
        for r in waiting:  # waiting is in arrival order, so each bucket is too: its head is its oldest
            buckets.setdefault((r.num_tokens - 1) // self.bucket_width, []).append(r)
        return sorted(buckets.values(), key=lambda b: b[0].arrival_time)

    def _ready(self, bucket: list[Request], now: float) -> bool:
        return len(bucket) >= self.batch_size or now - bucket[0].arrival_time >= self.timeout_s

    def admit(self, waiting, running, free_slots, budget, now) -> list[Request]:
        if running:
            return []
        ready = [b for b in self._buckets(waiting) if self._ready(b, now)]
        # Full buckets first (no waste, no wait), then the one whose oldest request has waited longest.
        ready.sort(key=lambda b: (len(b) < self.batch_size, b[0].arrival_time))
        return ready[0][:free_slots] if ready else []

    def seconds_until_admission(self, waiting, running, now) -> float:
        if running or not waiting:
            return 0.0
        buckets = self._buckets(waiting)
        if any(self._ready(b, now) for b in buckets):
            return 0.0
        return min(b[0].arrival_time + self.timeout_s for b in buckets) - now


class ContinuousPolicy:
    """Iteration level: every step, waiting requests take the free slots in arrival order, as long as the
    step's token budget has room to start their prompts."""
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


def make_policy(name: str, num_slots: int, bucket_width: int = 64, timeout_s: float = 0.05):
    if name == "static":
        return StaticPolicy()
    if name == "dynamic":
        return DynamicPolicy(num_slots, bucket_width, timeout_s)
    if name == "continuous":
        return ContinuousPolicy()
    raise ValueError(f"scheduling must be 'static', 'dynamic' or 'continuous', got {name!r}")


# ---------------------------------------------------------------- the scheduler

class Scheduler:
    """Owns the queue, the running set, the lanes (a contiguous cache's slots) and, with a paged cache, the
    block manager; plans each step and applies its results."""

    def __init__(self, policy, num_slots: int, max_model_len: int, token_budget: int | None = None,
                 block_manager: BlockManager | None = None):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if token_budget is not None and token_budget < 1:
            raise ValueError(f"token_budget must be >= 1 or None (no chunking), got {token_budget}")
        self.policy, self.num_slots, self.max_model_len, self.token_budget = policy, num_slots, max_model_len, token_budget
        self.blocks = block_manager
        if block_manager is not None:
            # One request may use the whole pool but no more: its length is capped there, as at max_model_len,
            # so a request running alone can always take its next block.
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
                self._take_blocks(r, 1)
                chunks.append(Chunk.of(r, 1))
        budget -= len(chunks)
        for r in list(self.running):
            if r.is_prefill and budget > 0 and r.status is RequestStatus.RUNNING and self._make_room(r, chunks):
                n = int(min(r.num_uncomputed, budget, self._room(r)))
                self._take_blocks(r, n)
                chunks.append(Chunk.of(r, n))
                budget -= n
        if self.num_preemptions == preemptions_before:  # blocks freed by a preemption go to running requests
            self._admit(budget, chunks, now)
        # Decodes in slot order: with every slot busy their contiguous-cache rows are adjacent, which attention
        # reads as one slice instead of gathering them.
        decodes = sorted((c for c in chunks if not c.request.is_prefill), key=lambda c: c.request.slot)
        # A request preempted after its copy-on-write in this step gave the copy back: its copy must not run.
        scheduled = {c.request.request_id for c in chunks}
        self.block_copies = [(src, dst) for rid, src, dst in self._copies if rid in scheduled]
        chunks = decodes + [c for c in chunks if c.request.is_prefill]
        spent = sum(c.num_tokens for c in chunks)
        return self._add_drafts(chunks, budget if self.token_budget is None else self.token_budget - spent)

    def _add_drafts(self, chunks: list[Chunk], budget: float) -> list[Chunk]:
        """Speculative decoding: grow each decode chunk by its request's drafts, with what the step leaves
        over. Drafts come last: they only spend tokens of the budget and free blocks nobody else in this step
        wanted, so speculation never shrinks a prefill nor causes a preemption, and the blocks the rejected
        drafts took go back to the pool when the step ends (`update`)."""
        out = []
        for c in chunks:
            r = c.request
            extra = int(min(len(r.spec_token_ids), budget, self._room(r) - c.num_tokens)) if c.samples else 0
            if extra > 0 and c.num_tokens == 1 and not r.is_prefill:
                self._take_blocks(r, 1 + extra)
                c = Chunk(r, c.start, 1 + extra, True, tuple(r.spec_token_ids[:extra]))
                budget -= extra
            out.append(c)
        return out

    def _admit(self, budget: float, chunks: list[Chunk], now: float) -> None:
        caching = self.blocks is not None and self.blocks.enable_prefix_caching
        if caching:  # tell the policy what each candidate will really compute (lookups change nothing)
            left = budget
            for r in self.waiting[:len(self.free_slots)]:
                if left <= 0:
                    break
                r.num_cached_hint = len(self.blocks.lookup(r.tokens)) * self.blocks.block_size
                left -= r.num_uncomputed - r.num_cached_hint
        promised = 0  # blocks the requests admitted in this step will still need for the rest of their prompts
        for r in self.policy.admit(self.waiting, self.running, len(self.free_slots), budget, now):
            if len(self.free_slots) < 1 + len(r.forks):
                break  # a slot for every sample it will fork
            if self.blocks is not None:
                # Sized after the cache lookup: hits need no new block, but a hit on an evictable block takes
                # it out of the free count. Each fork copies (or starts) a block at its first decode.
                hits = self.blocks.lookup(r.tokens)
                need = self.blocks.blocks_for(r.num_tokens) - len(hits) + len(r.forks)
                # One free block is kept for each running request to grow into: a prompt let into the last free
                # blocks would be preempted (and recomputed) as soon as the decodes cross a block boundary.
                headroom = len(self.running)
                if need + headroom > self.blocks.num_free_blocks - self.blocks.num_evictable(hits) - promised:
                    break  # first come, first served: nobody overtakes a request that does not fit yet
                promised += need
            self.waiting.remove(r)
            r.status, r.slot = RequestStatus.RUNNING, self.free_slots.pop()
            for f in r.forks:  # reserved now: the fork happens steps later, when other requests want slots too
                f.slot = self.free_slots.pop()
            if r.first_scheduled_time is None:
                r.first_scheduled_time = now
            if self.blocks is not None:
                r.num_computed = self.blocks.allocate_cached(r.request_id, r.tokens)
                if r.num_cached_tokens is None:
                    r.num_cached_tokens = r.num_computed
            self.running.append(r)
            if budget > 0:  # a static batch admits all its requests at once; the budget starts what it can
                n = int(min(r.num_uncomputed, budget))
                if self.blocks is not None:
                    promised -= self.blocks.num_new_blocks(r.request_id, r.num_computed + n)
                self._take_blocks(r, n)
                chunks.append(Chunk.of(r, n))
                budget -= n

    def _room(self, r: Request) -> float:
        """Tokens r can still compute with the blocks it holds and the free ones (a block it shares where it
        writes next costs a free block for its copy)."""
        if self.blocks is None:
            return math.inf
        return self.blocks.capacity(r.request_id, r.num_computed) - r.num_computed

    def _make_room(self, r: Request, chunks: list[Chunk]) -> bool:
        """Make sure r can compute at least one more token, preempting the most recently admitted requests
        that hold blocks (their chunks leave this step). False if r itself had to go."""
        while self._room(r) < 1:
            victim = next(v for v in reversed(self.running) if v is r or self.blocks.block_table(v.request_id))
            self.preempt(victim)
            chunks[:] = [c for c in chunks if c.request is not victim]
            if victim is r:
                return False
        return True

    def _take_blocks(self, r: Request, num_tokens: int) -> None:
        """Grow r's block table to cover the tokens it computes in this step."""
        if self.blocks is None or num_tokens == 0:
            return
        total = r.num_computed + num_tokens
        if r.request_id in self.blocks.block_tables:
            copies = self.blocks.copy_on_write(r.request_id, r.num_computed, total)
            self._copies += [(r.request_id, src, dst) for src, dst in copies]
            self.blocks.append_slots(r.request_id, total)
        else:
            self.blocks.allocate(r.request_id, total)

    @staticmethod
    def samplers(chunks: list[Chunk]) -> list[tuple[int, Request]]:
        """Who gets a token from this step, each with the row of the step's logits it samples: the request of
        every chunk that `samples`, in chunk order, each followed by the samples that fork from it now (they
        draw their first tokens from the logits of the one prefill)."""
        rows = [c.request for c in chunks if c.samples]
        return [(row, s) for row, r in enumerate(rows) for s in (r, *r.forks)]

    def update(self, chunks: list[Chunk], sampled: list, now: float) -> list[Request]:
        """Apply a step's results: `sampled` holds, per request of `samplers(chunks)` in that order (one per
        chunk that `samples` when nothing forks), its new token, or with speculative decoding the list of
        tokens the rejection sampler returned (accepted drafts, then one of the target's own). Returns the
        requests that finished, their slots and blocks already free."""
        samplers = [r for _, r in self.samplers(chunks)]
        if len(sampled) != len(samplers):
            raise ValueError(f"sampled has {len(sampled)} tokens for {len(samplers)} sampling requests")
        speculative = {c.request.request_id: c for c in chunks if c.draft_token_ids}
        for c in chunks:
            if c.request.request_id not in speculative:  # a speculative chunk counts what was accepted, below
                self._computed(c.request, c.request.num_computed + c.num_tokens)
        for c in chunks:
            if c.samples and c.request.forks:
                self._fork(c.request)
        finished = []
        for r, tokens in zip(samplers, sampled):
            tokens = [tokens] if isinstance(tokens, int) else list(tokens)
            # One token at a time, checking stops after each: nothing past a stop, max_tokens or max_model_len.
            reason, emitted = None, 0
            for token in tokens:
                r.output_ids.append(token)
                r.token_times.append(now)
                emitted += 1
                reason = self._finish_reason(r, token)
                if reason:
                    break
            if r.request_id in speculative:
                self._accept(speculative[r.request_id], emitted, len(tokens) - 1)
            if reason:
                r.finish_reason, r.status = reason, RequestStatus.FINISHED
                self._release(r)
                finished.append(r)
        return finished

    def _computed(self, r: Request, num_computed: int) -> None:
        """r's keys and values are now written up to `num_computed`: full blocks join the prefix cache."""
        r.num_computed = num_computed
        if self.blocks is not None:
            self.blocks.cache_blocks(r.request_id, r.tokens, num_computed)

    def _accept(self, c: Chunk, emitted: int, accepted: int) -> None:
        """Roll a speculative chunk back to what the rejection sampler kept. The cache now holds valid keys and
        values for the request's last token and its accepted drafts; those of rejected drafts stop counting
        (the context length is num_computed) and the blocks past the kept tokens go back to the pool. Only
        then are full blocks registered, so no hash ever covers a rejected token."""
        r = c.request
        r.num_draft_tokens += len(c.draft_token_ids)
        r.num_accepted_tokens += min(accepted, emitted)  # drafts past a stop token were not emitted
        self._computed(r, min(c.start + 1 + accepted, r.num_tokens))
        if self.blocks is not None:
            self.blocks.trim(r.request_id, r.num_computed)
        r.spec_token_ids = []

    def _fork(self, parent: Request) -> None:
        """The parent's prompt is computed: its other samples start running, sharing all its blocks (and each
        holding the slot reserved at admission)."""
        for f in parent.forks:
            self.blocks.fork(parent.request_id, f.request_id)
            f.num_computed, f.status = parent.num_computed, RequestStatus.RUNNING
            f.first_scheduled_time, f.num_cached_tokens = parent.first_scheduled_time, parent.num_cached_tokens
            self.running.append(f)
        parent.forks = []

    def preempt(self, request: Request) -> None:
        """Take a running request off its slot and blocks and put it first in the queue; its cache is lost, so
        it recomputes prompt and output so far when readmitted (its sampling state is kept)."""
        if request.status is not RequestStatus.RUNNING:
            raise ValueError(f"request {request.request_id} is {request.status.value}, not running")
        self._release(request)
        request.status, request.num_computed = RequestStatus.PREEMPTED, 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.insert(0, request)

    def abort(self, request: Request) -> None:
        """Drop an unfinished request (a client went away): out of the queue or the batch, its slot and blocks
        (and the slots reserved for the samples it has not forked yet) back at once; it and those samples end
        with finish_reason "abort". A forked sample is a request of its own: abort each one."""
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
        if len(r.output_ids) >= r.params.max_tokens or r.num_tokens >= self.max_model_len:
            return "length"
        return None
