/* The fp32 product y = x W^T for a few to a few hundred rows of x, on a copy of W packed once into panels
   (`products` form "c_f32"; `cpu_kernels.f32_gemm`).

   Layouts:
     x   [M, K] fp32, row-major
     wp  [N / P][K][P] fp32: panel p holds weight rows p P .. p P + P - 1, one column k after another, so one
         load gives P / VL vectors of the same column k for P consecutive rows (P from `f32_gemm_panel`)
     y   [M, N] fp32

   The micro-kernel is BLIS's: MR rows of x by one panel, MR x NR vectors of sums held in registers for the whole
   of K; each step k loads NR vectors of the panel and broadcasts MR values of x, then makes MR x NR multiply-adds.
   With AVX-512 (32 registers): MR = 8, NR = 3, P = 48, 24 sums; with AVX2 (16): MR = 6, NR = 2, P = 16, 12 sums.
   Every panel is read from memory once per call and then serves all M rows from cache; while the rows run on a
   panel, the next panel is prefetched into L2, its cache lines spread evenly over all of this panel's passes.

   Why it exists: at 4 to 64 rows (decode steps of a batch, a short prefill chunk) the product is neither
   memory- nor compute-bound alone, and how well a kernel overlaps streaming the weights with the arithmetic
   decides its speed. On a 2-core Xeon with AMX, over the model's 120 decoder products, 16 rows took 23.9 ms here
   against 28.3 ms with oneDNN's prepacked GEMM and 36.7 ms with F.linear (MKL, which repacks the weight on
   every call); 32 rows 31.8 ms against 37.0 and 42.2. Without prefetching the next panel it was 10% slower.
   How the prefetch is paced matters as much as having it. Issued all during the first MR rows (as it first was),
   it asked for the whole next panel in a sixth of the time memory needs to deliver it, so streaming and
   arithmetic took turns instead of overlapping: over the model's 121 products (the LM head included) with the
   caches flushed, 16 rows took 45.1 ms and 33 rows 59.9 ms. Spread over every pass, 34.2 and 41.1 ms
   (1.32x, 1.46x); one row, where there is one pass, 26.7 -> 24.1 ms (benchmarks/RESULTS.md, 2026-12-02).
   Build with -DAVX2_ONLY=1 to get the AVX2 kernel on an AVX-512 CPU (the tests check both). */
#include <immintrin.h>
#include <stddef.h>

#ifndef AVX2_ONLY
#define AVX2_ONLY 0
#endif

#if defined(__AVX512F__) && !AVX2_ONLY
#define MR 8
typedef __m512 vec;
enum { VL = 16, NR = 3 };
#define LOAD _mm512_loadu_ps
#define STORE _mm512_storeu_ps
#define BROADCAST _mm512_set1_ps
#define FMADD _mm512_fmadd_ps
#define ZERO _mm512_setzero_ps
#elif defined(__AVX2__) && defined(__FMA__)
#define MR 6
typedef __m256 vec;
enum { VL = 8, NR = 2 };
#define LOAD _mm256_loadu_ps
#define STORE _mm256_storeu_ps
#define BROADCAST _mm256_set1_ps
#define FMADD _mm256_fmadd_ps
#define ZERO _mm256_setzero_ps
#else
#error "the fp32 product needs AVX2 and FMA"
#endif

enum { P = NR * VL };

/* How many weight rows a panel holds: N must be a multiple of it, and the packed copy is laid out by it. */
int f32_gemm_panel(void) { return P; }

/* R rows of x (R <= MR, a constant once inlined) against one panel, the sums kept in registers over all of K.
   Meanwhile `lines` cache lines from `ahead` on are prefetched into L2, evenly over the K steps. */
static inline __attribute__((always_inline)) void rows_by_panel(const float *x, const float *panel, float *y,
                                                                const char *ahead, int lines, int N, int K,
                                                                const int R) {
  vec acc[MR][NR];
  for (int r = 0; r < R; r++)
    for (int j = 0; j < NR; j++) acc[r][j] = ZERO();
  int owed = 0; /* lines x (k + 1) / K prefetches are due after step k: a running sum, not a division a step */
  for (int k = 0; k < K; k++) {
    const float *col = panel + (size_t)k * P;
    for (owed += lines; owed >= K; owed -= K, ahead += 64) _mm_prefetch(ahead, _MM_HINT_T1);
    vec w[NR];
    for (int j = 0; j < NR; j++) w[j] = LOAD(col + j * VL);
    for (int r = 0; r < R; r++) {
      const vec xr = BROADCAST(x[(size_t)r * K + k]);
      for (int j = 0; j < NR; j++) acc[r][j] = FMADD(xr, w[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; r++)
    for (int j = 0; j < NR; j++) STORE(y + (size_t)r * N + j * VL, acc[r][j]);
}

/* y = x W^T. Returns 0, or -1 when N is not a multiple of the panel or a size is not positive. */
int f32_gemm_f32(const float *x, const float *wp, float *y, int M, int N, int K) {
  if (M <= 0 || K <= 0 || N <= 0 || N % P) return -1;
  const int panels = N / P;
#pragma omp parallel for schedule(static)
  for (int p = 0; p < panels; p++) {
    const float *panel = wp + (size_t)p * K * P;
    /* pass i of the panel's `passes` (MR rows each) prefetches the i-th share of the next panel's lines */
    const int passes = (M + MR - 1) / MR, lines = p + 1 < panels ? K * P * (int)sizeof(float) / 64 : 0;
    const char *next = (const char *)(panel + (size_t)K * P);
    for (int m0 = 0, i = 0; m0 < M; m0 += MR, i++) {
      const int first = (int)((long)i * lines / passes), share = (int)((long)(i + 1) * lines / passes) - first;
      const char *ahead = next + (size_t)first * 64;
      const float *xm = x + (size_t)m0 * K;
      float *ym = y + (size_t)m0 * N + (size_t)p * P;
      /* one inlined copy per row count, so that every loop over r and j is unrolled onto registers */
      switch (M - m0 < MR ? M - m0 : MR) {
#define ROWS(R)                                          \
  case R:                                                \
    rows_by_panel(xm, panel, ym, ahead, share, N, K, R); \
    break;
        ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6)
#if MR == 8
        ROWS(7) ROWS(8)
#endif
#undef ROWS
      }
    }
  }
  return 0;
}

