/* The int4 weight-only product y = x W^T on a CPU, with fp32 activations, read from the layout torch's packed int4
   kernel keeps (`quant.Int4Linear` on a CPU), so no second copy of the codes is made.

   Layouts:
     x       [M, K] fp32
     packed  [N / BN][K][BN / 2] bytes: in each block of BN weight rows, byte j of column k holds the 4-bit codes
             of rows j (low nibble) and j + BN / 2 (high nibble): torch's "halves" layout, BN = 32 or 64
     sz      [K / GS][N] uint32: the bf16 scale s (low 16 bits) and bf16 zero z (high 16 bits) of each group of
             GS weights along a row; w = (q - 8) s + z, which is Q4_1's w = d q + m with s = d, z = m + 8 d
     y       [M, N] fp32
   or, with `compact` (mini_engine/quant's "int4_compact"), 8-bit scales: Q4_1's w = d q + m with
     sz      [K / GS][N] uint16: an 8-bit code of d (low byte, unsigned) and of m (high byte, signed), then
             [2][N] fp32: each row's factor for d and for m, so d = dc * fd[n] and m = mc * fm[n]

   Per group g of GS columns, with S_g = sum of x over the group:
     y[n] += s * sum_k q[n, k] x[k] + (z - 8 s) * S_g
   (with compact scales: y[n] += d * sum_k q x + m * S_g)
   so the inner loop is one multiply-add per weight on codes converted to floats, and the scales are applied
   once per group. The codes of BN rows sit side by side in a column, so one load of BN / 2 bytes gives BN codes,
   which become BN / 8 vectors of 8 floats, each multiplied by the same broadcast x[k]: no sums across lanes.

   Why it exists: torch's `_weight_int4pack_mm_for_cpu` takes bf16 activations, and on an AVX2-only AMD EPYC
   (Zen 3) it ran the model's 121 products of one decode step in about 16 ms, where reading their 66 MB of codes
   and scales takes about 2.3 ms at the measured 29 GB/s. Needs AVX2 (x86-64-v3).

   With AVX-512, `block_row16` does the same with 16-lane vectors, so each instruction converts and multiplies
   16 codes instead of 8, and it asks for the next block's codes while it works on this one. A product of one
   row is short (0.2-1.1 MB), too short for the hardware prefetcher to reach full speed. On a 2-core Xeon with
   AMX, the model's 120 int4 products at one row, caches flushed first, took 9.7 ms with the 8-lane kernel,
   about 8 ms 16 lanes wide without the prefetch, and 5.6-5.9 ms with both; torch's `int4pack` took 6.4-7.2 ms.
   Build with -DAVX2_ONLY=1 to get the 8-lane kernel on an AVX-512 CPU (the tests check both). */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#ifndef __AVX2__
#error "the int4 kernel needs AVX2"
#endif
#ifndef AVX2_ONLY
#define AVX2_ONLY 0
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && !AVX2_ONLY
#define WIDE 1
#else
#define WIDE 0
#endif

/* The scale and the offset (z - 8 s, or m) of 8 columns from `col` of group g, in either form of the scales. */
static inline __attribute__((always_inline)) void group_scales8(const void *sz, int compact, int g, int G, int N,
                                                               int col, __m256 *s, __m256 *c) {
  if (compact) {
    const uint16_t *codes = (const uint16_t *)sz;
    const float *f = (const float *)(codes + (size_t)G * N);
    const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(codes + (size_t)g * N + col)));
    *s = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(0xff))), _mm256_loadu_ps(f + col));
    *c = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 16), 24)),
                       _mm256_loadu_ps(f + N + col));
  } else { /* bf16 -> fp32 is a 16-bit shift: the scale is the low half */
    const __m256i v = _mm256_loadu_si256((const __m256i *)((const uint32_t *)sz + (size_t)g * N + col));
    *s = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    const __m256 z = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)));
    *c = _mm256_fnmadd_ps(_mm256_set1_ps(8.f), *s, z);
  }
}

/* 8 bytes of a column, zero-extended to 32-bit lanes: the low nibbles are the codes of 8 rows, the high
   nibbles those of the 8 rows BN / 2 further on. */
#define CODES8(ptr, lo, hi)                                                        \
  do {                                                                             \
    const __m256i w_ = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(ptr))); \
    lo = _mm256_cvtepi32_ps(_mm256_and_si256(w_, low4));                           \
    hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(w_, 4));                             \
  } while (0)

