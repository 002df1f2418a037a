/* Paged attention on a CPU, read in place from the paged pool through each sequence's block table: the C twin of
   kernels/paged_attention.py (Triton, for GPUs). The PyTorch path copies each sequence's blocks out of the pool
   and runs SDPA on the copy, which reads every cached key and value twice; these read them once.
   - paged_decode_f32: one new query token per sequence (a decode step).
   - paged_chunk_f32: several query tokens per sequence, each seeing its own prefix (a prefill chunk after a
     cached prefix, a speculative step's verify chunks).

   Layouts (fp32, contiguous):
     q       [S, HQ, HEAD_DIM]                      query head j reads KV head j / (HQ / HKV) (GQA)
     pools   [num_blocks, block_size, HKV, HEAD_DIM] one layer's keys, and its values
     tables  [S, W] int32                            block ids in position order; entries past a context unread
     lens    [S] int32                               context length of each sequence (>= 1)
     out     [S, HQ, HEAD_DIM]
   (paged_chunk_f32's q and out have a Q axis after S; see there.)

   HQ, HKV and HEAD_DIM are compile-time constants (-D flags, one build per model shape): with them known, the
   compiler unrolls and vectorises the loops over a head's 64 values. Built with -fopenmp, the sequences are
   shared among the threads of PyTorch's own OpenMP runtime (the loader links the libgomp already loaded).

   paged_decode_f32 makes two passes per sequence, each streaming the blocks once: scores for every position (q . k
   / sqrt(d)), then softmax, then the weighted sum of the values. A block's rows hold every KV head side by side,
   so a sequence reads whole rows. Blocks sit anywhere in the pool, where the hardware prefetcher cannot guess the
   next one: the loop asks for the next block while it reads the current one (measured on a 2-core AMD EPYC, 16
   sequences of 1,024 positions: 1.60 ms a layer without the prefetch, 0.74 ms with it; the copy and SDPA took
   1.87). */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#ifndef HQ
#error "compile with -DHQ=<query heads> -DHKV=<kv heads> -DHEAD_DIM=<head dim>"
#endif

enum { G = HQ / HKV, ROW = HKV * HEAD_DIM };
_Static_assert(HEAD_DIM % 8 == 0, "the chunk kernel sums 8 output columns at a time");

/* Ask for row i of block `next` (NULL: none) while row i of the current block is read. A macro: written as an
   inline function, GCC 12 dropped every prefetch in it. */
#define PREFETCH_ROW(next, i)                                          \
  do {                                                                 \
    if (next)                                                          \
      for (int c = 0; c < ROW; c += 16) __builtin_prefetch((next) + (size_t)(i) * ROW + c); \
  } while (0)

/* Returns 0, or -1 when a scratch buffer could not be allocated (out is then incomplete). */
int paged_decode_f32(const float *q, const float *kpool, const float *vpool, const int32_t *tables,
                     const int32_t *lens, float *out, int S, int block_size, int W, float scale) {
  const size_t block = (size_t)block_size * ROW;
  int failed = 0;
#pragma omp parallel reduction(| : failed)
  {
    int cap = 0;
    float *scores = NULL; /* [HQ][len] of the sequence in hand */
#pragma omp for schedule(dynamic, 1)
    for (int s = 0; s < S; s++) {
      const int len = lens[s];
      if (len > cap) {
        free(scores);
        cap = len;
        scores = malloc(sizeof(float) * (size_t)cap * HQ);
        if (!scores) { cap = 0; failed = 1; continue; }
      }
      const float *qs = q + (size_t)s * HQ * HEAD_DIM;
      const int32_t *table = tables + (size_t)s * W;
      float *o = out + (size_t)s * HQ * HEAD_DIM;

      for (int t0 = 0; t0 < len; t0 += block_size) { /* pass 1: scores */
        const int b = t0 / block_size, n = len - t0 < block_size ? len - t0 : block_size;
        const float *kb = kpool + (size_t)table[b] * block;
        const float *next = t0 + block_size < len ? kpool + (size_t)table[b + 1] * block : NULL;
        for (int i = 0; i < n; i++) {
          PREFETCH_ROW(next, i);
          const float *k = kb + (size_t)i * ROW;
          for (int j = 0; j < HQ; j++) {
            const float *qj = qs + j * HEAD_DIM, *kh = k + (j / G) * HEAD_DIM;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int d = 0; d < HEAD_DIM; d++) dot += qj[d] * kh[d];
            scores[(size_t)j * len + t0 + i] = dot * scale;
          }
        }
      }
      float inv[HQ];
      for (int j = 0; j < HQ; j++) { /* softmax of each head's row, max subtracted */
        float *sc = scores + (size_t)j * len, m = sc[0], sum = 0.f;
        for (int t = 1; t < len; t++) m = sc[t] > m ? sc[t] : m;
#pragma omp simd reduction(+ : sum)
        for (int t = 0; t < len; t++) {
          const float e = expf(sc[t] - m);
          sc[t] = e;
          sum += e;
        }
        inv[j] = 1.f / sum;
        for (int d = 0; d < HEAD_DIM; d++) o[j * HEAD_DIM + d] = 0.f;
      }
      for (int t0 = 0; t0 < len; t0 += block_size) { /* pass 2: the weighted sum of the values */
        const int b = t0 / block_size, n = len - t0 < block_size ? len - t0 : block_size;
        const float *vb = vpool + (size_t)table[b] * block;
        const float *next = t0 + block_size < len ? vpool + (size_t)table[b + 1] * block : NULL;
        for (int i = 0; i < n; i++) {
          PREFETCH_ROW(next, i);
          const float *v = vb + (size_t)i * ROW;
          for (int j = 0; j < HQ; j++) {
            const float p = scores[(size_t)j * len + t0 + i], *vh = v + (j / G) * HEAD_DIM;
            float *oj = o + j * HEAD_DIM;
#pragma omp simd
            for (int d = 0; d < HEAD_DIM; d++) oj[d] += p * vh[d];
          }
        }
      }
      for (int j = 0; j < HQ; j++)
        for (int d = 0; d < HEAD_DIM; d++) o[j * HEAD_DIM + d] *= inv[j];
    }
    free(scores);
  }
  return failed ? -1 : 0;
}

