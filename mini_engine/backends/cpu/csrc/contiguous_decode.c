/* Decode attention on a CPU, read in place from the contiguous KV cache (`kv_cache.ContiguousKVCache`): one new
   query token per sequence. The head counts and head size are arguments, not compile-time constants, so that
   one build serves every model: both the ctypes wrapper (`cpu_kernels.contiguous_decode`, eager steps) and the
   C++ operator that compiled steps call (torch_ops.cpp) link this file.

   Layouts (fp32, contiguous):
     q       [S, HQ, HEAD_DIM]                       query head j reads KV head j / (HQ / HKV) (GQA)
     kc, vc  [num_slots, HKV, max_len, HEAD_DIM]     one layer's keys, and its values
     slots   [S] int32                               the slot each sequence reads
     lens    [S] int32                               context length of each sequence
     out     [S, HQ, HEAD_DIM] */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "softmax_row.h"

/* Work items are (sequence, KV head): the G query heads that share a KV head read its keys and values once, one
   pass for the scores, one for the weighted sum. The PyTorch path slices the cache and calls SDPA, whose fixed
   cost dominates a short decode: on a 2-core AMD EPYC (Zen 3), one layer of SmolLM2 at one sequence of about
   100 positions, about 60 us in SDPA alone, where the work is about 0.1 MFLOP.
   Returns 0; -1 when a scratch buffer could not be allocated (out is then incomplete); -2, before reading
   anything, when a slot lies outside [0, num_slots), a length outside [1, max_len], or HQ is not a multiple of
   HKV. Checked here, in one pass over S entries: the same checks in PyTorch ops cost more than the attention. */
int contiguous_decode_f32(const float *q, const float *kc, const float *vc, const int32_t *slots,
                          const int32_t *lens, float *out, int S, int num_slots, int max_len, int HQ, int HKV,
                          int HEAD_DIM, float scale) {
  if (HQ % HKV) return -2;
  for (int s = 0; s < S; s++)
    if (slots[s] < 0 || slots[s] >= num_slots || lens[s] < 1 || lens[s] > max_len) return -2;
  const int G = HQ / HKV;
  const size_t head = (size_t)max_len * HEAD_DIM;
  int failed = 0;
#pragma omp parallel reduction(| : failed)
  {
    int cap = 0;
    float *scores = NULL; /* [G][len] */
#pragma omp for schedule(static)
    for (int item = 0; item < S * HKV; item++) {
      const int s = item / HKV, h = item % HKV, len = lens[s];
      if (len > cap) {
        free(scores);
        cap = len;
        scores = malloc(sizeof(float) * (size_t)cap * G);
        if (!scores) { cap = 0; failed = 1; continue; }
      }
      const float *kh = kc + ((size_t)slots[s] * HKV + h) * head, *vh = vc + ((size_t)slots[s] * HKV + h) * head;
      const float *qh = q + ((size_t)s * HQ + (size_t)h * G) * HEAD_DIM;
      float *o = out + ((size_t)s * HQ + (size_t)h * G) * HEAD_DIM;
      for (int t = 0; t < len; t++) { /* pass 1: scores */
        const float *k = kh + (size_t)t * HEAD_DIM;
        for (int g = 0; g < G; g++) {
          const float *qg = qh + g * HEAD_DIM;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int d = 0; d < HEAD_DIM; d++) dot += qg[d] * k[d];
          scores[(size_t)g * len + t] = dot * scale;
        }
      }
      float inv[G]; /* G is small (query heads per KV head) */
      for (int g = 0; g < G; g++) { /* softmax of each head's row */
        inv[g] = softmax_row(scores + (size_t)g * len, len);
        for (int d = 0; d < HEAD_DIM; d++) o[g * HEAD_DIM + d] = 0.f;
      }
      for (int t = 0; t < len; t++) { /* pass 2: the weighted sum of the values */
        const float *v = vh + (size_t)t * HEAD_DIM;
        for (int g = 0; g < G; g++) {
          const float p = scores[(size_t)g * len + t];
          float *og = o + g * HEAD_DIM;
#pragma omp simd
          for (int d = 0; d < HEAD_DIM; d++) og[d] += p * v[d];
        }
      }
      for (int g = 0; g < G; g++)
        for (int d = 0; d < HEAD_DIM; d++) o[g * HEAD_DIM + d] *= inv[g];
    }
    free(scores);
  }
  return failed ? -1 : 0;
}
