/* What the AMX kernels (int4_gemm_amx.c, int8_gemm_amx.c) share: the operating system's permission to use the
   tile registers, and one tile configuration. Included only where AMX-TILE and AMX-BF16 are compiled for. */
#pragma once
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define AMX_TILES 5 /* tiles 0..4 are configured */

/* Linux hands the 8 KiB of tile state to a process only when asked (arch_prctl); using a tile before that is
   an illegal instruction. Asked once per process; asking twice is harmless. */
static inline int amx_permitted(void) {
  static int state; /* 0: not asked yet, 1: granted, -1: refused */
  if (state == 0) state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
  return state == 1;
}

struct amx_tile_config {
  uint8_t palette_id, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

/* Tiles 0..4 as 16 rows of 64 bytes (16 x 32 bf16, or 16 x 16 fp32). The configuration is a thread's state:
   each thread that runs tile instructions loads it, and releases the tiles when done. */
static inline void amx_configure(void) {
  struct amx_tile_config cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette_id = 1;
  for (int t = 0; t < AMX_TILES; t++) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

/* x [M, K] fp32 rounded to bf16 (round to nearest even, as torch rounds) into xb [mp, K], mp = M rounded up to
   16, the extra rows zero. With `sx` (not NULL), also each row's sum over each group of GS of the rounded
   values, sx [mp, K / GS]. */
static inline void amx_round_rows(const float *x, uint16_t *xb, float *sx, int M, int mp, int K, int GS) {
  const int groups = K / GS;
  memset(xb + (size_t)M * K, 0, sizeof(uint16_t) * (size_t)(mp - M) * K);
  if (sx) memset(sx + (size_t)M * groups, 0, sizeof(float) * (size_t)(mp - M) * groups);
#pragma omp parallel for schedule(static)
  for (int m = 0; m < M; m++)
    for (int g = 0; g < groups; g++) {
      __m512 sum = _mm512_setzero_ps();
      for (int k = g * GS; k < (g + 1) * GS; k += 16) {
        const __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(x + (size_t)m * K + k));
        _mm256_storeu_si256((__m256i *)(xb + (size_t)m * K + k), (__m256i)h);
        sum = _mm512_add_ps(sum, _mm512_cvtpbh_ps(h));
      }
      if (sx) sx[(size_t)m * groups + g] = _mm512_reduce_add_ps(sum);
    }
}
