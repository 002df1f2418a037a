// The int4 and int8 product kernels (int4_gemm.c, int8_gemm.c and their AMX twins, int4_gemm_amx.c and
// int8_gemm_amx.c) and the contiguous cache's decode attention (contiguous_decode.c) as PyTorch operators written
// in C++, for torch.compile graphs: `torch.ops.mini_engine_cpp.int4_gemm`, `.int4_gemm_amx`, `.int8_gemm`,
// `.int8_gemm_amx` and `.contiguous_decode`; and, for eager steps, the fp32 product (f32_gemm.c: `.f32_gemm`) and
// the small operations of a layer (layer_ops.c: `.rms_norm`, `.silu_mul`, `.rope`, `.store_rows`).
//
// Why: a graph calls an operator through the dispatcher. The same kernels registered from Python
// (`mini_engine::int4_gemm`, mini_engine/quant) make each call box its arguments into Python objects, run the ctypes
// wrapper and come back: on a 2-core AMD EPYC (Zen 3), 47.6 us a call against 24.3 us for the kernel itself, on
// each of the 120 int4 products of a decode step (and about 70 us against 12 us for each layer's attention).
// Registered here, a call costs the dispatcher's few microseconds and no Python. Built on first use by
// cpu_kernels.load_torch_ops; where it cannot be built, the Python-registered operators run instead.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

extern "C" {
int int4_gemm_f32(const float *x, const uint8_t *packed, const void *sz, float *y, int M, int N, int K, int GS,
                  int BN, int compact);
int int4_gemm_amx_f32(const float *x, const uint8_t *packed, const void *sz, float *y, int M, int N, int K,
                      int GS, int BN, int compact);
int int8_gemm_f32(const float *x, const int8_t *q, const uint16_t *sbits, float *y, int M, int N, int K);
int f32_gemm_f32(const float *x, const float *wp, float *y, int M, int N, int K);
int f32_gemm_panel(void);
int int8_gemm_amx_f32(const float *x, const int8_t *q, const uint16_t *sbits, float *y, int M, int N, int K);
int contiguous_decode_f32(const float *q, const float *kc, const float *vc, const int32_t *slots, const int32_t *lens,
                          float *out, int S, int num_slots, int max_len, int HQ, int HKV, int HEAD_DIM, float scale);
void rms_norm_f32(const float *x, const float *w, float *out, int T, int H, long stride, float eps);
void silu_mul_f32(const float *gate_up, float *out, int T, int I, long stride);
void rope_f32(const float *x, const float *cos_t, const float *sin_t, float *out, int T, int NH, int D, long stride);
void store_rows_f32(const float *k, const float *v, float *k_rows, float *v_rows, const int32_t *rows, int T, int W,
                    long k_stride, long v_stride);
}

namespace {

void check_activations(const at::Tensor &x, const char *op) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2, op,
              " needs fp32 CPU activations [M, K], got ", x.scalar_type(), " of ", x.dim(), " dims on ", x.device());
}

using Int4Kernel = int (*)(const float *, const uint8_t *, const void *, float *, int, int, int, int, int, int);

template <Int4Kernel kernel>
at::Tensor int4_gemm(const at::Tensor &x, const at::Tensor &packed, const at::Tensor &scales, int64_t n,
                     int64_t group_size, int64_t block_n) {
  check_activations(x, "int4_gemm");
  const int64_t m = x.size(0), k = x.size(1);
  // scales: bf16 [K / GS, n, 2] scales and zeros, or the compact int16 form (quant.compact_scales)
  const bool compact = scales.scalar_type() == at::kShort;
  TORCH_CHECK(packed.numel() == n * k / 2 && packed.is_contiguous() &&
                  (compact ? scales.dim() == 1 && scales.numel() == k / group_size * n + 4 * n
                           : scales.scalar_type() == at::kBFloat16 && scales.dim() == 3 &&
                                 scales.size(0) == k / group_size && scales.size(1) == n && scales.size(2) == 2),
              "int4_gemm: packed must hold ", n, " x ", k, " codes and scales be bf16 [", k / group_size, ", ", n,
              ", 2] or compact int16 [", k / group_size * n + 4 * n, "]");
  const at::Tensor xc = x.contiguous(), sc = scales.contiguous();
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  const int status = kernel(xc.data_ptr<float>(), static_cast<const uint8_t *>(packed.data_ptr()),
                            sc.data_ptr(), y.data_ptr<float>(), (int)m, (int)n, (int)k, (int)group_size,
                            (int)block_n, (int)compact);
  TORCH_CHECK(status != -2, "int4_gemm: the kernel could not allocate its scratch buffer");
  TORCH_CHECK(status != -3, "int4_gemm: this CPU or operating system does not allow AMX");
  TORCH_CHECK(status == 0, "int4_gemm does not take block_n=", block_n, ", n=", n, ", k=", k, ", group_size=",
              group_size);
  return y;
}

