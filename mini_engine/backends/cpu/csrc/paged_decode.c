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

   paged_decode_f32 makes two passes per sequence and KV head: scores for every position (q . k / sqrt(d)) of the
   G query heads that share it, then softmax, then the weighted sum of the values, with those G output rows held
   in registers. A block's rows hold every KV head side by side; the first head's pass asks for whole rows, so
   the other heads find them in cache. With AVX-512 the scores of 16 positions are summed together
   (`scores16`): on a 2-core Xeon with AMX, 16 sequences of 212 positions, one layer went from 0.349 to
   0.272-0.276 ms with both changes, the int4 model's serving run from 318-324 to 337 tok/s. Blocks sit anywhere
   in the pool, where the hardware prefetcher cannot guess the next one: the loop asks for the next block while
   it reads the current one (measured on a 2-core AMD EPYC, 16
   sequences of 1,024 positions: 1.60 ms a layer without the prefetch, 0.74 ms with it; the copy and SDPA took
   1.87). */
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "softmax_row.h"

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

#ifndef SCORES16 /* 16 positions' scores at once, with AVX-512 (tests build it with -DSCORES16=0 too) */
#if defined(__AVX512F__) && HEAD_DIM % 16 == 0
#define SCORES16 1
#else
#define SCORES16 0
#endif
#endif

#if SCORES16
/* q . k for 16 keys (rows ROW floats apart) at once. Each key's products with q are summed down to one vector
   of 16 partial sums, and the 16 vectors are then reduced together (pairs interleaved, then 128-bit lanes
   exchanged), 45 instructions for 16 sums where summing each vector across its lanes alone would take about
   128. Lane t of the result is key t's dot product. */
static inline __m512 scores16(const float *q, const float *k) {
  __m512 a[16];
  for (int t = 0; t < 16; t++) {
    const float *kt = k + (size_t)t * ROW;
    __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(kt));
    for (int d = 16; d < HEAD_DIM; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), _mm512_loadu_ps(kt + d), acc);
    a[t] = acc;
  }
  __m512 b[8], c[4]; /* in each 128-bit lane: b holds 2 keys' partial sums, c 4 keys' */
  for (int i = 0; i < 8; i++)
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; i++) {
    const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  /* now sum each c over its four 128-bit lanes: lane pairs (0, 1) and (2, 3), then the two halves */
  const __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(d0, d1, _MM_SHUFFLE(3, 1, 3, 1)));
}
#endif

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

      for (int h = 0; h < HKV; h++) { /* pass 1, per KV head: the scores of its G query heads */
        for (int t0 = 0; t0 < len; t0 += block_size) {
          const int b = t0 / block_size, n = len - t0 < block_size ? len - t0 : block_size;
          const float *kb = kpool + (size_t)table[b] * block + h * HEAD_DIM;
          const float *next = t0 + block_size < len ? kpool + (size_t)table[b + 1] * block : NULL;
          if (h == 0)
            for (int i = 0; i < n; i++) PREFETCH_ROW(next, i); /* whole rows: the other heads read them next */
          int i = 0;
#if SCORES16
          for (; i + 16 <= n; i += 16)
            for (int g = 0; g < G; g++) {
              const float *qj = qs + (h * G + g) * HEAD_DIM;
              _mm512_storeu_ps(scores + (size_t)(h * G + g) * len + t0 + i,
                               _mm512_mul_ps(scores16(qj, kb + (size_t)i * ROW), _mm512_set1_ps(scale)));
            }
#endif
          for (; i < n; i++)
            for (int g = 0; g < G; g++) {
              const float *qj = qs + (h * G + g) * HEAD_DIM, *k = kb + (size_t)i * ROW;
              float dot = 0.f;
#pragma omp simd reduction(+ : dot)
              for (int d = 0; d < HEAD_DIM; d++) dot += qj[d] * k[d];
              scores[(size_t)(h * G + g) * len + t0 + i] = dot * scale;
            }
        }
      }
      float inv[HQ];
      for (int j = 0; j < HQ; j++) inv[j] = softmax_row(scores + (size_t)j * len, len); /* each head's row */
      for (int h = 0; h < HKV; h++) { /* pass 2, per KV head: its G heads' output rows stay in registers */
        float acc[G][HEAD_DIM] = {{0.f}};
        for (int t0 = 0; t0 < len; t0 += block_size) {
          const int b = t0 / block_size, n = len - t0 < block_size ? len - t0 : block_size;
          const float *vb = vpool + (size_t)table[b] * block + h * HEAD_DIM;
          const float *next = t0 + block_size < len ? vpool + (size_t)table[b + 1] * block : NULL;
          for (int i = 0; i < n; i++) {
            if (h == 0) PREFETCH_ROW(next, i);
            const float *v = vb + (size_t)i * ROW;
            for (int g = 0; g < G; g++) {
              const float p = scores[(size_t)(h * G + g) * len + t0 + i];
#pragma omp simd
              for (int d = 0; d < HEAD_DIM; d++) acc[g][d] += p * v[d];
            }
          }
        }
        for (int g = 0; g < G; g++)
          for (int d = 0; d < HEAD_DIM; d++) o[(h * G + g) * HEAD_DIM + d] = acc[g][d] * inv[h * G + g];
      }
    }
    free(scores);
  }
  return failed ? -1 : 0;
}

