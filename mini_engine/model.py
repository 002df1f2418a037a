"""Llama-family decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU), in plain PyTorch (chapters 00-01).

The forward pass takes packed tokens plus an explicit `AttentionMetadata` and optional KV cache, so the
cache, batching and paging of later chapters plug in as arguments rather than rewrites. Calling the model
with a [B, N] tensor and nothing else is the plain full-recompute forward of chapter 01.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AttentionMetadata, make_backends, resolve_backend
from .config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        # Normalised in fp32, as the reference does, so that bf16/fp16 runs keep the statistic exact.
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + D/2) of each head by the position's angle: x*cos + rotate_half(x)*sin, where
    rotate_half(x) = [-x2, x1]. The table's sin carries the sign ([-sin, sin], see `rope_tables`), so
    rotate_half(x)*sin is x.roll(D/2)*sin. x [T,H,D], cos/sin [T,1,D] in x's dtype."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)


def rope_tables(config: ModelConfig, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sign-folded sin (see `apply_rope`) for every position, in fp32: [max_positions, head_dim]."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))
    freqs = torch.outer(torch.arange(config.max_position_embeddings, device=device).float(), inv_freq)
    return torch.cat([freqs, freqs], dim=-1).cos(), torch.cat([-freqs.sin(), freqs.sin()], dim=-1)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qk_size, self.v_size = q_size + kv_size, kv_size
        # q, k and v come from one matmul: one pass over the input instead of three.
        self.qkv_proj = nn.Linear(config.hidden_size, q_size + 2 * kv_size, bias=False)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=False)

    def project(self, x, cos, sin):
        """x [T, hidden] -> rotated q [T,Hq,D], rotated k and v [T,Hkv,D]."""
        t = x.shape[0]
        qk, v = self.qkv_proj(x).split([self.qk_size, self.v_size], dim=-1)
        # q and k sit side by side in the fused output: rotate all their heads in one pass.
        qk = self.rotate(qk, cos, sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        return q, k, v.view(t, self.num_kv_heads, self.head_dim)

    def rotate(self, qk, cos, sin):
        """RoPE on q and k side by side, qk [T, (Hq + Hkv) x D] -> [T, Hq + Hkv, D]."""
        return apply_rope(qk.view(qk.shape[0], self.num_heads + self.num_kv_heads, self.head_dim), cos, sin)

    def forward(self, x, cos, sin, meta: AttentionMetadata, layer_idx: int, kv_cache, attention):
        q, k, v = self.project(x, cos, sin)
        return self.o_proj(attention(q, k, v, meta, kv_cache, layer_idx).reshape(x.shape[0], -1))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # one product for both halves of SwiGLU
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, meta, layer_idx, kv_cache, attention):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta, layer_idx, kv_cache, attention)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, attention_backend: str = "torch"):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        self.attention_backend = resolve_backend(attention_backend, "cpu")
        # name -> the attention object that runs it (attention.py); an optional backend may swap in its own
        self.attention_backends = make_backends()
        self.quantization: str | None = None  # "int4" / "int8" once quant.quantize_model has replaced the products
        cos, sin = rope_tables(config)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @classmethod
    def empty(cls, config: ModelConfig, attention_backend: str = "torch") -> "LlamaModel":
        """A model on the CPU whose weights are uninitialised memory, for a loader that fills every one of them
        (`loading.loader.load_weights` checks it does): nn.Linear's random initialisation costs about a second for SmolLM2.
        Built on the meta device, then given storage; the RoPE tables are computed again, as they are no weights."""
        with torch.device("meta"):
            model = cls(config, attention_backend)
        model = model.to_empty(device="cpu")
        model.tie_weights()  # to_empty gives each module a parameter of its own
        model.rope_cos, model.rope_sin = rope_tables(config)
        return model

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    # Read off the final norm's weight: a float parameter even when the products hold integer codes (quant/).
    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    def _apply(self, fn, *args, **kwargs):
        # Keep the RoPE tables in fp32 whatever dtype the weights move to (bf16 angles lose positions).
        super()._apply(fn, *args, **kwargs)
        self.rope_cos, self.rope_sin = self.rope_cos.float(), self.rope_sin.float()
        return self

    def check_last_position(self, last: int, kv_cache=None) -> None:
        """Once per step: the RoPE table and the cache must reach the step's last position."""
        if last >= self.config.max_position_embeddings:
            raise ValueError(f"position {last} exceeds max_position_embeddings {self.config.max_position_embeddings}")
        if kv_cache is not None and last >= kv_cache.max_len:
            raise ValueError(f"position {last} is past the KV cache's max_len {kv_cache.max_len}")

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata | None = None, kv_cache=None,
                backend: str | None = None, last_only: bool = False) -> torch.Tensor:
        """input_ids [B, N] with nothing else: full causal forward, logits [B, N, vocab] ([B, 1, vocab] with
        last_only: generation needs only the last position, and the vocab projection is a fifth of the model).
        input_ids [T] packed, with `meta` (and optionally a KV cache): logits [T or len(logits_indices), vocab]."""
        backend = resolve_backend(backend or self.attention_backend, self.device)
        batched = input_ids.dim() == 2
        if batched:
            if meta is not None or kv_cache is not None:
                raise ValueError("input_ids must be packed 1-D [T] when meta or kv_cache is given")
            b, n = input_ids.shape
            meta = AttentionMetadata.build([n] * b, device=input_ids.device, last_only=last_only)
            input_ids = input_ids.reshape(-1)
        elif meta is None:
            raise ValueError("packed 1-D input_ids need an AttentionMetadata (meta)")
        if kv_cache is not None and meta.slot_mapping is None:
            raise ValueError("meta must name each sequence's cache slot or block table when kv_cache is given")
        self.check_last_position(max(meta.context_lens) - 1, kv_cache)
        logits = self.run(input_ids, meta, kv_cache, backend)
        return logits.view(b, 1 if last_only else n, -1) if batched else logits

    def run(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_cache, backend: str) -> torch.Tensor:
        """The layers over packed tokens, unchecked (`forward` checks). It reads only tensors of `meta`, so the
        compiled decode step (`compiled_decode`) traces this code, not a copy of it."""
        # Angles are computed in fp32, then cast once per step to the weights' dtype (as the reference does).
        cos = self.rope_cos[meta.positions, None].to(self.dtype)
        sin = self.rope_sin[meta.positions, None].to(self.dtype)
        x = self.embed_tokens(input_ids)
        attention = self.attention_backends[backend]
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, meta, i, kv_cache, attention)
        if meta.logits_indices is not None:
            x = x[meta.logits_indices]
        return self.lm_head(self.norm(x))
