"""Pipeline parallelism (chapter 11): the model's stack of layers cut into `size` stages, each a process of its own
holding its layers, their share of the KV cache and nothing else; a step's activations pass from stage to stage.

`PipelineModel(full, 3)` gives stage s the layers [s*L/3, (s+1)*L/3): stage 0 (the engine's own process) also holds
the embedding, the last stage the final norm and the LM head (with tied weights, a copy of the embedding table of
its own). Every step, stage 0 sends the others the step's compact inputs once, down a pipe (per sequence: query and
context lengths, block table or slot; no tensor), and each stage builds its own attention metadata from them
(`AttentionMetadata.build`, whose arguments the step's metadata keeps in `built_from`). The activations go from
stage to stage over torch.distributed's point-to-point `send`/`recv` (gloo between CPU processes, NCCL between
GPUs); the last stage sends the logits back to stage 0 on a second group, so that on NCCL, where a pair of ranks
runs its operations in order on one stream, logits coming back never queue behind activations going out.

A stage that only waits is a stage that costs memory and does nothing: with the whole step as one batch, stage 1
waits while stage 0 computes, then stage 0 waits. GPipe (Huang et al. 2019) cuts the batch into m micro-batches: while
stage 1 computes micro-batch 0, stage 0 computes micro-batch 1. Here a step's sequences are cut into
`micro_batches` groups (whole sequences, about equal tokens each). With p stages of equal time t a micro-batch, the
step takes (m + p - 1) t, and each stage idles (p - 1) t of it: the bubble, (p - 1)/(m + p - 1) of the stage-time.
`measure_bubble` measures it (see there for what a 2-core CPU does to the measurement). vLLM's engine fills its
stages another way: it keeps up to pipeline_parallel_size whole batches in flight, each a scheduler step of its own
(one scheduler per stage, "virtual engines", in its V0 engine: vllm-project/vllm PR #4412; a queue of batches in
V1, PR #13064); here one step is cut, which keeps the engine's one scheduler and one batch a step as they are.

Failures are handled as `ranks.ParallelModel` handles them: a stage that dies, raises or stops answering makes the
step a RuntimeError on stage 0 within the timeout (MINI_ENGINE_TP_TIMEOUT seconds, default 60), quoting a stage's
own error where it sent one, and every stage is ended; `shutdown()`, garbage collection and the interpreter's exit
end them too.
"""
from __future__ import annotations

import bisect
import contextlib
import dataclasses
import datetime
import itertools
import os
import signal
import time
import traceback
from dataclasses import dataclass

import torch
from torch import nn

from ..attention import AttentionMetadata, resolve_backend
from ..kv_cache import PagedKVCache
from ..model import LlamaModel, rope_tables
from .comm import Communicator
from ..runner import ModelRunner
from .ranks import Ranks, _recv, _send, make_cache

PER_SEQUENCE = ("query_lens", "context_lens", "slots", "block_tables")  # built_from's lists with one entry a sequence


def check_pipeline_parallel_size(config, size, micro_batches=1) -> None:
    """A ValueError unless `size` stages (1 ... the model's layers) and `micro_batches` (>= 1) are ints that fit."""
    if not isinstance(size, int) or isinstance(size, bool) or not 1 <= size <= config.num_layers:
        raise ValueError(f"pipeline_parallel_size must be an int from 1 to the model's num_layers "
                         f"({config.num_layers}): each stage holds at least one layer; got {size!r}")
    if not isinstance(micro_batches, int) or isinstance(micro_batches, bool) or micro_batches < 1:
        raise ValueError(f"pipeline_micro_batches (micro_batches) must be an int >= 1, got {micro_batches!r}")


