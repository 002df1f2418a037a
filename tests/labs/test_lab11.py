"""Grades lab 11 (tensor parallelism: the column- and row-parallel linears, the attention's split by heads, the
vocabulary-parallel embedding) in either tree.

    pytest tests/labs/test_lab11.py --impl=labs        # your work
    pytest tests/labs/test_lab11.py --impl=solutions   # the reference answers

First every rank's shard runs in one process (comm=None: the partial results), and the shards' outputs, joined
or summed, must equal the full layer's within fp32 rounding (a split product adds in another order). The last
test, run after the others, starts three real ranks (processes joined by torch.distributed's gloo through a file
store in a temporary folder), which run an embedding, an attention block and an MLP block through your layers
together, meeting at your all-reduces.
"""
from __future__ import annotations

import importlib
import os
import sys
import tempfile
import time
import types

import pytest
import torch
import torch.nn.functional as F

from mini_engine.parallel import layers as engine_layers

LAB = "lab11_tensor_parallel"
# The engine's parallel layers and splits already do these jobs: calling them fails the test.
SHORTCUTS = {name: [engine_layers] for name in ("column_shard", "column_parallel_linear", "row_shard",
                                                "row_parallel_linear", "qkv_shard", "vocab_parallel_embedding")}
TOL = dict(rtol=1e-5, atol=1e-5)


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


class RecordingComm:
    """One rank's comm in one process: records what is all-reduced, and 'sums' over one rank (returns t)."""

    def __init__(self):
        self.reduced = []

    def all_reduce(self, t):
        self.reduced.append(t.clone())
        return t


def close(a, b) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, **TOL)


# ---------------------------------------------------------------- 1. column-parallel

def test_column_shard_cuts_the_outputs(impl):
    w = rand(12, 5)
    shards = [impl.column_shard(w, r, 3) for r in range(3)]
    assert all(tuple(s.shape) == (4, 5) for s in shards), (
        f"column_shard of W [12, 5] over 3 ranks must be [4, 5] (a third of the OUTPUTS, W's dim 0), got "
        f"{[tuple(s.shape) for s in shards]}")
    assert torch.equal(shards[1], w[4:8]), "rank 1 of 3 holds outputs 4 ... 7 of 12: W's rows 4 ... 7, in order"
    assert torch.equal(torch.cat(shards), w), "the ranks' shards, joined in rank order, must give W back"


def test_column_parallel_outputs_join_to_the_full_layer(impl):
    w, x = rand(12, 5), rand(2, 3, 5, seed=1)
    parts = [impl.column_parallel_linear(x, impl.column_shard(w, r, 3)) for r in range(3)]
    assert all(tuple(p.shape) == (2, 3, 4) for p in parts), (
        f"a column-parallel rank gives its third of the outputs, [2, 3, 4] for x [2, 3, 5] and W [12, 5]; got "
        f"{[tuple(p.shape) for p in parts]}")
    assert close(torch.cat(parts, dim=-1), x @ w.T), (
        "the ranks' outputs joined along the last dimension must equal the full layer's x W^T")


# ---------------------------------------------------------------- 2. row-parallel

def test_row_shard_cuts_the_inputs(impl):
    w = rand(5, 12)
    shards = [impl.row_shard(w, r, 3) for r in range(3)]
    assert all(tuple(s.shape) == (5, 4) for s in shards), (
        f"row_shard of W [5, 12] over 3 ranks must be [5, 4] (a third of the INPUTS, W's dim 1), got "
        f"{[tuple(s.shape) for s in shards]}")
    assert torch.equal(shards[2], w[:, 8:]), "rank 2 of 3 holds inputs 8 ... 11 of 12: W's columns 8 ... 11"


def test_row_parallel_partials_sum_to_the_full_layer(impl):
    w, x = rand(5, 12), rand(7, 12, seed=1)
    parts = [impl.row_parallel_linear(x[:, 4 * r:4 * (r + 1)], impl.row_shard(w, r, 3)) for r in range(3)]
    assert all(tuple(p.shape) == (7, 5) for p in parts), (
        f"each row-parallel rank gives a partial y of the full width, [7, 5]; got {[tuple(p.shape) for p in parts]}")
    assert close(sum(parts), x @ w.T), "the ranks' partial outputs, summed, must equal the full layer's x W^T"