/* Chunks of Q query tokens per sequence (a prefill chunk after a cached prefix, a speculative step's verify
   chunk), query j of sequence s seeing the first visible[s * Q + j] positions (its own included; non-decreasing
   in j).  q [S, Q, HQ, HEAD_DIM], visible [S, Q] int32 (>= 1), out [S, Q, HQ, HEAD_DIM].

   FlashAttention's loop, laid out for a CPU's vector registers. The query rows that share a KV head (Q tokens x
   G heads of a group) sit one row per lane of a vector (16 lanes with AVX-512, 8 with AVX2): a score vector
   then holds one key's score for a vector's rows, and the online softmax (running max, rescale, running sum) is
   lane-wise arithmetic with no reduction across lanes. Keys and values are read KEYS = 16 positions at a time,
   in place through the block table: each score is HEAD_DIM fused multiply-adds of a query column by one
   broadcast key value, and each output column gathers broadcast values. Work items are (sequence, KV head, tile
   of rows), shared among the threads, so a single long chunk still uses every core, and the rows of a later
   chunk of positions are asked for while the current one is read (PF chunks ahead).
   Measured on a 2-core AMD EPYC (Zen 5), one layer of SmolLM2 (9 query heads, 3 KV heads of 64), every
   layer's pool in turn (so that keys and values come from memory, as in a step): a 32-token chunk after 1,024
   cached positions 0.32 ms, against 0.77 ms for the copy + SDPA; a 512-token chunk over 1,024 positions 3.2
   against 7.0 ms. 16 verify chunks of 5 tokens over 300 positions, one pool: 0.25 against 1.78 ms. Asking
   ahead took the verify chunks from 0.88 to 0.57 ms a layer out of cache. Built for AVX2 only (-march=znver3)
   on the same CPU, one pool: 0.53 ms (the 32-token chunk), 6.3 ms (the 512-token one) and 0.44 ms (the verify
   chunks), against 0.28, 3.3 and 0.25 for the AVX-512 build and 0.58, 7.1 and 1.38 for the copy + SDPA
   (those AVX2 figures are from before the two-vector tiles below).
   On a 2-core AMD EPYC of the Zen 3 generation (AVX2 only), one pool (in cache): the 32-token chunk 0.92 ms
   with two-vector tiles against 1.26 ms with the one-vector tiles that AVX-512 uses, the 512-token chunk 11.0
   against 13.7 ms. */
/* A vector of LANES floats (GCC's vector types): 16, one AVX-512 register, where the CPU has them; else 8, one
   AVX2 register. A tile is RT vectors of query rows (RT x LANES rows), and the register file decides the
   blocking. AVX-512's 32 registers hold a tile's 16 score vectors (16 keys) at once, so RT = 1. AVX2 has 16,
   so there a tile is two 8-row vectors: its scores are summed KB = 4 keys at a time (8 sums, the two query
   vectors and a broadcast key in registers) and its outputs PC = 4 columns at a time (8 sums, the two score
   vectors and a broadcast value). Each broadcast then feeds two multiply-adds instead of one, and the loads per
   multiply-add, which bound this loop on AVX2, drop from about 1.1 to 0.75. (16-float vectors on an AVX2 CPU
   would each take two of its 16 registers and spill: measured 10x slower.) */