def stage_layers(num_layers: int, size: int, stage: int) -> range:
    """Stage `stage`'s layers: [stage*L/size, (stage+1)*L/size), rounded down (30 layers, 4 stages: 7, 8, 7, 8)."""
    return range(stage * num_layers // size, (stage + 1) * num_layers // size)


class StageModel(LlamaModel):
    """One stage: the core's LlamaModel over its own layers only (its config's num_layers, cache layers 0 ...), the
    embedding on the first stage and the final norm and LM head on the last; elsewhere those are the identity, so the
    core's `run` goes through the stage unchanged: activations in, activations (or logits) out."""

    def __init__(self, config, attention_backend: str, first: bool, last: bool):
        super().__init__(config, attention_backend)
        if not first:
            self.embed_tokens = nn.Identity()
        if not last:
            self.norm, self.lm_head = nn.Identity(), nn.Identity()

    def tie_weights(self) -> None:
        if isinstance(self.embed_tokens, nn.Embedding) and isinstance(self.lm_head, nn.Linear):
            super().tie_weights()  # one stage holds both ends (size 1); a last stage alone has its own copy

    @property
    def device(self) -> torch.device:
        return self.layers[0].input_layernorm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].input_layernorm.weight.dtype


def stage_weights(state: dict, config, size: int, stage: int):
    """(name, weight) of the full model's state dict that stage `stage` holds, under its own layer numbers."""
    layers = stage_layers(config.num_layers, size, stage)
    for name, w in state.items():
        if name.startswith("layers."):
            i = int(name.split(".")[1])
            if i in layers:
                yield f"layers.{i - layers.start}.{name.split('.', 2)[2]}", w
        elif name.startswith("embed_tokens.") and stage == 0 or \
                name.startswith(("norm.", "lm_head.")) and stage == size - 1:
            yield name, w


def build_stage(config, size: int, stage: int, attention_backend: str, device, dtype, weights: dict) -> StageModel:
    """Stage `stage`'s model, built on the meta device (no memory), then given storage and its weights."""
    local = dataclasses.replace(config, num_layers=len(stage_layers(config.num_layers, size, stage)))
    with torch.device("meta"):
        model = StageModel(local, attention_backend, stage == 0, stage == size - 1)
    model = model.to_empty(device=device).to(dtype)
    model.tie_weights()
    model.rope_cos, model.rope_sin = rope_tables(config, device)
    model.load_state_dict(weights)
    return model.eval()


@dataclass
class MicroBatch:
    """One group of a step's sequences, as every stage needs it: build()'s arguments for its sequences alone, its
    packed token range in the step, and which of the step's logits rows it gives (rows, None: all its tokens) and
    from which of its own tokens (local)."""
    built_from: dict
    tokens: tuple[int, int]
    rows: list[int] | None
    local: list[int] | None

    @property
    def num_tokens(self) -> int:
        return self.tokens[1] - self.tokens[0]

    @property
    def num_rows(self) -> int:
        return self.num_tokens if self.local is None else len(self.local)

    def meta(self, device, logits: bool) -> AttentionMetadata:
        meta = AttentionMetadata.build(**self.built_from, device=device)
        if logits and self.local is not None:
            meta.logits_indices = torch.tensor(self.local, dtype=torch.long, device=device)
        return meta


def split_sequences(query_lens: list[int], groups: int) -> list[tuple[int, int]]:
    """Cut sequences 0 ... S-1 into min(groups, S) runs of consecutive sequences with about equal tokens each (no
    sequence cut, none empty): the cut before run g falls at the sequence boundary nearest g/groups of the tokens."""
    n = min(groups, len(query_lens))
    starts = list(itertools.accumulate(query_lens, initial=0))
    cuts = [0]
    for g in range(1, n):
        target = starts[-1] * g / n
        lo, hi = cuts[-1] + 1, len(query_lens) - (n - g)  # each run keeps at least one sequence
        i = min(max(bisect.bisect_left(starts, target), lo), hi)
        if i > lo and target - starts[i - 1] < starts[i] - target:
            i -= 1
        cuts.append(i)
    return list(zip(cuts, cuts[1:] + [len(query_lens)]))


