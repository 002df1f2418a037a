"""The core's layers with their small operations fused into one C++ operator each (`layer_ops`): RMSNorm, RoPE on
q and k, SwiGLU's silu(gate) * up. Each class is the core's own, subclassed: `install` swaps an instance's class,
so weights and state stay where they are, and each falls back to the core's code wherever the fused operator
does not apply (not fp32, not a CPU, a graph being compiled, operators not built)."""
from __future__ import annotations

import torch

from ...model import MLP, Attention, RMSNorm
from . import layer_ops


class FusedRMSNorm(RMSNorm):
    def forward(self, x):
        if layer_ops.fused(x) and x.dim() == 2 and self.weight.dtype == torch.float32:
            return torch.ops.mini_engine_cpp.rms_norm(x, self.weight, self.eps)
        return super().forward(x)


class FusedRopeAttention(Attention):
    def rotate(self, qk, cos, sin):
        return layer_ops.rope(qk, cos, sin, self.num_heads + self.num_kv_heads)


class FusedMLP(MLP):
    def forward(self, x):
        return self.down_proj(layer_ops.silu_mul(self.gate_up_proj(x)))


FUSED = {RMSNorm: FusedRMSNorm, Attention: FusedRopeAttention, MLP: FusedMLP}
