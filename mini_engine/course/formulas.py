"""Closed-form costs of LLM inference: KV-cache memory, FLOPs, bytes moved, the roofline, speculative
decoding, paging and prefix caching.

Plain numbers in, plain numbers out. Wherever an argument is a length or a count, a NumPy array works too,
so a notebook can plot a whole curve in one call. Functions that need the shape of a model take `model`:
a `ModelConfig`, a preset name from `mini_engine.config.PRESETS`, or a hand-built `ModelShape`.

Units: the textbook the course accompanies writes "GB" for what are binary gigabytes (its "roughly 2 GB per
sequence" for Llama-7B at 4K is 2 × 32 × 32 × 128 × 4096 × 2 bytes, exactly 2 GiB), so the course reports
memory in GiB / MiB and says so.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..config import PRESETS, ModelConfig

DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1, "fp8": 1}
KiB, MiB, GiB = 1024, 1024**2, 1024**3


@dataclass(frozen=True)
class ModelShape:
    """The few numbers the cost formulas read; build one by hand to price a model that has no preset."""

    n_params: float
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_size: int

    @classmethod
    def of(cls, model: ModelShape | ModelConfig | str) -> ModelShape:
        if isinstance(model, ModelShape):
            return model
        if isinstance(model, str):
            if model not in PRESETS:
                raise ValueError(f"model: unknown preset {model!r}; choose one of {sorted(PRESETS)}")
            model = PRESETS[model]
        if isinstance(model, ModelConfig):
            return cls(n_params=model.num_params, n_layers=model.num_layers, n_heads=model.num_heads,
                       n_kv_heads=model.num_kv_heads, head_dim=model.head_dim, hidden_size=model.hidden_size)
        raise ValueError(f"model: expected a ModelConfig, a preset name or a ModelShape, got {type(model).__name__}")


def _arr(x):
    """Arrays become float64 so cubic sums cannot overflow int64; Python ints stay exact."""
    return np.asarray(x, dtype=np.float64) if isinstance(x, (np.ndarray, list, tuple)) else x


def _out(x):
    """A 0-d result comes back as a Python number, anything else as an array."""
    x = np.asarray(x)
    return x.item() if x.ndim == 0 else x


def _check_at_least(name: str, value, low) -> None:
    if np.any(np.asarray(value) < low):
        raise ValueError(f"{name} must be >= {low}, got {value}")


# ---------------------------------------------------------------- KV-cache memory (chapter 03)

def kv_bytes_per_token(n_layers, n_kv_heads, head_dim, dtype_bytes=2):
    """Bytes one token adds to the KV cache: 2 (K and V) · L · H_kv · D · bytes.

    Llama-2-13B (40 layers, 40 KV heads, D = 128) in fp16: 819,200 bytes, about 0.78 MiB per token.
    """
    return 2 * n_layers * n_kv_heads * head_dim * dtype_bytes


def kv_cache_bytes(n_layers, n_kv_heads, head_dim, seq_len, batch=1, dtype_bytes=2):
    """KV-cache size: 2 · L · H_kv · D · N · B · bytes.

    The 2 counts keys and values; every layer keeps one K and one V vector of size D per KV head per token.
    Llama-7B (L = 32, H_kv = 32, D = 128) at N = 4096 in fp16 is exactly 2 GiB per sequence; Llama-70B
    (L = 80, D = 128) at 128K tokens is 40 GiB with its 8 GQA KV heads and 320 GiB if all 64 heads kept KV.
    """
    _check_at_least("seq_len", seq_len, 0)
    _check_at_least("batch", batch, 0)
    return kv_bytes_per_token(n_layers, n_kv_heads, head_dim, dtype_bytes) * seq_len * batch


def kv_bytes_per_token_for(model, dtype_bytes=2, n_kv_heads=None):
    """`kv_bytes_per_token` for a model; `n_kv_heads` overrides the model's own (to price MHA, GQA or MQA)."""
    s = ModelShape.of(model)
    return kv_bytes_per_token(s.n_layers, n_kv_heads or s.n_kv_heads, s.head_dim, dtype_bytes)


def kv_cache_bytes_for(model, seq_len, batch=1, dtype_bytes=2, n_kv_heads=None):
    """`kv_cache_bytes` for a model; `n_kv_heads` overrides the model's own."""
    s = ModelShape.of(model)
    return kv_cache_bytes(s.n_layers, n_kv_heads or s.n_kv_heads, s.head_dim, seq_len, batch, dtype_bytes)


def weight_bytes(model, dtype_bytes=2):
    """Bytes of the weights: parameters · bytes per parameter (13.0B params in fp16 ≈ 26 GB)."""
    return ModelShape.of(model).n_params * dtype_bytes