using Int8Kernel = int (*)(const float *, const int8_t *, const uint16_t *, float *, int, int, int);

template <Int8Kernel kernel>
at::Tensor int8_gemm(const at::Tensor &x, const at::Tensor &q, const at::Tensor &scales) {
  check_activations(x, "int8_gemm");
  const int64_t m = x.size(0), k = x.size(1), n = q.size(0);
  TORCH_CHECK(q.scalar_type() == at::kChar && q.dim() == 2 && q.size(1) == k &&
                  scales.scalar_type() == at::kBFloat16 && scales.numel() == n,
              "int8_gemm: q must be int8 [N, ", k, "] and scales bf16 [N]");
  const at::Tensor qc = q.contiguous(), sc = scales.contiguous(), xc = x.contiguous();
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  const int status = kernel(xc.data_ptr<float>(), qc.data_ptr<int8_t>(), static_cast<const uint16_t *>(sc.data_ptr()),
                            y.data_ptr<float>(), (int)m, (int)n, (int)k);
  TORCH_CHECK(status != -2, "int8_gemm: the kernel could not allocate its scratch buffer");
  TORCH_CHECK(status != -3, "int8_gemm: this CPU or operating system does not allow AMX");
  TORCH_CHECK(status == 0, "int8_gemm does not take n=", n, ", k=", k);
  return y;
}

// The fp32 product on a weight packed by cpu_kernels.f32_pack ([N / P, K, P]). Eager steps call it 121 times each
// (decode) and the Python wrapper's checks and ctypes call cost more than the dispatcher's one call; the checks
// are the same here, raised as ValueError.
at::Tensor f32_gemm(const at::Tensor &x, const at::Tensor &packed) {
  TORCH_CHECK_VALUE(packed.dim() == 3, "f32_gemm: packed must come from f32_pack ([N / P, K, P]), got ",
                    packed.sizes());
  const int64_t panels = packed.size(0), k = packed.size(1), panel = packed.size(2);
  TORCH_CHECK_VALUE(x.scalar_type() == at::kFloat && x.device().is_cpu() && x.dim() == 2 && x.size(1) == k,
                    "f32_gemm needs fp32 CPU activations [M, ", k, "], got ", x.scalar_type(), " ", x.sizes(), " on ",
                    x.device());
  TORCH_CHECK_VALUE(panel == f32_gemm_panel() && packed.scalar_type() == at::kFloat && packed.is_contiguous(),
                    "f32_gemm: packed must come from f32_pack (panels of ", f32_gemm_panel(), " rows), got ",
                    packed.scalar_type(), " ", packed.sizes());
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({x.size(0), panels * panel}, x.options());
  if (x.size(0) == 0) return y;
  TORCH_CHECK_VALUE(f32_gemm_f32(xc.data_ptr<float>(), packed.data_ptr<float>(), y.data_ptr<float>(), (int)x.size(0),
                                 (int)(panels * panel), (int)k) == 0,
                    "f32_gemm does not take k=", k, ", n=", panels * panel);
  return y;
}

