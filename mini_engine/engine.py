"""The serving engine (chapter 04): `LLMEngine` runs the step loop (schedule, run the model, sample, update), and
`LLM` wraps it in one call, `generate(prompts, sampling_params)`, as vLLM does.

Every step packs the scheduled chunks of all running requests end to end, without padding, into one forward pass
over the KV cache: by default the paged pool (chapter 07), where a request holds only the blocks its tokens fill,
or with kv_cache="contiguous" one `max_model_len` slot per running request. Only the rows that end a request's
uncomputed tokens go through the LM head and are sampled. A request is capped at `max_model_len` tokens, prompt
and output together: a longer prompt is rejected, and an output that reaches the cap stops with finish_reason
"length" (as in vLLM). When the pool runs out, the scheduler preempts the newest request, which later recomputes.

`SamplingParams(n=...)` returns n completions in `RequestOutput.outputs`. On the paged cache the prompt is
prefilled once and the samples fork from it, sharing its blocks copy-on-write (paging.py); on the contiguous
cache each sample prefills in a slot of its own. With a seed, sample i draws from its own stream
(`sampling.make_generator`), so the answers differ, reproducibly, and sample 0 draws what n=1 would.

Speculative decoding (`speculative=`, chapter 06): before each step the proposer drafts up to k tokens for each
decoding request; the scheduler appends what fits to its decode chunk, the runner returns logits at all 1 + k
positions, and `speculative.verify` keeps the tokens, with the stop checks after each one.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import itertools
import numbers
import time

import torch

from .compiled_decode import CompiledDecode
from .engine_config import EngineConfig
from .kv_cache import ContiguousKVCache, PagedKVCache
from .outputs import BlockPoolSnapshot, RequestOutput, StepRecord, as_prompt_list, request_steps  # noqa: F401
from .runner import ModelRunner
from .sampling import SamplingParams, make_generator, sample, stop_tokens
from .scheduler import Chunk, Request, Scheduler, make_policy
from .speculative import DraftModelProposer, make_proposer, verify


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class LLMEngine:
    """Step-level engine: `add_request` at any time, `step()` until `has_unfinished()` is False."""

    def __init__(self, model, tokenizer=None, config: EngineConfig | None = None):
        quantized = getattr(model, "quantization", None)
        config = config or EngineConfig(model="(in-memory model)", device=str(model.device),
                                        dtype=_dtype_name(model.dtype), quantization=quantized)
        if torch.device(config.device).type != model.device.type or config.dtype != _dtype_name(model.dtype):
            raise ValueError(f"config asks for device={config.device!r} dtype={config.dtype!r} but the model is on "
                             f"{model.device} in {_dtype_name(model.dtype)}")
        if config.quantization != quantized:
            raise ValueError(f"config asks for quantization={config.quantization!r} but the model's weights are "
                             f"{quantized or 'float'}: load it with load_model(..., quantization="
                             f"{config.quantization!r}) first")
        self.config = config.resolved(str(model.device), model.config.max_position_embeddings)
        self.model, self.tokenizer = model, tokenizer
        c = self.config
        # Before the KV cache is allocated: a draft model with another vocabulary fails fast.
        self.proposer = make_proposer(c.speculative, model, c.max_model_len, c.max_num_seqs) if c.speculative \
            else None
        # compile=True: one more block (or slot) than the scheduler manages, for the compiled step's padded rows.
        scratch = int(bool(c.compile))
        if c.kv_cache == "paged":
            blocks = c.block_manager_class()(c.num_kv_blocks, c.block_size, c.enable_prefix_caching)
            cache = PagedKVCache(model.config, c.num_kv_blocks + scratch, c.block_size, model.device, model.dtype)
        else:
            blocks = None
            cache = ContiguousKVCache(model.config, c.max_num_seqs + scratch, c.max_model_len, model.device,
                                      model.dtype)
        compiled = None
        if c.compile:
            compiled = CompiledDecode(model, cache, c.attention_backend, c.max_num_seqs,
                                      scratch=c.num_kv_blocks if blocks else c.max_num_seqs,
                                      block_size=c.block_size if blocks else None, max_model_len=c.max_model_len,
                                      mode=c.compile)
        runner = getattr(model, "runner_class", ModelRunner)  # a model split over ranks brings its own (chapter 11)
        self.runner = runner(model, cache, c.attention_backend, blocks, compiled)
        policy = make_policy(c.scheduling, c.max_num_seqs, **c.policy_options)
        self.scheduler = Scheduler(policy, c.max_num_seqs, c.max_model_len, c.chunked_prefill_tokens, blocks)
        eos = tokenizer.eos_token_id if tokenizer is not None else None
        self.eos_token_id = model.config.eos_token_id if eos is None else eos
        self.trace: list[StepRecord] = []
        self._generators: dict[int, torch.Generator | None] = {}
        self._draft_generators: dict[int, torch.Generator | None] = {}  # a sampling draft model's own streams
        self._draft_probs: dict[int, torch.Tensor] = {}  # request id -> this step's draft distributions [k, V]
        self._num_drafts: dict[int, int] = {}  # request id -> drafts for its next round (adaptive speculation)
        self._samples: dict[int, list[Request]] = {}  # request id -> its n samples (sample 0 has the request's id)
        self._request_of: dict[int, int] = {}          # sample's id -> its request's id
        self._ids = itertools.count()
        self._num_steps = 0

    @classmethod
    def from_model(cls, model, tokenizer=None, **engine_kwargs) -> "LLMEngine":
        kwargs = {"model": "(in-memory model)", "device": str(model.device), "dtype": _dtype_name(model.dtype),
                  "quantization": getattr(model, "quantization", None), **engine_kwargs}
        return cls(model, tokenizer, EngineConfig(**kwargs))

    def __repr__(self) -> str:
        c = self.config
        chunking = "off" if c.chunked_prefill_tokens is None else f"{c.chunked_prefill_tokens} tokens/step"
        size = f"{self.kv_cache_bytes / 2**20:.1f} MiB"
        if c.kv_cache == "paged":
            cache = (f"paged KV cache: {c.num_kv_blocks} blocks x {c.block_size} positions ({size}), up to "
                     f"{c.max_num_seqs} sequences of up to {self.scheduler.max_model_len} positions, prefix caching "
                     f"{'on (' + c.prefix_cache + ')' if c.enable_prefix_caching else 'off'}")
        else:
            cache = f"contiguous KV cache: {c.max_num_seqs} slots x {c.max_model_len} positions ({size})"
        spec = "" if c.speculative is None else f", speculative={c.speculative.as_dict()}"
        compiled = ""
        if self.runner.compiled is not None:
            buckets = ", ".join(map(str, self.runner.compiled.buckets))
            how = " (max-autotune)" if c.compile == "max-autotune" else ""
            compiled = f", compiled decode steps{how} (batch buckets {buckets})"
        weights = f", {c.quantization} weights" if c.quantization else ""
        return (f"LLMEngine(scheduling={getattr(c.scheduling, 'name', c.scheduling)}, {cache}, chunked prefill "
                f"{chunking}, attention={c.attention_backend}{spec}{compiled}, {c.device} {c.dtype}{weights})")

    @property
    def compile_seconds(self) -> float:
        """Seconds spent compiling decode graphs so far (compile=True; 0.0 otherwise): the first step of each
        batch-size bucket, or `warmup()`. A one-time cost, to report apart from any rate."""
        return self.runner.compiled.compile_seconds if self.runner.compiled is not None else 0.0

    def warmup(self, progress: bool = False) -> float:
        """With compile=True, compile the graph of every batch-size bucket now rather than at the first step
        that needs it; returns the seconds it took (0.0 without compile). The cache is left as it was, but for
        the scratch row only padded rows use. `progress`: a bar over the buckets."""
        return self.runner.compiled.warmup(progress) if self.runner.compiled is not None else 0.0

    @property
    def kv_cache_bytes(self) -> int:
        """Memory the cache holds from the start: the contiguous slots, or the whole paged pool."""
        return self.runner.kv_cache.nbytes

    @property
    def num_kv_blocks(self) -> int | None:
        """Blocks in the paged pool (None with the contiguous cache)."""
        return self.scheduler.blocks.num_blocks if self.scheduler.blocks else None

    @property
    def num_free_blocks(self) -> int | None:
        """Blocks no request holds (None with the contiguous cache), counting cached blocks that are evictable;
        all of them when the engine is idle."""
        return self.scheduler.blocks.num_free_blocks if self.scheduler.blocks else None

    def reset_prefix_cache(self) -> int:
        """Forget every cached block that no request holds (they become plain free blocks); returns how many.
        Blocks running requests hold stay cached. 0 with the contiguous cache or caching off."""
        return self.scheduler.blocks.reset_prefix_cache() if self.scheduler.blocks else 0

    def block_pool(self) -> BlockPoolSnapshot:
        """Who holds which block of the paged pool right now: call it between steps to watch the pool."""
        if self.scheduler.blocks is None:
            raise ValueError("block_pool() needs kv_cache='paged'; this engine has the contiguous cache")
        return BlockPoolSnapshot.of(self.scheduler, self._num_steps)

    def validate(self, prompt, params: SamplingParams | None = None) -> tuple[list[int], SamplingParams]:
        """Check one request without adding it: (prompt token ids, a private copy of the params), or a
        ValueError naming the bad argument."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        params = dataclasses.replace(params)  # re-runs its checks (fields may have been changed) and copies it
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt is a string but this engine has no tokenizer; pass token ids")
            prompt = self.tokenizer.encode(prompt)
        prompt = list(prompt)
        if not prompt:
            raise ValueError("prompt is empty")
        vocab = self.model.config.vocab_size
        bad = [t for t in prompt if not isinstance(t, numbers.Integral) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt holds ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        prompt = [int(t) for t in prompt]
        if len(prompt) >= self.config.max_model_len:
            raise ValueError(f"prompt has {len(prompt)} tokens; max_model_len={self.config.max_model_len} leaves "
                             "room for at most max_model_len - 1")
        blocks = self.scheduler.blocks
        if blocks is not None and blocks.blocks_for(len(prompt) + 1) > blocks.num_blocks:
            raise ValueError(f"prompt has {len(prompt)} tokens: with one new token it needs "
                             f"{blocks.blocks_for(len(prompt) + 1)} blocks of {blocks.block_size}, more than the whole "
                             f"KV pool (num_kv_blocks={blocks.num_blocks})")
        self._check_n(len(prompt), params.n)
        if params.n > 1 and self.proposer is not None:
            # The n samples fork from one prefill and share blocks copy-on-write; rolling back drafts inside
            # shared blocks is not built: refused rather than run wrong.
            raise ValueError(f"n={params.n}: parallel sampling is not supported with speculative decoding; "
                             "use n=1 or an engine without `speculative`")
        return prompt, params

    def _check_n(self, prompt_len: int, n: int) -> None:
        """n samples run side by side: one slot each, and on the paged cache the prompt's full blocks (shared)
        plus one block of each sample's own for its first new token."""
        if n > self.config.max_num_seqs:
            raise ValueError(f"n={n} samples run side by side but max_num_seqs={self.config.max_num_seqs}")
        blocks = self.scheduler.blocks
        if blocks is not None and prompt_len // blocks.block_size + n > blocks.num_blocks:
            raise ValueError(f"n={n} samples of a {prompt_len}-token prompt need {prompt_len // blocks.block_size} "
                             f"shared blocks + {n} of their own, more than the KV pool (num_kv_blocks="
                             f"{blocks.num_blocks})")

    def add_request(self, prompt, params: SamplingParams | None = None) -> int:
        """Queue a request (a string or token ids); it joins the batch at a step the policy allows.
        Returns its id. A bad request raises ValueError and changes nothing."""
        prompt, params = self.validate(prompt, params)
        stop, now = stop_tokens(params, self.eos_token_id), time.perf_counter()
        samples = [Request(next(self._ids), prompt, params, stop, now, index=i) for i in range(params.n)]
        for s in samples:
            self._generators[s.request_id] = make_generator(params, self.model.device, s.index)
            if isinstance(self.proposer, DraftModelProposer):  # a sampling draft model draws from its own stream
                self._draft_generators[s.request_id] = make_generator(params, self.model.device, s.index, "draft")
            self._request_of[s.request_id] = samples[0].request_id
        self._samples[samples[0].request_id] = samples
        if self.scheduler.blocks is not None:
            samples[0].forks = samples[1:]  # one prefill, then the others fork from it
            self.scheduler.add(samples[0])
        else:
            for s in samples:  # no blocks to share: each sample computes the prompt in a slot of its own
                self.scheduler.add(s)
        return samples[0].request_id

    def abort_request(self, request_id: int) -> bool:
        """Stop a request now, between steps (the server calls it when a client goes away): all its samples
        leave the queue or the batch and their slots and KV blocks go back to the pool at once, with
        finish_reason "abort"; step() never returns its output. False when the request is unknown or has
        already finished."""
        samples = self._samples.pop(request_id, None)
        if samples is None:
            return False
        for s in samples:
            if self._request_of.pop(s.request_id, None) is None:
                continue  # this sample had finished already
            self.scheduler.abort(s)
            del self._generators[s.request_id]
            self._draft_generators.pop(s.request_id, None)
            self._draft_probs.pop(s.request_id, None)
            self._num_drafts.pop(s.request_id, None)
        return True

    def request_samples(self, request_id: int) -> list[Request]:
        """The n samples of an unfinished request, as the scheduler's Requests (sample i at index i): their
        `output_ids` (and `logprobs`, when asked for) grow step by step and `finish_reason` is set when each
        one ends: what a streaming server reads between steps. Read them; do not change them."""
        return list(self._samples[request_id])

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Schedule, run one packed forward pass, sample; return the requests that finished in this step.
        All or nothing: if anything in it raises (Ctrl-C too), the requests it scheduled are aborted (see
        `_abort_step`) and the exception goes on, with a note naming them; the engine serves on."""
        start, chunks = time.perf_counter(), []
        try:
            if self.proposer is not None:
                self._propose()
            chunks = None  # from here on, a failure may leave half-planned chunks behind
            chunks = self.scheduler.schedule(start)
            if not chunks:
                wait = self.scheduler.seconds_until_admission(start)
                if self.has_unfinished() and wait <= 0:
                    raise RuntimeError("scheduler made no progress with requests pending")
                time.sleep(max(wait, 0.0))  # a dynamic batcher waiting for its bucket: nothing to compute
                return []
            logits = self.runner.execute(chunks, self.scheduler.block_copies)
            tokens = self._sample(chunks, logits)
            self.runner.record_logprobs(chunks, logits, self.scheduler.samplers(chunks), tokens)
            end = time.perf_counter()  # sample() read the tokens back, so the device has finished the step
            if self.config.record_trace:  # before update(), which frees the slots of the requests that finish
                self.trace.append(StepRecord(self._num_steps, start, end, tuple(
                    (c.request.request_id, c.request.slot, c.num_tokens, c.samples) for c in chunks),
                    len(self.scheduler.waiting), len(self.scheduler.running)))
            finished = self.scheduler.update(chunks, tokens, end)
        except BaseException as e:
            self._abort_step(chunks, e)
            raise
        self._num_steps += 1
        return [out for out in map(self._finish_sample, finished) if out is not None]

    def _abort_step(self, chunks: list[Chunk] | None, error: BaseException) -> None:
        """A failed step may have planned block copies that never ran and written keys and values it never
        recorded. Run on, those requests would compute on uncopied blocks and the prefix cache would take them
        in; so every request the step scheduled (every running one, if scheduling itself failed) is aborted:
        its blocks go back to the pool and only what earlier steps computed stays cached. Aborted, not queued
        again: a step that fails for one request's sake would fail again, forever."""
        running = self.scheduler.running if chunks is None else [c.request for c in chunks]
        ids = sorted({self._request_of[r.request_id] for r in running if r.request_id in self._request_of})
        for request_id in ids:
            self.abort_request(request_id)
        if ids:
            error.add_note(f"mini_engine: step {self._num_steps} failed; requests {ids}, which it scheduled, were "
                           "aborted (finish_reason 'abort') and their KV blocks freed; the engine serves on")

    def _propose(self) -> None:
        """Draft up to k tokens for every decoding request (the scheduler then verifies what fits the step).
        A step adds a request's drafts plus one token, so it drafts at most what max_tokens and max_model_len
        still allow, minus one."""
        k, limit = self.config.speculative.k, self.scheduler.max_model_len
        self._draft_probs.clear()
        for r in self.scheduler.running:
            r.spec_token_ids = []
            n = min(self._num_drafts.get(r.request_id, k), r.params.max_tokens - len(r.output_ids) - 1,
                    limit - r.num_tokens - 1)
            if r.is_prefill or n <= 0:
                continue
            if not isinstance(self.proposer, DraftModelProposer):
                drafts = self.proposer.propose(r.tokens, n)
            elif r.params.greedy:
                drafts = self.proposer.propose(r.tokens, n, slot=r.slot)
            else:  # drafts drawn from the draft's processed distribution: accepted more often than greedy ones
                drafts, self._draft_probs[r.request_id] = self.proposer.propose_sampled(
                    r.tokens, n, r.params, self._draft_generators[r.request_id], slot=r.slot)
            r.spec_token_ids = list(drafts)[:n]

    def _sample(self, chunks: list[Chunk], logits: torch.Tensor) -> list:
        """What each request of `scheduler.samplers(chunks)` gets from this step, in that order: a token from
        the plain sampler, or for a speculative chunk the list `rejection_sample` keeps. A request whose chunk
        carries no drafts goes through the plain sampler, so it draws exactly the random numbers it would
        without speculation."""
        sampling = [c for c in chunks if c.samples]
        offsets = list(itertools.accumulate((c.num_logits for c in sampling), initial=0))
        out: list = []
        plain: list[tuple[int, int, Request]] = []  # (place in out, logits row, request)
        for row, r in self.scheduler.samplers(chunks):  # forks draw from the row of the prefill they fork from
            c = sampling[row]
            if c.draft_token_ids:
                out.append(verify(logits[offsets[row]:offsets[row + 1]], list(c.draft_token_ids),
                                  self._draft_probs.get(r.request_id), r.params, self._generators[r.request_id]))
                if self.config.speculative.adaptive:  # one more than it accepted (len(out[-1]) - 1), up to k
                    self._num_drafts[r.request_id] = min(len(out[-1]), self.config.speculative.k)
            else:
                plain.append((len(out), offsets[row], r))
                out.append(None)
        if plain:
            places, rows, requests = zip(*plain)
            rows = list(rows)
            plain_logits = logits if rows == list(range(logits.shape[0])) else logits[rows]
            tokens = sample(plain_logits, [r.params for r in requests],
                            [self._generators[r.request_id] for r in requests])
            for place, token in zip(places, tokens):
                out[place] = token
        return out

    def _finish_sample(self, r: Request) -> RequestOutput | None:
        """The request's output once its last sample has finished (None before)."""
        del self._generators[r.request_id]
        self._draft_generators.pop(r.request_id, None)
        self._num_drafts.pop(r.request_id, None)
        request_id = self._request_of.pop(r.request_id)
        samples = self._samples[request_id]
        if any(s.request_id in self._request_of for s in samples):  # a sample is still running
            return None
        del self._samples[request_id]
        return RequestOutput.of(samples, self.tokenizer)


class LLM(contextlib.AbstractContextManager):
    """Offline serving in one call, vLLM style:

        llm = LLM("smollm2-135m", max_num_seqs=16)
        outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(max_tokens=32))

    `LLM.from_model(model, tokenizer, **engine_kwargs)` serves weights already in memory.
    `quantization="int4"` or `"int8"` loads the model with weight-only quantized products (mini_engine/quant); a model
    already quantized (`load_model(..., quantization=...)`) is served as it is by `from_model`. Parts of your own
    plug in through `scheduling=`, `speculative=` and `block_manager=` (see `EngineConfig`)."""

    def __init__(self, model: str = "smollm2-135m", device: str = "cpu", dtype: str = "float32",
                 kv_cache: str = "paged", block_size: int = 16, num_kv_blocks: int | None = None,
                 max_num_seqs: int | None = None, max_model_len: int | None = None,
                 enable_prefix_caching: bool | None = None, chunked_prefill_tokens: int | None = 512,
                 scheduling: object = "continuous", speculative: dict | None = None, attention_backend: str = "auto",
                 compile: bool | str = False, quantization: str | None = None, **engine_kwargs):
        from .loading.loader import load_model
        config = EngineConfig(  # checked before the weights load
            model=model, device=device, dtype=dtype, kv_cache=kv_cache, block_size=block_size,
            num_kv_blocks=num_kv_blocks, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching, chunked_prefill_tokens=chunked_prefill_tokens,
            scheduling=scheduling, speculative=speculative, attention_backend=attention_backend, compile=compile,
            quantization=quantization, **engine_kwargs)
        weights, tokenizer = load_model(model, device=device, dtype=dtype, quantization=quantization) \
            if config.num_ranks == 1 else importlib.import_module(".parallel", __package__).load_parallel(config)
        self.engine = LLMEngine(weights, tokenizer, config)

    @classmethod
    def from_model(cls, model, tokenizer=None, **engine_kwargs) -> "LLM":
        llm = cls.__new__(cls)
        llm.engine = LLMEngine.from_model(model, tokenizer, **engine_kwargs)
        return llm

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    def __repr__(self) -> str:
        return repr(self.engine).replace("LLMEngine", "LLM", 1)

    def shutdown(self, *exc) -> None:  # end a tensor-parallel engine's ranks (chapter 11); also on leaving `with`
        getattr(self.engine.model, "shutdown", lambda: None)()

    __exit__ = shutdown  # `with LLM(...) as llm:` (contextlib.AbstractContextManager's __enter__ returns llm)

    def reset_prefix_cache(self) -> int:
        """Drop every cached block no request holds (see `LLMEngine.reset_prefix_cache`); returns how many."""
        return self.engine.reset_prefix_cache()

    def warmup(self, progress: bool = False) -> float:
        """compile=True: compile every batch-size bucket's decode graph now (see `LLMEngine.warmup`)."""
        return self.engine.warmup(progress)

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt (strings or token-id lists) to completion; outputs in prompt order.
        `sampling_params`: one for all, or a list with one per prompt. Every request is checked before
        any runs: a bad one raises ValueError naming its index, and nothing is queued."""
        from tqdm.auto import tqdm

        prompts = as_prompt_list(prompts)
        if not prompts:
            raise ValueError("prompts must not be empty")
        many = isinstance(sampling_params, (list, tuple))
        params = list(sampling_params) if many else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params has {len(params)} entries for {len(prompts)} prompts")
        checked = []
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            try:
                checked.append(self.engine.validate(prompt, sp))
            except ValueError as e:
                raise ValueError(f"request {i}: {e}") from None
        ids = [self.engine.add_request(prompt, sp) for prompt, sp in checked]
        wanted = set(ids)
        outputs: dict[int, RequestOutput] = {}
        try:
            with tqdm(total=len(ids), desc="requests", disable=not use_tqdm) as bar:
                while len(outputs) < len(ids):
                    for out in self.engine.step():
                        if out.request_id in wanted:  # the engine may also hold requests added step by step
                            outputs[out.request_id] = out
                            bar.update(1)
        except BaseException:  # a failed step (or Ctrl-C): nobody will collect the rest, as the server aborts
            for i in ids:      # a failed step's streams; the step has aborted the requests it scheduled
                self.engine.abort_request(i)
            raise
        return [outputs[i] for i in ids]