def test_row_parallel_all_reduces_once(impl):
    w, x = rand(5, 12), rand(7, 12, seed=1)
    comm = RecordingComm()
    partial = impl.row_parallel_linear(x[:, :4], impl.row_shard(w, 0, 3))
    y = impl.row_parallel_linear(x[:, :4], impl.row_shard(w, 0, 3), comm)
    assert len(comm.reduced) == 1, (f"row_parallel_linear with a comm must all-reduce exactly once (its partial y), "
                                    f"it called comm.all_reduce {len(comm.reduced)} times")
    assert close(comm.reduced[0], partial) and close(y, partial), (
        "all-reduce the rank's partial y (x_shard W_shard^T) and return what comm.all_reduce gives back")


def test_column_then_row_is_the_mlp_with_one_all_reduce(impl):
    """SmolLM2's MLP at a small width: gate/up column-parallel, SwiGLU on the rank's own columns, down row-parallel."""
    hidden, inter = 8, 24
    gate, up, down, x = rand(inter, hidden), rand(inter, hidden, seed=1), rand(hidden, inter, seed=2), rand(3, hidden, seed=3)
    full = (F.silu(x @ gate.T) * (x @ up.T)) @ down.T
    parts, comms = [], []
    for r in range(3):
        h = F.silu(impl.column_parallel_linear(x, impl.column_shard(gate, r, 3))) * \
            impl.column_parallel_linear(x, impl.column_shard(up, r, 3))
        comms.append(RecordingComm())
        parts.append(impl.row_parallel_linear(h, impl.row_shard(down, r, 3), comms[-1]))
    assert close(sum(parts), full), "column-parallel gate/up, then row-parallel down: the partials must sum to the MLP"
    assert [len(c.reduced) for c in comms] == [1, 1, 1], "the MLP block costs one all-reduce a rank"


# ---------------------------------------------------------------- 3. attention, split by heads