at::Tensor contiguous_decode(const at::Tensor &q, const at::Tensor &k_cache, const at::Tensor &v_cache,
                             const at::Tensor &slots, const at::Tensor &context_lens) {
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kFloat && q.dim() == 3 &&
                  k_cache.scalar_type() == at::kFloat && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.is_contiguous() && v_cache.is_contiguous() && q.size(2) == k_cache.size(3),
              "contiguous_decode needs fp32 q [S, Hq, D] and contiguous fp32 caches [slots, Hkv, max_len, D]");
  const int64_t s = q.size(0);
  TORCH_CHECK(slots.numel() == s && context_lens.numel() == s,
              "contiguous_decode: slots and context_lens need one entry per sequence");
  const at::Tensor qc = q.contiguous(), sl = slots.to(at::kInt).contiguous(),
                   lens = context_lens.to(at::kInt).contiguous();
  at::Tensor out = at::empty_like(qc);
  if (s == 0) return out;
  const int status = contiguous_decode_f32(
      qc.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), sl.data_ptr<int32_t>(),
      lens.data_ptr<int32_t>(), out.data_ptr<float>(), (int)s, (int)k_cache.size(0), (int)k_cache.size(2),
      (int)q.size(1), (int)k_cache.size(1), (int)q.size(2), 1.0f / std::sqrt((float)q.size(2)));
  TORCH_CHECK(status != -1, "contiguous_decode: the kernel could not allocate its scratch buffer");
  TORCH_CHECK(status == 0, "contiguous_decode: slots must lie in [0, ", k_cache.size(0), "), context_lens in [1, ",
              k_cache.size(2), "], and Hq be a multiple of Hkv");
  return out;
}

// The layer's small operations (layer_ops.c). Their 2-D inputs may be views whose rows lie further apart than
// their width (a split of a fused product's output), as long as each row's values are contiguous.
void check_rows(const at::Tensor &x, const char *op) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1 &&
                  x.stride(0) >= x.size(1),
              op, " needs fp32 CPU rows [T, H], each contiguous, got ", x.scalar_type(), " of sizes ", x.sizes(),
              " and strides ", x.strides(), " on ", x.device());
}

at::Tensor rms_norm(const at::Tensor &x, const at::Tensor &weight, double eps) {
  check_rows(x, "rms_norm");
  const int64_t t = x.size(0), h = x.size(1);
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.dim() == 1 && weight.size(0) == h && weight.is_contiguous(),
              "rms_norm: weight must be a contiguous fp32 [", h, "]");
  at::Tensor out = at::empty({t, h}, x.options());
  rms_norm_f32(x.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(), (int)t, (int)h, (long)x.stride(0),
               (float)eps);
  return out;
}

at::Tensor silu_mul(const at::Tensor &gate_up) {
  check_rows(gate_up, "silu_mul");
  const int64_t t = gate_up.size(0), i = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_mul: gate_up must hold gate then up, an even width, got ",
              gate_up.size(1));
  at::Tensor out = at::empty({t, i}, gate_up.options());
  silu_mul_f32(gate_up.data_ptr<float>(), out.data_ptr<float>(), (int)t, (int)i, (long)gate_up.stride(0));
  return out;
}

at::Tensor rope(const at::Tensor &x, const at::Tensor &cos, const at::Tensor &sin, int64_t heads) {
  check_rows(x, "rope");
  const int64_t t = x.size(0);
  TORCH_CHECK(heads > 0 && x.size(1) % heads == 0 && (x.size(1) / heads) % 2 == 0,
              "rope: the rows' width ", x.size(1), " must be heads (", heads, ") x an even head size");
  const int64_t d = x.size(1) / heads;
  for (const at::Tensor *table : {&cos, &sin})
    TORCH_CHECK(table->scalar_type() == at::kFloat && table->numel() == t * d && table->size(0) == t &&
                    table->size(-1) == d && table->is_contiguous(),
                "rope: cos and sin must be contiguous fp32 [", t, ", ", d, "] (or [", t, ", 1, ", d, "])");
  at::Tensor out = at::empty({t, heads, d}, x.options());
  rope_f32(x.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), out.data_ptr<float>(), (int)t,
           (int)heads, (int)d, (long)x.stride(0));
  return out;
}

