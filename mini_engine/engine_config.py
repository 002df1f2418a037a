"""EngineConfig: every knob of the serving engine (chapter 04 on), checked where it is made.

`speculative` (chapter 06) is a dict parsed into a `SpeculativeConfig` here, so a typo in it fails before
any weights load. Three knobs also take a part of your own (the labs plug theirs in): see `EngineConfig`.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from .attention import resolve_backend
from .paging import BlockManager

DTYPES = ("float32", "bfloat16", "float16")
KV_CACHES = ("paged", "contiguous")
SCHEDULING = ("static", "dynamic", "continuous", "cache_aware")
PREFIX_CACHES = ("hashed", "radix")  # vLLM's hashed full blocks (paging.py); SGLang's radix tree (prefix/radix_cache.py)

# The contiguous cache reserves max_model_len positions for each of max_num_seqs slots up front. SmolLM2-135M
# keeps 46 KB per token in fp32, so 64 slots x 2048 positions would pin 6 GB: a CPU gets a smaller default.
DEFAULT_LIMITS = {"cuda": (64, 2048), "cpu": (16, 1024)}  # (max_num_seqs, max_model_len)
# The paged pool gets that same memory by default (see `resolved`), but a request takes only the blocks it
# fills, so far more requests run at once: reservation no longer caps the batch, and the default is larger.
PAGED_MAX_NUM_SEQS = {"cuda": 256, "cpu": 64}


SPECULATIVE_METHODS = ("ngram", "draft")
QUANTIZATIONS = ("int4", "int4_compact", "int8")  # weight-only (mini_engine/quant); None: float weights


@dataclass(frozen=True)
class SpeculativeConfig:
    """`LLM(speculative={...})`, checked before any weights load. method "ngram": prompt lookup with n from
    ngram_max down to ngram_min; method "draft": `model` (any name or path `load_model` accepts, or a model
    already in memory) drafts greedily, or from its own distribution when a request samples, with `dtype`
    (None: the target's). k: the most tokens drafted per request and step. adaptive: a request drafts one
    token more than it had accepted in its last round (at most k), so a request whose drafts keep failing
    drafts one at a time and its rows stop weighing on a batched step; False drafts k every round. method may
    also be a proposer of your own (keys k, adaptive): an object with `speculative.Proposer`'s propose(ids, k)."""
    method: str | object
    k: int = 4
    ngram_min: int = 1
    ngram_max: int = 4
    model: object = None
    dtype: str | None = None
    adaptive: bool = True
    quantization: str | None = None  # draft: load a named model quantized ("int4", "int8"; chapter 10)

    # Keys each method reads: any other key is a typo the user should hear about, not silently ignored.
    KEYS = {"ngram": ("method", "k", "ngram_min", "ngram_max", "adaptive"),
            "draft": ("method", "k", "model", "dtype", "adaptive", "quantization"), "own": ("method", "k", "adaptive")}

    @classmethod
    def parse(cls, spec) -> "SpeculativeConfig":
        if isinstance(spec, SpeculativeConfig):
            return spec
        if not isinstance(spec, dict):
            raise ValueError(f"speculative must be a dict such as {{'method': 'ngram', 'k': 4}} or None, got {spec!r}")
        method = spec.get("method")
        own = not isinstance(method, type) and callable(getattr(method, "propose", None))  # a proposer object
        if method not in SPECULATIVE_METHODS and not own:
            raise ValueError(f"speculative['method'] must be one of {SPECULATIVE_METHODS} or a proposer object with "
                             f"a propose(token_ids, k) method, got {method!r}")
        keys = cls.KEYS[method if method in SPECULATIVE_METHODS else "own"]
        unknown = sorted(set(spec) - set(keys))
        if unknown:
            raise ValueError(f"speculative[{unknown[0]!r}]: unknown key for method {method!r} "
                             f"(it takes {', '.join(keys)})")
        config = cls(**spec)
        config.check()
        return config

    def check(self) -> None:
        def positive_int(name):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative[{name!r}] must be an int >= 1, got {value!r}")
        positive_int("k")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative['adaptive'] must be True or False, got {self.adaptive!r}")
        if self.method == "ngram":
            positive_int("ngram_min")
            positive_int("ngram_max")
            if self.ngram_max < self.ngram_min:
                raise ValueError(f"speculative['ngram_max'] must be >= ngram_min ({self.ngram_min}), "
                                 f"got {self.ngram_max}")
        elif self.method == "draft":
            if self.model is None or (isinstance(self.model, str) and not self.model):
                raise ValueError("speculative['model'] is required for method 'draft' (a name, a path, or a model)")
            if self.dtype is not None and self.dtype not in DTYPES:
                raise ValueError(f"speculative['dtype'] must be one of {DTYPES} or None, got {self.dtype!r}")
            if self.quantization is not None and self.quantization not in QUANTIZATIONS:
                raise ValueError(f"speculative['quantization'] must be one of {QUANTIZATIONS} or None, "
                                 f"got {self.quantization!r}")
            if self.quantization is not None and not isinstance(self.model, str):
                raise ValueError("speculative['quantization'] applies when speculative['model'] is a name or path "
                                 "to load; quantize a model in memory with load_model(..., quantization=...)")

    def as_dict(self) -> dict:
        keys = self.KEYS[self.method if self.method in SPECULATIVE_METHODS else "own"]
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name in keys}


