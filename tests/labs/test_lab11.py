"""Grades lab 11 (tensor parallelism: the two cuts of a weight, the split attention block, the vocabulary-parallel
embedding and LM head, and, optionally, an all-reduce made of a reduce-scatter and an all-gather) in either tree.

    pytest tests/labs/test_lab11.py --impl=labs        # your work
    pytest tests/labs/test_lab11.py --impl=solutions   # the reference answers

First every rank's shard runs in one process (comm=None, or a comm that records what it is asked to exchange), and
the shards' outputs, joined or summed, must equal the full layer's within fp32 rounding (a split product adds in
another order). The optional ring runs its three ranks as three threads first. Last, the slow checks start three
real ranks (processes joined by torch.distributed's gloo through a file store in a temporary folder): one runs an
embedding, your attention block, an MLP and your LM head together, meeting at your exchanges; the other runs your
reduce-scatter, all-gather and all-reduce against torch's.

Under `--impl=labs` some tests are deselected: those that grade this grader itself (they take the `mutant`,
`hand_off`, `wrong_answer` or `asked_for` fixtures: the reference solution with a part replaced by a hand-off to
the engine or a typical wrong answer, which must fail with the one line below). They say nothing about your work,
and they run in CI under `--impl=solutions`.
"""
from __future__ import annotations

import importlib
import os
import queue
import sys
import tempfile
import threading
import time
import types

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from mini_engine import model as engine_model
from mini_engine.attention import AttentionMetadata, TorchAttention
from mini_engine.config import ModelConfig
from mini_engine.parallel import comm as engine_comm
from mini_engine.parallel import layers as engine_layers

LAB = "lab11_tensor_parallel"
# The engine's parallel layers and splits (and its own attention) already do these jobs, and torch.distributed's
# collectives do the optional part's: calling them fails the test.
COLLECTIVES = [getattr(dist, name) for name in ("all_reduce", "reduce_scatter", "all_gather", "reduce_scatter_tensor",
                                                "all_gather_into_tensor", "reduce_scatter_single", "all_gather_single",
                                                "all_to_all", "broadcast", "reduce", "gather")
               if hasattr(dist, name)] + [engine_comm]
SHORTCUTS = {**{name: [engine_layers] for name in ("column_shard", "row_shard", "qkv_shard",
                                                   "vocab_parallel_embedding", "ParallelLMHead")},
             "ParallelAttention": [engine_layers, engine_model.Attention],
             **{name: COLLECTIVES for name in ("reduce_scatter", "all_gather", "ring_all_reduce")}}
TOL = dict(rtol=1e-5, atol=1e-5)


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


class RecordingComm:
    """One rank's comm in one process: records what it is asked to exchange; 'sums' and 'joins' over one rank
    (returns t)."""

    def __init__(self):
        self.reduced, self.gathered = [], []

    def all_reduce(self, t):
        self.reduced.append(t.clone())
        return t

    def gather(self, t):
        self.gathered.append(t.clone())
        return t


def close(a, b) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, **TOL)


def shapes(tensors) -> list:
    return [tuple(t.shape) for t in tensors]


# ---------------------------------------------------------------- 1. the two cuts

def test_column_shard_cuts_the_outputs(impl):
    w = rand(12, 5)
    shards = [impl.column_shard(w, r, 3) for r in range(3)]
    assert all(tuple(s.shape) == (4, 5) for s in shards), (
        f"column_shard of W [12, 5] over 3 ranks must be [4, 5] (a third of the OUTPUTS, W's dim 0), got "
        f"{shapes(shards)}")
    assert torch.equal(shards[1], w[4:8]), "rank 1 of 3 holds outputs 4 ... 7 of 12: W's rows 4 ... 7, in order"
    assert torch.equal(torch.cat(shards), w), "the ranks' shards, joined in rank order, must give W back"


def test_row_shard_cuts_the_inputs(impl):
    w = rand(5, 12)
    shards = [impl.row_shard(w, r, 3) for r in range(3)]
    assert all(tuple(s.shape) == (5, 4) for s in shards), (
        f"row_shard of W [5, 12] over 3 ranks must be [5, 4] (a third of the INPUTS, W's dim 1), got {shapes(shards)}")
    assert torch.equal(shards[2], w[:, 8:]), "rank 2 of 3 holds inputs 8 ... 11 of 12: W's columns 8 ... 11"


# ---------------------------------------------------------------- 2. attention, split by heads

def test_qkv_shard_gives_each_rank_whole_heads(impl):
    """SmolLM2-135M's heads, 9 query and 3 KV, at 3 ranks: 3 query heads and 1 KV head a rank."""
    check_qkv_shard(impl, 9, 3, 3)


@pytest.mark.parametrize("heads,kv_heads,size", [(4, 2, 2), (6, 2, 1)], ids=["4q-2kv-2ranks", "6q-2kv-1rank"])
def test_qkv_shard_at_other_head_counts(impl, heads, kv_heads, size):
    check_qkv_shard(impl, heads, kv_heads, size)


