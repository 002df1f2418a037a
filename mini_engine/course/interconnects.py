"""GPUs and the links between them (chapter 11): what one all-reduce costs on each, by which algorithm, and what
that does to a tensor-parallel decode step.

An all-reduce costs a latency per collective plus its bytes over a bandwidth, and the algorithm decides both:

- a **ring** (NCCL's default for large payloads) pays 2(p − 1) hop latencies and moves 2(p − 1)/p of the payload
  through each rank's link: bandwidth-optimal;
- NCCL's **LL** ("low latency") protocol runs the same ring with hops about six times cheaper, at half the bandwidth
  (each 8-byte store carries 4 bytes of data and a 4-byte flag, so the receiver needs no separate fence);
  **LL128** does the same on 128-byte lines with 8 bytes of flag (120/128 of the bandwidth, NVLink only);
- **NVLS** (NVLink SHARP, H100 with NVSwitch) lets the switch add the payloads: each GPU sends its payload once and
  reads the sum once;
- vLLM's **custom all-reduce** (`cross_device_reduce_1stage`, vLLM PR #2192) is one-shot: every GPU reads every
  other GPU's whole payload over NVLink and sums it itself. One latency, nearly flat in p: what decode's few KB want.

A library picks the fastest for each payload (NCCL from its own cost model, vLLM by size thresholds); so does
`all_reduce` here. Every constant is quoted from the source that publishes or measured it, cited where it is set.
The bandwidths are the links' peaks (what NCCL's tests reach is lower), so large payloads come out optimistic.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import formulas as F
from .rooflines import GPU_ROOFS, Roof

# NCCL's own latency model: ncclTunerConstantsDefaults in src/graph/tuning.cc (NVIDIA/nccl master, commit 5067397,
# https://github.com/NVIDIA/nccl/blob/master/src/graph/tuning.cc), in microseconds. A ring all-reduce costs
# baseLatencies[Ring][protocol] once plus hwLatencies[link][Ring][protocol] for each of its 2(p − 1) steps; across
# nodes, 2(nodes − 1) of those steps cross the network. NCCL's model is what NCCL itself uses to choose an algorithm
# and protocol: estimates tuned by its developers, not a measurement of any one machine.
NCCL_BASE_US = {"LL": 6.6, "LL128": 14.0, "Simple": 8.4}
NCCL_HOP_US = {"NVLink": {"LL": 0.6, "LL128": 1.9, "Simple": 3.4},
               "PCIe": {"LL": 1.0, "LL128": 2.5, "Simple": 5.7},
               "network": {"LL": 2.7, "LL128": 4.0, "Simple": 14.0}}
# The share of the link's bandwidth each protocol keeps: tuning.cc halves LL's ring bandwidth ("busBw * .5") and
# keeps 120/128 for LL128 (".92 /*120.0/128.0*/").
NCCL_PROTOCOL_BANDWIDTH = {"LL": 0.5, "LL128": 120 / 128, "Simple": 1.0}
NCCL_NVLS_US = 25.0          # hwLatencies[NVLINK][NVLS][Simple]; NVLS has no base latency and no LL protocols
NCCL_NVLS_EFFICIENCY = 0.85  # nvlsEfficiency[Hopper] in tuning.cc

# vLLM's custom all-reduce, timed by SGLang's developers without CUDA graphs, microseconds by GPUs and payload bytes:
# H100 in https://github.com/sgl-project/sglang/pull/2904 (its "vllm" table), A100 in
# https://github.com/sgl-project/sglang/pull/2688 ("vllm time"; its 8-GPU rows past 4 KB are not published).
# From 512 B to 32 KB they stay within 8.5-14.2 µs at 2, 4 and 8 GPUs: flat in p and in bytes.
VLLM_CUSTOM_ALL_REDUCE_US = {
    "H100": {2: {512: 9.5, 4096: 8.8, 32768: 8.7, 262144: 12.9, 524288: 17.7, 1048576: 26.6},
             4: {512: 9.1, 4096: 8.5, 32768: 9.2, 262144: 20.6, 524288: 26.9, 1048576: 40.2},
             8: {512: 10.1, 4096: 9.3, 32768: 11.8, 262144: 24.1, 524288: 30.4, 1048576: 45.0}},
    "A100": {2: {512: 13.0, 4096: 11.3, 32768: 12.1, 262144: 17.6, 524288: 22.3, 1048576: 32.5},
             4: {512: 13.5, 4096: 12.1, 32768: 13.5, 262144: 23.9, 524288: 31.3, 1048576: 47.1},
             8: {512: 14.0, 4096: 14.2}},
}
# vLLM's rules (csrc/custom_all_reduce.cuh and vllm/distributed/device_communicators/custom_all_reduce.py): only
# 2, 4, 6 or 8 GPUs of one node, all joined by NVLink (or just two); payloads under 8 MiB; one-shot always for two
# GPUs, and below 512 KiB (up to 4 GPUs) or 256 KiB (up to 8) for more, else two-shot (a reduce-scatter then an all-gather, both over NVLink).
VLLM_CUSTOM_SIZES = (2, 4, 6, 8)
VLLM_CUSTOM_MAX_BYTES = 8 * 1024 * 1024


def _vllm_one_shot_below(ranks: int) -> float:
    if ranks == 2:
        return float("inf")  # two GPUs always take the one-shot kernel
    return 512 * 1024 if ranks <= 4 else 256 * 1024


@dataclass(frozen=True)
class Link:
    """One GPU's link to the others: its class in NCCL's latency model and its peak bytes/s in each direction."""
    name: str
    kind: str         # "NVLink", "PCIe" or "network" (NCCL_HOP_US's keys)
    bandwidth: float  # bytes/s, each direction, one GPU


# Peak per-direction bandwidths. A T4 sits on PCIe Gen3 x16, https://www.nvidia.com/en-us/data-center/tesla-t4/ :
# 8 GT/s × 16 lanes with 128b/130b encoding, 15.75 GB/s each way (its data sheet's "32 GB/s" counts both); A100 SXM ("600 GB/s" NVLink, both ways),
# https://www.nvidia.com/en-us/data-center/a100/ ; H100 SXM ("900 GB/s" NVLink, both ways),
# https://www.nvidia.com/en-us/data-center/h100/ ; DGX H100, one 400 Gb/s ConnectX-7 InfiniBand NDR port per GPU,
# https://docs.nvidia.com/dgx/dgxh100-user-guide/introduction-to-dgxh100.html ; 100 Gb/s Ethernet (RoCE).
# NCCL's model gives InfiniBand and RoCE the same hop latencies (its IB and socket transports both report a network
# latency of 0, "Not set"); over plain TCP sockets, without RDMA, real hops cost more than this model counts.
LINKS = {
    "PCIe 3 x16": Link("PCIe 3 x16", "PCIe", 8e9 * 16 * 128 / 130 / 8),
    "NVLink 3": Link("NVLink 3", "NVLink", 300e9),
    "NVLink 4": Link("NVLink 4", "NVLink", 450e9),
    "InfiniBand NDR": Link("InfiniBand NDR, 400 Gb/s a GPU", "network", 50e9),
    "Ethernet 100 Gb/s": Link("Ethernet 100 Gb/s (RoCE)", "network", 12.5e9),
}
GPU_MEMORY = {"T4": 16e9, "A100": 80e9, "H100": 80e9}  # bytes, the data sheets' 16 GB and 80 GB


@dataclass(frozen=True)
class System:
    """GPUs of one kind and what joins them. With `nodes` = 2 the ranks are split between two machines: inside each
    they talk over `intra`, between the two over `link` (the network), and a collective is as slow as its slowest
    link. vLLM's custom all-reduce (`vllm_custom`, the key of its measured latencies) needs one NVLink node."""
    name: str
    gpu: str           # a key of rooflines.GPU_ROOFS and GPU_MEMORY
    link: Link
    nodes: int = 1
    intra: Link | None = None
    nvls: bool = False
    vllm_custom: str | None = None

    @property
    def roof(self) -> Roof:
        return GPU_ROOFS[self.gpu]

    @property
    def memory(self) -> float:
        return GPU_MEMORY[self.gpu]