/* Chunks of Q query tokens per sequence (a prefill chunk after a cached prefix, a speculative step's verify
   chunk), query j of sequence s seeing the first visible[s * Q + j] positions (its own included; non-decreasing
   in j).  q [S, Q, HQ, HEAD_DIM], visible [S, Q] int32 (>= 1), out [S, Q, HQ, HEAD_DIM].

   FlashAttention's loop, laid out for a CPU's vector registers. The query rows that share a KV head (Q tokens x
   G heads of a group) are taken LANES at a time (16 with AVX-512, 8 with AVX2), one row per lane of a vector:
   a score vector then holds one key's score for LANES rows, and the online softmax (running max, rescale,
   running sum) is lane-wise arithmetic with no reduction across lanes. Keys and values are read LANES positions
   at a time, in place through the block table: each score is HEAD_DIM fused multiply-adds of a query column by
   one broadcast key value, and each output column gathers LANES broadcast values. Work items are (sequence, KV
   head, tile of LANES rows), shared among the threads, so a single long chunk still uses every core, and the
   rows of a later chunk of positions are asked for while the current one is read (PF chunks ahead).
   Measured on a 2-core AMD EPYC (Zen 5), one layer of SmolLM2 (9 query heads, 3 KV heads of 64), every
   layer's pool in turn (so that keys and values come from memory, as in a step): a 32-token chunk after 1,024
   cached positions 0.32 ms, against 0.77 ms for the copy + SDPA; a 512-token chunk over 1,024 positions 3.2
   against 7.0 ms. 16 verify chunks of 5 tokens over 300 positions, one pool: 0.25 against 1.78 ms. Asking
   ahead took the verify chunks from 0.88 to 0.57 ms a layer out of cache. Built for AVX2 only (-march=znver3)
   on the same CPU, one pool: 0.53 ms (the 32-token chunk), 6.3 ms (the 512-token one) and 0.44 ms (the verify
   chunks), against 0.28, 3.3 and 0.25 for the AVX-512 build and 0.58, 7.1 and 1.38 for the copy + SDPA. */
/* A vector of LANES floats (GCC's vector types): 16, one AVX-512 register, where the CPU has them; else 8, one
   AVX2 register. A tile is LANES rows by KEYS = LANES positions, so its scores fill half the vector registers
   either way: 16-float vectors on an AVX2 CPU would each take two of its 16 registers, and the scores alone
   would spill (measured 10x slower). */
#ifdef __AVX512F__
#define LANES 16
#else
#define LANES 8
#endif
typedef float vf __attribute__((vector_size(LANES * 4)));
typedef int32_t vi __attribute__((vector_size(LANES * 4)));
enum { KEYS = LANES };
#ifndef PF
#define PF 1
#endif
#define NEG_BIG (-1e30f) /* "cannot see": finite, since -ffast-math assumes no infinities */

static inline vf vmax(vf a, vf b) {
  const vi m = a > b;
  return (vf)(((vi)a & m) | ((vi)b & ~m));
}

/* Lane-wise expf, inline: a call (glibc's vector expf) would make the compiler spill the score vectors
   around it, since a call may overwrite every vector register. Cephes' expf: x = n ln2 + r with |r| <= ln2 / 2,
   a degree-7 polynomial in r, then 2^n put into the exponent bits. Arguments below -87 give about 1e-38, not 0,
   which the sums cannot notice (every row's largest score contributes exp(0) = 1). */
