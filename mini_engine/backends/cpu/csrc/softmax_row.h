/* Shared by the decode kernels (paged_decode.c, contiguous_decode.c). */
#ifndef MINI_ENGINE_SOFTMAX_ROW_H
#define MINI_ENGINE_SOFTMAX_ROW_H
#include <math.h>

/* One head's scores [len] become exp(score - max) in place; returns 1 / their sum, which the kernels apply once
   to the output row instead of to every probability. */
static inline float softmax_row(float *sc, int len) {
  float m = sc[0], sum = 0.f;
  for (int t = 1; t < len; t++) m = sc[t] > m ? sc[t] : m;
#pragma omp simd reduction(+ : sum)
  for (int t = 0; t < len; t++) {
    const float e = expf(sc[t] - m);
    sc[t] = e;
    sum += e;
  }
  return 1.f / sum;
}
#endif