def max_concurrent_requests(gpu_bytes, weight_bytes, kv_bytes_per_request):
    """How many requests' KV caches fit beside the weights: ⌊(GPU memory − weights) / KV per request⌋.

    The textbook's "~35 on an 80 GB A100" (Llama-2-13B's KV cache "caps how many requests a GPU holds") comes
    out of these assumptions:
    the "80 GB" A100 holds 80 GiB (81,920 MiB), the fp16 weights take 13.0B × 2 bytes ≈ 26 GB, each request
    reserves 2048 tokens of fp16 KV (1.5625 GiB), and nothing else (activations, CUDA context, allocator
    slack) is counted: (85.9 GB − 26.0 GB) / 1.68 GB = 35.7, so 35. Real servers reserve 5–10% more.
    """
    free = np.asarray(gpu_bytes) - np.asarray(weight_bytes)
    return _out(np.maximum(0, free // kv_bytes_per_request).astype(np.int64))


# ---------------------------------------------------------------- FLOPs (chapters 01 and 02)

def matmul_flops(model, n_tokens):
    """FLOPs of the weight matmuls for `n_tokens` tokens: 2 · params · n (one multiply-add per weight).

    Counting every parameter (embeddings included) is the usual approximation; for an untied model the
    input embedding is really a lookup, which overstates the count by 2 · vocab · hidden per token.
    """
    return 2 * ModelShape.of(model).n_params * _arr(n_tokens)


def attention_flops(model, n_queries, n_keys):
    """FLOPs of the attention products QKᵀ and PV: 4 · L · H · D · queries · keys.

    Each of the two products costs one multiply-add (2 FLOPs) per query, key, head and head dimension.
    Counted over the full rectangle, as naive attention computes it before masking; a causal kernel that
    skips masked tiles does about half of it during prefill.
    """
    s = ModelShape.of(model)
    return 4 * s.n_layers * s.n_heads * s.head_dim * _arr(n_queries) * _arr(n_keys)


def flops_per_token(model, context_len):
    """FLOPs to push one token through the model while it attends to `context_len` keys:
    2 · params + 4 · L · H · D · context."""
    return matmul_flops(model, 1) + attention_flops(model, 1, context_len)


def prefill_flops(model, n, past=0):
    """FLOPs of one forward pass over `n` new tokens attending to `past` cached ones plus themselves:
    2 · params · n + 4 · L · H · D · n · (past + n). With past = 0 this is a full no-cache forward pass."""
    _check_at_least("n", n, 0)
    return matmul_flops(model, n) + attention_flops(model, n, _arr(past) + _arr(n))


def decode_flops(model, context, batch=1):
    """FLOPs of one decode step for `batch` sequences, each attending to `context` keys (its cache plus
    the new token): batch · (2 · params + 4 · L · H · D · context)."""
    return _arr(batch) * flops_per_token(model, context)


# ---------------------------------------------------------------- bytes moved and intensity (chapter 02)

def _activation_bytes(s: ModelShape, n_tokens, dtype_bytes):
    # Each layer reads and writes its slice of the residual stream; the rest stays in caches and registers.
    return 2 * _arr(n_tokens) * s.hidden_size * s.n_layers * dtype_bytes


def prefill_bytes(model, n, dtype_bytes=2, past=0):
    """Bytes a prefill of `n` tokens moves: weights once + `past` cached K/V read + `n` new K/V written
    + activations (2 · n · hidden · L · bytes). Assumes fused attention, so scores never reach memory."""
    s = ModelShape.of(model)
    kv = kv_bytes_per_token_for(s, dtype_bytes)
    return (weight_bytes(s, dtype_bytes) + kv * (_arr(past) + _arr(n))
            + _activation_bytes(s, n, dtype_bytes))


def decode_bytes(model, batch, context, dtype_bytes=2, weight_bits=None):
    """Bytes one decode step moves: weights once (shared by the whole batch) + every sequence's K/V
    (context − 1 cached entries read, the new one written) + activations. Equals `prefill_bytes` of one
    token with context − 1 past at batch 1. The weight term is why batching helps decode.
    `weight_bits`: bits per weight of quantized weights (`bits_per_weight`; chapter 10); the K/V and the
    activations stay in `dtype_bytes`. None: the weights are in `dtype_bytes` too."""
    s = ModelShape.of(model)
    kv = kv_bytes_per_token_for(s, dtype_bytes)
    weights = weight_bytes(s, dtype_bytes) if weight_bits is None else weight_bytes(s, _arr(weight_bits) / 8)
    return weights + _arr(batch) * kv * _arr(context) + _activation_bytes(s, batch, dtype_bytes)


def arithmetic_intensity(flops, bytes_moved):
    """FLOPs per byte moved: below the hardware's ridge point the work waits on memory."""
    return _arr(flops) / _arr(bytes_moved)


def decode_intensity(model, batch, context, dtype_bytes=2):
    """Arithmetic intensity of a decode step. About 1 FLOP/byte at batch 1 in fp16 (two FLOPs per weight,
    two bytes per weight), growing with the batch until the per-sequence KV reads dominate."""
    return arithmetic_intensity(decode_flops(model, context, batch), decode_bytes(model, batch, context, dtype_bytes))


def prefill_intensity(model, n, dtype_bytes=2):
    """Arithmetic intensity of a prefill of `n` tokens: roughly n FLOPs/byte in fp16, so long prompts are
    compute-bound."""
    return arithmetic_intensity(prefill_flops(model, n), prefill_bytes(model, n, dtype_bytes))


# ---------------------------------------------------------------- roofline (chapter 02)

def ridge_point(peak_flops, peak_bw):
    """Intensity (FLOPs/byte) where the memory roof meets the compute roof: peak FLOP/s / peak bytes/s."""
    return peak_flops / peak_bw


def attainable_flops(intensity, peak_flops, peak_bw):
    """The roofline: min(peak FLOP/s, intensity · bandwidth)."""
    return _out(np.minimum(peak_flops, _arr(intensity) * peak_bw))


def roofline_time(flops, bytes_moved, peak_flops, peak_bw):
    """Lower bound on run time: max(flops / peak FLOP/s, bytes / bandwidth), whichever unit is busier."""
    return _out(np.maximum(_arr(flops) / peak_flops, _arr(bytes_moved) / peak_bw))


def roofline_bound(flops, bytes_moved, peak_flops, peak_bw) -> str:
    """'memory' when moving the bytes takes longer than doing the FLOPs, else 'compute'."""
    return "memory" if bytes_moved / peak_bw > flops / peak_flops else "compute"


def prefill_time(model, n, past, dtype_bytes, peak_flops, peak_bw):
    """Roofline lower bound on a prefill of `n` tokens after `past` cached ones (seconds): the time to first
    token when nothing else shares the step. A fp16 prefill does about n FLOP per byte, so one of fewer tokens
    than the ridge point is memory-bound: it pays for reading every weight however few tokens it computes."""
    return roofline_time(prefill_flops(model, n, past), prefill_bytes(model, n, dtype_bytes, past),
                         peak_flops, peak_bw)


def predicted_decode_tok_s(model, batch, context, dtype_bytes, peak_flops, peak_bw, weight_bits=None):
    """Roofline ceiling on decode throughput: batch tokens per step / roofline time of the step (`weight_bits`:
    quantized weights, as in `decode_bytes`; the FLOPs do not change, only the bytes)."""
    step = roofline_time(decode_flops(model, context, batch),
                         decode_bytes(model, batch, context, dtype_bytes, weight_bits), peak_flops, peak_bw)
    return _out(_arr(batch) / step)


# ---------------------------------------------------------------- naive vs cached generation (chapter 01)

def _sum_range(a, b):
    """Σ n for n = a..b (0 when b < a)."""
    a, b = _arr(a), _arr(b)
    return (b * (b + 1) - (a - 1) * a) / 2


def _sum_squares_range(a, b):
    """Σ n² for n = a..b (0 when b < a)."""
    a, b = _arr(a), _arr(b)
    return (b * (b + 1) * (2 * b + 1) - (a - 1) * a * (2 * a - 1)) / 6


def naive_step_flops(model, seq_len):
    """FLOPs of one step without a cache: a full forward pass over all `seq_len` tokens so far,
    2 · params · n (O(n), the weight matmuls) + 4 · L · H · D · n² (O(n²), the attention products)."""
    return prefill_flops(model, seq_len)


def naive_generation_flops(model, prompt_len, new_tokens):
    """Total FLOPs to generate `new_tokens` (T) after a prompt of P tokens by full recompute.

    Step s = 1..T re-runs the whole sequence of n = P + s − 1 tokens, so the total is
    Σₙ [2 · params · n + 4 · L · H · D · n²] over n = P..P+T−1: the matmul part grows as O(N²) in total
    and the attention part as O(N³) (a sum of squares), which dominates at long lengths.
    """
    _check_at_least("prompt_len", prompt_len, 1)
    _check_at_least("new_tokens", new_tokens, 1)
    s = ModelShape.of(model)
    first, last = _arr(prompt_len), _arr(prompt_len) + _arr(new_tokens) - 1
    return (matmul_flops(s, _sum_range(first, last))
            + attention_flops(s, 1, _sum_squares_range(first, last)))


def cached_generation_flops(model, prompt_len, new_tokens):
    """Total FLOPs with a KV cache: one prefill of the P prompt tokens (which yields the first new token)
    plus T − 1 single-token decode steps attending to P + 1 .. P + T − 1 keys.

    = prefill_flops(P) + Σ_c flops_per_token(c) for c = P+1..P+T−1: every position is pushed through
    the weights once (O(N) in total) and attends once to its past (O(N²) in total).
    """
    _check_at_least("prompt_len", prompt_len, 1)
    _check_at_least("new_tokens", new_tokens, 1)
    s = ModelShape.of(model)
    p, t = _arr(prompt_len), _arr(new_tokens)
    return (prefill_flops(s, p) + matmul_flops(s, t - 1)
            + attention_flops(s, 1, _sum_range(p + 1, p + t - 1)))


def attention_work_ratio(n):
    """Attention work without a cache over with one, for a decode reaching n tokens from a 1-token prompt:
    Σ i² / Σ i for i = 1..n = (n(n+1)(2n+1)/6) / (n(n+1)/2) = (2n + 1) / 3.

    At n = 1024 that is 683: the textbook's "roughly a 700× reduction in attention FLOPs".
    """
    _check_at_least("n", n, 1)
    return (2 * _arr(n) + 1) / 3


# ---------------------------------------------------------------- speculative decoding (chapter 06)

def _check_speculative(k, alpha):
    _check_at_least("k", k, 0)
    if np.any(np.asarray(alpha) < 0) or np.any(np.asarray(alpha) > 1):
        raise ValueError(f"alpha must lie in [0, 1], got {alpha}")


def expected_tokens_per_step(k, alpha):
    """Tokens committed per target forward pass with k drafted tokens, each accepted with probability α
    independently until the first rejection: Σ αⁱ for i = 0..k = (1 − α^(k+1)) / (1 − α) (k + 1 at α = 1).
    The target always contributes one token (the correction or the bonus token). α = 0.8, k = 4 gives 3.36.
    """
    _check_speculative(k, alpha)
    k, alpha = np.asarray(k, dtype=np.float64), np.asarray(alpha, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        geometric = (1 - alpha ** (k + 1)) / (1 - alpha)
    return _out(np.where(alpha == 1, k + 1, geometric))


def acceptance_rate(target_probs, draft_probs):
    """α = Σ_x min(p(x), q(x)) over the last axis: the chance that the rejection sampler accepts a draft drawn
    from q when the target's distribution is p (Leviathan et al. 2023). 1 when q = p, 0 when their supports
    are disjoint. For a deterministic proposer (q one-hot at its guess x) it is p(x)."""
    p, q = np.asarray(target_probs, dtype=np.float64), np.asarray(draft_probs, dtype=np.float64)
    if p.shape != q.shape:
        raise ValueError(f"draft_probs must have target_probs' shape {p.shape}, got {q.shape}")
    return _out(np.minimum(p, q).sum(axis=-1))


def expected_accepted_drafts(k, alpha):
    """Drafts accepted per round, α + α² + … + α^k: every token of `expected_tokens_per_step` but the target's
    own one. What the engine's metrics count as num_accepted_tokens / rounds."""
    return _out(np.asarray(expected_tokens_per_step(k, alpha)) - 1)


def speculative_speedup(k, alpha, draft_cost, overhead=0.0):
    """Speedup over plain decoding: expected tokens per round / cost of a round in target passes,
    (1 − α^(k+1)) / (1 − α) / (1 + k · draft_cost + overhead).

    `draft_cost` is one draft pass relative to one target pass (0.02 for a draft 50× cheaper); `overhead`
    is per-round bookkeeping in the same unit. Assumes verifying k tokens costs the same as decoding one,
    which holds while decode is memory-bound (small batches).
    """
    _check_at_least("draft_cost", draft_cost, 0)
    _check_at_least("overhead", overhead, 0)
    return _out(expected_tokens_per_step(k, alpha) / (1 + np.asarray(k) * draft_cost + overhead))


# The grid of the textbook's speedup table: k drafts per round by acceptance rate α, for a draft 50× cheaper
# than the target (draft_cost 0.02) and 5% per-round overhead.
TEXTBOOK_KS, TEXTBOOK_ALPHAS = (1, 3, 5, 7, 10), (0.3, 0.5, 0.7, 0.9)


def speculative_speedup_table(ks=TEXTBOOK_KS, alphas=TEXTBOOK_ALPHAS, draft_cost=0.02, overhead=0.05):
    """Speedups on the grid ks × alphas, shape [len(ks), len(alphas)] (rows k, columns α). The defaults
    reproduce the textbook's k × α table: 2.56× at k = 5, α = 0.7; 5.49× at k = 10, α = 0.9."""
    k = np.asarray(ks, dtype=np.float64)[:, None]
    alpha = np.asarray(alphas, dtype=np.float64)[None, :]
    return np.asarray(speculative_speedup(k, alpha, draft_cost, overhead))


# ---------------------------------------------------------------- paging and prefix caching (chapters 07, 08)

def blocks_needed(seq_len, block_size):
    """Blocks a paged cache allocates for a sequence: ⌈N / block⌉."""
    _check_at_least("block_size", block_size, 1)
    return _out(-(-np.asarray(seq_len) // block_size))


def paged_waste_tokens(seq_len, block_size):
    """Unused slots in a request's last block: ⌈N / block⌉ · block − N, always < block_size."""
    return _out(np.asarray(blocks_needed(seq_len, block_size)) * block_size - np.asarray(seq_len))


def contiguous_waste_fraction(actual_lens, max_len):
    """Share of a max-length reservation left unused: 1 − Σ actual / (requests · max_len)."""
    lens = np.asarray(actual_lens)
    if np.any(lens > max_len):
        raise ValueError(f"actual_lens: a length exceeds max_len = {max_len}")
    return 1 - lens.sum() / (lens.size * max_len)


def cached_prefix_tokens(prompt_len, shared_len, block_size=1):
    """Prompt tokens a prefix-cache hit serves, when the first `shared_len` tokens of a `prompt_len`-token
    prompt are already in the cache: ⌊min(shared, N − 1) / block⌋ · block.

    Only full blocks are hashed and cached, so a hit is a whole number of blocks. And the step must still
    compute at least the prompt's last token, whose logits give the first output token: a hit never covers
    the whole prompt, so a fully cached prompt recomputes its last block (vLLM's cap at N − 1; engines that
    allowed a full hit crashed on a step with nothing to compute). With blocks of 16, a 64-token prompt
    whose first 48 tokens are cached gets 48; with all 64 cached it still gets 48.
    """
    _check_at_least("prompt_len", prompt_len, 1)
    _check_at_least("shared_len", shared_len, 0)
    _check_at_least("block_size", block_size, 1)
    usable = np.minimum(np.asarray(shared_len), np.asarray(prompt_len) - 1)
    return _out(usable // block_size * block_size)


def prefix_hit_rate(prompt_lens, shared_lens, block_size=1):
    """Share of a workload's prompt tokens served from the prefix cache: Σ cached / Σ prompt tokens, where
    request i has `prompt_lens[i]` tokens of which its first `shared_lens[i]` are in the cache when it
    arrives (0 for the request that fills it), counted in full blocks by `cached_prefix_tokens`."""
    cached = np.asarray(cached_prefix_tokens(np.asarray(prompt_lens), np.asarray(shared_lens), block_size))
    return float(cached.sum() / np.sum(prompt_lens))


def block_boundary_loss(prompt_len, shared_len, block_size):
    """Prompt tokens a cache of whole blocks (vLLM's hashed blocks; SGLang's tree with pages of block_size) leaves to
    compute that a match ending at any token (SGLang at page size 1; this engine's shared partial block) serves:
    cached_prefix_tokens(N, shared, 1) − cached_prefix_tokens(N, shared, block_size). For a prefix
    that is not the whole prompt this is shared mod block_size: a 300-token system prompt in blocks of 16 loses 12
    (288 against 300), in blocks of 128 it loses 44 (256). Never more than block_size − 1."""
    _check_at_least("block_size", block_size, 1)
    return _out(np.asarray(cached_prefix_tokens(prompt_len, shared_len, 1))
                - np.asarray(cached_prefix_tokens(prompt_len, shared_len, block_size)))


def expected_block_boundary_loss(block_size):
    """The mean of `block_boundary_loss` when shared prefixes end at a random point, every position of a block as
    likely: (block_size − 1) / 2, about half a block per match. A conversation pays it at every turn, at the end
    of the previous turn's answer; a few-shot prompt once per request, at the end of its examples."""
    _check_at_least("block_size", block_size, 1)
    return _out((np.asarray(block_size) - 1) / 2)


@dataclass(frozen=True)
class PrefixSavings:
    """What caching a shared prefix saves across a batch of requests."""

    cached_tokens: int     # prompt tokens a hit serves (full blocks of the prefix, never the last token)
    hit_rate: float        # share of all prompt tokens served from the cache
    flops_without: float   # every request prefills prefix + suffix
    flops_with: float      # the cached blocks are computed once, every request computes the rest
    flops_skipped: float
    ttft_ratio: float      # prefill FLOPs without / with a cache hit: the TTFT ratio of compute-bound prefill


def prefix_cache_savings(prefix_len, suffix_len, n_requests, model, block_size=1) -> PrefixSavings:
    """FLOPs skipped by reusing the KV of a shared prefix of P tokens, for requests with S own tokens.

    A hit serves C = cached_prefix_tokens(P + S, P, block) tokens (C = P when the prefix fills whole blocks).
    Without caching each request costs prefill_flops(P + S); with it the C cached tokens are computed once,
    and every request computes its other P + S − C tokens attending to them, prefill_flops(P + S − C, past=C):
    the suffix still attends to the whole prefix, so attention is not skipped but cut from (P + S)² to
    (P + S − C)(P + S) query-key pairs.

    TTFT ratio = prefill_flops(P + S) / prefill_flops(P + S − C, past=C), which is exactly (P + S) / (P + S − C)
    here (both terms of a prefill of n tokens against P + S keys scale with n). The textbook's "skips ~52 PFLOP
    of redundant prefill across 1,000 requests" is 2 · 13.0e9 weight FLOPs per token for 2000 shared tokens,
    1000 times (999 here: the prefix is computed once), so a 13B model and a 2000-token system prompt; its
    "cuts TTFT ~40×" is then (2000 + S) / S with S = 50-token questions: 41×. That is the compute-bound ratio;
    `prefix_cache_ttft` prices both prefills on a roofline, where so short a suffix is memory-bound on a GPU.
    """
    _check_at_least("prefix_len", prefix_len, 0)
    _check_at_least("suffix_len", suffix_len, 1)
    _check_at_least("n_requests", n_requests, 1)
    prompt_len = prefix_len + suffix_len
    cached = cached_prefix_tokens(prompt_len, prefix_len, block_size)
    full = prefill_flops(model, prompt_len)
    hit = prefill_flops(model, prompt_len - cached, past=cached)
    without = n_requests * full
    with_cache = prefill_flops(model, cached) + n_requests * hit
    # The first request finds the cache empty; each later one hits `cached` tokens.
    hit_rate = (n_requests - 1) * cached / (n_requests * prompt_len)
    return PrefixSavings(cached_tokens=cached, hit_rate=hit_rate, flops_without=without, flops_with=with_cache,
                         flops_skipped=without - with_cache, ttft_ratio=full / hit)


def prefix_cache_ttft(model, prefix_len, suffix_len, dtype_bytes, peak_flops, peak_bw, block_size=1):
    """Roofline TTFT (seconds) of a request with a P-token shared prefix and S own tokens, without and with a
    prefix-cache hit: (prefill_time of P + S tokens, prefill_time of the P + S − C uncached ones after C).

    Their ratio reaches the FLOP ratio of `prefix_cache_savings` only when the uncached tail is itself
    compute-bound, i.e. longer than the ridge point in tokens (fp16 prefill does about n FLOP/byte). On an
    A100 (ridge about 153 FLOP/byte) Llama-2-13B's 50-token suffix is memory-bound: it still reads all 26 GB
    of weights, about 13.6 ms, so the textbook's 2000 + 50 case drops TTFT from 182 ms by about 13×, not 41×;
    40× there takes a compute-bound suffix and P ≈ 39 · S (6240 + 160 tokens). On a CPU, whose ridge is a
    few FLOP/byte, the 50-token suffix is compute-bound and the ratio is the full 41×.
    """
    prompt_len = _arr(prefix_len) + _arr(suffix_len)
    cached = cached_prefix_tokens(prompt_len, prefix_len, block_size)
    without = prefill_time(model, prompt_len, 0, dtype_bytes, peak_flops, peak_bw)
    with_hit = prefill_time(model, prompt_len - _arr(cached), cached, dtype_bytes, peak_flops, peak_bw)
    return without, with_hit



# ---------------------------------------------------------------- attention's HBM traffic (chapter 05)

def attention_hbm_bytes(n, head_dim, dtype_bytes=2, block_m=None):
    """Bytes one attention head moves between device memory (HBM) and the chip for N queries over N keys.

    Naive (`block_m=None`): read Q and K, write the N × N scores S, read S and write P = softmax(S), read P
    and V, write O: 4·N·d + 4·N² numbers. Tiled, as FlashAttention does (`block_m` queries per tile): read
    each Q tile once, read all of K and V once per Q tile (⌈N / block_m⌉ passes), write O: 2·N·d +
    2·N·d·⌈N / block_m⌉ numbers, and no N × N term. Causal masking, which lets both skip about half of the
    work above the diagonal, is not counted. The textbook's N = 8192 example (a score matrix of "67M entries,
    occupying 134 MB in BF16"), naive, d = 128, fp16: the two score-sized tensors alone account for
    4 · 8192² · 2 B ≈ 537 MB of traffic per head.
    """
    n, d = _arr(n), _arr(head_dim)
    if block_m is None:
        numbers = 4 * n * d + 4 * n * n
    else:
        _check_at_least("block_m", block_m, 1)
        numbers = 2 * n * d + 2 * n * d * np.ceil(n / block_m)
    return _out(numbers * dtype_bytes)


# ---------------------------------------------------------------- where the regimes change (chapters 01, 02)

def attention_crossover_tokens(model):
    """Length n at which a full forward pass's attention FLOPs (4 · L · H · D · n²) equal its weight-matmul
    FLOPs (2 · params · n): n = params / (2 · L · H · D).

    Below it a prefill's cost (the TTFT) grows about linearly with the prompt, above it about quadratically.
    Counted over the full score rectangle, as `attention_flops` does; a causal kernel that skips the masked
    half doubles it. SmolLM2-135M: about 3.9k tokens; Llama-7B: about 25.7k.
    """
    s = ModelShape.of(model)
    return s.n_params / (2 * s.n_layers * s.n_heads * s.head_dim)


def decode_knee_batch(model, context, dtype_bytes=2):
    """Decode batch at which the sequences' K/V reads equal the one shared weight read:
    weight_bytes / (kv_bytes_per_token · context).

    While a step is memory-bound, a sequence below this batch rides almost free on the weight read; at it
    the step takes about twice as long as at batch 1 and the throughput is half its ceiling, bandwidth /
    (kv_bytes_per_token · context); above it the throughput saturates while every sequence's tokens slow
    down in proportion. Llama-7B in fp16 at 512 to 2048 tokens of context: 50 down to 12.6.
    """
    _check_at_least("context", context, 1)
    return weight_bytes(model, dtype_bytes) / (kv_bytes_per_token_for(model, dtype_bytes) * _arr(context))


def decode_ridge_batch(model, context, dtype_bytes, peak_flops, peak_bw):
    """Smallest decode batch (a real number; round it up) whose step reaches the ridge point, i.e. turns
    compute-bound; inf when the per-sequence K/V and activation reads keep the intensity below the ridge at
    any batch.

    Intensity at batch b is b·F / (W + b·X) with F the FLOPs of one token, W the weight bytes and X the bytes
    each sequence adds, so it reaches the ridge R at b = R·W / (F − R·X) when F > R·X.
    """
    _check_at_least("context", context, 1)
    s = ModelShape.of(model)
    ridge = ridge_point(peak_flops, peak_bw)
    per_token = flops_per_token(s, context)
    per_sequence = kv_bytes_per_token_for(s, dtype_bytes) * _arr(context) + _activation_bytes(s, 1, dtype_bytes)
    margin = per_token - ridge * per_sequence
    with np.errstate(divide="ignore"):
        return _out(np.where(margin > 0, ridge * weight_bytes(s, dtype_bytes) / np.where(margin > 0, margin, 1),
                             np.inf))


# ---------------------------------------------------------------- the whole ladder on a roofline (chapter 09)

def naive_generation_time(model, prompt_len, new_tokens, dtype_bytes, peak_flops, peak_bw):
    """Roofline lower bound (seconds) on generating T = `new_tokens` tokens for one sequence by full recompute:
    step s is a forward pass over all n = P + s − 1 tokens so far, `prefill_time(n)` with nothing cached. Past a
    few hundred tokens each step is compute-bound, and the steps grow with n: Llama-7B on an A100-80GB (312
    TFLOP/s, 2.04 TB/s, fp16) reaches at most 59 tok/s for 512 tokens after a 128-token prompt and 22 tok/s for
    1,024 after 512; the textbook's "5 to 10 tokens per second" is 23-46% of that second roof, what eager code
    attains."""
    _check_at_least("prompt_len", prompt_len, 1)
    _check_at_least("new_tokens", new_tokens, 1)
    n = np.arange(prompt_len, prompt_len + new_tokens)
    return float(np.sum(prefill_time(model, n, 0, dtype_bytes, peak_flops, peak_bw)))


def cached_generation_time(model, prompt_len, new_tokens, dtype_bytes, peak_flops, peak_bw, batch=1):
    """Roofline lower bound (seconds) on generating T tokens for each of `batch` sequences of P-token prompts with
    a KV cache: one prefill of the batch's prompts (the weights read once, B · P tokens of work), then T − 1
    decode steps at contexts P + 1 .. P + T − 1, each reading the weights once for the whole batch plus every
    sequence's cached keys and values (`decode_bytes`). At batch 1 a step moves the whole model for one token:
    13.5 GB for Llama-7B in fp16, so an A100-80GB tops out near 146 tok/s (512 + 512 tokens); 16 sequences share
    that read (1.4 GB per token at 1K of context) and the same GPU's roof is about 1,500 tok/s, 64 about 2,900."""
    _check_at_least("prompt_len", prompt_len, 1)
    _check_at_least("new_tokens", new_tokens, 1)
    _check_at_least("batch", batch, 1)
    s = ModelShape.of(model)
    # B prompts of P tokens: B times one prompt's FLOPs (attention within each prompt), and the bytes of a
    # prefill of B·P tokens (weights once, K/V and activations per token).
    prefill = roofline_time(batch * prefill_flops(s, prompt_len), prefill_bytes(s, batch * prompt_len, dtype_bytes),
                            peak_flops, peak_bw)
    contexts = np.arange(prompt_len + 1, prompt_len + new_tokens)
    decode = np.sum(roofline_time(decode_flops(s, contexts, batch), decode_bytes(s, batch, contexts, dtype_bytes),
                                  peak_flops, peak_bw)) if new_tokens > 1 else 0.0
    return float(prefill + decode)


def generation_tok_s(model, prompt_len, new_tokens, dtype_bytes, peak_flops, peak_bw, batch=1, cache=True):
    """The roofline's ceiling on output tokens/s: batch · T / `cached_generation_time` (or, with cache=False, T /
    `naive_generation_time` of one sequence). Real engines reach a fraction of it; the ratio of two ceilings says
    how much of a measured gain the hardware's roofs explain."""
    if not cache:
        if batch != 1:
            raise ValueError("batch: the naive loop runs one sequence (batch=1)")
        return new_tokens / naive_generation_time(model, prompt_len, new_tokens, dtype_bytes, peak_flops, peak_bw)
    return batch * new_tokens / cached_generation_time(model, prompt_len, new_tokens, dtype_bytes, peak_flops,
                                                       peak_bw, batch)


def decode_bytes_per_token(model, batch, context, dtype_bytes=2, weight_bits=None):
    """Bytes a decode step moves per token it produces: `decode_bytes` / batch. At batch 1 it is the whole model
    (plus one sequence's K/V), which is why a memory-bound decode's ceiling is bandwidth / model size; batching
    divides the weight part by the batch, and the K/V part stays per sequence."""
    _check_at_least("batch", batch, 1)
    return decode_bytes(model, batch, context, dtype_bytes, weight_bits) / _arr(batch)


# ---------------------------------------------------------------- quantized weights (chapter 10)

def bits_per_weight(bits, group_size=None, scale_bits=16, zero_bits=0):
    """Storage bits per weight of a weight-only quantized format: the code's `bits`, plus one scale (and one
    zero point / minimum, `zero_bits`) shared by each group of `group_size` weights; None: no per-group cost
    (per-tensor scales, or per-row ones over long rows, cost next to nothing).

    Q4_1 (llama.cpp: 32 codes of 4 bits, an fp16 scale and an fp16 minimum) is 4 + 32/32 = 5 bits; Q8_0 (an
    fp16 scale per 32 int8 codes) 8.5; QLoRA's NF4 in blocks of 64 with an fp32 absmax 4.5 (4.127 once the
    absmaxes are themselves quantized to 8 bits in blocks of 256); AWQ / GPTQ's usual int4 with groups of 128,
    an fp16 scale and a 4-bit zero, 4.16."""
    _check_at_least("bits", bits, 1)
    if group_size is None:
        return _out(_arr(bits) * 1.0)
    _check_at_least("group_size", group_size, 1)
    return _out(_arr(bits) + (scale_bits + zero_bits) / _arr(group_size))


def human_bytes(n: float) -> str:
    """Binary units, as the course reports memory: 2147483648 → '2.00 GiB'."""
    for unit, size in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


# ---------------------------------------------------------------- tensor parallelism (chapter 11)

# Chapter 11 prices a collective as a latency per collective plus bytes over a bandwidth; which latency and which
# share of the bytes depends on the algorithm (`interconnects` holds the GPUs, links and measured constants).
# `payload_bytes` is always the whole tensor one rank holds before the collective (all-reduce, reduce-scatter)
# or after it (all-gather); `bandwidth` is one rank's link, bytes/s in each direction.


def _check_ranks(ranks) -> None:
    _check_at_least("ranks", ranks, 1)


def ring_all_reduce_seconds(payload_bytes, ranks, hop_latency_s, bandwidth, base_latency_s=0.0):
    """A ring all-reduce: a reduce-scatter then an all-gather around the ring, 2(p − 1) steps that each pay a hop's
    latency, and each rank sends and receives 2(p − 1)/p of the payload (nccl-tests calls that factor the "bus
    bandwidth" correction). `base_latency_s` is what one collective costs before its first hop (a launch,
    NCCL's per-collective setup). One rank: nothing to do. Best for large payloads; for the few KB a decode
    step sends the 2(p − 1) latencies are the whole cost."""
    _check_ranks(ranks)
    p = _arr(ranks)
    steps = 2 * (p - 1)
    return _out(np.where(p > 1, base_latency_s + steps * hop_latency_s + steps / p * _arr(payload_bytes) / bandwidth,
                         0.0))


def all_reduce_seconds(payload_bytes, ranks, latency_s, bandwidth):
    """A ring all-reduce with no per-collective latency but its hops' (`ring_all_reduce_seconds`): the model
    section 4 fits to this machine, where each hop is a message between processes."""
    return ring_all_reduce_seconds(payload_bytes, ranks, latency_s, bandwidth)


def one_shot_all_reduce_seconds(payload_bytes, ranks, latency_s, bandwidth):
    """A one-shot all-reduce (vLLM's custom all-reduce for small payloads, `cross_device_reduce_1stage`): every rank
    reads every other rank's whole payload over the links at once and sums locally. One latency, flat in p, but
    (p − 1) payloads into each rank: the latency-optimal choice for small payloads, the wrong one for large."""
    _check_ranks(ranks)
    p = _arr(ranks)
    return _out(np.where(p > 1, latency_s + (p - 1) * _arr(payload_bytes) / bandwidth, 0.0))


def reduce_scatter_seconds(payload_bytes, ranks, hop_latency_s, bandwidth, base_latency_s=0.0):
    """A ring reduce-scatter: rank r ends with the sum of slice r of everyone's payload; p − 1 steps, each rank
    sends and receives (p − 1)/p of the payload. The first half of a ring all-reduce."""
    _check_ranks(ranks)
    p = _arr(ranks)
    return _out(np.where(p > 1, base_latency_s + (p - 1) * hop_latency_s
                         + (p - 1) / p * _arr(payload_bytes) / bandwidth, 0.0))


def all_gather_seconds(payload_bytes, ranks, hop_latency_s, bandwidth, base_latency_s=0.0):
    """A ring all-gather of `payload_bytes` in all (each rank brings 1/p of it): the same p − 1 steps and
    (p − 1)/p of the bytes as a reduce-scatter, the second half of a ring all-reduce. So
    reduce-scatter + all-gather = ring all-reduce, latency and bytes (less one base latency)."""
    return reduce_scatter_seconds(payload_bytes, ranks, hop_latency_s, bandwidth, base_latency_s)


def pipeline_bubble(stages, micro_batches):
    """The share of a pipeline's time its stages sit idle, (p − 1)/(m + p − 1), for p stages and m micro-batches of
    equal cost (GPipe, Huang et al. 2019): filling and draining the pipe takes p − 1 stage-times out of m + p − 1.
    One stage: no bubble. Many micro-batches: it vanishes as (p − 1)/m."""
    _check_at_least("stages", stages, 1)
    _check_at_least("micro_batches", micro_batches, 1)
    p, m = _arr(stages), _arr(micro_batches)
    return _out((p - 1) / (m + p - 1))


def tensor_parallel_step(layers, hidden, batch, ranks, compute_s, latency_s, bandwidth, dtype_bytes=2):
    """(compute, communication) seconds of one decode step split over `ranks`: the one-rank step's `compute_s`
    divided by the ranks (each multiplies a 1/p share of every weight), and two ring all-reduces a layer of the
    block's output, batch × hidden values (2·h·b bytes in 16 bits). `interconnects.tensor_parallel_decode` prices
    the same step on a named GPU and link, with the algorithm a library would pick."""
    comm = 2 * _arr(layers) * all_reduce_seconds(_arr(batch) * _arr(hidden) * dtype_bytes, ranks, latency_s,
                                                 bandwidth)
    return _out(_arr(compute_s) / _arr(ranks)), comm