#ifndef LANES /* -D flags may set these: the tests build the AVX-512 layouts on any CPU, to check their logic */
#ifdef __AVX512F__
#define LANES 16
#define RT 1  /* row vectors per tile */
#define KB 16 /* keys per score pass */
#define PC 8  /* output columns per pass */
#define WRT 3 /* the same for the wide tiles of long chunks (see WIDE) */
#define WKB 8
#define WPC 8
#else
#define LANES 8
#define RT 2
#define KB 4
#define PC 4
#define WRT 2 /* no wide tiles: 16 registers leave no room for a third row vector */
#define WKB 4
#define WPC 4
#endif
#endif
#ifndef WRT /* a layout given by -D flags without wide tiles has none */
#define WRT RT
#define WKB KB
#define WPC PC
#endif
typedef float vf __attribute__((vector_size(LANES * 4)));
typedef int32_t vi __attribute__((vector_size(LANES * 4)));
enum { KEYS = 16, RT_MAX = WRT > RT ? WRT : RT, KB_MAX = WKB > KB ? WKB : KB, PC_MAX = WPC > PC ? WPC : PC };
_Static_assert(KEYS % KB == 0 && HEAD_DIM % PC == 0 && KEYS % WKB == 0 && HEAD_DIM % WPC == 0,
               "the score and output passes must divide their loops");
/* Wide tiles, where a chunk's rows fill them (a prefill chunk, not a verify chunk): with AVX-512 a tile of three
   16-row vectors makes each broadcast key or value feed three multiply-adds, where a one-vector tile's loop is
   bound by those broadcast loads. The scores then take 8 keys at a time (24 sums) and the outputs 8 columns (24
   sums). On a 2-core Xeon with AMX, one layer of SmolLM2, pools from memory: a 32-token chunk over 1,056
   positions 0.41 ms against 0.48-0.55 ms with one-vector tiles, a 512-token chunk over 1,024 positions 3.9
   against 4.8 ms; 16 tokens over 300 positions 0.078 against 0.087. Below one wide tile of rows per KV head they
   lose (5 tokens over 300: 0.075 against 0.041 ms), as their spare lanes compute rows that are thrown away. */
#define WIDE (WRT > RT)
#ifndef PF
#define PF 1
#endif
enum { RING = PF > 0 ? PF : 1 }; /* chunks whose rows are known: the one in hand and PF - 1 more */
#define NEG_BIG (-1e30f) /* "cannot see": finite, since -ffast-math assumes no infinities */

/* Keep x in a vector register: reused by several multiply-adds, it is loaded once rather than folded into each
   as a memory operand (GCC's choice, which costs a load per multiply-add). */
#if defined(__AVX512F__) || (defined(__AVX__) && LANES == 8)
#define IN_REGISTER(x) __asm__("" : "+v"(x))
#else
#define IN_REGISTER(x) ((void)0)
#endif

static inline vf vmax(vf a, vf b) {
  const vi m = a > b;
  return (vf)(((vi)a & m) | ((vi)b & ~m));
}

/* Lane-wise expf, inline: a call (glibc's vector expf) would make the compiler spill the score vectors
   around it, since a call may overwrite every vector register. Cephes' expf: x = n ln2 + r with |r| <= ln2 / 2,
   a degree-7 polynomial in r, then times 2^n. Arguments below -87 give about 1e-38, not 0, which the sums
   cannot notice (every row's largest score contributes exp(0) = 1).
   With 16 AVX-512 lanes, n is rounded by one instruction (vrndscaleps) and 2^n applied by another
   (vscalefps), where the portable form takes five conversions and compares, and an integer shift and add, to do
   both: the same results bit for bit (they differ only where x log2(e) is exactly half-way, and then only in
   which n and r they pick), and the 32-token chunk over 1,056 positions went from 8.85-9.19 to 8.51-8.81 ms for
   the 30 layers on a 2-core Xeon with AMX. */