def plan_micro_batches(meta: AttentionMetadata, groups: int) -> list[MicroBatch]:
    """The step's sequences as micro-batches; the step's logits rows (meta.logits_indices, in the runner's order)
    shared out to the micro-batch that holds each row's token."""
    built = meta.built_from
    starts = list(itertools.accumulate(built["query_lens"], initial=0))
    wanted = None if meta.logits_indices is None else meta.logits_indices.tolist()
    plans = []
    for i0, i1 in split_sequences(built["query_lens"], groups):
        part = {k: (v[i0:i1] if k in PER_SEQUENCE and v is not None else v) for k, v in built.items()}
        part["last_only"] = False  # the rows wanted are the step's logits_indices, shared out below
        a, b = starts[i0], starts[i1]
        rows = None if wanted is None else [j for j, r in enumerate(wanted) if a <= r < b]
        plans.append(MicroBatch(part, (a, b), rows, None if rows is None else [wanted[j] - a for j in rows]))
    return plans


def _timed(device: torch.device, timing: bool):
    """(wall, CPU) clocks, read after the device has finished when timing a GPU (its work is queued, not done)."""
    if timing and device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter(), time.process_time()


def stage_main(stage: int, size: int, stores: tuple[str, str], conn, threads: int, device: str,
               timeout: float) -> None:
    """A stage other than 0: join both groups, receive its layers' weights, then run what stage 0 sends until
    "stop" (or until stage 0's end of the pipe closes). An error is sent to stage 0 as text, then ends the stage."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: stage 0 decides
    torch.set_num_threads(threads)
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    wait = datetime.timedelta(seconds=timeout)
    try:
        _send(conn, ("ready", None))  # torch is imported: what remains of start-up is quick
        forward, back = (Communicator(path, stage, size, device, timeout).group for path in stores)
        _, config, backend, dtype, count = _recv(conn)
        model = build_stage(config, size, stage, backend, device, dtype, dict(_recv(conn) for _ in range(count)))
        last, caches, times = stage == size - 1, {}, []  # caches: stage 0's cache id -> this stage's layers of it
        while True:
            kind, *args = _recv(conn)
            if kind == "stop":
                break
            if kind == "cache":
                caches[args[0]] = make_cache(args[1], model.config, device, model.dtype)
            elif kind == "drop":
                del caches[args[0]]
            elif kind == "copy":
                caches[args[0]].copy_blocks(args[1])
            elif kind == "times":
                _send(conn, ("times", times))
            elif kind == "forward":
                plans, backend, cache_id, timing = args
                cache = None if cache_id is None else caches[cache_id]
                times, sends, outs = [], [], []
                bufs = [torch.empty(p.num_tokens, config.hidden_size, dtype=model.dtype, device=device) for p in plans]
                recvs = [forward.recv([buf], stage - 1, k) for k, buf in enumerate(bufs)]  # all posted up front
                for k, (plan, buf, work) in enumerate(zip(plans, bufs, recvs)):
                    meta = plan.meta(device, logits=last)
                    work.wait(wait)
                    start, cpu = _timed(device, timing)
                    with torch.inference_mode():
                        out = model.run(buf, meta, cache, backend).contiguous()
                    end, cpu_end = _timed(device, timing)
                    times.append((k, start, end, cpu_end - cpu))
                    if not last:
                        sends.append(forward.send([out], stage + 1, k))
                    elif plan.num_rows:
                        sends.append(back.send([out], 0, k))
                    outs.append(out)  # a send reads its tensor until waited on
                for work in sends:
                    work.wait(wait)
    except EOFError:
        pass  # stage 0 has gone: nothing is left to serve
    except BaseException:  # noqa: BLE001 (whatever it is, stage 0 should read it)
        with contextlib.suppress(OSError, ValueError):
            _send(conn, ("error", traceback.format_exc()))
        os._exit(1)  # at once, with code 1: no interpreter shutdown while gloo's threads are mid-operation


class PipelineRunner(ModelRunner):
    """Stage 0's runner: the core's, which also hands each step's copy-on-write block copies to the other stages."""

    def execute(self, chunks, block_copies=()):
        if block_copies:
            self.model.copy_blocks(block_copies, self.kv_cache)
        return super().execute(chunks, block_copies)