static inline vf vexp(vf x) {
  const vf lo = (vf){0} - 87.f;
  x = vmax(x, lo);
  vf fx = x * 1.44269504088896341f + 0.5f;
  vi n = __builtin_convertvector(fx, vi); /* truncates toward zero: step down where that rounded up */
  vf nf = __builtin_convertvector(n, vf);
  const vi up = nf > fx;
  n += up;  /* -1 in the lanes that rounded up */
  nf = __builtin_convertvector(n, vf);
  const vf r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  vf p = (vf){0} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  return p * (vf)((n + 127) << 23);
}

/* Where position t of a sequence keeps KV head h's values in a pool: its block's row, then the head. */
static inline size_t head_row(const int32_t *table, int t, int block_size, int h) {
  return ((size_t)table[t / block_size] * block_size + t % block_size) * ROW + (size_t)h * HEAD_DIM;
}

void paged_chunk_f32(const float *q, const float *kpool, const float *vpool, const int32_t *tables,
                    const int32_t *visible, float *out, int S, int Q, int block_size, int W, float scale) {
  const int rows = Q * G, tiles = (rows + LANES - 1) / LANES; /* row r of a KV head: token r / G, head r % G */
  const int items = S * HKV * tiles;
#pragma omp parallel for schedule(dynamic, 1)
  for (int item = 0; item < items; item++) {
    const int s = item / (HKV * tiles), h = item / tiles % HKV, r0 = item % tiles * LANES;
    const int n_rows = rows - r0 < LANES ? rows - r0 : LANES;
    const int32_t *vis = visible + (size_t)s * Q, *table = tables + (size_t)s * W;
    vf qt[HEAD_DIM], o[HEAD_DIM], seen, m, l;
    int lo = 1 << 30, hi = 0; /* fewest and most positions a row of the tile sees */
    for (int lane = 0; lane < LANES; lane++) { /* lanes past the last row repeat it; their results are dropped */
      const int r = r0 + (lane < n_rows ? lane : n_rows - 1), j = r / G;
      const float *qr = q + (((size_t)s * Q + j) * HQ + h * G + r % G) * HEAD_DIM;
      for (int d = 0; d < HEAD_DIM; d++) qt[d][lane] = qr[d] * scale;
      seen[lane] = (float)vis[j];
      lo = vis[j] < lo ? vis[j] : lo;
      hi = vis[j] > hi ? vis[j] : hi;
    }
    for (int d = 0; d < HEAD_DIM; d++) o[d] = (vf){0};
    m = (vf){0} + NEG_BIG;
    l = (vf){0};
    for (int t0 = 0; t0 < hi; t0 += KEYS) {
      const float *krow[KEYS], *vrow[KEYS];
      for (int i = 0; i < KEYS; i++) { /* positions past the end read the last one again, then are masked */
        const size_t at = head_row(table, t0 + i < hi ? t0 + i : hi - 1, block_size, h);
        krow[i] = kpool + at;
        vrow[i] = vpool + at;
      }
      for (int i = 0, t = t0 + PF * KEYS; i < KEYS && t < hi; i++, t++) { /* ask for a later chunk's rows now */
        const size_t at = head_row(table, t, block_size, h);
        for (int c = 0; c < HEAD_DIM; c += 16) {
          __builtin_prefetch(kpool + at + c);
          __builtin_prefetch(vpool + at + c);
        }
      }
      vf sc[KEYS];
      for (int i = 0; i < KEYS; i++) sc[i] = (vf){0};
      for (int d = 0; d < HEAD_DIM; d++)
        for (int i = 0; i < KEYS; i++) sc[i] += qt[d] * krow[i][d];
      if (t0 + KEYS > lo)
        for (int i = 0; i < KEYS; i++) {
          const vi ok = ((vf){0} + (float)(t0 + i)) < seen;
          sc[i] = (vf)(((vi)sc[i] & ok) | ((vi)((vf){0} + NEG_BIG) & ~ok));
        }
      vf mx = m;
      for (int i = 0; i < KEYS; i++) mx = vmax(mx, sc[i]);
      const vf alpha = vexp(m - mx);
      m = mx;
      l *= alpha;
      for (int i = 0; i < KEYS; i++) {
        sc[i] = vexp(sc[i] - mx);
        l += sc[i];
      }
      for (int d0 = 0; d0 < HEAD_DIM; d0 += 8) { /* 8 independent sums: the multiply-adds do not wait in line */
        vf acc[8];
        for (int e = 0; e < 8; e++) acc[e] = o[d0 + e] * alpha;
        for (int i = 0; i < KEYS; i++)
          for (int e = 0; e < 8; e++) acc[e] += sc[i] * vrow[i][d0 + e];
        for (int e = 0; e < 8; e++) o[d0 + e] = acc[e];
      }
    }
    const vf inv = 1.f / l;
    for (int lane = 0; lane < n_rows; lane++) {
      const int r = r0 + lane;
      float *orow = out + (((size_t)s * Q + r / G) * HQ + h * G + r % G) * HEAD_DIM;
      for (int d = 0; d < HEAD_DIM; d++) orow[d] = o[d][lane] * inv[lane];
    }
  }
}