static inline vf vexp(vf x) {
  const vf lo = (vf){0} - 87.f;
  x = vmax(x, lo);
#if LANES == 16 && defined(__AVX512F__)
  const vf nf = (vf)_mm512_roundscale_ps((__m512)(x * 1.44269504088896341f),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
  const vf fx = x * 1.44269504088896341f + 0.5f;
  vi n = __builtin_convertvector(fx, vi); /* truncates toward zero: step down where that rounded up */
  n += __builtin_convertvector(n, vf) > fx; /* -1 in the lanes that rounded up */
  const vf nf = __builtin_convertvector(n, vf);
#endif
  const vf r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  vf p = (vf){0} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
#if LANES == 16 && defined(__AVX512F__)
  return (vf)_mm512_scalef_ps((__m512)p, (__m512)nf);
#else
  return p * (vf)((n + 127) << 23);
#endif
}

/* Where position t of a sequence keeps KV head h's values in a pool: its block's row, then the head. */
static inline size_t head_row(const int32_t *table, int t, int block_size, int h) {
  return ((size_t)table[t / block_size] * block_size + t % block_size) * ROW + (size_t)h * HEAD_DIM;
}

/* One work item: KV head h of sequence s, query rows r0 .. r0 + rt x LANES - 1 (rt row vectors), its scores kb
   keys and its outputs pc columns at a time. Always inlined with constant rt, kb and pc (RT, KB, PC or WRT, WKB,
   WPC), so that its arrays of sums are unrolled onto registers, as in f32_gemm.c. */
static inline __attribute__((always_inline)) void chunk_tile(const int rt, const int kb, const int pc,
                                                             const float *q, const float *kpool, const float *vpool,
                                                             const int32_t *tables, const int32_t *visible,
                                                             float *out, int Q, int block_size, int W, float scale,
                                                             int rows, int s, int h, int r0) {
  const int tile = rt * LANES;
  const int n_rows = rows - r0 < tile ? rows - r0 : tile;
  const int32_t *vis = visible + (size_t)s * Q, *table = tables + (size_t)s * W;
  vf qt[RT_MAX][HEAD_DIM], o[RT_MAX][HEAD_DIM], seen[RT_MAX], m[RT_MAX], l[RT_MAX];
  int lo = 1 << 30, hi = 0; /* fewest and most positions a row of the tile sees */
  for (int x = 0; x < tile; x++) { /* lanes past the last row repeat it; their results are dropped */
    const int r = r0 + (x < n_rows ? x : n_rows - 1), j = r / G, v = x / LANES, lane = x % LANES;
    const float *qr = q + (((size_t)s * Q + j) * HQ + h * G + r % G) * HEAD_DIM;
    for (int d = 0; d < HEAD_DIM; d++) qt[v][d][lane] = qr[d] * scale;
    seen[v][lane] = (float)vis[j];
    lo = vis[j] < lo ? vis[j] : lo;
    hi = vis[j] > hi ? vis[j] : hi;
  }
  for (int v = 0; v < rt; v++) {
    for (int d = 0; d < HEAD_DIM; d++) o[v][d] = (vf){0};
    m[v] = (vf){0} + NEG_BIG;
    l[v] = (vf){0};
  }
  /* The positions' rows, walked through the block table (no division per position: on Zen 3 an integer
     division costs as much as a score's multiply-adds). The ring holds the rows of the chunk in hand and of
     the next RING - 1; as a chunk is taken, its slot is refilled with the chunk RING ahead, whose rows are
     asked for then. Positions past `hi` repeat the last row. */
  const size_t last = head_row(table, hi - 1, block_size, h);
  int blk = 0, off = 0, walked = 0; /* the walk's next position: row off of the table's block blk */
  size_t ring[RING][KEYS];
  for (int t0 = -RING * KEYS, c = 0; t0 < hi; t0 += KEYS, c = c == RING - 1 ? 0 : c + 1) {
    const float *krow[KEYS], *vrow[KEYS];
    if (t0 >= 0)
      for (int i = 0; i < KEYS; i++) {
        krow[i] = kpool + ring[c][i];
        vrow[i] = vpool + ring[c][i];
      }
    for (int i = 0; i < KEYS; i++, walked++) { /* refill this slot with the chunk RING ahead */
      if (walked >= hi) {
        ring[c][i] = last;
        continue;
      }
      const size_t at = ((size_t)table[blk] * block_size + off) * ROW + (size_t)h * HEAD_DIM;
      ring[c][i] = at;
      if (PF > 0 && t0 >= 0) /* the first chunks' rows are asked for by their first reads */
        for (int e = 0; e < HEAD_DIM; e += 16) {
          __builtin_prefetch(kpool + at + e);
          __builtin_prefetch(vpool + at + e);
        }
      if (++off == block_size) {
        off = 0;
        blk++;
      }
    }
    if (t0 < 0)
      continue;
    vf sc[RT_MAX][KEYS];
    for (int i0 = 0; i0 < KEYS; i0 += kb) {
      vf acc[RT_MAX][KB_MAX];
      for (int v = 0; v < rt; v++)
        for (int i = 0; i < kb; i++) acc[v][i] = (vf){0};
      for (int d = 0; d < HEAD_DIM; d++) {
        vf qd[RT_MAX];
        for (int v = 0; v < rt; v++) {
          qd[v] = qt[v][d];
          IN_REGISTER(qd[v]);
        }
        for (int i = 0; i < kb; i++) {
          const float k = krow[i0 + i][d];
          for (int v = 0; v < rt; v++) acc[v][i] += qd[v] * k;
        }
      }
      for (int v = 0; v < rt; v++)
        for (int i = 0; i < kb; i++) sc[v][i0 + i] = acc[v][i];
    }
    vf alpha[RT_MAX];
    for (int v = 0; v < rt; v++) {
      if (t0 + KEYS > lo)
        for (int i = 0; i < KEYS; i++) {
          const vi ok = ((vf){0} + (float)(t0 + i)) < seen[v];
          sc[v][i] = (vf)(((vi)sc[v][i] & ok) | ((vi)((vf){0} + NEG_BIG) & ~ok));
        }
      vf mx = m[v];
      for (int i = 0; i < KEYS; i++) mx = vmax(mx, sc[v][i]);
      alpha[v] = vexp(m[v] - mx);
      m[v] = mx;
      l[v] *= alpha[v];
      for (int i = 0; i < KEYS; i++) {
        sc[v][i] = vexp(sc[v][i] - mx);
        l[v] += sc[v][i];
      }
    }
    for (int d0 = 0; d0 < HEAD_DIM; d0 += pc) { /* rt x pc independent sums: the multiply-adds do not queue */
      vf acc[RT_MAX][PC_MAX];
      for (int v = 0; v < rt; v++)
        for (int e = 0; e < pc; e++) acc[v][e] = o[v][d0 + e] * alpha[v];
      for (int i = 0; i < KEYS; i++) {
        vf p[RT_MAX];
        for (int v = 0; v < rt; v++) {
          p[v] = sc[v][i];
          IN_REGISTER(p[v]);
        }
        for (int e = 0; e < pc; e++) {
          const float x = vrow[i][d0 + e];
          for (int v = 0; v < rt; v++) acc[v][e] += p[v] * x;
        }
      }
      for (int v = 0; v < rt; v++)
        for (int e = 0; e < pc; e++) o[v][d0 + e] = acc[v][e];
    }
  }
  for (int x = 0; x < n_rows; x++) {
    const int r = r0 + x, v = x / LANES, lane = x % LANES;
    float *orow = out + (((size_t)s * Q + r / G) * HQ + h * G + r % G) * HEAD_DIM;
    const float inv = 1.f / l[v][lane];
    for (int d = 0; d < HEAD_DIM; d++) orow[d] = o[v][d][lane] * inv;
  }
}

void paged_chunk_f32(const float *q, const float *kpool, const float *vpool, const int32_t *tables,
                    const int32_t *visible, float *out, int S, int Q, int block_size, int W, float scale) {
  const int rows = Q * G; /* row r of a KV head: token r / G, head r % G */
  const int wide = WIDE && rows >= WRT * LANES, tile = (wide ? WRT : RT) * LANES, tiles = (rows + tile - 1) / tile;
  const int items = S * HKV * tiles;
#pragma omp parallel for schedule(dynamic, 1)
  for (int item = 0; item < items; item++) {
    const int s = item / (HKV * tiles), h = item / tiles % HKV, r0 = item % tiles * tile;
#if WIDE
    if (wide) {
      chunk_tile(WRT, WKB, WPC, q, kpool, vpool, tables, visible, out, Q, block_size, W, scale, rows, s, h, r0);
      continue;
    }
#endif
    chunk_tile(RT, KB, PC, q, kpool, vpool, tables, visible, out, Q, block_size, W, scale, rows, s, h, r0);
  }
}
