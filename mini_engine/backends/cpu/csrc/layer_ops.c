/* The small operations around a layer's products, each fused into one pass over its rows: the RMSNorm, the
   rotary embedding of q and k, SwiGLU's silu(gate) * up, and the paged cache's write of the new keys and values.
   vLLM's CUDA kernels `rms_norm`, `rotary_embedding`, `silu_and_mul` and `reshape_and_cache` are the same idea;
   these are their CPU twins, called by eager steps through the C++ operators of torch_ops.cpp (`layer_ops.py`).
   Compiled graphs do not need them: Inductor fuses the same PyTorch ops itself.

   Why: in PyTorch each of them is several operators (the RMSNorm six: pow, mean, add, rsqrt, two multiplies),
   and at the few rows of a decode step or a short prefill chunk each operator costs microseconds of dispatch
   for nanoseconds of arithmetic. Run between weight products that stream megabytes through the caches, the
   dispatcher's code and data are evicted each time: on a 2-core Xeon with AMX, an RMSNorm of 32 rows took
   59 us inside a step against 25 us when called twice in a row (benchmarks/RESULTS.md, 2026-12-02 evening).
   Every loop is over a row's contiguous values, so GCC vectorises it (-O3 -march=native -ffast-math, expf
   through glibc's vector math library). Rows are shared among threads only where there are many of them
   (a long prefill chunk); below that, a parallel region costs more than the work. silu_mul, whose exponential
   makes it the heaviest of them, counts values instead: a 32-token chunk's 32 x 1,536 took 21.9 us on one
   thread, and sharing it cut the cached prefix request's model step (32 tokens after 1,024 cached) from
   48.05-48.74 to 47.19-47.77 ms on a 2-core Xeon with AMX (benchmarks/RESULTS.md, 2026-12-03). */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

enum { PARALLEL_ROWS = 64, PARALLEL_VALUES = 16384 }; /* rows, or values for silu_mul */

/* out[t] = w * (x[t] / sqrt(mean(x[t]^2) + eps)), x and out [T, H] with rows `stride` floats apart in x. */
void rms_norm_f32(const float *x, const float *w, float *out, int T, int H, long stride, float eps) {
#pragma omp parallel for if (T >= PARALLEL_ROWS) schedule(static)
  for (int t = 0; t < T; t++) {
    const float *xt = x + (size_t)t * stride;
    float *ot = out + (size_t)t * H;
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int i = 0; i < H; i++) ss += xt[i] * xt[i];
    const float r = 1.f / sqrtf(ss / (float)H + eps);
#pragma omp simd
    for (int i = 0; i < H; i++) ot[i] = w[i] * (xt[i] * r);
  }
}

/* out[t] = silu(g[t]) * u[t] = g / (1 + exp(-g)) * u, where row t of gate_up (rows `stride` floats apart) holds
   g (its first I values) then u (the next I); out [T, I]. */
void silu_mul_f32(const float *gate_up, float *out, int T, int I, long stride) {
#pragma omp parallel for if ((long)T * I >= PARALLEL_VALUES) schedule(static)
  for (int t = 0; t < T; t++) {
    const float *g = gate_up + (size_t)t * stride, *u = g + I;
    float *ot = out + (size_t)t * I;
#pragma omp simd
    for (int i = 0; i < I; i++) ot[i] = g[i] / (1.f + expf(-g[i])) * u[i];
  }
}

/* The rotary embedding of NH heads of size D per row: out[t, h, d] = x[t, h, d] cos[t, d] + x[t, h, (d + D/2) % D]
   sin[t, d], where sin carries the sign of the rotation ([-sin, sin], as model.rope_tables builds it). x [T, NH,
   D] with rows `stride` floats apart (q and k inside the fused qkv product's output); cos and sin [T, D]; out
   [T, NH, D]. */
void rope_f32(const float *x, const float *cos_t, const float *sin_t, float *out, int T, int NH, int D,
              long stride) {
  const int half = D / 2;
#pragma omp parallel for if (T >= PARALLEL_ROWS) schedule(static)
  for (int t = 0; t < T; t++) {
    const float *c = cos_t + (size_t)t * D, *s = sin_t + (size_t)t * D;
    for (int h = 0; h < NH; h++) {
      const float *xh = x + (size_t)t * stride + (size_t)h * D;
      float *oh = out + ((size_t)t * NH + h) * D;
#pragma omp simd
      for (int d = 0; d < half; d++) oh[d] = xh[d] * c[d] + xh[d + half] * s[d];
#pragma omp simd
      for (int d = half; d < D; d++) oh[d] = xh[d] * c[d] + xh[d - half] * s[d];
    }
  }
}

/* The paged cache's write: token t's keys (W = kv heads x head size values, contiguous; tokens `k_stride` floats
   apart) go to row rows[t] of k_rows [R, W], its values likewise; the caller has checked every row lies in
   [0, R). One copy per token where PyTorch's indexed store makes two operators per layer. rows are int32, the
   type of the engine's slot_mapping (and of the Triton KV-store kernel's). */
void store_rows_f32(const float *k, const float *v, float *k_rows, float *v_rows, const int32_t *rows, int T, int W,
                    long k_stride, long v_stride) {
  for (int t = 0; t < T; t++) {
    memcpy(k_rows + (size_t)rows[t] * W, k + (size_t)t * k_stride, sizeof(float) * (size_t)W);
    memcpy(v_rows + (size_t)rows[t] * W, v + (size_t)t * v_stride, sizeof(float) * (size_t)W);
  }
}