/* One block of BN weight rows against one row of x: out[BN] for columns [0, K). With BN constant (the calls
   below inline it), the sums stay in registers: BN / 8 vectors, twice over for BN = 32 (even and odd columns
   summed apart), so that 8 chains of multiply-adds are in flight and none waits for the one before. */
static inline __attribute__((always_inline)) void block_row(const float *x, const float *sx, const uint8_t *codes,
                                                           const void *sz, int compact, int col0, float *out, int N,
                                                           int K, int GS, const int BN) {
  enum { NV = 8 };                   /* sums in flight */
  const int per_col = BN / 8, sets = NV / per_col; /* vectors per column; columns summed apart */
  const __m256i low4 = _mm256_set1_epi32(0x0f);
  __m256 y[8];
  for (int i = 0; i < per_col; i++) y[i] = _mm256_setzero_ps();
  for (int k0 = 0, g = 0; k0 < K; k0 += GS, g++) {
    __m256 acc[NV];
    for (int i = 0; i < NV; i++) acc[i] = _mm256_setzero_ps();
    for (int k = k0; k < k0 + GS; k += sets)
      for (int c = 0; c < sets; c++) {
        const __m256 xk = _mm256_broadcast_ss(x + k + c);
        const uint8_t *col = codes + (size_t)(k + c) * (BN / 2);
        __m256 *a = acc + c * per_col;
        for (int h = 0; h < BN / 16; h++) { /* rows 8h.. (low nibbles) and BN / 2 + 8h.. (high) */
          __m256 lo, hi;
          CODES8(col + 8 * h, lo, hi);
          a[h] = _mm256_fmadd_ps(lo, xk, a[h]);
          a[BN / 16 + h] = _mm256_fmadd_ps(hi, xk, a[BN / 16 + h]);
        }
      }
    for (int c = 1; c < sets; c++)
      for (int i = 0; i < per_col; i++) acc[i] = _mm256_add_ps(acc[i], acc[c * per_col + i]);
    const __m256 sg = _mm256_set1_ps(sx[g]);
    for (int i = 0; i < per_col; i++) {
      __m256 s, c;
      group_scales8(sz, compact, g, K / GS, N, col0 + 8 * i, &s, &c);
      y[i] = _mm256_fmadd_ps(s, acc[i], y[i]);
      y[i] = _mm256_fmadd_ps(c, sg, y[i]);
    }
  }
  for (int i = 0; i < per_col; i++) _mm256_storeu_ps(out + 8 * i, y[i]);
}

#if WIDE
/* group_scales8 for 16 columns. */
static inline __attribute__((always_inline)) void group_scales16(const void *sz, int compact, int g, int G, int N,
                                                                int col, __m512 *s, __m512 *c) {
  if (compact) {
    const uint16_t *codes = (const uint16_t *)sz;
    const float *f = (const float *)(codes + (size_t)G * N);
    const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(codes + (size_t)g * N + col)));
    *s = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(0xff))), _mm512_loadu_ps(f + col));
    *c = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 16), 24)),
                       _mm512_loadu_ps(f + N + col));
  } else {
    const __m512i v = _mm512_loadu_si512((const void *)((const uint32_t *)sz + (size_t)g * N + col));
    *s = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    const __m512 z = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u)));
    *c = _mm512_fnmadd_ps(_mm512_set1_ps(8.f), *s, z);
  }
}

/* 16 bytes of a column as 16-lane vectors: the codes of 16 rows (low nibbles) and of the 16 rows BN / 2 further on. */
#define CODES16(ptr, lo, hi)                                                         \
  do {                                                                               \
    const __m512i w_ = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(ptr))); \
    lo = _mm512_cvtepi32_ps(_mm512_and_si512(w_, low4));                             \
    hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(w_, 4));                               \
  } while (0)

/* block_row with 16-lane vectors: vector i holds rows 16 i .. 16 i + 15. Columns are taken `sets` at a time, so GS
   must be a multiple of it (4 for BN = 32, 2 for BN = 64). `next`: the next block's codes, asked for a cache line
   at a time as this block's columns are read, or NULL. */
