"""The optional CPU backend: C kernels, tuned product forms, fused layer operators."""