class PipelineModel(Ranks):
    """What the engine holds in place of a LlamaModel when the model's layers are cut into `size` stages: stage 0's
    model here, the other stages behind it. Calling it runs one forward pass through every stage, in
    `micro_batches` groups of the step's sequences, and returns the whole logits in the step's row order.
    `config` is stage 0's share (its layers, which size the engine's KV cache; the whole vocabulary).
    Built from `full`, a model in the core's plain modules on the CPU, which the caller then lets go.
    `micro_batches` may be changed between steps (`measure_bubble` does)."""

    runner_class = PipelineRunner  # hands each step's copy-on-write block copies to the other stages
    noun, step_failed = "stage", "pipeline-parallel step failed"

    def __init__(self, full: LlamaModel, size: int, device="cpu", micro_batches: int = 1,
                 timeout: float | None = None):
        check_pipeline_parallel_size(full.config, size, micro_batches)
        if getattr(full, "quantization", None) is not None:
            raise ValueError(f"quantization={full.quantization!r} is not built for pipeline_parallel_size > 1")
        device = torch.device(device)
        if device.type == "cuda":
            first = torch.cuda.current_device() if device.index is None else device.index
            if torch.cuda.device_count() < first + size:
                raise ValueError(f"pipeline_parallel_size={size} needs a GPU per stage from cuda:{first} on, but "
                                 f"{torch.cuda.device_count()} are visible; run the stages on device='cpu' instead")
            device = torch.device("cuda", first)
        super().__init__(size, timeout, "mini_engine_pp_")
        self._micro_batches = micro_batches
        self.cuts = [stage_layers(full.config.num_layers, size, s) for s in range(size)]  # each stage's layers
        self.quantization = None
        self.timing = False  # when True, each stage waits for its GPU before reading the clock (measure_bubble)
        self.last_step: tuple[float, float] | None = None  # stage 0's (start, end) clock of the last step
        self.times: list = []  # stage 0's (micro-batch, start, end, CPU seconds) of the last step
        stores = (os.path.join(self.folder, "forward"), os.path.join(self.folder, "back"))
        try:
            self._spawn(stage_main, lambda stage, conn: (
                stage, size, stores, conn, self.threads,
                f"cuda:{device.index + stage}" if device.type == "cuda" else "cpu", self.timeout))
            # Every stage joins both groups before any weight streams: a slow stream cannot time the meeting out.
            self.forward, self.back = (Communicator(path, 0, size, device, self.timeout).group for path in stores)
            state = full.state_dict()
            for stage, (_, conn) in enumerate(self._ranks, start=1):  # one weight at a time: no second whole copy
                mine = list(stage_weights(state, full.config, size, stage))
                _send(conn, ("load", full.config, full.attention_backend, full.dtype, len(mine)))
                for name, w in mine:
                    _send(conn, (name, w))
            weights = {name: w.clone() for name, w in stage_weights(state, full.config, size, 0)}
            self.stage = build_stage(full.config, size, 0, full.attention_backend, device, full.dtype, weights)
        except BaseException as e:
            if isinstance(e, (OSError, EOFError, RuntimeError)):
                self._fail(e, "a pipeline stage failed to start")
            self.shutdown()
            raise
        self.vocab_size, self.hidden_size = full.config.vocab_size, full.config.hidden_size
        self.max_positions = full.config.max_position_embeddings
        self.config = self.stage.config

    @property
    def micro_batches(self) -> int:
        """Groups each step's sequences are cut into (fewer when a step has fewer sequences); may change between
        steps."""
        return self._micro_batches

    @micro_batches.setter
    def micro_batches(self, value: int) -> None:
        check_pipeline_parallel_size(self.config, 1, value)
        self._micro_batches = value

    # What LLMEngine reads of a model.
    @property
    def device(self) -> torch.device:
        return self.stage.device

    @property
    def dtype(self) -> torch.dtype:
        return self.stage.dtype

    @property
    def attention_backend(self) -> str:
        return self.stage.attention_backend

    def __repr__(self) -> str:
        state = "shut down" if self.closed else f"stages 1-{self.size - 1}: pids {self.pids}"
        cuts = ", ".join(f"{r.start}-{r.stop - 1}" for r in self.cuts)
        return (f"PipelineModel({self.size} stages (layers {cuts}), {self.micro_batches} micro-batch(es), "
                f"{self.threads} thread(s) each, {self.device}, {state})")

    def __call__(self, input_ids, meta=None, kv_cache=None, backend=None, last_only=False):
        """As `LlamaModel.forward`: [B, N] ids alone, or packed [T] ids with `meta` (made by AttentionMetadata.build,
        whose arguments every stage rebuilds its micro-batches' metadata from) and optionally the KV cache."""
        self._check()
        batched = input_ids.dim() == 2
        if batched:
            if meta is not None or kv_cache is not None:
                raise ValueError("input_ids must be packed 1-D [T] when meta or kv_cache is given")
            b, n = input_ids.shape
            meta = AttentionMetadata.build([n] * b, device=input_ids.device, last_only=last_only)
            input_ids = input_ids.reshape(-1)
        elif meta is None or meta.built_from is None:
            raise ValueError("packed 1-D input_ids need an AttentionMetadata (meta) made by AttentionMetadata.build: "
                             "the stages rebuild it from build()'s arguments (meta.built_from)")
        if meta.built_from.get("static_len"):
            raise ValueError("a compiled step's metadata (static_len) is not built for pipeline stages")
        if kv_cache is not None and meta.slot_mapping is None:
            raise ValueError("meta must name each sequence's cache slot or block table when kv_cache is given")
        last = max(meta.context_lens) - 1
        if last >= self.max_positions:
            raise ValueError(f"position {last} exceeds max_position_embeddings {self.max_positions}")
        if kv_cache is not None and last >= kv_cache.max_len:
            raise ValueError(f"position {last} is past the KV cache's max_len {kv_cache.max_len}")
        backend = resolve_backend(backend or self.attention_backend, self.device)
        try:
            logits = self._step(input_ids, meta, kv_cache, backend)
        except BaseException as e:
            self._fail(e)
        return logits.view(b, 1 if last_only else n, -1) if batched else logits

    def _step(self, input_ids, meta, kv_cache, backend) -> torch.Tensor:
        """Stage 0's part of a step: send the plan, compute and send each micro-batch in turn (the next one's
        compute overlaps the other stages' work on this one), then take the logits from the last stage."""
        wait = datetime.timedelta(seconds=self.timeout)
        start = time.perf_counter()
        plans = plan_micro_batches(meta, self.micro_batches)
        self._broadcast(("forward", plans, backend, self._cache_id(kv_cache), self.timing))
        self.times, sends = [], []
        with self._threads():
            for k, plan in enumerate(plans):
                part_meta = plan.meta(self.device, logits=self.size == 1)
                t0, cpu = _timed(self.device, self.timing)
                with torch.inference_mode():
                    x = self.stage.run(input_ids[plan.tokens[0]:plan.tokens[1]], part_meta, kv_cache, backend)
                t1, cpu_end = _timed(self.device, self.timing)
                self.times.append((k, t0, t1, cpu_end - cpu))
                if self.size == 1:
                    sends.append((None, x))
                else:
                    sends.append((self.forward.send([x.contiguous()], 1, k), x))
            if self.size == 1:
                parts = [x for _, x in sends]
            else:
                # Posted only now: on NCCL a pair of ranks runs its operations in order, so stage 0's sends go first.
                parts = [torch.empty(p.num_rows, self.vocab_size, dtype=self.dtype, device=self.device)
                         for p in plans]
                recvs = [self.back.recv([part], self.size - 1, k) for k, (p, part) in enumerate(zip(plans, parts))
                         if p.num_rows]
                for work in [w for w, _ in sends] + recvs:
                    work.wait(wait)
        if plans[0].rows is None:
            logits = torch.cat(parts)
        else:  # each micro-batch's rows back to their places among the step's logits rows
            logits = torch.empty(sum(p.num_rows for p in plans), self.vocab_size, dtype=self.dtype,
                                 device=self.device)
            for plan, part in zip(plans, parts):
                if plan.rows:
                    logits[torch.tensor(plan.rows, device=self.device)] = part
        self.last_step = (start, time.perf_counter())
        return logits

    def copy_blocks(self, pairs, kv_cache) -> None:
        """The other stages' share of a step's copy-on-write in `kv_cache` (stage 0's own is copied by the runner)."""
        self._check()
        try:
            self._broadcast(("copy", self._cache_id(kv_cache), list(pairs)))
        except BaseException as e:
            self._fail(e)

    def stage_times(self) -> list[list[tuple]]:
        """Every stage's (micro-batch, start, end, CPU seconds) of the last step, in stage order; the clocks are
        time.perf_counter's, which on Linux is one clock (CLOCK_MONOTONIC) for every process of the machine."""
        self._check()
        try:
            self._broadcast(("times",))
            return [self.times] + self._replies("times")
        except BaseException as e:
            self._fail(e)