static inline __attribute__((always_inline)) void block_row16(const float *x, const float *sx, const uint8_t *codes,
                                                             const void *sz, int compact, int col0, float *out,
                                                             int N, int K, int GS, const int BN, const uint8_t *next) {
  enum { NV = 8 };
  const int per_col = BN / 16, sets = NV / per_col;
  const __m512i low4 = _mm512_set1_epi32(0x0f);
  __m512 y[4];
  for (int i = 0; i < per_col; i++) y[i] = _mm512_setzero_ps();
  for (int k0 = 0, g = 0; k0 < K; k0 += GS, g++) {
    __m512 acc[NV];
    for (int i = 0; i < NV; i++) acc[i] = _mm512_setzero_ps();
    for (int k = k0; k < k0 + GS; k += sets)
      for (int c = 0; c < sets; c++) {
        const __m512 xk = _mm512_set1_ps(x[k + c]);
        const uint8_t *col = codes + (size_t)(k + c) * (BN / 2);
        if (next && (k + c) * (BN / 2) % 64 == 0)
          _mm_prefetch((const char *)(next + (size_t)(k + c) * (BN / 2)), _MM_HINT_T0);
        __m512 *a = acc + c * per_col;
        for (int h = 0; h < BN / 32; h++) { /* rows 16h.. (low nibbles) and BN / 2 + 16h.. (high) */
          __m512 lo, hi;
          CODES16(col + 16 * h, lo, hi);
          a[h] = _mm512_fmadd_ps(lo, xk, a[h]);
          a[BN / 32 + h] = _mm512_fmadd_ps(hi, xk, a[BN / 32 + h]);
        }
      }
    for (int c = 1; c < sets; c++)
      for (int i = 0; i < per_col; i++) acc[i] = _mm512_add_ps(acc[i], acc[c * per_col + i]);
    const __m512 sg = _mm512_set1_ps(sx[g]);
    for (int i = 0; i < per_col; i++) {
      __m512 s, c;
      group_scales16(sz, compact, g, K / GS, N, col0 + 16 * i, &s, &c);
      y[i] = _mm512_fmadd_ps(s, acc[i], y[i]);
      y[i] = _mm512_fmadd_ps(c, sg, y[i]);
    }
  }
  for (int i = 0; i < per_col; i++) _mm512_storeu_ps(out + 16 * i, y[i]);
}
#endif

/* One block of BN rows against one row of x, in the widest form that takes this group size. */
static inline __attribute__((always_inline)) void block_row_any(const float *x, const float *sx, const uint8_t *codes,
                                                               const void *sz, int compact, int col0, float *out,
                                                               int N, int K, int GS, const int BN,
                                                               const uint8_t *next) {
#if WIDE
  if (GS % (BN == 32 ? 4 : 2) == 0) {
    block_row16(x, sx, codes, sz, compact, col0, out, N, K, GS, BN, next);
    return;
  }
#endif
  block_row(x, sx, codes, sz, compact, col0, out, N, K, GS, BN);
}

/* Returns 0, -1 for a layout it does not take (BN not 32 or 64, N or K not whole blocks or groups), -2 when a
   scratch buffer could not be allocated. */
int int4_gemm_f32(const float *x, const uint8_t *packed, const void *sz, float *y, int M, int N, int K, int GS,
                  int BN, int compact) {
  if ((BN != 32 && BN != 64) || N % BN || K % GS || GS % 2) return -1;
  const int groups = K / GS, blocks = N / BN;
  float *sx = malloc(sizeof(float) * (size_t)M * groups); /* each row's sum over each group */
  if (!sx) return -2;
  for (int m = 0; m < M; m++)
    for (int g = 0; g < groups; g++) {
      float s = 0.f;
      for (int k = g * GS; k < (g + 1) * GS; k++) s += x[(size_t)m * K + k];
      sx[(size_t)m * groups + g] = s;
    }
  /* Blocks are shared among the threads; each block's codes are read once per row of x, from cache after the
     first (a block is K * BN / 2 bytes: 9 KiB for K = 576, BN = 32). */
#pragma omp parallel for schedule(static)
  for (int b = 0; b < blocks; b++) {
    const uint8_t *codes = packed + (size_t)b * K * (BN / 2);
    for (int m = 0; m < M; m++) {
      float tmp[64];
      const uint8_t *next = m == 0 && b + 1 < blocks ? codes + (size_t)K * (BN / 2) : NULL;
      if (BN == 32)
        block_row_any(x + (size_t)m * K, sx + (size_t)m * groups, codes, sz, compact, b * BN, tmp, N, K, GS, 32, next);
      else
        block_row_any(x + (size_t)m * K, sx + (size_t)m * groups, codes, sz, compact, b * BN, tmp, N, K, GS, 64, next);
      for (int i = 0; i < BN; i++) y[(size_t)m * N + (size_t)b * BN + i] = tmp[i];
    }
  }
  free(sx);
  return 0;
}