void store_rows(const at::Tensor &k, const at::Tensor &v, at::Tensor k_rows, at::Tensor v_rows,
                const at::Tensor &rows) {
  TORCH_CHECK(k_rows.scalar_type() == at::kFloat && k_rows.device().is_cpu() && k_rows.is_contiguous() &&
                  v_rows.sizes() == k_rows.sizes() && v_rows.scalar_type() == at::kFloat && v_rows.is_contiguous() &&
                  k_rows.dim() == 3,
              "store_rows: k_rows and v_rows must be contiguous fp32 CPU caches [rows, kv heads, head size] of "
              "one shape");
  const int64_t t = k.size(0), r = k_rows.size(0), w = k_rows.size(1) * k_rows.size(2);
  for (const at::Tensor *x : {&k, &v})
    TORCH_CHECK(x->scalar_type() == at::kFloat && x->device().is_cpu() && x->dim() == 3 && x->size(0) == t &&
                    x->size(1) == k_rows.size(1) && x->size(2) == k_rows.size(2) && x->stride(2) == 1 &&
                    x->stride(1) == k_rows.size(2),
                "store_rows: k and v must be fp32 [", t, ", ", k_rows.size(1), ", ", k_rows.size(2),
                "], each token's values contiguous");
  TORCH_CHECK(rows.scalar_type() == at::kInt && rows.dim() == 1 && rows.size(0) == t && rows.is_contiguous(),
              "store_rows: rows must be int32 [", t, "]");
  const int32_t *idx = rows.data_ptr<int32_t>();
  for (int64_t i = 0; i < t; i++)  // before any write: a bad row writes nothing
    TORCH_CHECK(idx[i] >= 0 && idx[i] < r, "store_rows: rows must lie in [0, ", r, "), got ", idx[i]);
  store_rows_f32(k.data_ptr<float>(), v.data_ptr<float>(), k_rows.data_ptr<float>(), v_rows.data_ptr<float>(), idx,
                 (int)t, (int)w, (long)k.stride(0), (long)v.stride(0));
}

}  // namespace

TORCH_LIBRARY(mini_engine_cpp, m) {
  m.def("int4_gemm(Tensor x, Tensor packed, Tensor scales, int n, int group_size, int block_n) -> Tensor");
  m.def("int4_gemm_amx(Tensor x, Tensor packed, Tensor scales, int n, int group_size, int block_n) -> Tensor");
  m.def("int8_gemm(Tensor x, Tensor q, Tensor scales) -> Tensor");
  m.def("int8_gemm_amx(Tensor x, Tensor q, Tensor scales) -> Tensor");
  m.def("f32_gemm(Tensor x, Tensor packed) -> Tensor");
  m.impl("f32_gemm", c10::DispatchKey::CPU, TORCH_FN(f32_gemm));
  m.def("contiguous_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, Tensor context_lens) -> Tensor");
  m.impl("int4_gemm", c10::DispatchKey::CPU, TORCH_FN(int4_gemm<int4_gemm_f32>));
  m.impl("int4_gemm_amx", c10::DispatchKey::CPU, TORCH_FN(int4_gemm<int4_gemm_amx_f32>));
  m.impl("int8_gemm", c10::DispatchKey::CPU, TORCH_FN(int8_gemm<int8_gemm_f32>));
  m.impl("int8_gemm_amx", c10::DispatchKey::CPU, TORCH_FN(int8_gemm<int8_gemm_amx_f32>));
  m.impl("contiguous_decode", c10::DispatchKey::CPU, TORCH_FN(contiguous_decode));
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("rope(Tensor x, Tensor cos, Tensor sin, int heads) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(rms_norm));
  m.impl("silu_mul", c10::DispatchKey::CPU, TORCH_FN(silu_mul));
  m.impl("rope", c10::DispatchKey::CPU, TORCH_FN(rope));
  m.def("store_rows(Tensor k, Tensor v, Tensor(a!) k_rows, Tensor(b!) v_rows, Tensor rows) -> ()");
  m.impl("store_rows", c10::DispatchKey::CPU, TORCH_FN(store_rows));
}