@dataclass
class Bubble:
    """One timed step at `stages` stages and `micro_batches` micro-batches. `step_s`: stage 0's wall seconds from
    the call to the logits. Per stage, over that window: `busy_s`, wall seconds inside its layers (from its own
    clock's timestamps around each micro-batch), `cpu_s`, CPU seconds it spent there. `measured`: the idle share
    of the stage-time, 1 - sum(busy) / (stages x step); `formula`: (p-1)/(m+p-1); `replayed`: the bubble of the
    same per-micro-batch busy times scheduled on a core per stage with free transfers (GPipe's schedule: a stage
    starts micro-batch k when it has finished k-1 and the stage before has finished k), which differs from the
    formula only because the stages' times differ; `from_cpu`: 1 - sum(cpu) / (stages x step). `spans`: per stage,
    each micro-batch's (start, end) in seconds from the step's start, for drawing the schedule."""
    stages: int
    micro_batches: int
    step_s: float
    busy_s: list[float]
    cpu_s: list[float]
    measured: float
    formula: float
    replayed: float
    from_cpu: float
    spans: list[list[tuple[float, float]]]


def bubble_of(times: list[list[tuple]], window: tuple[float, float]) -> Bubble:
    """The Bubble of one step from `PipelineModel.stage_times()` and its `last_step` window."""
    p, m = len(times), len(times[0])
    step = window[1] - window[0]
    busy = [sum(end - start for _, start, end, _ in stage) for stage in times]
    cpu = [sum(c for *_, c in stage) for stage in times]
    finish = [[0.0] * m for _ in range(p)]
    for s, k in itertools.product(range(p), range(m)):
        ready = max(finish[s - 1][k] if s else 0.0, finish[s][k - 1] if k else 0.0)
        finish[s][k] = ready + times[s][k][2] - times[s][k][1]
    return Bubble(p, m, step, busy, cpu, 1 - sum(busy) / (p * step), (p - 1) / (m + p - 1),
                  1 - sum(busy) / (p * finish[-1][-1]), 1 - sum(cpu) / (p * step),
                  [[(start - window[0], end - window[0]) for _, start, end, _ in stage] for stage in times])