def gqa_attention(q, k, v):
    """q [T, Hq, D], k and v [T, Hkv, D]: causal attention, each query head reading its group's KV head; [T, Hq*D]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
    return out.transpose(0, 1).reshape(q.shape[0], -1)


def attention_block(x, qkv_w, o_w, heads, kv_heads, d):
    q, k, v = (x @ qkv_w.T).split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    out = gqa_attention(q.view(-1, heads, d), k.view(-1, kv_heads, d), v.view(-1, kv_heads, d))
    return out @ o_w.T


@pytest.mark.parametrize("heads,kv_heads,size", [(9, 3, 3), (4, 2, 2), (6, 2, 1)],
                         ids=["smollm2-9q-3kv-3ranks", "4q-2kv-2ranks", "6q-2kv-1rank"])
def test_qkv_shard_gives_each_rank_whole_heads(impl, heads, kv_heads, size):
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


def test_attention_split_by_heads_is_the_full_attention(impl):
    """SmolLM2-135M's heads (9 query, 3 KV) at a small head size: each rank runs attention over its own heads alone,
    o_proj row-parallel; the partials sum to the full attention block, with one all-reduce a rank."""
    heads, kv_heads, d, hidden, size = 9, 3, 4, 12, 3
    qkv_w, o_w, x = rand((heads + 2 * kv_heads) * d, hidden), rand(hidden, heads * d, seed=1), rand(5, hidden, seed=2)
    full = attention_block(x, qkv_w, o_w, heads, kv_heads, d)
    parts, comms = [], []
    for r in range(size):
        hq, hkv = heads // size, kv_heads // size
        qkv = impl.column_parallel_linear(x, impl.qkv_shard(qkv_w, heads, kv_heads, d, r, size))
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        out = gqa_attention(q.view(-1, hq, d), k.view(-1, hkv, d), v.view(-1, hkv, d))
        comms.append(RecordingComm())
        parts.append(impl.row_parallel_linear(out, impl.row_shard(o_w, r, size), comms[-1]))
    assert close(sum(parts), full), "each rank's attention over its own heads, then o_proj row-parallel: the " \
                                    "partials must sum to the full attention block"
    assert [len(c.reduced) for c in comms] == [1, 1, 1], "the attention block costs one all-reduce a rank"


# ---------------------------------------------------------------- 4. vocabulary-parallel embedding

IDS = torch.tensor([[0, 3, 4, 7], [8, 11, 5, 0]])


def test_each_rank_looks_up_only_its_vocabulary_range(impl):
    table = rand(12, 6)
    for r in range(3):
        part = impl.vocab_parallel_embedding(IDS, table[4 * r:4 * (r + 1)], 4 * r)
        assert tuple(part.shape) == (2, 4, 6), f"ids [2, 4] and a hidden size of 6 give [2, 4, 6], got {tuple(part.shape)}"
        mine = (IDS >= 4 * r) & (IDS < 4 * (r + 1))
        assert torch.equal(part[~mine], torch.zeros_like(part[~mine])), (
            f"rank {r} holds ids {4 * r} ... {4 * r + 3}: every other id's row must be zeros (another rank holds it)")
        assert torch.equal(part[mine], table[IDS[mine]]), (
            f"rank {r} holds ids {4 * r} ... {4 * r + 3}: each of them gives its row of the table (id - start in the shard)")


def test_the_ranks_parts_sum_to_the_full_embedding(impl):
    table = rand(12, 6)
    comms = [RecordingComm() for _ in range(3)]
    parts = [impl.vocab_parallel_embedding(IDS, table[4 * r:4 * (r + 1)], 4 * r, comms[r]) for r in range(3)]
    assert torch.equal(sum(parts), F.embedding(IDS, table)), "the ranks' parts, summed, must be the full lookup"
    assert [len(c.reduced) for c in comms] == [1, 1, 1], "the embedding costs one all-reduce a rank"


def test_the_embedding_keeps_the_tables_dtype(impl):
    table = rand(12, 6).bfloat16()
    part = impl.vocab_parallel_embedding(IDS, table[4:8], 4)
    assert part.dtype == torch.bfloat16, f"a bfloat16 table gave {part.dtype} rows: zero the others' rows in the table's dtype"


# ---------------------------------------------------------------- three real ranks (slow, last)

SIZE, HEADS, KV_HEADS, D, HIDDEN, INTER, VOCAB = 3, 9, 3, 4, 12, 24, 30


def block_weights():
    g = torch.Generator().manual_seed(11)
    shape = dict(embed=(VOCAB, HIDDEN), qkv=((HEADS + 2 * KV_HEADS) * D, HIDDEN), o=(HIDDEN, HEADS * D),
                 gate=(INTER, HIDDEN), up=(INTER, HIDDEN), down=(HIDDEN, INTER))
    return {name: torch.randn(*s, generator=g) / s[1] ** 0.5 for name, s in shape.items()}  # activations near 1


IDS_REAL = torch.tensor([0, 9, 10, 19, 20, 29, 5])


def block_forward(w, comm, rank, lab):
    """Embedding, attention block and MLP block (residuals, no norms) through the lab's layers at rank `rank`; with
    lab=None, the full model in one process."""
    if lab is None:
        x = F.embedding(IDS_REAL, w["embed"])
        x = x + attention_block(x, w["qkv"], w["o"], HEADS, KV_HEADS, D)
        return x + (F.silu(x @ w["gate"].T) * (x @ w["up"].T)) @ w["down"].T
    rows, hq, hkv = VOCAB // SIZE, HEADS // SIZE, KV_HEADS // SIZE
    x = lab.vocab_parallel_embedding(IDS_REAL, lab.column_shard(w["embed"], rank, SIZE), rank * rows, comm)
    qkv = lab.column_parallel_linear(x, lab.qkv_shard(w["qkv"], HEADS, KV_HEADS, D, rank, SIZE))
    q, k, v = qkv.split([hq * D, hkv * D, hkv * D], dim=-1)
    out = gqa_attention(q.view(-1, hq, D), k.view(-1, hkv, D), v.view(-1, hkv, D))
    x = x + lab.row_parallel_linear(out, lab.row_shard(w["o"], rank, SIZE), comm)
    h = F.silu(lab.column_parallel_linear(x, lab.column_shard(w["gate"], rank, SIZE))) * \
        lab.column_parallel_linear(x, lab.column_shard(w["up"], rank, SIZE))
    return x + lab.row_parallel_linear(h, lab.row_shard(w["down"], rank, SIZE), comm)


def rank_worker(rank: int, module: str, folder: str, timeout: float) -> None:
    """One real rank (a spawned process): join the group through a file:// store in `folder`, run the blocks through
    the lab's layers, save the output (or the error, one line) for the grader."""
    import datetime

    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        lab = importlib.import_module(module)
        dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=SIZE,
                                timeout=datetime.timedelta(seconds=timeout))

        class Comm:  # the group's all-reduce, as the engine's Communicator gives it
            calls = 0

            def all_reduce(self, t):
                Comm.calls += 1
                dist.all_reduce(t)
                return t

        y = block_forward(block_weights(), Comm(), rank, lab)
        torch.save({"y": y, "all_reduces": Comm.calls}, f"{folder}/rank{rank}.pt")
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - say what went wrong, in one line, to the grader
        with open(f"{folder}/rank{rank}.err", "w") as f:
            f.write(f"{type(e).__name__}: {' '.join(str(e).split())}")
        raise


