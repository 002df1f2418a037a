"""KV transfer (chapter 12, mini_engine/transfer/pack.py): a pool's blocks packed into one buffer and unpacked into
another pool, bit for bit, with the course's bytes per token, and every damaged or mismatched buffer refused."""
import pytest
import torch

from mini_engine import formulas
from mini_engine.config import PRESETS
from mini_engine.kv_cache import PagedKVCache
from mini_engine.transfer import HEADER_BYTES, KVBufferError, buffer_bytes, bytes_per_token, pack, read_header, unpack

SMOLLM2 = PRESETS["smollm2-135m"]  # 30 layers, 3 KV heads, head_dim 64: the embedded model's pool
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def random_pool(dtype, num_blocks=8, block_size=16, seed=0) -> PagedKVCache:
    """A pool whose every byte is random: NaNs, infinities and subnormals included, so equality is of bits."""
    cache = PagedKVCache(SMOLLM2, num_blocks, block_size, dtype=dtype)
    raw = cache.data.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
    return cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_round_trip_is_bit_for_bit(dtype):
    src, dst = random_pool(dtype, seed=1), random_pool(dtype, seed=2)
    before = dst.data.clone()
    buffer = pack(src, [5, 0, 3])
    unpack(dst, buffer, [1, 7, 2])
    bits = BITS[dtype]
    for s, d in ((5, 1), (0, 7), (3, 2)):
        assert torch.equal(src.data[:, :, s].view(bits), dst.data[:, :, d].view(bits)), f"block {s} -> {d}"
    untouched = [b for b in range(8) if b not in (1, 7, 2)]
    assert torch.equal(dst.data[:, :, untouched].view(bits), before[:, :, untouched].view(bits)), \
        "blocks outside block_ids changed"
    into = torch.empty(buffer_bytes(src, 3), dtype=torch.uint8)
    assert pack(src, [5, 0, 3], out=into) is into and torch.equal(into, buffer), "out= fills the same bytes"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_bytes_per_token_is_the_course_formula(dtype):
    cache = random_pool(dtype, block_size=16)
    size = torch.empty(0, dtype=dtype).element_size()
    per_token = formulas.kv_bytes_per_token(SMOLLM2.num_layers, SMOLLM2.num_kv_heads, SMOLLM2.head_dim, size)
    assert bytes_per_token(cache) == per_token == 2 * 30 * 3 * 64 * size
    buffer = pack(cache, [1, 2, 3])
    assert buffer.numel() == HEADER_BYTES + 3 * 16 * per_token == buffer_bytes(cache, 3)
    header = read_header(buffer)
    assert (header.dtype, header.num_blocks, header.block_size, header.payload_bytes) == (dtype, 3, 16, 48 * per_token)


def test_a_damaged_buffer_is_refused():
    cache = random_pool(torch.float32)
    good = pack(cache, [0, 1])
    flipped = good.clone()
    flipped[HEADER_BYTES + 12345] ^= 1
    with pytest.raises(KVBufferError, match="CRC"):
        unpack(cache, flipped, [2, 3])
    with pytest.raises(KVBufferError, match="truncated"):
        unpack(cache, good[:-4].clone(), [2, 3])
    with pytest.raises(KVBufferError, match="header"):
        unpack(cache, good[:10].clone(), [2, 3])
    not_ours = good.clone()
    not_ours[:4] = 0
    with pytest.raises(KVBufferError, match="not a packed"):
        read_header(not_ours)
    with pytest.raises(KVBufferError, match="1-D host uint8"):
        read_header(good.float())
    assert read_header(flipped, verify=False).num_blocks == 2, "the header alone is intact"


def test_a_buffer_goes_only_into_a_pool_laid_out_the_same_way():
    buffer = pack(random_pool(torch.float32, block_size=16), [0])
    with pytest.raises(KVBufferError, match="block_size=16; this pool has block_size=8"):
        unpack(random_pool(torch.float32, block_size=8), buffer, [0])
    with pytest.raises(KVBufferError, match="dtype"):
        unpack(random_pool(torch.bfloat16), buffer, [0])
    with pytest.raises(ValueError, match="block_ids has 2 blocks; the buffer holds 1"):
        unpack(random_pool(torch.float32), buffer, [0, 1])


def test_bad_arguments_name_themselves():
    cache = random_pool(torch.float32)
    for ids in ([], [8], [-1]):
        with pytest.raises(ValueError, match="block_ids"):
            pack(cache, ids)
    with pytest.raises(ValueError, match="block_ids"):
        unpack(cache, pack(cache, [0]), [99])
    with pytest.raises(ValueError, match="out must be"):
        pack(cache, [0], out=torch.empty(10, dtype=torch.uint8))
