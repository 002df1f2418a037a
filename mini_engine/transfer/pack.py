"""A paged pool's blocks as one buffer (chapter 12): `pack` copies some blocks' keys and values, every layer, into one
contiguous byte tensor on the host, and `unpack` writes such a buffer into blocks of a pool of the same shape, bit for
bit. The tiered prefix cache keeps evicted blocks this way in host memory and in files; a prefill engine sends a
request's blocks this way to a decode engine.

The buffer is a 64-byte header, then the payload: the pool's data[:, :, block_ids] ([layers, K/V, blocks, block_size,
kv_heads, head_dim]) as raw bytes. The header names the layout and dtype (a buffer can only go into a pool laid out
the same way), the payload's length (a truncated file shows) and its CRC-32 (a flipped bit shows). So the payload is
exactly the course's formula, 2 x layers x kv_heads x head_dim x dtype bytes per token (`bytes_per_token`).
"""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import torch

MAGIC, VERSION = b"MEKV", 1
HEADER_BYTES = 64  # the fields below, zero padded: keeps the payload aligned for any dtype
_FIELDS = struct.Struct("<4sHHIIIIIQI")  # magic, version, dtype, layers, kv_heads, head_dim, block_size, blocks,
#                                           payload bytes, CRC-32 of the payload
DTYPES = {1: torch.float32, 2: torch.bfloat16, 3: torch.float16}
_CODES = {dtype: code for code, dtype in DTYPES.items()}


class KVBufferError(ValueError):
    """A buffer that cannot be unpacked: not a packed buffer, truncated, corrupted, or laid out for another pool."""


@dataclass(frozen=True)
class Header:
    dtype: torch.dtype
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_blocks: int
    payload_bytes: int
    crc32: int

    @property
    def shape(self) -> tuple[int, ...]:
        """The payload as a tensor: [layers, K/V, blocks, block_size, kv_heads, head_dim]."""
        return self.num_layers, 2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim


def bytes_per_token(kv_cache) -> int:
    """Payload bytes per cached token: 2 (K and V) x layers x kv_heads x head_dim x dtype bytes."""
    layers, _, _, _, kv_heads, head_dim = kv_cache.data.shape
    return 2 * layers * kv_heads * head_dim * kv_cache.data.element_size()


def buffer_bytes(kv_cache, num_blocks: int) -> int:
    """Size of the buffer `pack` makes for `num_blocks` blocks of this pool: the header and the payload."""
    return HEADER_BYTES + num_blocks * kv_cache.block_size * bytes_per_token(kv_cache)


def _check_ids(kv_cache, block_ids) -> list[int]:
    ids = [int(b) for b in block_ids]
    bad = [b for b in ids if not 0 <= b < kv_cache.data.shape[2]]
    if not ids or bad:
        raise ValueError(f"block_ids must be a non-empty list of blocks in [0, {kv_cache.data.shape[2]}), "
                         f"got {list(block_ids)[:8]}")
    return ids


def pack(kv_cache, block_ids, out: torch.Tensor | None = None, pin_memory: bool = False) -> torch.Tensor:
    """The keys and values of `block_ids` (in that order, every layer) as one uint8 tensor on the host: header, then
    payload. `out`: a host uint8 tensor of `buffer_bytes(kv_cache, len(block_ids))` to fill instead of a new one;
    `pin_memory`: a new one in page-locked memory (a GPU copies it by DMA, and can overlap it with compute)."""
    ids, data = _check_ids(kv_cache, block_ids), kv_cache.data
    if data.dtype not in _CODES:
        raise ValueError(f"pack supports pools of {sorted(str(d) for d in _CODES)}, not {data.dtype}")
    size = buffer_bytes(kv_cache, len(ids))
    if out is None:
        out = torch.empty(size, dtype=torch.uint8, pin_memory=pin_memory)
    elif out.dtype != torch.uint8 or out.device.type != "cpu" or out.shape != (size,) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous host uint8 tensor of {size} bytes, got {out.dtype} "
                         f"{tuple(out.shape)} on {out.device}")
    layers, _, _, block_size, kv_heads, head_dim = data.shape
    payload = out[HEADER_BYTES:].view(data.dtype).view(layers, 2, len(ids), block_size, kv_heads, head_dim)
    index = torch.tensor(ids, device=data.device)
    if data.device.type == "cpu":
        torch.index_select(data, 2, index, out=payload)  # gathered straight into the buffer: one pass
    else:
        payload.copy_(data.index_select(2, index))  # gathered on the device, then one copy over the link
    crc = zlib.crc32(out[HEADER_BYTES:].numpy())
    fields = _FIELDS.pack(MAGIC, VERSION, _CODES[data.dtype], layers, kv_heads, head_dim, block_size, len(ids),
                          size - HEADER_BYTES, crc)
    out[:HEADER_BYTES] = torch.frombuffer(bytearray(fields.ljust(HEADER_BYTES, b"\0")), dtype=torch.uint8)
    return out