@dataclass
class EngineConfig:
    """Three knobs also take a part of your own, checked here (the labs plug theirs in). scheduling: a policy
    object with `scheduler.ContinuousPolicy`'s methods: admit(waiting, running, free_slots, budget, now) returns
    the waiting requests to start now, in order (read-only; admission stops at the first that does not fit), and
    seconds_until_admission(waiting, running, now) how long nothing can start (0.0: no wait). speculative:
    {"method": a proposer, "k": ...} (`SpeculativeConfig`). block_manager: a `paging.BlockManager` subclass, built
    as cls(num_kv_blocks, block_size, enable_prefix_caching) in place of the engine's: override what you replace."""
    model: str = "smollm2-135m"
    device: str = "cpu"
    dtype: str = "float32"
    kv_cache: str = "paged"             # or "contiguous": one max_model_len slot per sequence (chapter 04)
    block_size: int = 16                # paged: positions per block
    num_kv_blocks: int | None = None    # paged: blocks in the pool; None: the contiguous cache's memory (resolved)
    max_num_seqs: int | None = None     # None: paged 256 on a GPU, 64 on a CPU; contiguous 64 and 16
    max_model_len: int | None = None    # None: 2048 on a GPU, 1024 on a CPU, capped by the model's positions
    enable_prefix_caching: bool | None = None  # paged: share cached full blocks (chapter 08); None: on with paged
    prefix_cache: str = "hashed"        # with prefix caching: "hashed" full blocks, or "radix" (matches end at any token)
    chunked_prefill_tokens: int | None = 512  # tokens per step; None turns chunking off (prompts run whole)
    scheduling: str | object = "continuous"  # a name in SCHEDULING, or a policy object (see above)
    prefix_holding: bool = False        # cache_aware: hold a request back while a prompt sharing its prefix is computed
    aging_s: float | None = None        # cache_aware: a request waiting this long goes first, so none starves
    speculative: dict | SpeculativeConfig | None = None  # see SpeculativeConfig; a dict is parsed into one
    attention_backend: str = "auto"
    block_manager: type[BlockManager] | None = None  # paged: your BlockManager subclass (see above)
    quantization: str | None = None     # "int4" | "int8": weight-only quantized model (chapter 10); dtype: activations
    dynamic_bucket_width: int = 64      # scheduling="dynamic": prompt-length bucket, in tokens
    dynamic_timeout_s: float = 0.05     # scheduling="dynamic": longest wait for a bucket to fill
    record_trace: bool = False          # keep a StepRecord per step (which request ran in which slot)
    # Decode-only steps through compiled graphs, one per batch-size bucket. "max-autotune": Inductor also writes
    # and times the weight products (longer to compile; see compiled_decode._MAX_AUTOTUNE_CPU).
    compile: bool | str = False
    # Chapter 11 (mini_engine/parallel): the model split over processes of their own. Tensor parallelism cuts every
    # layer over tensor_parallel_size ranks (sequence_parallel: their norms and residual stream over tokens too);
    # pipeline parallelism cuts the stack of layers into pipeline_parallel_size stages, each step's sequences
    # passed through them in pipeline_micro_batches groups.
    tensor_parallel_size: int = 1
    sequence_parallel: bool = False
    pipeline_parallel_size: int = 1
    pipeline_micro_batches: int = 1
    # Chapter 12 (mini_engine/transfer): blocks the prefix cache evicts spill to host memory ("host"), then to files
    # in kv_offload_dir ("disk"), and are copied back on a hit. Tier sizes in blocks; None: the pool's, disk 4x host.
    kv_offload: str | None = None
    kv_offload_dir: str | None = None
    kv_offload_host_blocks: int | None = None
    kv_offload_disk_blocks: int | None = None

    def __post_init__(self):
        if not isinstance(self.record_trace, bool):
            raise ValueError(f"record_trace must be True or False, got {self.record_trace!r}")
        if not (isinstance(self.compile, bool) or self.compile == "max-autotune"):
            raise ValueError(f"compile must be False, True or 'max-autotune', got {self.compile!r}")
        if self.compile and self.num_ranks != 1:
            raise ValueError(f"compile={self.compile!r} is not built for a model split over processes "
                             "(tensor_parallel_size or pipeline_parallel_size > 1); use compile=False")
        if not isinstance(self.sequence_parallel, bool):
            raise ValueError(f"sequence_parallel must be True or False, got {self.sequence_parallel!r}")
        for name, allowed in (("kv_cache", KV_CACHES), ("dtype", DTYPES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        policy, manager = self.scheduling, self.block_manager  # a name, or a policy object of your own
        if not (policy in SCHEDULING if isinstance(policy, str) else not isinstance(policy, type)
                and all(callable(getattr(policy, m, None)) for m in ("admit", "seconds_until_admission"))):
            raise ValueError(f"scheduling must be one of {SCHEDULING} or a policy object with admit() and "
                             f"seconds_until_admission() methods, got {policy!r}")
        if self.prefix_holding is not False or self.aging_s is not None:  # options of the cache-aware policy
            from .prefix.policies import check_options  # beside the core: loaded only when asked for
            check_options(policy, self.prefix_holding, self.aging_s)
        if manager is not None and not (isinstance(manager, type) and issubclass(manager, BlockManager)):
            raise ValueError(f"block_manager must be a subclass of paging.BlockManager or None, got {manager!r}")
        for name, verb in (("num_kv_blocks", "sizes"), ("block_manager", "runs")):
            if getattr(self, name) is not None and self.kv_cache != "paged":
                raise ValueError(f"{name} {verb} the paged KV pool; kv_cache={self.kv_cache!r} does not use it")
        if self.enable_prefix_caching not in (None, True, False):
            raise ValueError(f"enable_prefix_caching must be True, False or None, got {self.enable_prefix_caching!r}")
        if self.enable_prefix_caching and self.kv_cache != "paged":
            raise ValueError("enable_prefix_caching=True shares blocks of the paged KV cache; "
                             f"kv_cache={self.kv_cache!r} has none (leave it None or False)")
        if self.prefix_cache not in PREFIX_CACHES:
            raise ValueError(f"prefix_cache must be one of {PREFIX_CACHES}, got {self.prefix_cache!r}")
        if self.prefix_cache == "radix" and (self.enable_prefix_caching is False or self.kv_cache != "paged"):
            raise ValueError("prefix_cache='radix' is a prefix cache over the paged KV pool: it needs kv_cache='paged' "
                             f"and enable_prefix_caching True or None, got kv_cache={self.kv_cache!r}, "
                             f"enable_prefix_caching={self.enable_prefix_caching!r}")
        if self.prefix_cache == "radix" and manager is not None:
            raise ValueError("prefix_cache='radix' is a block manager of its own (prefix.radix_cache.RadixBlockManager): "
                             "pass it or block_manager=..., not both")
        self.speculative = None if self.speculative is None else SpeculativeConfig.parse(self.speculative)
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None, got {self.quantization!r}")
        resolve_backend(self.attention_backend, self.device)  # a bad name fails here, before any weights load
        for name in ("block_size", "num_kv_blocks", "max_num_seqs", "max_model_len", "chunked_prefill_tokens",
                     "dynamic_bucket_width", "tensor_parallel_size", "pipeline_parallel_size",
                     "pipeline_micro_batches"):
            value = getattr(self, name)
            optional = name in ("num_kv_blocks", "max_num_seqs", "max_model_len", "chunked_prefill_tokens")
            if not (value is None and optional) and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an int >= 1{' or None' if optional else ''}, got {value!r}")
        if self.sequence_parallel and self.tensor_parallel_size == 1:
            raise ValueError("sequence_parallel=True shards tensor-parallel ranks' activations: it needs "
                             f"tensor_parallel_size > 1, got {self.tensor_parallel_size}")
        if self.tensor_parallel_size > 1 and self.pipeline_parallel_size > 1:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} with pipeline_parallel_size="
                             f"{self.pipeline_parallel_size}: this engine splits a model one way at a time; set one to 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must leave room for a prompt token and a new one, got {self.max_model_len}")
        if not isinstance(self.dynamic_timeout_s, (int, float)) or self.dynamic_timeout_s < 0:
            raise ValueError(f"dynamic_timeout_s must be >= 0, got {self.dynamic_timeout_s!r}")
        if any(v is not None for v in (self.kv_offload, self.kv_offload_dir, self.kv_offload_host_blocks,
                                       self.kv_offload_disk_blocks)):  # chapter 12's tiers, checked beside the core
            from .transfer.offload import check_kv_offload
            check_kv_offload(self)

    @property
    def num_ranks(self) -> int:
        """Processes the model runs in: 1, or the ranks of tensor or pipeline parallelism (chapter 11)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def policy_options(self) -> dict:
        """make_policy's keyword arguments: the knobs of the named policies."""
        return {"bucket_width": self.dynamic_bucket_width, "timeout_s": self.dynamic_timeout_s,
                "prefix_holding": self.prefix_holding, "aging_s": self.aging_s}

    def block_manager_class(self) -> type[BlockManager]:
        """The paged pool's bookkeeping: your block_manager, the radix tree (prefix_cache="radix") or paging's."""
        if self.kv_offload is not None:  # chapter 12: a factory, called as a class is, for the tiered prefix cache
            from .transfer.offload import tiered_block_manager
            return tiered_block_manager(self)
        if self.prefix_cache == "radix":
            from .prefix.radix_cache import RadixBlockManager  # beside the core: loaded only when asked for
            return RadixBlockManager
        return self.block_manager or BlockManager

    def resolved(self, device: str, max_positions: int) -> "EngineConfig":
        """A copy with the device's defaults filled in, checked against the model's positions. A paged pool
        left unsized (num_kv_blocks=None) gets the memory a contiguous cache would reserve for max_num_seqs x
        max_model_len (max_num_seqs at the contiguous default when not given): the two caches then compare
        at equal memory."""
        kind = "cuda" if str(device).startswith("cuda") else "cpu"
        seqs, length = DEFAULT_LIMITS[kind]
        max_model_len = self.max_model_len or min(length, max_positions)
        if max_model_len > max_positions:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's {max_positions} positions")
        backend = resolve_backend(self.attention_backend, device)
        max_num_seqs, num_kv_blocks = self.max_num_seqs or seqs, self.num_kv_blocks
        if self.kv_cache == "paged":
            if num_kv_blocks is None:
                num_kv_blocks = -(-max_num_seqs * max_model_len // self.block_size)
            max_num_seqs = self.max_num_seqs or PAGED_MAX_NUM_SEQS[kind]
        caching = self.kv_cache == "paged" if self.enable_prefix_caching is None else self.enable_prefix_caching
        return EngineConfig(**{**vars(self), "device": str(device), "max_num_seqs": max_num_seqs,
                               "num_kv_blocks": num_kv_blocks, "max_model_len": max_model_len,
                               "attention_backend": backend, "enable_prefix_caching": caching})