def check_qkv_shard(impl, heads, kv_heads, size):
    d, hidden = 4, 10
    w = rand((heads + 2 * kv_heads) * d, hidden)
    q, k, v = w.split([heads * d, kv_heads * d, kv_heads * d])
    hq, hkv = heads // size, kv_heads // size
    for r in range(size):
        mine = impl.qkv_shard(w, heads, kv_heads, d, r, size)
        want = torch.cat([q[r * hq * d:(r + 1) * hq * d], k[r * hkv * d:(r + 1) * hkv * d],
                          v[r * hkv * d:(r + 1) * hkv * d]])
        assert tuple(mine.shape) == tuple(want.shape), (
            f"{heads} query and {kv_heads} KV heads of {d} over {size} ranks: a rank holds {hq} query and {hkv} KV "
            f"heads, [({hq} + 2*{hkv})*{d}, {hidden}] = {tuple(want.shape)}; got {tuple(mine.shape)}")
        assert torch.equal(mine, want), (
            f"rank {r}: its query heads {r * hq} ... {(r + 1) * hq - 1} from q's rows, its KV head(s) "
            f"{r * hkv} ... {(r + 1) * hkv - 1} from k's and from v's, joined q, k, v: cut q, k and v apart first")


# SmolLM2-135M's heads (9 query, 3 KV) at a small head size; hidden != a rank's heads * D, so that a tensor of the
# one shape is never mistaken for the other.
SMALL = ModelConfig(vocab_size=30, hidden_size=10, intermediate_size=24, num_layers=1, num_heads=9, num_kv_heads=3,
                    head_dim=4, max_position_embeddings=64)
QUERY_LENS = [3, 4]  # two sequences' prompts, packed: 7 tokens


def full_attention(cfg=SMALL, seed=5):
    """The engine's own attention block at `cfg`, with random weights."""
    attn = engine_model.Attention(cfg).eval()
    with torch.no_grad():
        attn.qkv_proj.weight.copy_(rand(*attn.qkv_proj.weight.shape, seed=seed) / cfg.hidden_size ** 0.5)
        attn.o_proj.weight.copy_(rand(*attn.o_proj.weight.shape, seed=seed + 1) / (cfg.num_heads * cfg.head_dim) ** 0.5)
    return attn


def attention_inputs(cfg=SMALL, seed=7):
    """x [T, hidden], RoPE's cos and sin [T, 1, D], the step's metadata (no cache) and the torch backend."""
    meta = AttentionMetadata.build(QUERY_LENS)
    cos, sin = engine_model.rope_tables(cfg)
    x = rand(sum(QUERY_LENS), cfg.hidden_size, seed=seed)
    return x, cos[meta.positions, None], sin[meta.positions, None], meta, TorchAttention()


def same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def test_parallel_attention_holds_its_heads_as_copies(impl):
    attn, size = full_attention(), 3
    for rank in range(size):
        block = impl.ParallelAttention(attn, rank, size, RecordingComm())
        heads = (getattr(block, "num_heads", None), getattr(block, "num_kv_heads", None))
        assert heads == (3, 1), (
            f"rank {rank} of 3 holds 3 of the 9 query heads and 1 of the 3 KV heads: self.num_heads and "
            f"self.num_kv_heads must be (3, 1), got {heads}")
        kept = [name for name in ("qkv_proj", "o_proj")
                if isinstance(getattr(getattr(block, name, None), "weight", None), torch.Tensor)]
        assert kept == ["qkv_proj", "o_proj"], (
            f"rank {rank}'s block keeps {kept or 'neither'} of self.qkv_proj and self.o_proj with a .weight: the "
            "engine loads each rank's weights by those names (the class docstring)")
        qkv, o = block.qkv_proj.weight, block.o_proj.weight
        want = engine_layers.split_qkv(attn.qkv_proj.weight, SMALL, rank, size)
        assert qkv.shape == want.shape and torch.equal(qkv, want), (
            f"rank {rank}'s qkv_proj must hold its own heads' rows (your qkv_shard), {tuple(want.shape)}; got "
            f"{tuple(qkv.shape)}{'' if qkv.shape != want.shape else ' with other rows'}")
        want = attn.o_proj.weight[:, rank * 12:(rank + 1) * 12]
        assert o.shape == want.shape and torch.equal(o, want), (
            f"rank {rank}'s o_proj must hold the columns that read its own heads' outputs, {tuple(want.shape)}: "
            f"o_proj is row-parallel; got {tuple(o.shape)}")
        for name, mine, whole in (("qkv_proj", qkv, attn.qkv_proj.weight), ("o_proj", o, attn.o_proj.weight)):
            assert not same_storage(mine, whole), (
                f"rank {rank}'s {name} is a view of the full {list(whole.shape)} weight: keep a copy (a view keeps the "
                "whole weight alive in every rank)")