def read_header(buffer: torch.Tensor, verify: bool = True) -> Header:
    """The header of a packed buffer, after checking that the buffer is one, whole (its length) and, with `verify`,
    intact (the payload's CRC-32). Raises KVBufferError otherwise."""
    if not isinstance(buffer, torch.Tensor) or buffer.dtype != torch.uint8 or buffer.dim() != 1 \
            or buffer.device.type != "cpu":
        raise KVBufferError("buffer must be a 1-D host uint8 tensor made by pack()")
    if buffer.numel() < HEADER_BYTES:
        raise KVBufferError(f"buffer has {buffer.numel()} bytes, fewer than the {HEADER_BYTES}-byte header")
    magic, version, code, *shape, payload_bytes, crc = _FIELDS.unpack_from(buffer[:_FIELDS.size].numpy().tobytes())
    if magic != MAGIC or version != VERSION or code not in DTYPES:
        raise KVBufferError(f"buffer is not a packed KV buffer of version {VERSION} (magic {magic!r}, version "
                            f"{version}, dtype code {code})")
    header = Header(DTYPES[code], *shape, payload_bytes, crc)
    expected = 2 * header.num_layers * header.num_blocks * header.block_size * header.num_kv_heads \
        * header.head_dim * torch.empty(0, dtype=header.dtype).element_size()
    if payload_bytes != expected or buffer.numel() != HEADER_BYTES + payload_bytes:
        raise KVBufferError(f"buffer holds {buffer.numel() - HEADER_BYTES} payload bytes; its header says "
                            f"{payload_bytes} and its shape {expected}: truncated or damaged")
    if verify and zlib.crc32(buffer[HEADER_BYTES:].numpy()) != crc:
        raise KVBufferError("buffer's payload does not match its CRC-32: corrupted")
    return header


def unpack(kv_cache, buffer: torch.Tensor, block_ids, verify: bool = True) -> None:
    """Write a packed buffer's blocks into `block_ids` of this pool (the i-th packed block into block_ids[i]), after
    checking the buffer (see `read_header`) and that it was packed from a pool laid out as this one."""
    ids, data = _check_ids(kv_cache, block_ids), kv_cache.data
    header = read_header(buffer, verify)
    layers, _, _, block_size, kv_heads, head_dim = data.shape
    for name, ours, theirs in (("dtype", data.dtype, header.dtype), ("layers", layers, header.num_layers),
                               ("kv_heads", kv_heads, header.num_kv_heads), ("head_dim", head_dim, header.head_dim),
                               ("block_size", block_size, header.block_size)):
        if ours != theirs:
            raise KVBufferError(f"buffer was packed with {name}={theirs}; this pool has {name}={ours}")
    if len(ids) != header.num_blocks:
        raise ValueError(f"block_ids has {len(ids)} blocks; the buffer holds {header.num_blocks}")
    payload = buffer[HEADER_BYTES:].view(header.dtype).view(header.shape)
    data.index_copy_(2, torch.tensor(ids, device=data.device), payload.to(data.device))  # one pass, no index_put
