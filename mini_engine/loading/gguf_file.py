"""Read a GGUF file: its metadata as Python values and its tensors as numpy views of the file's bytes.

The `gguf` package's `GGUFReader` builds a numpy view for every part of every metadata field, which for this
model's tokenizer (49,152 tokens and 48,900 merges, each a string) took about 6 s of the 9 s a model load
took on a 2-core CPU, in every notebook, test and server that loads the model. The format is simple enough to
read directly (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md):

    magic "GGUF", version (u32), tensor count (u64), metadata count (u64)
    metadata: key (string), value type (u32), value           string = length (u64) + UTF-8 bytes
    tensor infos: name (string), n_dims (u32), dims (u64 each, innermost first), type (u32), offset (u64)
    padding to `general.alignment` (32 by default), then the tensor data, each at its offset

Tensors stay in the file (a read-only memory map) until dequantized. tests/engine/test_loader.py checks every
field and tensor against `gguf.GGUFReader`.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# Metadata value types: (struct format, size) of the scalar ones; 8 is a string, 9 an array.
_SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4), 6: ("<f", 4),
            7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8)}
_STRING, _ARRAY = 8, 9
# Tensor types this reader sizes: ggml type -> (elements per block, bytes per block). F32, F16, Q4_0, Q4_1,
# Q5_0, Q5_1, Q8_0, BF16; others (the k-quants) are refused by name.
_BLOCKS = {0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 30: (1, 2)}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]   # as GGUF lists it: innermost (row length) first
    tensor_type: int         # a gguf.GGMLQuantizationType value
    data: np.ndarray         # F32 / F16: typed, [rows..., row]; quantized: uint8, [rows..., bytes per row]


@dataclass(frozen=True)
class GGUFFile:
    metadata: dict           # key -> int / float / bool / str, or a list of them
    tensors: list[GGUFTensor]


class _Cursor:
    def __init__(self, buf: memoryview):
        self.buf, self.pos = buf, 0

    def scalar(self, kind: int):
        fmt, size = _SCALARS[kind]
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        (n,) = struct.unpack_from("<Q", self.buf, self.pos)
        start = self.pos + 8
        self.pos = start + n
        return bytes(self.buf[start:self.pos]).decode("utf-8", errors="replace")

    def value(self, kind: int):
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item_kind, count = self.scalar(4), self.scalar(10)
            if item_kind in _SCALARS and item_kind != 7:  # a block of numbers: one numpy read
                fmt, size = _SCALARS[item_kind]
                items = np.frombuffer(self.buf, dtype=np.dtype(fmt), count=count, offset=self.pos).tolist()
                self.pos += size * count
                return items
            return [self.value(item_kind) for _ in range(count)]
        if kind not in _SCALARS:
            raise ValueError(f"unknown GGUF metadata value type {kind} at byte {self.pos}")
        return self.scalar(kind)


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse `path`'s header, metadata and tensor infos; the tensors' data are views of a memory map."""
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(memoryview(mm))
    if bytes(mm[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (magic {bytes(mm[:4])!r})")
    cur.pos = 4
    version, n_tensors, n_fields = cur.scalar(4), cur.scalar(10), cur.scalar(10)
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3)")
    metadata = {}
    for _ in range(n_fields):
        key = cur.string()
        metadata[key] = cur.value(cur.scalar(4))
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = tuple(cur.scalar(10) for _ in range(cur.scalar(4)))
        infos.append((name, dims, cur.scalar(4), cur.scalar(10)))
    align = int(metadata.get("general.alignment", 32))
    start = (cur.pos + align - 1) // align * align
    tensors = []
    for name, dims, kind, offset in infos:
        if kind not in _BLOCKS:
            raise ValueError(f"{path}: tensor {name} has type {kind}, which this reader does not size")
        per_block, block_bytes = _BLOCKS[kind]
        row_bytes = dims[0] // per_block * block_bytes
        rows = tuple(reversed(dims[1:]))
        n_bytes = row_bytes * int(np.prod(rows, dtype=np.int64))
        raw = mm[start + offset:start + offset + n_bytes]
        if kind in (0, 1):  # F32, F16: typed elements
            data = raw.view(np.float32 if kind == 0 else np.float16).reshape(*rows, dims[0])
        else:
            data = raw.reshape(*rows, row_bytes)
        tensors.append(GGUFTensor(name, dims, kind, data))
    return GGUFFile(metadata, tensors)