def run_ranks(module: str, timeout: float = 60.0, deadline_s: float = 300.0) -> list[dict]:
    """Start SIZE ranks with torch.multiprocessing (spawn), wait for them (at most `deadline_s`), return each rank's
    saved result; a rank's error, or ranks that never finish, fail in one line."""
    import torch.multiprocessing as mp

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo" if sys.platform.startswith("linux") else "lo0")
    with tempfile.TemporaryDirectory(prefix="lab11_ranks_") as folder:
        context = mp.start_processes(rank_worker, args=(module, folder, timeout), nprocs=SIZE, join=False,
                                     start_method="spawn")
        end = time.monotonic() + deadline_s
        try:
            while not context.join(timeout=max(0.1, min(5.0, end - time.monotonic()))):
                if time.monotonic() > end:
                    pytest.fail(f"{SIZE} ranks did not finish within {deadline_s:g} s: does every rank call "
                                "all_reduce the same number of times?", pytrace=False)
        except mp.ProcessRaisedException:
            errors = [open(os.path.join(folder, f)).read() for f in sorted(os.listdir(folder)) if f.endswith(".err")]
            pytest.fail(f"a rank failed: {errors[0] if errors else 'see its traceback (--tb=long)'}", pytrace=False)
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                process.join(5)
        return [torch.load(os.path.join(folder, f"rank{r}.pt")) for r in range(SIZE)]


@pytest.mark.engine("three real ranks (processes joined by torch.distributed's gloo) run an embedding, an attention "
                    "block and an MLP block through your layers together, about 15 seconds")
def test_three_real_ranks_give_the_full_model(impl):
    w = block_weights()
    block_forward(w, RecordingComm(), 0, impl)  # in this process first: a TODO, or a hand-off, says so here
    results = run_ranks(impl.__name__)
    full = block_forward(w, None, 0, None)
    for rank, result in enumerate(results):
        assert result["all_reduces"] == 3, (
            f"rank {rank} all-reduced {result['all_reduces']} times: an embedding, an attention block and an MLP "
            "block need 3 (one each)")
        assert close(result["y"], full), (
            f"rank {rank}'s output differs from the full model's by {(result['y'] - full).abs().max():.2e}: every rank "
            "must end with the whole hidden state")


# ---------------------------------------------------------------- the guards (see conftest.py)

solution = importlib.import_module(f"solutions.{LAB}")  # what a wrong answer may build on


