"""Checks shared by the hypothesis state machines of test_paging.py and test_prefix_caching.py."""


def record_write(bm, content: dict, tokens: list, seq: int, start: int, end: int) -> None:
    """Positions start..end-1 of `seq` are written: each must land in a block only `seq` holds and that is not
    registered in the prefix cache. `content[block][offset]` records the prefix whose keys/values sit there."""
    table = bm.block_table(seq)
    for p in range(start, end):
        block = table[p // bm.block_size]
        assert bm.ref_counts[block] == 1, f"sequence {seq} writes into block {block}, held {bm.ref_counts[block]}x"
        assert bm.block_hash[block] is None, f"sequence {seq} writes into registered block {block}"
        content.setdefault(block, [None] * bm.block_size)[p % bm.block_size] = tuple(tokens[:p + 1])
