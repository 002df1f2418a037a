"""The C fp32 product on a packed weight (csrc/f32_gemm.c, form "c_f32") against a float64 reference, in this CPU's
build and in the AVX2 build other CPUs get, with the row counts that exercise every tail of its 8- (or 6-) row
blocks, and its refusals."""
import ctypes

import pytest
import torch
import torch.nn.functional as F

from mini_engine.backends.cpu import cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels.f32_panel() is None,
                                reason="the C fp32 kernel needs a C compiler and an x86 CPU with AVX2")
ROWS = [1, 2, 5, 6, 7, 8, 9, 13, 16, 31, 64, 130]


def reference(x, w):
    return (x.double() @ w.double().T).float()


@pytest.mark.parametrize("k", [1, 37, 576])
def test_the_kernel_matches_the_reference_at_every_row_tail(k):
    g = torch.Generator().manual_seed(k)
    panel = cpu_kernels.f32_panel()
    w = torch.randn(3 * panel, k, generator=g)
    packed = cpu_kernels.f32_pack(w)
    assert packed.shape == (3, k, panel)
    for rows in ROWS:
        x = torch.randn(rows, k, generator=g)
        torch.testing.assert_close(cpu_kernels.f32_gemm(x, packed), reference(x, w), rtol=1e-5, atol=1e-4,
                                   msg=lambda m: f"{rows} rows, k={k}: {m}")


def test_the_avx2_build_matches_the_reference():
    """A CPU without AVX-512 builds the 16-row panels and 6-row blocks: built that way here too, and checked."""
    lib = ctypes.CDLL(str(cpu_kernels.build("f32_gemm", {"AVX2_ONLY": 1})))
    lib.f32_gemm_f32.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 3
    assert lib.f32_gemm_panel() == 16
    g = torch.Generator().manual_seed(1)
    w = torch.randn(48, 83, generator=g)
    packed = w.view(3, 16, 83).transpose(1, 2).contiguous()
    for rows in ROWS:
        x = torch.randn(rows, 83, generator=g)
        y = torch.empty(rows, 48)
        assert lib.f32_gemm_f32(x.data_ptr(), packed.data_ptr(), y.data_ptr(), rows, 48, 83) == 0
        torch.testing.assert_close(y, reference(x, w), rtol=1e-5, atol=1e-4, msg=lambda m: f"{rows} rows: {m}")
    assert lib.f32_gemm_f32(x.data_ptr(), packed.data_ptr(), y.data_ptr(), rows, 40, 83) == -1, \
        "a weight whose rows do not fill whole panels must be refused"


def test_the_model_shapes_give_f_linears_result():
    """The SmolLM2 products (fused q/k/v, o, fused gate/up, down) at a decode batch's and a prefill chunk's rows."""
    g = torch.Generator().manual_seed(2)
    for n, k in [(960, 576), (576, 576), (3072, 576), (576, 1536)]:
        w = torch.randn(n, k, generator=g) * 0.05
        packed = cpu_kernels.f32_pack(w)
        for rows in (16, 32):
            x = torch.randn(rows, k, generator=g)
            torch.testing.assert_close(cpu_kernels.f32_gemm(x, packed), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_bad_inputs_are_refused_by_name():
    panel = cpu_kernels.f32_panel()
    w = torch.randn(panel, 32)
    packed = cpu_kernels.f32_pack(w)
    assert cpu_kernels.f32_gemm(torch.randn(0, 32), packed).shape == (0, panel)
    with pytest.raises(ValueError, match="f32_pack"):
        cpu_kernels.f32_pack(torch.randn(panel + 1, 32))
    with pytest.raises(ValueError, match="f32_pack"):
        cpu_kernels.f32_pack(w.bfloat16())
    with pytest.raises(ValueError, match="activations"):
        cpu_kernels.f32_gemm(torch.randn(2, 31), packed)
    with pytest.raises(ValueError, match="activations"):
        cpu_kernels.f32_gemm(torch.randn(2, 32, dtype=torch.float64), packed)
    with pytest.raises(ValueError, match="f32_pack"):
        cpu_kernels.f32_gemm(torch.randn(2, 32), w)  # a weight that was never packed
    assert not cpu_kernels.f32_gemm_supported(panel + 1)


def test_a_large_packed_weight_starts_on_a_huge_page_and_holds_the_panels():
    """f32_pack puts a weight of 2 MiB or more on a 2 MiB boundary (advised as huge-page memory on Linux), and the
    panels are the weight's rows column after column, as a small weight's are."""
    panel = cpu_kernels.f32_panel()
    for rows, k in ((2 * panel, 40), (64 * panel, 576)):  # 15 KB, and 7 MB (the model's gate/up product)
        w = torch.randn(rows, k)
        packed = cpu_kernels.f32_pack(w)
        assert torch.equal(packed, w.view(rows // panel, panel, k).transpose(1, 2)) and packed.is_contiguous()
        if w.nbytes >= cpu_kernels.HUGE_PAGE and cpu_kernels._madvise() is not None:
            assert packed.data_ptr() % cpu_kernels.HUGE_PAGE == 0
        x = torch.randn(3, k)
        torch.testing.assert_close(cpu_kernels.f32_gemm(x, packed), reference(x, w), rtol=1e-5, atol=1e-4)
    for numel in (1, 1000, 3 << 20):
        t = cpu_kernels.huge_page_empty(numel)
        assert t.shape == (numel,) and t.dtype == torch.float32
