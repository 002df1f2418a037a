"""The model runner (chapter 04): the one part of the serving engine that holds tensors. It packs a step's chunks
into token ids and attention metadata and runs the model; the scheduler and block manager stay pure Python."""
from __future__ import annotations

import itertools

import torch

from .attention import AttentionMetadata
from .compiled_decode import CompiledDecode
from .kv_cache import ContiguousKVCache, PagedKVCache
from .paging import BlockManager
from .sampling import logprobs_of
from .scheduler import Chunk


class ModelRunner:
    """Owns the tensors: turns a step's chunks into packed ids and attention metadata, runs the model. With a
    paged cache it reads the block tables from the scheduler's block manager (`blocks`). With `compiled` (a
    `CompiledDecode`), a step whose chunks all bring one token runs through its compiled graphs."""

    def __init__(self, model, kv_cache: ContiguousKVCache | PagedKVCache, backend: str,
                 blocks: BlockManager | None = None, compiled: CompiledDecode | None = None):
        self.model, self.kv_cache, self.backend, self.blocks = model, kv_cache, backend, blocks
        self.compiled = compiled

    def execute(self, chunks: list[Chunk], block_copies: list[tuple[int, int]] = ()) -> torch.Tensor:
        """Logits [rows, vocab]: `num_logits` rows per chunk, in chunk order (one per sampling chunk, 1 + k for
        a speculative one). `block_copies`: the step's copy-on-write (src, dst) blocks, copied before the step
        writes into them."""
        if hasattr(self.blocks, "load_from_tiers"):  # chapter 12: prefix blocks found in host memory or on disk
            self.blocks.load_from_tiers(self.kv_cache)  # are copied back before the step reads them
        if block_copies:
            self.kv_cache.copy_blocks(block_copies)
        scored = [_prompt_rows(c) for c in chunks]
        if self.compiled is not None and all(c.num_tokens == 1 for c in chunks) and not any(scored):
            return self._execute_compiled(chunks)
        ids, query_lens, context_lens, rows, prompt_rows = [], [], [], [], []
        for c, n in zip(chunks, scored):
            prompt_rows += range(len(ids), len(ids) + n)
            ids += c.token_ids
            query_lens.append(c.num_tokens)
            context_lens.append(c.start + c.num_tokens)
            rows += range(len(ids) - c.num_logits, len(ids))  # the last row, or every row of a speculative chunk
        device, where = self.model.device, self._cache_rows(chunks)
        layout = {"block_tables": where, "block_size": self.blocks.block_size} if self.blocks is not None else \
            {"slots": where}
        meta = AttentionMetadata.build(query_lens, context_lens, device=device, **layout)
        meta.logits_indices = torch.tensor(rows + prompt_rows, dtype=torch.long, device=device)
        logits = self.model(torch.tensor(ids, device=device), meta, self.kv_cache, backend=self.backend)
        if prompt_rows:  # row p scores prompt token p + 1 (SamplingParams.prompt_logprobs)
            parts = logits[len(rows):].split([n for n in scored if n])
            for c, part in zip([c for c, n in zip(chunks, scored) if n], parts):
                r, p = c.request, c.start
                r.prompt_logprobs[p:p + len(part)] = logprobs_of(part, r.prompt_ids[p + 1:p + 1 + len(part)],
                                                                 r.params.prompt_logprobs)
        return logits[:len(rows)]

    @staticmethod
    def record_logprobs(chunks: list[Chunk], logits: torch.Tensor, samplers, sampled: list) -> None:
        """Each sampled token's log-probability (SamplingParams.logprobs), from the row it was drawn from."""
        starts = list(itertools.accumulate((c.num_logits for c in chunks if c.samples), initial=0))
        for (row, r), got in zip(samplers, sampled):
            if r.params.logprobs is not None:
                tokens = [got] if isinstance(got, int) else list(got)
                r.logprobs += logprobs_of(logits[starts[row]:starts[row] + len(tokens)], tokens, r.params.logprobs)

    def _cache_rows(self, chunks: list[Chunk]) -> list:
        """Where each chunk's sequence lives in the cache: its slot, or with a paged cache its block table."""
        if self.blocks is None:
            return [c.request.slot for c in chunks]
        return [self.blocks.block_table(c.request.request_id) for c in chunks]

    def _execute_compiled(self, chunks: list[Chunk]) -> torch.Tensor:
        """A decode-only step (one token per chunk) through the compiled graph of its batch-size bucket."""
        logits = self.compiled([c.token_ids[0] for c in chunks], [c.start for c in chunks], self._cache_rows(chunks))
        if all(c.num_logits == 1 for c in chunks):
            return logits
        # A one-token chunk inside a prompt (a chunked prefill's budget can leave one token) samples nothing:
        # its row is dropped, as the eager step drops it.
        return logits[[i for i, c in enumerate(chunks) if c.num_logits == 1]]


def _prompt_rows(c: Chunk) -> int:
    """Rows of chunk c that score the prompt's next token: SamplingParams.prompt_logprobs, first pass only."""
    r, last = c.request, len(c.request.prompt_ids) - 1
    wanted = r.params.prompt_logprobs is not None and len(r.prompt_logprobs) < last
    return max(0, min(c.start + c.num_tokens, last) - c.start) if wanted else 0
