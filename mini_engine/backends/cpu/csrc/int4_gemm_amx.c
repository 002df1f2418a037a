/* The int4 weight-only product y = x W^T on Intel AMX (Advanced Matrix Extensions, Sapphire Rapids and later):
   the same layouts as int4_gemm.c (torch's packed int4 CPU layout, bf16 scales and zeros or compact 8-bit ones),
   activations rounded to bf16 as torch's `_weight_int4pack_mm_for_cpu` rounds them.

   Why it exists: past a few rows, a CPU int4 kernel that dequantizes with vector instructions is compute-bound.
   torch's int4 kernel dequantizes every weight tile again for each 4 rows of x, and this project's AVX2 kernel for
   each row, so at 16 rows (a batch-16 decode step) reading a quarter of fp32's bytes bought little. AMX multiplies
   a 16 x 32 bf16 tile by a 32 x 16 one into 16 x 16 fp32 sums in one instruction (`tdpbf16ps`), so here each
   weight is turned into bf16 once per call and then serves every row of x, 16 rows per instruction.

   Exact codes, scales applied per group. The codes q (0..15) are small integers, exact in bf16, so the tiles hold
   the codes themselves, not the dequantized weights (which bf16 would round). Per group g of GS columns, with
   S_g the sum of the (bf16) x over the group, the identity of int4_gemm.c:
     y[m, n] += s[g, n] * sum_k q[n, k] x[m, k] + (z[g, n] - 8 s[g, n]) * S_g[m]
   AMX computes the inner sums for 16 rows x 16 columns x GS codes, fp32 accumulation; the scales are applied in
   fp32 with AVX-512. So the one rounding beyond fp32's is x's to bf16, as in torch's kernel.

   Tiles (`tdpbf16ps C, A, B`: C[m][n] += sum_i A[m][2i] B[i][2n] + A[m][2i + 1] B[i][2n + 1]):
     A  16 rows of x, 32 bf16 columns (64 bytes a row), read in place from a padded bf16 copy of x
     B  32 codes along k for 16 weight rows, in "VNNI" pairs: row i holds (q[n][2i], q[n][2i + 1]) for n = 0..15
     C  16 x 16 fp32 sums, stored to memory after each group for the epilogue
   The work is shared among the threads by units of 32 weight rows (two B tiles wide): each unit converts its
   codes to B tiles once (K x 32 bf16 = 36 KiB for K = 576), then runs every 16-row tile of x against them.

   Needs AMX-TILE, AMX-BF16, AVX512-BF16 and AVX512-BW at compile time (-march=native on such a CPU), and the
   Linux kernel's permission to use the tile registers (amx.h). Elsewhere the function is built as a stub that
   returns -3. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#include "amx.h"

/* Tile numbers: the intrinsics take them as constants. */
#define TA 0
#define TB0 1
#define TB1 2
#define TC0 3
#define TC1 4

/* bf16 bit patterns of 0..15 (the codes), indexed by a 16-bit lane's value with vpermw. */
static __m512i code_table(void) {
  uint16_t t[32];
  for (int i = 0; i < 32; i++) {
    const float f = (float)(i & 15);
    uint32_t bits;
    memcpy(&bits, &f, 4);
    t[i] = (uint16_t)(bits >> 16); /* exact: small integers need no rounding */
  }
  return _mm512_loadu_si512(t);
}

/* 32 interleaved codes (bytes: q[n][k], q[n][k + 1] for 16 n) -> one 64-byte B-tile row of bf16. */
static inline void store_pairs(uint16_t *dst, __m256i pairs, __m512i table) {
  _mm512_storeu_si512(dst, _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(pairs), table));
}

/* The B tiles of one unit of 32 weight rows, for all K: tiles[(k / 32) * 2 + half] is 16 rows of 32 bf16 (the
   pairs of 16 weight rows). codes: the unit's first byte of column 0; stride: bytes per column in the layout
   (BN / 2); wide: the unit's 32 rows are 32 bytes of one nibble (BN = 64, `shift` picks the nibble), else 16
   bytes of both nibbles (BN = 32: low nibbles rows 0..15, high nibbles rows 16..31). */
static void convert_unit(const uint8_t *codes, int stride, int wide, int shift, int K, uint16_t *tiles,
                         __m512i table) {
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  for (int k = 0; k < K; k += 2) {
    uint16_t *row0 = tiles + (size_t)(k / 32) * 2 * 512 + (k % 32) / 2 * 32, *row1 = row0 + 512;
    __m256i a, b; /* the codes of columns k and k + 1, 32 rows each, as bytes 0..31 */
    if (wide) {
      a = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)(codes + (size_t)k * stride)),
                                             shift), low4);
      b = _mm256_and_si256(
          _mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)(codes + (size_t)(k + 1) * stride)), shift), low4);
    } else {
      const __m128i a16 = _mm_loadu_si128((const __m128i *)(codes + (size_t)k * stride));
      const __m128i b16 = _mm_loadu_si128((const __m128i *)(codes + (size_t)(k + 1) * stride));
      const __m128i low = _mm_set1_epi8(0x0f);
      a = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(a16, 4), low), _mm_and_si128(a16, low));
      b = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b16, 4), low), _mm_and_si128(b16, low));
    }
    /* unpack interleaves within 128-bit lanes: lo = rows 0..7 | 16..23, hi = rows 8..15 | 24..31 */
    const __m256i lo = _mm256_unpacklo_epi8(a, b), hi = _mm256_unpackhi_epi8(a, b);
    store_pairs(row0, _mm256_permute2x128_si256(lo, hi, 0x20), table); /* rows 0..15 */
    store_pairs(row1, _mm256_permute2x128_si256(lo, hi, 0x31), table); /* rows 16..31 */
  }
}