def test_parallel_attention_sums_to_the_full_block_with_one_all_reduce(impl):
    attn, size = full_attention(), 3
    x, cos, sin, meta, backend = attention_inputs()
    with torch.no_grad():
        full = attn(x, cos, sin, meta, 0, None, backend)
    parts = []
    for rank in range(size):
        comm = RecordingComm()
        with torch.no_grad():
            parts.append(impl.ParallelAttention(attn, rank, size, comm)(x, cos, sin, meta, 0, None, backend))
        t, hidden = x.shape
        assert len(comm.reduced) == 1, (
            f"rank {rank}'s attention block all-reduced {len(comm.reduced)} times: it needs exactly one, of its "
            "partial output")
        assert shapes(comm.reduced) == [(t, hidden)], (
            f"rank {rank}'s attention block all-reduced a {list(comm.reduced[0].shape)} tensor: its one exchange "
            f"sums o_proj's partial outputs, [{t}, {hidden}] (a rank's attention output holds only its own heads; "
            "summing the ranks' would add different heads together)")
        assert not comm.gathered, f"rank {rank}'s attention block gathered: nothing is joined there, only summed"
    assert all(tuple(p.shape) == tuple(full.shape) for p in parts), (
        f"each rank's attention block returns [T, hidden] = {list(full.shape)}; got {shapes(parts)}")
    assert close(sum(parts), full), (
        "each rank's attention over its own heads (RoPE on its q and k, its KV head(s)), then o_proj: the ranks' "
        f"partial outputs must sum to the full block's; max |diff| {(sum(parts) - full).abs().max():.2e}")


# ---------------------------------------------------------------- 3. vocabulary-parallel embedding

IDS = torch.tensor([[0, 3, 4, 7], [8, 11, 5, 0]])


def embed(impl, ids, shard, start, comm=None):
    """The student's embedding, with an index error explained in one line."""
    try:
        return impl.vocab_parallel_embedding(ids, shard, start, comm)
    except IndexError as err:
        pytest.fail(f"vocab_parallel_embedding indexed past its shard ({' '.join(str(err).split())}): an id another "
                    f"rank holds (outside {start} ... {start + shard.shape[0] - 1}) must not index the "
                    f"{shard.shape[0]}-row shard; give it a row of zeros", pytrace=False)


def test_each_rank_looks_up_only_its_vocabulary_range(impl):
    table = rand(12, 6)
    for r in range(3):
        part = embed(impl, IDS, table[4 * r:4 * (r + 1)], 4 * r)
        assert tuple(part.shape) == (2, 4, 6), (
            f"ids [2, 4] and a hidden size of 6 give [2, 4, 6], got {tuple(part.shape)}")
        mine = (IDS >= 4 * r) & (IDS < 4 * (r + 1))
        assert torch.equal(part[~mine], torch.zeros_like(part[~mine])), (
            f"rank {r} holds ids {4 * r} ... {4 * r + 3}: every other id's row must be zeros (another rank holds it)")
        assert torch.equal(part[mine], table[IDS[mine]]), (
            f"rank {r} holds ids {4 * r} ... {4 * r + 3}: each of them gives its row of the table (id - start in the "
            "shard)")


def test_the_ranks_parts_sum_to_the_full_embedding(impl):
    table = rand(12, 6)
    comms = [RecordingComm() for _ in range(3)]
    parts = [embed(impl, IDS, table[4 * r:4 * (r + 1)], 4 * r, comms[r]) for r in range(3)]
    assert torch.equal(sum(parts), F.embedding(IDS, table)), "the ranks' parts, summed, must be the full lookup"
    assert [len(c.reduced) for c in comms] == [1, 1, 1], "the embedding costs one all-reduce a rank"


def test_the_embedding_keeps_the_tables_dtype(impl):
    table = rand(12, 6).bfloat16()
    part = embed(impl, IDS, table[4:8], 4)
    assert part.dtype == torch.bfloat16, (
        f"a bfloat16 table gave {part.dtype} rows: zero the others' rows in the table's dtype")


# ---------------------------------------------------------------- 4. vocabulary-parallel LM head

def test_lm_head_gives_each_rank_its_vocabulary_columns(impl):
    table, x = rand(12, 6), rand(5, 6, seed=1)
    parts = [impl.ParallelLMHead(table[4 * r:4 * (r + 1)])(x) for r in range(3)]
    assert shapes(parts) == [(5, 4)] * 3, (
        f"with comm=None a rank returns the logits of its own 4 ids of 12, [5, 4]; got {shapes(parts)}")
    assert close(torch.cat(parts, dim=-1), x @ table.T), (
        "rank r's logits are the columns of ids 4r ... 4r + 3: joined in rank order they must be the full x W^T")


def test_lm_head_gathers_its_columns_once(impl):
    table, x = rand(12, 6), rand(5, 6, seed=1)
    for r in range(3):
        comm = RecordingComm()
        impl.ParallelLMHead(table[4 * r:4 * (r + 1)], comm)(x)
        assert not comm.reduced, (
            f"rank {r}'s LM head all-reduced {shapes(comm.reduced)}: the ranks' logits are different columns of the "
            "whole [T, V], not terms of a sum; join them (an all-reduce of [T, V] would move every rank's zeros too)")
        assert shapes(comm.gathered) == [(5, 4)], (
            f"rank {r}'s LM head must gather its own logits, [5, 4], once (rank 0 joins every rank's); it gathered "
            f"{shapes(comm.gathered)}")


# ---------------------------------------------------------------- 5. optional: the ring, three threads as ranks

