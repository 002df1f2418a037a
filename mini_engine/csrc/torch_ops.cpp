// The int4 and int8 product kernels (int4_gemm.c, int8_gemm.c) as PyTorch operators written in C++, for
// torch.compile graphs: `torch.ops.mini_engine_cpp.int4_gemm` and `.int8_gemm`.
//
// Why: a graph calls an operator through the dispatcher. The same kernels registered from Python
// (`mini_engine::int4_gemm`, quant.py) make each call box its arguments into Python objects, run the ctypes
// wrapper and come back: on a 2-core AMD EPYC (Zen 3), 47.6 us a call against 24.3 us for the kernel itself, on
// each of the 120 int4 products of a decode step. Registered here, a call costs the dispatcher's few
// microseconds and no Python. Built on first use by cpu_kernels.load_torch_ops; where it cannot be built, the
// Python-registered operators run instead.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>

extern "C" {
int int4_gemm_f32(const float *x, const uint8_t *packed, const uint32_t *sz, float *y, int M, int N, int K, int GS,
                  int BN);
int int8_gemm_f32(const float *x, const int8_t *q, const uint16_t *sbits, float *y, int M, int N, int K);
}

namespace {

void check_activations(const at::Tensor &x, const char *op) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2, op,
              " needs fp32 CPU activations [M, K], got ", x.scalar_type(), " of ", x.dim(), " dims on ", x.device());
}

at::Tensor int4_gemm(const at::Tensor &x, const at::Tensor &packed, const at::Tensor &scales, int64_t n,
                     int64_t group_size, int64_t block_n) {
  check_activations(x, "int4_gemm");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(packed.numel() == n * k / 2 && packed.is_contiguous() && scales.scalar_type() == at::kBFloat16 &&
                  scales.dim() == 3 && scales.size(0) == k / group_size && scales.size(1) == n && scales.size(2) == 2,
              "int4_gemm: packed must hold ", n, " x ", k, " codes and scales be bf16 [", k / group_size, ", ", n,
              ", 2]");
  const at::Tensor xc = x.contiguous(), sc = scales.contiguous();
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  const int status = int4_gemm_f32(xc.data_ptr<float>(), static_cast<const uint8_t *>(packed.data_ptr()),
                                   static_cast<const uint32_t *>(sc.data_ptr()), y.data_ptr<float>(), (int)m, (int)n,
                                   (int)k, (int)group_size, (int)block_n);
  TORCH_CHECK(status != -2, "int4_gemm: the kernel could not allocate its scratch buffer");
  TORCH_CHECK(status == 0, "int4_gemm does not take block_n=", block_n, ", n=", n, ", k=", k, ", group_size=",
              group_size);
  return y;
}

at::Tensor int8_gemm(const at::Tensor &x, const at::Tensor &q, const at::Tensor &scales) {
  check_activations(x, "int8_gemm");
  const int64_t m = x.size(0), k = x.size(1), n = q.size(0);
  TORCH_CHECK(q.scalar_type() == at::kChar && q.dim() == 2 && q.size(1) == k && scales.scalar_type() == at::kBFloat16 &&
                  scales.numel() == n,
              "int8_gemm: q must be int8 [N, ", k, "] and scales bf16 [N]");
  const at::Tensor qc = q.contiguous(), sc = scales.contiguous(), xc = x.contiguous();
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  const int status = int8_gemm_f32(xc.data_ptr<float>(), qc.data_ptr<int8_t>(),
                                   static_cast<const uint16_t *>(sc.data_ptr()), y.data_ptr<float>(), (int)m, (int)n,
                                   (int)k);
  TORCH_CHECK(status == 0, "int8_gemm does not take n=", n, ", k=", k, " (n must be a multiple of 4, k of 8)");
  return y;
}

}  // namespace

TORCH_LIBRARY(mini_engine_cpp, m) {
  m.def("int4_gemm(Tensor x, Tensor packed, Tensor scales, int n, int group_size, int block_n) -> Tensor");
  m.def("int8_gemm(Tensor x, Tensor q, Tensor scales) -> Tensor");
  m.impl("int4_gemm", c10::DispatchKey::CPU, TORCH_FN(int4_gemm));
  m.impl("int8_gemm", c10::DispatchKey::CPU, TORCH_FN(int8_gemm));
}
