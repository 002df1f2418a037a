"""What the serving engine hands back (chapter 04 on): each request's output and metrics, vLLM's shape, and what
a step or the block pool looked like (for the chapters' pictures)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class RequestMetrics:
    """Per-request latencies in seconds, all measured from the request's arrival (add_request)."""
    queue_s: float        # arrival until first scheduled
    ttft_s: float         # arrival until the first output token
    tpot_s: float         # mean time between output tokens after the first (NaN for one token)
    e2e_s: float          # arrival until the last output token
    num_preemptions: int
    num_prompt_tokens: int
    num_output_tokens: int
    arrival_time: float   # time.perf_counter() clock
    token_times: tuple[float, ...]  # when each output token was sampled, same clock
    num_draft_tokens: int = 0       # speculative decoding: drafts the target verified
    num_accepted_tokens: int = 0    # of those, accepted (and emitted: drafts past a stop token are not counted)
    num_host_cached_tokens: int = 0  # chapter 12: of num_cached_tokens, copied back from host memory
    num_disk_cached_tokens: int = 0  # and from disk (a tiered prefix cache, kv_offload=...)


@dataclass(frozen=True)
class CompletionOutput:
    """One of a request's n completions (vLLM's shape)."""
    index: int            # which sample: 0 .. n − 1
    token_ids: list[int]
    text: str | None      # None when the engine has no tokenizer
    finish_reason: str    # "stop" (stop or EOS token, included in token_ids) or "length"
    logprobs: list[dict[int, float]] | None = None  # SamplingParams.logprobs: per token (`sampling.logprobs_of`)


@dataclass(frozen=True)
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]  # outputs[0]'s, as are text and finish_reason
    text: str | None      # None when the engine has no tokenizer
    finish_reason: str    # "stop" (stop or EOS token, included in token_ids) or "length"
    metrics: RequestMetrics  # over all n samples (ttft: the first token of any, e2e: the last of all)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache when the request was first admitted
    outputs: list[CompletionOutput] = dataclasses.field(default_factory=list)  # the n completions, by index
    prompt_logprobs: list[dict[int, float] | None] | None = None  # SamplingParams.prompt_logprobs; first None

    @classmethod
    def of(cls, samples: list, tokenizer=None) -> "RequestOutput":
        """The output of a request whose n samples (the scheduler's Requests, sample i at index i) have all
        finished; its metrics cover all of them (TTFT: the first token of any, e2e: the last of all)."""
        r = samples[0]
        first = min(s.token_times[0] for s in samples)
        last = max(s.token_times[-1] for s in samples)
        tpots = [(s.token_times[-1] - s.token_times[0]) / (len(s.output_ids) - 1) for s in samples
                 if len(s.output_ids) > 1]  # per sample: the time between its own tokens
        metrics = RequestMetrics(
            queue_s=min(s.first_scheduled_time for s in samples) - r.arrival_time, ttft_s=first - r.arrival_time,
            tpot_s=sum(tpots) / len(tpots) if tpots else float("nan"), e2e_s=last - r.arrival_time,
            num_preemptions=sum(s.num_preemptions for s in samples), num_prompt_tokens=len(r.prompt_ids),
            num_output_tokens=sum(len(s.output_ids) for s in samples), arrival_time=r.arrival_time,
            token_times=tuple(sorted(t for s in samples for t in s.token_times)),
            num_draft_tokens=sum(s.num_draft_tokens for s in samples),
            num_accepted_tokens=sum(s.num_accepted_tokens for s in samples),
            num_host_cached_tokens=r.num_tier_cached_tokens[0], num_disk_cached_tokens=r.num_tier_cached_tokens[1])
        outputs = [CompletionOutput(s.index, list(s.output_ids), tokenizer.decode(s.output_ids)
                                    if tokenizer is not None else None, s.finish_reason,
                                    s.logprobs[:len(s.output_ids)] if s.params.logprobs is not None else None)
                   for s in samples]
        return cls(r.request_id, r.prompt_ids, outputs[0].token_ids, outputs[0].text, outputs[0].finish_reason,
                   metrics, r.num_cached_tokens or 0, outputs,
                   [None, *r.prompt_logprobs] if r.params.prompt_logprobs is not None else None)


@dataclass(frozen=True)
class StepRecord:
    """What one step ran: (request_id, slot, num_tokens, sampled) per chunk, and when."""
    step: int
    start: float
    end: float
    chunks: tuple[tuple[int, int, int, bool], ...]
    num_waiting: int
    num_running: int  # requests admitted and unfinished during the step (some may have had no chunk in it)


def request_steps(trace: list[StepRecord], request_id: int) -> list[tuple[int, float]]:
    """(tokens computed, seconds) of each traced step that ran a chunk of the request, in order."""
    return [(sum(n for rid, _, n, _ in s.chunks if rid == request_id), s.end - s.start)
            for s in trace if any(rid == request_id for rid, *_ in s.chunks)]


@dataclass(frozen=True)
class BlockPoolSnapshot:
    """The paged pool between two steps (`LLMEngine.block_pool()`): who holds each block."""
    step: int                          # steps run so far
    block_size: int
    owners: tuple[int | None, ...]     # per block: a request id holding it (the first), None when free
    num_computed: dict[int, int]       # running request id -> tokens whose keys/values are in its blocks
    waiting: tuple[int, ...]           # queued request ids in queue order (preempted ones go first)
    num_preemptions: int               # preemptions since the engine started
    ref_counts: tuple[int, ...] = ()   # per block: how many block tables hold it (> 1: shared by prefix caching)
    cached: tuple[bool, ...] = ()      # per block: registered in the prefix cache (held, or free but evictable)
    block_tables: dict[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)  # request id -> its blocks

    @property
    def num_free_blocks(self) -> int:
        return self.owners.count(None)

    @classmethod
    def of(cls, scheduler, step: int) -> "BlockPoolSnapshot":
        blocks = scheduler.blocks
        owners: list[int | None] = [None] * blocks.num_blocks
        for request_id, table in blocks.block_tables.items():
            for block in table:
                if owners[block] is None:
                    owners[block] = request_id
        return cls(step, blocks.block_size, tuple(owners), {r.request_id: r.num_computed for r in scheduler.running},
                   tuple(r.request_id for r in scheduler.waiting), scheduler.num_preemptions,
                   tuple(blocks.ref_counts), tuple(h is not None for h in blocks.block_hash),
                   {i: tuple(t) for i, t in blocks.block_tables.items()})


def as_prompt_list(prompts) -> list:
    """`LLM.generate`'s prompts as a list: one prompt (a string or one list of token ids) becomes a list of one."""
    if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                    and all(isinstance(t, int) for t in prompts)):
        return [prompts]
    return list(prompts)