class ThreadComm:
    """One of `size` ranks that are threads of this process: sendrecv passes a copy through a queue a pair of
    ranks. Records the elements each rank sends."""

    def __init__(self, rank: int, size: int, boxes: dict):
        self.rank, self.size, self.boxes, self.sent = rank, size, boxes, []

    def sendrecv(self, send: torch.Tensor, to: int, recv: torch.Tensor, source: int) -> None:
        if send.shape != recv.shape:
            raise ValueError(f"sendrecv: send {list(send.shape)} and recv {list(recv.shape)} must have one shape")
        if not (0 <= to < self.size and 0 <= source < self.size) or self.rank in (to, source):
            raise ValueError(f"sendrecv on rank {self.rank} of {self.size}: to={to}, source={source} must be other "
                             "ranks")
        self.sent.append(send.numel())
        self.boxes[self.rank, to].put(send.clone())
        try:
            recv.copy_(self.boxes[source, self.rank].get(timeout=10))
        except queue.Empty:
            raise TimeoutError(f"rank {self.rank} waited 10 s for rank {source}, which never sent to it: do the ranks "
                               "agree on who sends to whom at each step?") from None


def on_thread_ranks(fn, inputs: list, size: int = 3):
    """Run fn(inputs[r], comm_r) on `size` threads, one a rank; (outputs, each rank's comm). The first error
    raised on a rank is raised here."""
    boxes = {(a, b): queue.Queue() for a in range(size) for b in range(size)}
    comms = [ThreadComm(r, size, boxes) for r in range(size)]
    outputs, errors = [None] * size, [None] * size

    def run(rank):
        try:
            outputs[rank] = fn(inputs[rank], comms[rank])
        except BaseException as err:  # noqa: BLE001 - raised again on the grader's thread
            errors[rank] = err

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    for err in errors:
        if err is not None:
            raise err
    return outputs, comms


RING = ("reduce_scatter", "all_gather", "ring_all_reduce")


@pytest.mark.optional(*RING)
def test_reduce_scatter_sums_each_ranks_own_chunk(impl):
    ts = [rand(6, 5, seed=r) for r in range(3)]
    originals = [t.clone() for t in ts]
    outs, comms = on_thread_ranks(impl.reduce_scatter, ts)
    total = sum(originals)
    for r in range(3):
        assert outs[r] is not None and tuple(outs[r].shape) == (2, 5), (
            f"rank {r}'s reduce_scatter of [6, 5] over 3 ranks returns its chunk, [2, 5]; got "
            f"{None if outs[r] is None else tuple(outs[r].shape)}")
        assert close(outs[r], total[2 * r:2 * (r + 1)]), (
            f"rank {r}'s reduce_scatter must return chunk {r} (rows {2 * r} ... {2 * r + 1}) of the sum over the ranks")
        assert torch.equal(ts[r], originals[r]), f"rank {r}'s reduce_scatter changed its input: leave t as it is"
        assert comms[r].sent == [10, 10], (
            f"rank {r}'s reduce_scatter sent {comms[r].sent} elements per step: a ring's takes 2 steps at 3 ranks, "
            "one chunk (10 elements) each")


@pytest.mark.optional(*RING)
def test_all_gather_joins_every_ranks_chunk(impl):
    chunks = [rand(2, 5, seed=r) for r in range(3)]
    outs, comms = on_thread_ranks(impl.all_gather, chunks)
    for r in range(3):
        assert outs[r] is not None and close(outs[r], torch.cat(chunks)), (
            f"rank {r}'s all_gather must return every rank's chunk joined in rank order, [6, 5]; got "
            f"{None if outs[r] is None else tuple(outs[r].shape)}{'' if outs[r] is None else ' with other rows'}")
        assert comms[r].sent == [10, 10], (
            f"rank {r}'s all_gather sent {comms[r].sent} elements per step: a ring's takes 2 steps at 3 ranks, one "
            "chunk (10 elements) each")


@pytest.mark.optional(*RING)
def test_ring_all_reduce_is_a_sum_in_place_for_any_shape(impl):
    ts = [rand(7, 5, seed=r) for r in range(3)]  # 35 elements: 3 ranks do not divide them
    total = sum(t.clone() for t in ts)
    outs, comms = on_thread_ranks(impl.ring_all_reduce, ts)
    for r in range(3):
        assert outs[r] is ts[r], f"rank {r}'s ring_all_reduce must sum in place and return t itself, as all_reduce does"
        assert close(ts[r], total), f"rank {r}'s ring_all_reduce must leave the sum over the ranks in t"
        sent = sum(comms[r].sent)
        assert sent == 48, (
            f"rank {r}'s ring_all_reduce sent {sent} elements: a reduce-scatter then an all-gather send 2 (p - 1) / p "
            "of the (padded) 36, 48: each rank's share, not the whole tensor")


# ---------------------------------------------------------------- three real ranks (slow, last)

SIZE = 3
CFG = ModelConfig(vocab_size=30, hidden_size=12, intermediate_size=24, num_layers=1, num_heads=9,
                num_kv_heads=3, head_dim=4, max_position_embeddings=64)


