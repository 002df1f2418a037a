"""The plain generation loops: full recompute (chapter 01), the KV-cached loop (chapter 03) and the
speculative loop (chapter 06), each for one sequence (`generate_batch` decodes several together)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .attention import AttentionMetadata
from .compiled_decode import COMPILE_MODES, CompiledDecode, plain_cache
from .kv_cache import ContiguousKVCache
from .sampling import SamplingParams, make_generator, sample, stop_tokens
from .speculative import _check_k, verify


def _check(model, prompts: list[list[int]], max_new_tokens, params, eos_token_id):
    """Validate the prompts and the budget; the sampling params (greedy by default) and the stop tokens."""
    params = params or SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
    if not prompts:
        raise ValueError("prompts must not be empty")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    limit = model.config.max_position_embeddings
    for prompt_ids in prompts:
        if len(prompt_ids) == 0:
            raise ValueError("prompt_ids must not be empty")
        if len(prompt_ids) + max_new_tokens > limit:
            raise ValueError(f"prompt ({len(prompt_ids)}) + max_new_tokens ({max_new_tokens}) exceeds the model's "
                             f"{limit} positions")
    return params, stop_tokens(params, model.config.eos_token_id if eos_token_id is None else eos_token_id)


def generate_naive(model, prompt_ids: list[int], max_new_tokens: int = 32, params: SamplingParams | None = None,
                   eos_token_id: int | None = None, on_token=None) -> list[int]:
    """Full recompute: every step runs the whole sequence so far through every layer. Returns the new tokens
    (a stop token, when hit, is included as the last one). `on_token(token)` is called as each one arrives."""
    params, stops = _check(model, [prompt_ids], max_new_tokens, params, eos_token_id)
    gen, seq, out = make_generator(params, model.device), list(prompt_ids), []
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([seq], device=model.device), last_only=True)[0]  # O(len(seq)) work, every step
        token = sample(logits, [params], [gen])[0]
        out.append(token)
        seq.append(token)
        if on_token:
            on_token(token)
        if token in stops:
            break
    return out


def prefill(model, kv_cache, prompts: list[list[int]], slots: list[int]) -> torch.Tensor:
    """Run all prompts at once (packed), filling their cache slots; logits of each prompt's last token."""
    meta = AttentionMetadata.build([len(p) for p in prompts], slots=slots, device=model.device, last_only=True)
    ids = torch.tensor([t for p in prompts for t in p], device=model.device)
    return model(ids, meta, kv_cache)


def decode_step(model, kv_cache, tokens: list[int], context_lens: list[int], slots: list[int]) -> torch.Tensor:
    """One new token per sequence against the cache; context_lens count the cache plus that token."""
    meta = AttentionMetadata.build([1] * len(tokens), context_lens, slots, device=model.device)
    return model(torch.tensor(tokens, device=model.device), meta, kv_cache)


def generate_cached(model, prompt_ids: list[int], max_new_tokens: int = 32, params: SamplingParams | None = None,
                    eos_token_id: int | None = None, on_token=None, kv_cache: ContiguousKVCache | None = None,
                    compile: bool | str = False) -> list[int]:
    """Prefill once, then decode one token per step against the KV cache. Same tokens as `generate_naive`.
    compile=True runs each decode step as one compiled graph (`compiled_decode`; the first call compiles);
    compile="cpp" compiles it with Inductor's C++ wrapper (longer to compile, less overhead per step), and
    "max-autotune" lets Inductor time its own weight products."""
    return generate_batch(model, [prompt_ids], max_new_tokens, params, eos_token_id,
                          on_token=on_token, kv_cache=kv_cache, compile=compile)[0]


def generate_batch(model, prompts: list[list[int]], max_new_tokens: int = 32, params: SamplingParams | None = None,
                   eos_token_id: int | None = None, on_token=None, kv_cache: ContiguousKVCache | None = None,
                   compile: bool | str = False) -> list[list[int]]:
    """Cached generation for several prompts decoded together, one slot each: every decode step reads the
    weights once for the whole batch, and a finished sequence drops out of it. `on_token` streams only with
    a single prompt. compile: as in `generate_cached`, compiled anew for each batch size met."""
    params, stops = _check(model, prompts, max_new_tokens, params, eos_token_id)
    if compile not in (False, *COMPILE_MODES):
        raise ValueError(f"compile must be False or one of {COMPILE_MODES}, got {compile!r}")
    longest = max(len(p) for p in prompts) + max_new_tokens
    if kv_cache is None:  # compiled: the model's own cache of this shape, whose address its CUDA graph replays
        kv_cache = plain_cache(model, len(prompts), longest) if compile else \
            ContiguousKVCache(model.config, len(prompts), longest, model.device, model.dtype)
    elif kv_cache.num_slots < len(prompts) or kv_cache.max_len < longest:
        raise ValueError(f"kv_cache too small: need {len(prompts)} slots of {longest} positions")
    # compiled: one graph per batch size met (size=len(tokens): no padding, so no scratch slot)
    graphs = compile and CompiledDecode(model, kv_cache, model.attention_backend, len(prompts), mode=compile)
    gens = [make_generator(params, model.device) for _ in prompts]
    outs: list[list[int]] = [[] for _ in prompts]
    active = list(range(len(prompts)))
    logits = prefill(model, kv_cache, prompts, active)
    while True:
        tokens = sample(logits, [params] * len(active), [gens[i] for i in active])
        for i, tok in zip(active, tokens):
            outs[i].append(tok)
            if on_token and len(prompts) == 1:
                on_token(tok)
        active = [i for i in active if outs[i][-1] not in stops and len(outs[i]) < max_new_tokens]
        if not active:
            return outs
        tokens, lens = [outs[i][-1] for i in active], [len(prompts[i]) + len(outs[i]) for i in active]
        if graphs:
            logits = graphs(tokens, [n - 1 for n in lens], active, size=len(active))
        else:
            logits = decode_step(model, kv_cache, tokens, lens, active)


