"""Moving the KV cache (chapter 12): a pool's blocks packed into one buffer and unpacked into another pool
(`pack.py`), and a prefix cache that spills evicted blocks to host memory and disk and copies them back on a hit
(`tiers.py` holds the tiers, `offload.py` the block manager that uses them: `LLM(..., kv_offload="host")`).
The core reads the same without this package: EngineConfig loads it only to check the kv_offload knobs and to
build the tiered block manager when they ask for one."""
from .pack import HEADER_BYTES, KVBufferError, buffer_bytes, bytes_per_token, pack, read_header, unpack
from .tiers import TierStats, TierStore

__all__ = ["HEADER_BYTES", "KVBufferError", "TierStats", "TierStore", "buffer_bytes", "bytes_per_token", "pack",
           "read_header", "unpack"]
