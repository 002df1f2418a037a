/* The int8 weight-only product y = x W^T on a CPU with fp32 activations, for `quant.Int8Linear` (the int4 model's
   LM head: 49,152 rows of 576 int8 weights, one bf16 scale per row).

   Layouts:
     x       [M, K] fp32
     q       [N, K] int8, row-major (what torch's `_weight_int8pack_mm` reads: no second copy)
     sbits   [N] the bits of each row's bf16 scale; w[n, k] = q[n, k] * scale[n]
     y       [M, N] fp32

   Four weight rows at a time against one row of x: each 8 codes become 8 floats (sign-extend, convert) and feed
   one multiply-add with the same 8 values of x, four sums in flight; the scale multiplies each row's sum once.
   Why it exists: torch's int8 kernel wants bf16 activations to be fast (with fp32 ones it took 21 ms for the
   head at one row on an AVX2-only AMD EPYC, Zen 3), and with bf16 it rounds them; this one keeps them in fp32
   and took 2.3-2.7 ms against 3.1-3.5 ms for the bf16 form there. Needs AVX2 (x86-64-v3). */
#include <immintrin.h>
#include <stdint.h>

#ifndef __AVX2__
#error "the int8 kernel needs AVX2"
#endif

static inline float hsum(__m256 v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_add_ss(a, _mm_movehdup_ps(a)));
}

static inline float bf16_to_float(uint16_t bits) {
  union { uint32_t u; float f; } v = {(uint32_t)bits << 16};
  return v.f;
}

#define CODES8(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))

/* Returns 0, or -1 for a shape it does not take (K not a multiple of 8, N not a multiple of 4). */
int int8_gemm_f32(const float *x, const int8_t *q, const uint16_t *sbits, float *y, int M, int N, int K) {
  if (K % 8 || N % 4) return -1;
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; n += 4) {
    const int8_t *q0 = q + (size_t)n * K, *q1 = q0 + K, *q2 = q1 + K, *q3 = q2 + K;
    for (int m = 0; m < M; m++) {
      const float *xm = x + (size_t)m * K;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int k = 0; k < K; k += 8) {
        const __m256 xv = _mm256_loadu_ps(xm + k);
        a0 = _mm256_fmadd_ps(CODES8(q0 + k), xv, a0);
        a1 = _mm256_fmadd_ps(CODES8(q1 + k), xv, a1);
        a2 = _mm256_fmadd_ps(CODES8(q2 + k), xv, a2);
        a3 = _mm256_fmadd_ps(CODES8(q3 + k), xv, a3);
      }
      float *ym = y + (size_t)m * N + n;
      ym[0] = bf16_to_float(sbits[n]) * hsum(a0);
      ym[1] = bf16_to_float(sbits[n + 1]) * hsum(a1);
      ym[2] = bf16_to_float(sbits[n + 2]) * hsum(a2);
      ym[3] = bf16_to_float(sbits[n + 3]) * hsum(a3);
    }
  }
  return 0;
}