def block_weights():
    g = torch.Generator().manual_seed(11)
    shape = dict(embed=(CFG.vocab_size, CFG.hidden_size), qkv=((CFG.num_heads + 2 * CFG.num_kv_heads) * CFG.head_dim,
                                                                CFG.hidden_size),
                 o=(CFG.hidden_size, CFG.num_heads * CFG.head_dim), gate=(CFG.intermediate_size, CFG.hidden_size),
                 up=(CFG.intermediate_size, CFG.hidden_size), down=(CFG.hidden_size, CFG.intermediate_size))
    return {name: torch.randn(*s, generator=g) / s[1] ** 0.5 for name, s in shape.items()}  # activations near 1


IDS_REAL = torch.tensor([0, 9, 10, 19, 20, 29, 5])


def block_forward(w, comm, rank, lab):
    """Embedding, attention block and MLP block (residuals, no norms), then the tied LM head, through the lab's
    layers at rank `rank`; with lab=None, the full model in one process."""
    meta = AttentionMetadata.build([len(IDS_REAL)])
    cos, sin = engine_model.rope_tables(CFG)
    cos, sin, backend = cos[meta.positions, None], sin[meta.positions, None], TorchAttention()
    attn = engine_model.Attention(CFG)
    attn.qkv_proj.weight.data, attn.o_proj.weight.data = w["qkv"], w["o"]
    with torch.no_grad():
        if lab is None:
            x = F.embedding(IDS_REAL, w["embed"])
            x = x + attn(x, cos, sin, meta, 0, None, backend)
            x = x + (F.silu(x @ w["gate"].T) * (x @ w["up"].T)) @ w["down"].T
            return x @ w["embed"].T
        rows = CFG.vocab_size // SIZE
        table = lab.column_shard(w["embed"], rank, SIZE).clone()
        x = lab.vocab_parallel_embedding(IDS_REAL, table, rank * rows, comm)
        x = x + lab.ParallelAttention(attn, rank, SIZE, comm)(x, cos, sin, meta, 0, None, backend)
        h = F.silu(x @ lab.column_shard(w["gate"], rank, SIZE).T) * (x @ lab.column_shard(w["up"], rank, SIZE).T)
        x = x + comm.all_reduce(h @ lab.row_shard(w["down"], rank, SIZE).T)  # the given MLP's one all-reduce
        return lab.ParallelLMHead(table, comm)(x)


def ring_forward(rank, comm):
    """The optional part on a real rank: each of its three pieces against torch.distributed's own collectives."""
    t = torch.randn(7, 5, generator=torch.Generator().manual_seed(rank))
    want = t.clone()
    dist.all_reduce(want)
    lab = comm.lab
    got = {"ring_all_reduce": lab.ring_all_reduce(t.clone(), comm), "want_all_reduce": want,
           "reduce_scatter": lab.reduce_scatter(t[:6].clone(), comm),
           "want_reduce_scatter": want[2 * rank:2 * rank + 2],
           "all_gather": lab.all_gather(t[:2].clone(), comm)}
    parts = [torch.empty(2, 5) for _ in range(SIZE)]
    dist.all_gather(parts, t[:2].clone())
    got["want_all_gather"] = torch.cat(parts)
    return got


def rank_worker(rank: int, module: str, job: str, folder: str, timeout: float) -> None:
    """One real rank (a spawned process): join the group through a file:// store in `folder`, run `job` ("blocks"
    or "ring") through the lab's code, save the output (or the error, one line) for the grader."""
    import datetime

    torch.set_num_threads(1)
    try:
        lab = importlib.import_module(module)
        dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=SIZE,
                                timeout=datetime.timedelta(seconds=timeout))

        class Comm:  # the group's collectives, as the engine's Communicator gives them, and the ring's one step
            all_reduces = gathers = 0
            sent: list = []

            def __init__(self):
                self.rank, self.size, self.lab = rank, SIZE, lab

            def all_reduce(self, t):
                Comm.all_reduces += 1
                dist.all_reduce(t)
                return t

            def gather(self, t):
                Comm.gathers += 1
                t = t.contiguous()
                parts = [torch.empty_like(t) for _ in range(SIZE)] if rank == 0 else None
                dist.gather(t, parts, dst=0)
                return torch.cat(parts, dim=-1) if rank == 0 else t

            def sendrecv(self, send, to, recv, source):
                if send.shape != recv.shape:
                    raise ValueError(f"sendrecv: send {list(send.shape)} and recv {list(recv.shape)} must have one "
                                     "shape")
                Comm.sent.append(send.numel())
                incoming = torch.empty_like(recv)  # gloo receives into a contiguous buffer
                works = [dist.isend(send.contiguous(), to), dist.irecv(incoming, source)]
                for work in works:
                    work.wait()
                recv.copy_(incoming)

        y = block_forward(block_weights(), Comm(), rank, lab) if job == "blocks" else ring_forward(rank, Comm())
        torch.save({"y": y, "all_reduces": Comm.all_reduces, "gathers": Comm.gathers, "sent": Comm.sent},
                   f"{folder}/rank{rank}.pt")
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - say what went wrong, in one line, to the grader
        with open(f"{folder}/rank{rank}.err", "w") as f:
            f.write(f"{type(e).__name__}: {' '.join(str(e).split())}")
        raise