@dataclass
class SpeculativeStats:
    """What one `generate_speculative` run did. A round is one verify pass: 1 to k + 1 tokens."""
    target_steps: int = 0            # rounds: target forward passes after the prefill
    num_draft_tokens: int = 0        # drafts proposed, over all rounds
    num_accepted_tokens: int = 0     # drafts the rejection sampler accepted
    rounds: list[tuple[list[int], int]] = field(default_factory=list)  # per round: (drafts, number accepted)
    prefill_s: float = 0.0           # wall time of the prefill (and the first token)
    draft_s: float = 0.0             # wall time spent in the proposer
    target_s: float = 0.0            # wall time of the verify passes and the rejection sampler

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted: the share of all drafts that became output (vLLM's "draft acceptance rate")."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def alpha(self) -> float:
        """The formula's α, estimated (maximum likelihood): accepted / tested. A draft is tested only when all
        before it in its round were accepted: each round tests its accepted drafts and the one rejected, if any."""
        tested = self.num_accepted_tokens + sum(accepted < len(drafts) for drafts, accepted in self.rounds)
        return self.num_accepted_tokens / tested if tested else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens the verify passes produced per pass (the prefill's first token is not counted)."""
        return (self.num_accepted_tokens + self.target_steps) / self.target_steps if self.target_steps else 0.0


def generate_speculative(model, prompt_ids: list[int], proposer, k: int = 4, max_new_tokens: int = 32,
                         params: SamplingParams | None = None, eos_token_id: int | None = None, on_token=None,
                         kv_cache: ContiguousKVCache | None = None) -> tuple[list[int], SpeculativeStats]:
    """Speculative decoding for one sequence: each round `proposer` drafts up to k tokens, the target runs its
    last token and the drafts as ONE chunk against its KV cache, and `verify` keeps the accepted drafts plus
    one token of its own. Returns (new tokens, SpeculativeStats). Greedy, the tokens are `generate_cached`'s
    (up to floating-point ties); sampled, they follow the same distribution. A proposer with `propose_sampled`
    (`DraftModelProposer`) samples its drafts when `params` does; others' drafts are deterministic.

    Rollback is a length: a rejected draft's rows lie past the context, are never read and are overwritten by
    the next round's chunk. Stops are checked after each token; nothing passes the budget."""
    params, stops = _check(model, [prompt_ids], max_new_tokens, params, eos_token_id)
    _check_k(k)
    length = len(prompt_ids) + max_new_tokens
    if kv_cache is None:
        kv_cache = ContiguousKVCache(model.config, 1, length, model.device, model.dtype)
    elif kv_cache.max_len < length:
        raise ValueError(f"kv_cache too small: need {length} positions")
    gen = make_generator(params, model.device)
    sampled_drafts = not params.greedy and hasattr(proposer, "propose_sampled")
    stats, out = SpeculativeStats(), []

    def commit(tokens: list[int]) -> bool:  # append one at a time; True once a stop or the budget ends it
        for token in tokens:
            out.append(token)
            if on_token:
                on_token(token)
            if token in stops or len(out) >= max_new_tokens:
                return True
        return False

    t0 = time.perf_counter()
    logits = prefill(model, kv_cache, [list(prompt_ids)], [0])
    done = commit(verify(logits, [], None, params, gen))
    stats.prefill_s = time.perf_counter() - t0
    while not done:
        seq = list(prompt_ids) + out           # the cache holds all but seq[-1]
        t0 = time.perf_counter()
        n = min(k, max_new_tokens - len(out) - 1)  # a round adds its drafts plus one: never past the budget
        drafts, draft_probs = [], None
        if n > 0 and sampled_drafts:
            drafts, draft_probs = proposer.propose_sampled(seq, n, params, gen)
        elif n > 0:
            drafts = list(proposer.propose(seq, n))[:n]
        t1 = time.perf_counter()
        chunk = [seq[-1]] + drafts
        meta = AttentionMetadata.build([len(chunk)], [len(seq) + len(drafts)], slots=[0], device=model.device)
        logits = model(torch.tensor(chunk, device=model.device), meta, kv_cache)  # [n + 1, V]: p_0 .. p_n
        tokens = verify(logits, drafts, draft_probs, params, gen)
        stats.draft_s += t1 - t0
        stats.target_s += time.perf_counter() - t1
        stats.target_steps += 1
        stats.num_draft_tokens += len(drafts)
        stats.num_accepted_tokens += len(tokens) - 1
        stats.rounds.append((drafts, len(tokens) - 1))
        done = commit(tokens)
    return out, stats