SYSTEMS = {
    "T4 × PCIe 3 (one host)": System("T4 × PCIe 3", "T4", LINKS["PCIe 3 x16"]),
    "A100 × NVLink 3 (NVSwitch)": System("A100 × NVLink 3", "A100", LINKS["NVLink 3"], vllm_custom="A100"),
    "H100 × NVLink 4 (NVSwitch)": System("H100 × NVLink 4", "H100", LINKS["NVLink 4"], nvls=True,
                                         vllm_custom="H100"),
    "H100 × 2 nodes, InfiniBand NDR": System("H100 × 2 nodes, InfiniBand", "H100", LINKS["InfiniBand NDR"], nodes=2,
                                             intra=LINKS["NVLink 4"]),
    "H100 × 2 nodes, Ethernet 100 Gb/s": System("H100 × 2 nodes, Ethernet", "H100", LINKS["Ethernet 100 Gb/s"],
                                                nodes=2, intra=LINKS["NVLink 4"]),
}


def _ring_us(system: System, protocol: str, payload: float, ranks: int) -> float:
    """NCCL's ring in NCCL's model: its base latency, a hop latency per step (the network's for the 2(nodes − 1)
    steps that cross it), and 2(p − 1)/p of the payload at the protocol's share of the slowest link."""
    steps = 2 * (ranks - 1)
    inter = 2 * (system.nodes - 1) if system.nodes > 1 else 0
    near = system.intra or system.link
    hops = (steps - inter) * NCCL_HOP_US[near.kind][protocol] + inter * NCCL_HOP_US[system.link.kind][protocol]
    bandwidth = min(near.bandwidth, system.link.bandwidth) * NCCL_PROTOCOL_BANDWIDTH[protocol]
    return NCCL_BASE_US[protocol] + hops + steps / ranks * payload / bandwidth * 1e6