def run_ranks(module: str, job: str, timeout: float | None = None, deadline_s: float = 300.0) -> list[dict]:
    """Start SIZE ranks with torch.multiprocessing (spawn), wait for them (at most `deadline_s`), return each rank's
    saved result; a rank's error, or ranks that never finish, fail in one line."""
    import torch.multiprocessing as mp

    timeout = timeout or float(os.environ.get("MINI_ENGINE_TP_TIMEOUT", 60))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo" if sys.platform.startswith("linux") else "lo0")
    with tempfile.TemporaryDirectory(prefix="lab11_ranks_") as folder:
        context = mp.start_processes(rank_worker, args=(module, job, folder, timeout), nprocs=SIZE, join=False,
                                     start_method="spawn")
        end = time.monotonic() + deadline_s
        try:
            while not context.join(timeout=max(0.1, min(5.0, end - time.monotonic()))):
                if time.monotonic() > end:
                    pytest.fail(f"{SIZE} ranks did not finish within {deadline_s:g} s: does every rank call the same "
                                "collectives, in the same order?", pytrace=False)
        except mp.ProcessRaisedException:
            errors = [open(os.path.join(folder, f)).read() for f in sorted(os.listdir(folder)) if f.endswith(".err")]
            pytest.fail(f"a rank failed: {errors[0] if errors else 'see its traceback (--tb=long)'}", pytrace=False)
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                process.join(5)
        return [torch.load(os.path.join(folder, f"rank{r}.pt")) for r in range(SIZE)]


@pytest.mark.engine("three real ranks (processes joined by torch.distributed's gloo) run an embedding, your attention "
                    "block, an MLP and your LM head together, about 15 seconds")
def test_three_real_ranks_give_the_full_model(impl):
    w = block_weights()
    block_forward(w, RecordingComm(), 0, impl)  # in this process first: a TODO, or a hand-off, says so here
    results = run_ranks(impl.__name__, "blocks")
    full = block_forward(w, None, 0, None)
    for rank, result in enumerate(results):
        assert (result["all_reduces"], result["gathers"]) == (3, 1), (
            f"rank {rank} all-reduced {result['all_reduces']} times and gathered {result['gathers']} times: an "
            "embedding, an attention block and an MLP need 3 all-reduces (one each), the LM head one gather")
    assert close(results[0]["y"], full), (
        f"rank 0's logits differ from the full model's by {(results[0]['y'] - full).abs().max():.2e}: it must end "
        "with every id's logit, in vocabulary order")
    rows = CFG.vocab_size // SIZE
    for rank, result in enumerate(results[1:], start=1):
        assert close(result["y"], full[:, rank * rows:(rank + 1) * rows]), (
            f"rank {rank} must end with the logits of its own ids {rank * rows} ... {(rank + 1) * rows - 1}")


@pytest.mark.optional(*RING)
@pytest.mark.engine("three real ranks run your reduce-scatter, all-gather and all-reduce against torch.distributed's "
                    "own, about 10 seconds")
def test_three_real_ranks_run_your_ring(impl):
    on_thread_ranks(impl.ring_all_reduce, [rand(4, seed=r) for r in range(3)])  # a TODO, or a hand-off, says so here
    results = run_ranks(impl.__name__, "ring")
    for rank, result in enumerate(results):
        y = result["y"]
        for part in RING:
            want = y[f"want_{part.removeprefix('ring_')}"]
            gap = f"max |diff| {(y[part] - want).abs().max():.2e}" if y[part].shape == want.shape else \
                f"shape {list(y[part].shape)}, not {list(want.shape)}"
            assert close(y[part], want), f"rank {rank}'s {part} differs from torch.distributed's on real ranks ({gap})"
        assert result["sent"] == [12] * 4 + [10] * 4, (
            f"rank {rank}'s ring sent {result['sent']} elements per step: each of the ring's steps sends one chunk")


# ---------------------------------------------------------------- the guards (see conftest.py)

solution = importlib.import_module(f"solutions.{LAB}")  # what a wrong answer may build on