def measure_bubble(model: PipelineModel, micro_batches: int, batch: int = 16, prompt_len: int = 64,
                   kind: str = "prefill", repeats: int = 3, block_size: int = 16, seed: int = 0) -> Bubble:
    """Time one forward step of `batch` sequences through `model`'s stages in `micro_batches` micro-batches:
    a prefill of `prompt_len` random tokens each (kind="prefill"), or a decode step after such a prefill
    (kind="decode"), on a paged cache of the model's own; the logits of each sequence's last token, as the engine
    asks. Returns the Bubble of the repeat whose step time is the median (after one step untimed).

    On a machine with fewer cores than stages (this course's 2-core CPU, 3 stages of one thread each) the stages
    take turns on the cores: a stage that is "busy" (between its timestamps) may be waiting for a core, so its
    wall `busy_s` grows when the others compute too, and `measured` comes out smaller than on hardware with a
    core (a GPU) per stage: overlap costs the stages speed instead of showing as idle time. `cpu_s` counts only
    the time a stage ran: `from_cpu` cannot fall below 1 - cores/stages (a third at 2 cores and 3 stages), whatever
    the schedule. Read the three together: `replayed` is what the measured stage times would give with a core each.
    A decode step's micro-batches each read every weight of the stage again, so on a CPU (where a decode step is
    bound by reading weights) m micro-batches cost nearly m times one: the bubble shrinks, the step does not."""
    if kind not in ("prefill", "decode"):
        raise ValueError(f"kind must be 'prefill' or 'decode', got {kind!r}")
    before = model.micro_batches
    device, generator = model.device, torch.Generator().manual_seed(seed)
    width = -(-(prompt_len + 1) // block_size)
    cache = PagedKVCache(model.config, batch * width, block_size, device, model.dtype)
    tables = [list(range(i * width, (i + 1) * width)) for i in range(batch)]

    def step(query: int, context: int) -> None:
        ids = torch.randint(model.vocab_size, (batch * query,), generator=generator).to(device)
        meta = AttentionMetadata.build([query] * batch, [context] * batch, device=device, block_tables=tables,
                                       block_size=block_size)
        meta.logits_indices = torch.arange(query - 1, batch * query, query, device=device)
        model(ids, meta, cache)

    runs = []
    try:
        model.micro_batches, model.timing = micro_batches, True
        shape = (prompt_len, prompt_len) if kind == "prefill" else (1, prompt_len + 1)
        if kind == "decode":
            step(prompt_len, prompt_len)
        for _ in range(repeats + 1):
            step(*shape)
            runs.append(bubble_of(model.stage_times(), model.last_step))
    finally:
        model.micro_batches, model.timing = before, False
    runs = sorted(runs[1:], key=lambda r: r.step_s)
    return runs[len(runs) // 2]


def bubble_table(model: PipelineModel, micro_batches=(1, 2, 4, 8), **kwargs) -> list[Bubble]:
    """`measure_bubble` at each number of micro-batches (keyword arguments passed on)."""
    return [measure_bubble(model, m, **kwargs) for m in micro_batches]


def format_bubbles(rows: list[Bubble]) -> str:
    """The bubble table as text: one line per number of micro-batches."""
    lines = [f"{'m':>3} {'(p-1)/(m+p-1)':>14} {'measured':>9} {'replayed':>9} {'from CPU':>9} {'step ms':>8}   "
             "busy ms per stage (CPU ms)"]
    for r in rows:
        busy = "  ".join(f"{b * 1e3:.0f} ({c * 1e3:.0f})" for b, c in zip(r.busy_s, r.cpu_s))
        lines.append(f"{r.micro_batches:>3} {r.formula:>14.1%} {r.measured:>9.1%} {r.replayed:>9.1%} "
                     f"{r.from_cpu:>9.1%} {r.step_s * 1e3:>8.0f}   {busy}")
    return "\n".join(lines)

