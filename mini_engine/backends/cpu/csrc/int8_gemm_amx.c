/* The int8 weight-only product y = x W^T on Intel AMX, for `quant.Int8Linear` (the int4 model's LM head: 49,152
   rows of 576 int8 weights, one bf16 scale per row), activations rounded to bf16 as torch's int8 kernel rounds
   them in the `int8pack_bf16` form.

   The codes (-127..127) are exact in bf16, so the tiles hold them as they are and each row's scale multiplies
   its sums once at the end. The weight is the tiles' left operand here (`tdpbf16ps C, A, B` with A = 16 weight
   rows x 32 codes, read along the row-major int8 matrix with no transpose; B = 32 columns of x for 16 rows of x,
   in pairs), so C holds y transposed: 16 weight rows x 16 rows of x, fp32 sums over all of K in the tile.
     y[m, n] = scale[n] * sum_k q[n, k] bf16(x[m, k])

   The threads share units of 32 weight rows (two A tiles tall); each converts its codes to bf16 once and runs
   every 16 rows of x against them. Needs what int4_gemm_amx.c needs (amx.h); elsewhere a stub returns -3. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#include "amx.h"

#define TA0 0
#define TA1 1
#define TB 2
#define TC0 3
#define TC1 4

/* One unit's 32 rows of int8 codes -> tiles[c * 2 + r / 16]: 16 rows of 32 bf16 for columns [32 c, 32 c + 32). */
static void convert_rows(const int8_t *q, int K, uint16_t *tiles) {
  for (int r = 0; r < 32; r++)
    for (int k = 0; k < K; k += 32) {
      const int8_t *src = q + (size_t)r * K + k;
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)src)));
      const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(src + 16))));
      uint16_t *dst = tiles + ((size_t)(k / 32) * 2 + r / 16) * 512 + (r % 16) * 32;
      _mm512_storeu_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(hi, lo)); /* exact: |code| <= 127 */
    }
}

int int8_gemm_amx_f32(const float *x, const int8_t *q, const uint16_t *sbits, float *y, int M, int N, int K) {
  if (N % 32 || K % 32) return -1;
  if (!amx_permitted()) return -3;
  const int mp = (M + 15) / 16 * 16, chunks = K / 32, units = N / 32;
  uint16_t *xb = aligned_alloc(64, sizeof(uint16_t) * (size_t)mp * K);
  uint32_t *xv = aligned_alloc(64, sizeof(uint16_t) * (size_t)mp * K);
  if (!xb || !xv) {
    free(xb);
    free(xv);
    return -2;
  }
  amx_round_rows(x, xb, NULL, M, mp, K, K);
  /* x as B tiles: tile (m-tile t, chunk c), row i holds the pairs (x[m][32 c + 2 i], x[m][32 c + 2 i + 1]) of its
     16 rows m: a transpose of 32-bit pairs, small next to the weight (16 x 576 for a decode step's head) */
  const uint32_t *pairs = (const uint32_t *)xb;
  for (int t = 0; t < mp / 16; t++)
    for (int c = 0; c < chunks; c++)
      for (int i = 0; i < 16; i++)
        for (int m = 0; m < 16; m++)
          xv[(((size_t)t * chunks + c) * 16 + i) * 16 + m] = pairs[((size_t)t * 16 + m) * (K / 2) + c * 16 + i];
  int status = 0;
#pragma omp parallel
  {
    uint16_t *tiles = aligned_alloc(64, (size_t)K * 64); /* K / 32 x 2 tiles of 1 KiB */
    float *c = aligned_alloc(64, 2 * 16 * 16 * sizeof(float));
    const int ok = tiles && c;
    if (!ok) {
#pragma omp atomic write
      status = -2;
    } else {
      amx_configure();
    }
#pragma omp for schedule(static)
    for (int u = 0; u < units; u++) {
      if (!ok) continue;
      const int n0 = u * 32;
      convert_rows(q + (size_t)n0 * K, K, tiles);
      float scale[32];
      for (int r = 0; r < 32; r++) {
        const uint32_t bits = (uint32_t)sbits[n0 + r] << 16;
        memcpy(scale + r, &bits, 4);
      }
      for (int m0 = 0; m0 < mp; m0 += 16) {
        _tile_zero(TC0);
        _tile_zero(TC1);
        for (int ch = 0; ch < chunks; ch++) {
          _tile_loadd(TB, xv + ((size_t)(m0 / 16) * chunks + ch) * 256, 64);
          _tile_loadd(TA0, tiles + (size_t)ch * 1024, 64);
          _tile_loadd(TA1, tiles + (size_t)ch * 1024 + 512, 64);
          _tile_dpbf16ps(TC0, TA0, TB);
          _tile_dpbf16ps(TC1, TA1, TB);
        }
        _tile_stored(TC0, c, 64);
        _tile_stored(TC1, c + 256, 64);
        const int rows = M - m0 < 16 ? M - m0 : 16;
        for (int m = 0; m < rows; m++)
          for (int r = 0; r < 32; r++) y[(size_t)(m0 + m) * N + n0 + r] = c[r * 16 + m] * scale[r];
      }
    }
    if (ok) _tile_release();
    free(tiles);
    free(c);
  }
  free(xb);
  free(xv);
  return status;
}

#else

int int8_gemm_amx_f32(const float *x, const int8_t *q, const uint16_t *sbits, float *y, int M, int N, int K) {
  (void)x, (void)q, (void)sbits, (void)y, (void)M, (void)N, (void)K;
  return -3; /* built for a CPU without AMX */
}

#endif