def qkv_shard_by_the_engine(weight, num_heads, num_kv_heads, head_dim, rank, size):
    config = types.SimpleNamespace(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
    return engine_layers.split_qkv(weight, config, rank, size)


class AttentionCutByTheEngine(solution.ParallelAttention):
    def __init__(self, attn, rank, size, comm=None):
        super().__init__(attn, rank, size, comm)
        self.qkv_proj = engine_layers.ColumnParallelLinear(engine_layers.split_qkv(attn.qkv_proj.weight, SMALL, rank,
                                                                                   size).clone())


class AttentionReducedByTheEngine(solution.ParallelAttention):
    def forward(self, x, cos, sin, meta, layer_idx, kv_cache, attention):
        t, d = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj(x).split([self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], dim=-1)
        q, k = (engine_model.apply_rope(q.view(t, -1, d), cos, sin),
                engine_model.apply_rope(k.view(t, -1, d), cos, sin))
        out = attention(q, k, v.view(t, -1, d), meta, kv_cache, layer_idx).reshape(t, -1)
        return engine_layers.RowParallelLinear(self.o_proj.weight, self.comm)(out)


class LMHeadOfTheEngine(solution.ParallelLMHead):
    def forward(self, x):
        return engine_layers.ParallelLMHead(self.weight, self.comm)(x)


def reduce_scatter_by_torch(t, comm):
    out = [torch.empty_like(t.chunk(comm.size)[0])]
    dist.reduce_scatter(out[0], list(t.chunk(comm.size)))
    return out[0]


def all_gather_by_torch(chunk, comm):
    parts = [torch.empty_like(chunk) for _ in range(comm.size)]
    dist.all_gather(parts, chunk)
    return torch.cat(parts)


def all_reduce_by_torch(t, comm):
    dist.all_reduce(t)
    return t


# Each part of the lab handed to the engine (or to torch.distributed), and a grading test that must fail it.
HAND_OFFS = [
    ("column_shard", engine_layers.split_rows, test_column_shard_cuts_the_outputs),
    ("row_shard", engine_layers.split_columns, test_row_shard_cuts_the_inputs),
    ("qkv_shard", qkv_shard_by_the_engine, test_qkv_shard_gives_each_rank_whole_heads),
    ("ParallelAttention.__init__", AttentionCutByTheEngine, test_parallel_attention_holds_its_heads_as_copies),
    ("ParallelAttention.forward", AttentionReducedByTheEngine,
     test_parallel_attention_sums_to_the_full_block_with_one_all_reduce),
    ("vocab_parallel_embedding",
     lambda ids, w, start, comm=None: engine_layers.VocabParallelEmbedding(w, start, comm)(ids),
     test_the_ranks_parts_sum_to_the_full_embedding),
    ("ParallelLMHead.forward", LMHeadOfTheEngine, test_lm_head_gives_each_rank_its_vocabulary_columns),
    ("reduce_scatter", reduce_scatter_by_torch, test_reduce_scatter_sums_each_ranks_own_chunk),
    ("all_gather", all_gather_by_torch, test_all_gather_joins_every_ranks_chunk),
    ("ring_all_reduce", all_reduce_by_torch, test_ring_all_reduce_is_a_sum_in_place_for_any_shape),
]


def test_every_part_of_the_lab_has_a_hand_off_check(asked_for):
    missing = set(asked_for(LAB)) - {part for part, *_ in HAND_OFFS}
    assert not missing, f"parts of the lab with no hand-off check above: {sorted(missing)}"


@pytest.mark.parametrize("part,replacement,test", HAND_OFFS, ids=[part for part, *_ in HAND_OFFS])
def test_the_grader_fails_a_part_handed_off(hand_off, part, replacement, test):
    hand_off(part, replacement, test)


# ---------------------------------------------------------------- wrong answers, and the one line each prints

def column_shard_of_the_inputs(weight, rank, size):
    return weight.chunk(size, dim=1)[rank]


def qkv_shard_of_the_fused_rows(weight, num_heads, num_kv_heads, head_dim, rank, size):
    """Cuts the fused [q; k; v] weight in `size` equal pieces, as if it were one projection."""
    return weight.chunk(size)[rank]


class AttentionOfViews(solution.ParallelAttention):
    """Keeps views of the full weights (the shard functions' results as they are)."""

    def __init__(self, attn, rank, size, comm=None):
        super().__init__(attn, rank, size, comm)
        self.o_proj.weight = torch.nn.Parameter(solution.row_shard(attn.o_proj.weight, rank, size), requires_grad=False)


class AttentionReducedBeforeOProj(solution.ParallelAttention):
    """All-reduces the attention output (the rank's heads), then applies o_proj without an exchange."""

    def forward(self, x, cos, sin, meta, layer_idx, kv_cache, attention):
        t, d = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj(x).split([self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], dim=-1)
        q, k = (engine_model.apply_rope(q.view(t, -1, d), cos, sin),
                engine_model.apply_rope(k.view(t, -1, d), cos, sin))
        out = attention(q, k, v.view(t, -1, d), meta, kv_cache, layer_idx).reshape(t, -1)
        out = out if self.comm is None else self.comm.all_reduce(out)
        return F.linear(out, self.o_proj.weight)


class AttentionWithoutItsAllReduce(solution.ParallelAttention):
    def __init__(self, attn, rank, size, comm=None):
        super().__init__(attn, rank, size, None)


def embedding_without_zeros(ids, weight_shard, start, comm=None):
    """Clamps the ids into the range but keeps the rows of ids another rank holds."""
    part = weight_shard[(ids - start).clamp(0, weight_shard.shape[0] - 1)]
    return part if comm is None else comm.all_reduce(part)


def embedding_indexed_as_is(ids, weight_shard, start, comm=None):
    """Indexes the shard with every id's local number, in range or not."""
    part = weight_shard[ids - start]
    return part if comm is None else comm.all_reduce(part)


def embedding_in_fp32(ids, weight_shard, start, comm=None):
    return solution.vocab_parallel_embedding(ids, weight_shard.float(), start, comm)


class LMHeadAllReduced(solution.ParallelLMHead):
    """Puts its logits in a zero [T, V] and all-reduces that."""

    def forward(self, x):
        logits = F.linear(x, self.weight)
        if self.comm is None:
            return logits
        whole = logits.new_zeros(*logits.shape[:-1], 3 * logits.shape[-1])
        return self.comm.all_reduce(whole)


def reduce_scatter_returning_the_next_chunk(t, comm):
    """The textbook ring's indices, which leave rank r with chunk r + 1."""
    chunks, incoming = [c.clone() for c in t.chunk(comm.size)], torch.empty_like(t.chunk(comm.size)[0])
    for step in range(comm.size - 1):
        send, receive = (comm.rank - step) % comm.size, (comm.rank - step - 1) % comm.size
        comm.sendrecv(chunks[send], (comm.rank + 1) % comm.size, incoming, (comm.rank - 1) % comm.size)
        chunks[receive] += incoming
    return chunks[(comm.rank + 1) % comm.size]


def all_reduce_sending_everything(t, comm):
    """Passes the whole tensor round the ring, adding each neighbour's: the right sum, p - 1 whole copies sent."""
    passing, incoming = t.clone(), torch.empty_like(t)
    for _ in range(comm.size - 1):
        comm.sendrecv(passing, (comm.rank + 1) % comm.size, incoming, (comm.rank - 1) % comm.size)
        passing = incoming.clone()
        t += incoming
    return t


# A wrong part, a grading test, and the one line that test must print for it (a regular expression).
WRONG_ANSWERS = [
    ({"column_shard": column_shard_of_the_inputs}, test_column_shard_cuts_the_outputs,
     r"column_shard of W \[12, 5\] over 3 ranks must be \[4, 5\] \(a third of the OUTPUTS, W's dim 0\), got "
     r"\[\(12, 2\), \(12, 2\), \(12, 1\)\]"),
    ({"row_shard": solution.column_shard}, test_row_shard_cuts_the_inputs,
     r"row_shard of W \[5, 12\] over 3 ranks must be \[5, 4\] \(a third of the INPUTS, W's dim 1\), got .*"),
    ({"qkv_shard": qkv_shard_of_the_fused_rows}, test_qkv_shard_gives_each_rank_whole_heads,
     r"rank 0: its query heads 0 \.\.\. 2 from q's rows, its KV head\(s\) 0 \.\.\. 0 from k's and from v's, joined q, "
     r"k, v: cut q, k and v apart first"),
    ({"ParallelAttention": AttentionOfViews}, test_parallel_attention_holds_its_heads_as_copies,
     r"rank 0's o_proj is a view of the full \[10, 36\] weight: keep a copy \(a view keeps the whole weight alive in "
     r"every rank\)"),
    ({"ParallelAttention": AttentionReducedBeforeOProj},
     test_parallel_attention_sums_to_the_full_block_with_one_all_reduce,
     r"rank 0's attention block all-reduced a \[7, 12\] tensor: its one exchange sums o_proj's partial outputs, "
     r"\[7, 10\] .*"),
    ({"ParallelAttention": AttentionWithoutItsAllReduce},
     test_parallel_attention_sums_to_the_full_block_with_one_all_reduce,
     r"rank 0's attention block all-reduced 0 times: it needs exactly one, of its partial output"),
    ({"vocab_parallel_embedding": embedding_without_zeros}, test_each_rank_looks_up_only_its_vocabulary_range,
     r"rank 0 holds ids 0 \.\.\. 3: every other id's row must be zeros \(another rank holds it\)"),
    ({"vocab_parallel_embedding": embedding_indexed_as_is}, test_each_rank_looks_up_only_its_vocabulary_range,
     r"vocab_parallel_embedding indexed past its shard \(index \d+ is out of bounds .*\): an id another rank holds "
     r"\(outside 0 \.\.\. 3\) must not index the 4-row shard; give it a row of zeros"),
    ({"vocab_parallel_embedding": embedding_in_fp32}, test_the_embedding_keeps_the_tables_dtype,
     r"a bfloat16 table gave torch.float32 rows: zero the others' rows in the table's dtype"),
    ({"ParallelLMHead": LMHeadAllReduced}, test_lm_head_gathers_its_columns_once,
     r"rank 0's LM head all-reduced \[\(5, 12\)\]: the ranks' logits are different columns of the whole \[T, V\], not "
     r"terms of a sum; join them .*"),
    ({"reduce_scatter": reduce_scatter_returning_the_next_chunk}, test_reduce_scatter_sums_each_ranks_own_chunk,
     r"rank 0's reduce_scatter must return chunk 0 \(rows 0 \.\.\. 1\) of the sum over the ranks"),
    ({"ring_all_reduce": all_reduce_sending_everything}, test_ring_all_reduce_is_a_sum_in_place_for_any_shape,
     r"rank 0's ring_all_reduce sent 70 elements: a reduce-scatter then an all-gather send 2 \(p - 1\) / p of the "
     r"\(padded\) 36, 48: each rank's share, not the whole tensor"),
]


@pytest.mark.parametrize("replacements,test,line", WRONG_ANSWERS,
                         ids=[f"{t.__name__.removeprefix('test_')}-{i}" for i, (_, t, _) in enumerate(WRONG_ANSWERS)])
def test_a_wrong_answer_fails_with_one_line_that_says_what_to_fix(wrong_answer, replacements, test, line):
    wrong_answer(test, replacements, line)