/* y += the scaled sums of one group for `rows` rows (up to 16) x 16 columns: acc rows are 32 floats apart (a unit
   is 32 wide). Rows past M (the zero padding of a last tile of x) are skipped. */
static inline void apply_group(const float *c, float *acc, const float *sx, int groups, __m512 s, __m512 zp,
                               int rows) {
  for (int r = 0; r < rows; r++) {
    __m512 a = _mm512_loadu_ps(acc + r * 32);
    a = _mm512_fmadd_ps(s, _mm512_loadu_ps(c + r * 16), a);
    a = _mm512_fmadd_ps(zp, _mm512_set1_ps(sx[(size_t)r * groups]), a);
    _mm512_storeu_ps(acc + r * 32, a);
  }
}

int int4_gemm_amx_f32(const float *x, const uint8_t *packed, const void *sz, float *y, int M, int N, int K,
                      int GS, int BN, int compact) {
  if ((BN != 32 && BN != 64) || N % BN || GS % 32 || K % GS) return -1;
  if (!amx_permitted()) return -3;
  const int groups = K / GS, mp = (M + 15) / 16 * 16, units = N / 32;
  /* x rounded to bf16, zero rows up to a multiple of 16, and each row's sum over each group of those values */
  uint16_t *xb = aligned_alloc(64, sizeof(uint16_t) * (size_t)mp * K);
  float *sx = malloc(sizeof(float) * (size_t)mp * groups);
  if (!xb || !sx) {
    free(xb);
    free(sx);
    return -2;
  }
  amx_round_rows(x, xb, sx, M, mp, K, GS);
  int status = 0;
  const __m512i table = code_table();
  const __m512i low16 = _mm512_set1_epi32(0xffff), low8 = _mm512_set1_epi32(0xff);
  const uint16_t *codes8 = (const uint16_t *)sz;              /* compact: 8-bit codes of d and m, */
  const float *fd = (const float *)(codes8 + (size_t)groups * N), *fm = fd + N; /* then the rows' factors */
#pragma omp parallel
  {
    uint16_t *tiles = aligned_alloc(64, (size_t)K * 64); /* K / 32 x 2 tiles of 1 KiB */
    float *c = aligned_alloc(64, 2 * 16 * 16 * sizeof(float));
    float *acc = aligned_alloc(64, 16 * 32 * sizeof(float));
    const int ok = tiles && c && acc;
    if (!ok) {
#pragma omp atomic write
      status = -2;
    } else {
      amx_configure();
    }
    /* every thread meets the loop (a worksharing loop must be met by the whole team); one without its buffers
       skips its share and the call fails */
#pragma omp for schedule(static)
    for (int u = 0; u < units; u++) {
      if (!ok) continue;
      const int n0 = u * 32, b = n0 / BN;
      const uint8_t *block = packed + (size_t)b * K * (BN / 2);
      if (BN == 64)
        convert_unit(block, 32, 1, (n0 % 64) ? 4 : 0, K, tiles, table);
      else
        convert_unit(block, 16, 0, 0, K, tiles, table);
      for (int m0 = 0; m0 < mp; m0 += 16) {
        const int rows = M - m0 < 16 ? M - m0 : 16;
        memset(acc, 0, 16 * 32 * sizeof(float));
        for (int g = 0; g < groups; g++) {
          _tile_zero(TC0);
          _tile_zero(TC1);
          for (int k = g * GS; k < (g + 1) * GS; k += 32) {
            _tile_loadd(TA, xb + (size_t)m0 * K + k, K * 2);
            _tile_loadd(TB0, tiles + (size_t)(k / 32) * 1024, 64);
            _tile_loadd(TB1, tiles + (size_t)(k / 32) * 1024 + 512, 64);
            _tile_dpbf16ps(TC0, TA, TB0);
            _tile_dpbf16ps(TC1, TA, TB1);
          }
          _tile_stored(TC0, c, 64);
          _tile_stored(TC1, c + 256, 64);
          for (int h = 0; h < 2; h++) {
            const int col = n0 + 16 * h;
            __m512 s, zp;
            if (compact) { /* d = dc fd[n], m = mc fm[n]: y += d sum(q x) + m S_g */
              const __m512i v =
                  _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(codes8 + (size_t)g * N + col)));
              s = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, low8)), _mm512_loadu_ps(fd + col));
              zp = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 16), 24)),
                                 _mm512_loadu_ps(fm + col));
            } else { /* bf16 -> fp32 is a 16-bit shift: the scale is the low half */
              const __m512i v = _mm512_loadu_si512((const uint32_t *)sz + (size_t)g * N + col);
              s = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_and_si512(v, low16), 16));
              const __m512 z = _mm512_castsi512_ps(_mm512_andnot_si512(low16, v));
              zp = _mm512_fnmadd_ps(_mm512_set1_ps(8.f), s, z);
            }
            apply_group(c + 256 * h, acc + 16 * h, sx + (size_t)m0 * groups + g, groups, s, zp,
                        rows);
          }
        }
        for (int r = 0; r < rows; r++) memcpy(y + (size_t)(m0 + r) * N + n0, acc + r * 32, 32 * sizeof(float));
      }
    }
    if (ok) _tile_release();
    free(tiles);
    free(c);
    free(acc);
  }
  free(xb);
  free(sx);
  return status;
}

#else

int int4_gemm_amx_f32(const float *x, const uint8_t *packed, const void *sz, float *y, int M, int N, int K,
                      int GS, int BN, int compact) {
  (void)x, (void)packed, (void)sz, (void)y, (void)M, (void)N, (void)K, (void)GS, (void)BN, (void)compact;
  return -3; /* built for a CPU without AMX */
}

#endif
