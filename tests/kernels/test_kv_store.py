"""Writing a step's keys and values into the paged cache through its slot mapping.

The caches start as NaN, so a slot the kernel should have written stands out, and so does a slot it
should have left alone (slot -1, or any slot not in the mapping) but wrote anyway.
"""
import pytest
import torch

from mini_engine.kernels import paged_decode_attention, paged_decode_attention_reference, store_kv_cache
from mini_engine.kernels.kv_store import store_kv_cache_reference


def rand(*shape, device, dtype=torch.float32, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(*shape, generator=gen, device=device).to(dtype)


def poisoned_caches(num_blocks, block_size, heads, head_dim, device, dtype=torch.float32):
    k_cache = torch.full((num_blocks, block_size, heads, head_dim), float("nan"), dtype=dtype, device=device)
    return k_cache, torch.full_like(k_cache, float("nan"))


def random_slots(num_tokens, num_slots, device, skip=(), seed=0):
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens].int()
    slots[list(skip)] = -1
    return slots.to(device)


def assert_same_with_nan(a, b):
    assert torch.equal(a.isnan(), b.isnan()), "written / untouched slots differ from the reference"
    assert torch.equal(a.nan_to_num(), b.nan_to_num())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, head_dim", [(3, 16), (4, 32)])
def test_writes_each_token_to_its_slot_and_nothing_else(heads, head_dim, dtype, device):
    k, v = rand(11, heads, head_dim, device=device, dtype=dtype, seed=1), rand(11, heads, head_dim, device=device,
                                                                               dtype=dtype, seed=2)
    slots = random_slots(11, 6 * 4, device, skip=(0, 7))
    k_cache, v_cache = poisoned_caches(6, 4, heads, head_dim, device, dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv_cache(k, v, k_cache, v_cache, slots)
    store_kv_cache_reference(k, v, k_ref, v_ref, slots)
    assert_same_with_nan(k_cache, k_ref)
    assert_same_with_nan(v_cache, v_ref)
    # By hand, for one token: slot = block * block_size + offset.
    slot = slots[3].item()
    assert torch.equal(k_cache[slot // 4, slot % 4], k[3])
    assert k_cache.isnan().flatten(0, 1).all(dim=(1, 2)).sum() == 6 * 4 - 9, "slot -1 means: store nothing"


def test_keys_and_values_as_views_of_a_fused_projection(device):
    # k and v sliced out of one [T, (Hq + 2 Hkv), D] projection: token stride (Hq + 2 Hkv) * D.
    qkv = rand(5, 4 + 2 * 2, 16, device=device)
    _, k, v = qkv.split([4, 2, 2], dim=1)
    assert not k.is_contiguous()
    slots = random_slots(5, 3 * 8, device, seed=3)
    k_cache, v_cache = poisoned_caches(3, 8, 2, 16, device)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv_cache(k, v, k_cache, v_cache, slots)
    store_kv_cache_reference(k, v, k_ref, v_ref, slots)
    assert_same_with_nan(k_cache, k_ref)
    assert_same_with_nan(v_cache, v_ref)


def test_a_prefill_then_decodes_read_back_by_paged_attention(device):
    """The two kernels together, as an engine step runs them: store the step's keys and values through the
    slot mapping its block table gives, then attend over the cache through that table."""
    block_size, heads_q, heads_kv, head_dim = 4, 4, 2, 16
    block_table = torch.tensor([[5, 0, 3]], dtype=torch.int32, device=device)
    k_cache, v_cache = poisoned_caches(6, block_size, heads_kv, head_dim, device)
    k, v = rand(11, heads_kv, head_dim, device=device, seed=4), rand(11, heads_kv, head_dim, device=device, seed=5)
    slots = torch.tensor([block_table[0, p // block_size].item() * block_size + p % block_size for p in range(11)],
                         dtype=torch.int32, device=device)
    store_kv_cache(k[:9], v[:9], k_cache, v_cache, slots[:9])  # the prompt
    for p in (9, 10):                                             # two decode steps
        store_kv_cache(k[p:p + 1], v[p:p + 1], k_cache, v_cache, slots[p:p + 1])
    q = rand(1, heads_q, head_dim, device=device, seed=6)
    context_lens = torch.tensor([11], dtype=torch.int32, device=device)
    out = paged_decode_attention(q, k_cache, v_cache, block_table, context_lens)
    torch.testing.assert_close(out, paged_decode_attention_reference(q, k_cache, v_cache, block_table, context_lens),
                               atol=1e-4, rtol=1e-4)
    assert not out.isnan().any()


def bad_call(**overrides):
    args = dict(k=torch.zeros(3, 2, 16), v=torch.zeros(3, 2, 16), k_cache=torch.zeros(4, 8, 2, 16),
                v_cache=torch.zeros(4, 8, 2, 16), slot_mapping=torch.tensor([0, 5, -1], dtype=torch.int32))
    args.update(overrides)
    store_kv_cache(**args)


@pytest.mark.parametrize("overrides, message", [
    (dict(k=torch.zeros(3, 32)), "^k must be a 3-D tensor"),
    (dict(v_cache=torch.zeros(4, 8, 32)), "^v_cache must be a 4-D tensor"),
    (dict(v=torch.zeros(3, 2, 16, dtype=torch.float16)), "^v has dtype"),
    (dict(v=torch.zeros(4, 2, 16)), "^k and v must have the same shape"),
    (dict(v_cache=torch.zeros(5, 8, 2, 16)), "^k_cache and v_cache must have the same shape"),
    (dict(k_cache=torch.zeros(4, 8, 3, 16), v_cache=torch.zeros(4, 8, 3, 16)), r"^k holds \[Hkv, D\]"),
    (dict(k_cache=torch.zeros(4, 8, 16, 2).transpose(2, 3), v_cache=torch.zeros(4, 8, 16, 2).transpose(2, 3)),
     "^k_cache must be contiguous in its last"),
    (dict(slot_mapping=torch.tensor([0, 5, -1])), "^slot_mapping must be a 1-D int32"),
    (dict(slot_mapping=torch.tensor([0, 5], dtype=torch.int32)), r"^slot_mapping must be .*\[tokens = 3\]"),
    (dict(slot_mapping=torch.tensor([0, 32, -1], dtype=torch.int32)), r"^slot_mapping entries .* \[0, 32\)"),
    (dict(slot_mapping=torch.tensor([0, -2, 1], dtype=torch.int32)), "^slot_mapping entries must be -1"),
])
def test_bad_inputs_name_the_argument(overrides, message):
    with pytest.raises(ValueError, match=message):
        bad_call(**overrides)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a prefill-sized write is for the GPU")
def test_prefill_sized_write_on_gpu(gpu_dtype):
    k, v = rand(8192, 8, 128, device="cuda", dtype=gpu_dtype, seed=7), rand(8192, 8, 128, device="cuda",
                                                                           dtype=gpu_dtype, seed=8)
    slots = random_slots(8192, 1024 * 16, "cuda", skip=range(0, 8192, 97))
    k_cache, v_cache = poisoned_caches(1024, 16, 8, 128, "cuda", gpu_dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv_cache(k, v, k_cache, v_cache, slots)
    store_kv_cache_reference(k, v, k_ref, v_ref, slots)
    assert_same_with_nan(k_cache, k_ref)
    assert_same_with_nan(v_cache, v_ref)