def vllm_custom_latency_us(gpu: str, ranks: int) -> float:
    """The measured time of vLLM's custom all-reduce of a 4 KiB payload (decode's size) on `ranks` GPUs. Six GPUs
    were not measured: we take the mean of four and eight, an estimate."""
    table = VLLM_CUSTOM_ALL_REDUCE_US[gpu]
    if ranks == 6:
        return (table[4][4096] + table[8][4096]) / 2
    return table[ranks][4096]


def all_reduce_options(system: System, payload_bytes: float, ranks: int) -> dict[str, float]:
    """Seconds of one all-reduce of `payload_bytes` among `ranks` GPUs of `system`, by every algorithm that applies
    there (empty for one rank: nothing to do)."""
    F._check_at_least("ranks", ranks, 1)
    if ranks == 1:
        return {}
    protocols = ("LL", "LL128", "Simple") if (system.intra or system.link).kind == "NVLink" else ("LL", "Simple")
    options = {f"NCCL ring, {proto}": _ring_us(system, proto, payload_bytes, ranks) * 1e-6 for proto in protocols}
    if system.nvls and system.nodes == 1:
        # The switch sums: each GPU sends its payload once and reads the sum once.
        options["NCCL NVLS"] = (NCCL_NVLS_US * 1e-6
                                + payload_bytes / (system.link.bandwidth * NCCL_NVLS_EFFICIENCY))
    if (system.vllm_custom and system.nodes == 1 and ranks in VLLM_CUSTOM_SIZES
            and payload_bytes < VLLM_CUSTOM_MAX_BYTES):
        latency = vllm_custom_latency_us(system.vllm_custom, ranks) * 1e-6
        if payload_bytes < _vllm_one_shot_below(ranks):
            options["vLLM one-shot"] = F.one_shot_all_reduce_seconds(payload_bytes, ranks, latency,
                                                                     system.link.bandwidth)
        else:
            options["vLLM two-shot"] = latency + 2 * (ranks - 1) / ranks * payload_bytes / system.link.bandwidth
    return options


@dataclass(frozen=True)
class AllReduceCost:
    seconds: float
    algorithm: str  # "" for one rank


def all_reduce(system: System, payload_bytes: float, ranks: int) -> AllReduceCost:
    """The fastest algorithm `all_reduce_options` knows for this payload: what NCCL's tuner or vLLM's thresholds
    would run."""
    options = all_reduce_options(system, payload_bytes, ranks)
    if not options:
        return AllReduceCost(0.0, "")
    name = min(options, key=options.get)
    return AllReduceCost(options[name], name)


@dataclass(frozen=True)
class TensorParallelDecode:
    """One decode step of a model split over `ranks` GPUs of a system."""
    ranks: int
    one_rank_s: float      # the whole step on one GPU (the roofline: weights read once, products done once)
    compute_s: float       # each rank's 1/p of it
    collectives: int       # two all-reduces a layer
    payload_bytes: float   # each all-reduce's: batch × hidden values
    all_reduce: AllReduceCost
    weight_bytes_per_rank: float

    @property
    def communication_s(self) -> float:
        return self.collectives * self.all_reduce.seconds

    @property
    def step_s(self) -> float:
        return self.compute_s + self.communication_s

    @property
    def speedup(self) -> float:
        return self.one_rank_s / self.step_s

    @property
    def communication_share(self) -> float:
        return self.communication_s / self.step_s


def tensor_parallel_decode(system: System, model, batch: int, ranks: int, context: int = 512,
                           dtype_bytes: int = 2) -> TensorParallelDecode:
    """Price a decode step of `model` (a preset name or a ModelConfig) at `batch` sequences of `context` tokens on
    `ranks` GPUs of `system`: the step on one of *its* GPUs by the roofline, divided by the ranks, plus 2L
    all-reduces of the block output (batch × hidden values of `dtype_bytes`) by the fastest algorithm there."""
    F._check_at_least("batch", batch, 1)
    F._check_at_least("ranks", ranks, 1)
    shape = F.ModelShape.of(model)
    roof = system.roof
    one = F.roofline_time(F.decode_flops(model, context, batch), F.decode_bytes(model, batch, context, dtype_bytes),
                          roof.peak_flops, roof.peak_bw)
    payload = batch * shape.hidden_size * dtype_bytes
    return TensorParallelDecode(ranks, one, one / ranks, 2 * shape.n_layers, payload,
                                all_reduce(system, payload, ranks), F.weight_bytes(model, dtype_bytes) / ranks)