def qkv_shard_by_the_engine(weight, num_heads, num_kv_heads, head_dim, rank, size):
    config = types.SimpleNamespace(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
    return engine_layers.split_qkv(weight, config, rank, size)


# Each part of the lab handed to the engine's layers, and a grading test that must fail it.
HAND_OFFS = [
    ("column_shard", engine_layers.split_rows, test_column_shard_cuts_the_outputs),
    ("column_parallel_linear", lambda x, w: engine_layers.ColumnParallelLinear(w)(x),
     test_column_parallel_outputs_join_to_the_full_layer),
    ("row_shard", engine_layers.split_columns, test_row_shard_cuts_the_inputs),
    ("row_parallel_linear", lambda x, w, comm=None: engine_layers.RowParallelLinear(w, comm)(x),
     test_row_parallel_partials_sum_to_the_full_layer),
    ("qkv_shard", qkv_shard_by_the_engine, test_attention_split_by_heads_is_the_full_attention),
    ("vocab_parallel_embedding", lambda ids, w, start, comm=None: engine_layers.VocabParallelEmbedding(w, start, comm)(ids),
     test_the_ranks_parts_sum_to_the_full_embedding),
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


def row_parallel_without_the_all_reduce(x_shard, weight_shard, comm=None):
    return x_shard @ weight_shard.T


def qkv_shard_of_the_fused_rows(weight, num_heads, num_kv_heads, head_dim, rank, size):
    """Cuts the fused [q; k; v] weight in `size` equal pieces, as if it were one projection."""
    return weight.chunk(size)[rank]


def embedding_without_zeros(ids, weight_shard, start, comm=None):
    """Clamps the ids into the range but keeps the rows of ids another rank holds."""
    part = weight_shard[(ids - start).clamp(0, weight_shard.shape[0] - 1)]
    return part if comm is None else comm.all_reduce(part)


def embedding_in_fp32(ids, weight_shard, start, comm=None):
    return solution.vocab_parallel_embedding(ids, weight_shard.float(), start, comm)


# A wrong part, a grading test, and the one line that test must print for it (a regular expression).
WRONG_ANSWERS = [
    ({"column_shard": column_shard_of_the_inputs}, test_column_shard_cuts_the_outputs,
     r"column_shard of W \[12, 5\] over 3 ranks must be \[4, 5\] \(a third of the OUTPUTS, W's dim 0\), got "
     r"\[\(12, 2\), \(12, 2\), \(12, 1\)\]"),
    ({"row_shard": solution.column_shard}, test_row_shard_cuts_the_inputs,
     r"row_shard of W \[5, 12\] over 3 ranks must be \[5, 4\] \(a third of the INPUTS, W's dim 1\), got .*"),
    ({"row_parallel_linear": row_parallel_without_the_all_reduce}, test_row_parallel_all_reduces_once,
     r"row_parallel_linear with a comm must all-reduce exactly once \(its partial y\), it called comm.all_reduce "
     r"0 times"),
    ({"qkv_shard": qkv_shard_of_the_fused_rows}, test_attention_split_by_heads_is_the_full_attention,
     r"each rank's attention over its own heads, then o_proj row-parallel: the partials must sum to the full "
     r"attention block"),
    ({"vocab_parallel_embedding": embedding_without_zeros}, test_each_rank_looks_up_only_its_vocabulary_range,
     r"rank 0 holds ids 0 \.\.\. 3: every other id's row must be zeros \(another rank holds it\)"),
    ({"vocab_parallel_embedding": embedding_in_fp32}, test_the_embedding_keeps_the_tables_dtype,
     r"a bfloat16 table gave torch.float32 rows: zero the others' rows in the table's dtype"),
]


@pytest.mark.parametrize("replacements,test,line", WRONG_ANSWERS,
                         ids=[f"{t.__name__.removeprefix('test_')}-{i}" for i, (_, t, _) in enumerate(WRONG_ANSWERS)])
def test_a_wrong_answer_fails_with_one_line_that_says_what_to_fix(wrong_answer, replacements, test, line):
    wrong_answer(test, replacements, line)
