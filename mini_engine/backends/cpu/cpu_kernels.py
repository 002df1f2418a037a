"""C kernels for the CPU, built on first use by the machine's C compiler and called through ctypes.

The sources:
- csrc/paged_decode.c, two kernels that read a paged KV pool in place through the block tables, where the
  PyTorch path copies each sequence's blocks out of the pool before SDPA: `paged_decode` (one query token per
  sequence, the CPU twin of the Triton kernel in kernels/paged_attention.py) and `paged_chunk` (several query
  tokens per sequence, each seeing its own prefix: a prefill chunk, or a speculative step's verify chunks;
  FlashAttention's loop with 16 query rows in the lanes of vectors).
- csrc/contiguous_decode.c, `contiguous_decode`: decode attention read in place from the contiguous cache.
- csrc/int4_gemm.c, `int4_gemm`: an int4 weight-only product with fp32 activations, reading the packed layout
  torch's own int4 kernel keeps (x86 CPUs with AVX2).
- csrc/int8_gemm.c, `int8_gemm`: the int8 one (per-row scales) with fp32 activations, for the int4 model's head.
- csrc/f32_gemm.c, `f32_gemm`: the fp32 product on a copy of the weight packed into panels (`f32_pack`), for
  the few to few hundred rows of a batch's decode step or a short prefill chunk (form "c_f32" of `products`).
- csrc/int4_gemm_amx.c and int8_gemm_amx.c (`int4_gemm(..., amx=True)`, `int8_gemm(..., amx=True)`): the same two
  products on Intel AMX's tile instructions, bf16 activations; on a CPU without AMX they build as stubs that
  refuse (`has_amx` says which), and csrc/amx.h holds what they share.
These products and the contiguous decode are also PyTorch operators written in C++ (csrc/torch_ops.cpp,
`load_torch_ops`), which torch.compile graphs call without going through Python. The same library holds
csrc/layer_ops.c, a layer's small operations fused into one operator each for eager steps (`layer_ops`); eager
steps call the fp32 product through it too (`f32_gemm`).
Whether they run is measured, like every other form (`attention.paged_decode_form`,
`CpuAttention.contiguous_decode_form`, the "paged_prefill" and "paged_verify" choices of `CpuAttention`, the "int4_product" and
"int8_product" ops of `quant_forms.choose_form`): on a machine where they lose, or
without a C compiler, the PyTorch forms run.

The build:
- `-O3 -march=native`: for the CPU it runs on; the cached library's name carries a digest of the source, the
  flags, the compiler and this CPU's model and feature flags, so a cache shared with another CPU builds anew.
- `-ffast-math` when compiling, never when linking. Compiling with it lets GCC vectorise `expf` (glibc's
  libmvec) and reassociate the dot products; linking a shared library with it adds `crtfastmath.o`, which
  turns on flush-to-zero for the whole process as the library loads, and every PyTorch op after that would
  lose its denormals (tests/engine/test_cpu_kernels.py checks they survive).
- `-fopenmp`: the library asks for `libgomp.so.1`, the name under which PyTorch's wheel has already loaded its
  own OpenMP runtime, so the kernel's threads are PyTorch's threads (one team, `torch.set_num_threads`).
- The model's head counts and head size are compile-time constants of paged_decode.c (`-D`): one build per
  model shape.

Built libraries go to $MINI_ENGINE_CACHE, or $XDG_CACHE_HOME/mini_engine (~/.cache/mini_engine). Set
MINI_ENGINE_C_KERNELS=0 to never build or use them.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import warnings
from pathlib import Path

import torch

SOURCE_DIR = Path(__file__).parent / "csrc"
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC")
LINK_FLAGS = ("-shared", "-fopenmp")


def cache_dir() -> Path:
    if os.environ.get("MINI_ENGINE_CACHE"):
        return Path(os.environ["MINI_ENGINE_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mini_engine"


def compiler() -> str | None:
    """The C compiler: $CC, else cc or gcc on the PATH; None when C kernels are off or there is none."""
    if os.environ.get("MINI_ENGINE_C_KERNELS", "1") == "0":
        return None
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def cxx_compiler() -> str | None:
    """The C++ compiler (for `build_torch_ops`): $CXX, else c++ or g++ on the PATH; None as for `compiler`."""
    if compiler() is None:
        return None
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def _cpu_signature() -> bytes:
    """This CPU's model name and feature flags: what -march=native compiled for."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return b"unknown"
    return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags"))})).encode()


def build(name: str, defines: dict[str, int]) -> Path:
    """Compile csrc/<name>.c with `defines` into the cache (once per source, flags and CPU); the library's path.
    Raises RuntimeError with the compiler's message when the build fails."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler (or MINI_ENGINE_C_KERNELS=0)")
    source = SOURCE_DIR / f"{name}.c"
    flags = [*COMPILE_FLAGS, *(f"-D{k}={v}" for k, v in sorted(defines.items()))]
    out = _library_path(name, source.read_bytes(), " ".join([cc, *flags, *LINK_FLAGS]).encode())
    # Linked without -ffast-math: see the module's notes.
    return _compile_and_link(out, [([cc, *flags], source)], [cc, *LINK_FLAGS], ["-lm"])


def build_torch_ops() -> Path:
    """csrc/torch_ops.cpp and the kernels it calls (int4_gemm.c, int8_gemm.c, contiguous_decode.c, layer_ops.c)
    linked into one library of PyTorch operators, built once per source, flags, compilers, CPU and PyTorch
    version; its path. The C++ file is compiled against the headers PyTorch's wheel ships, with its C++ ABI.
    Raises RuntimeError when a step fails."""
    cc, cxx = compiler(), cxx_compiler()
    if cc is None or cxx is None:
        raise RuntimeError("no C and C++ compilers (or MINI_ENGINE_C_KERNELS=0)")
    root = Path(torch.__file__).parent
    cxx_flags = [cxx, "-O2", "-fPIC", "-std=c++20", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
                 f"-I{root / 'include'}", f"-I{root / 'include' / 'torch' / 'csrc' / 'api' / 'include'}"]
    sources = [SOURCE_DIR / f"{name}.c" for name in (*_ARGTYPES, "layer_ops")] + [SOURCE_DIR / "torch_ops.cpp"]
    link = [cxx, *LINK_FLAGS, f"-L{root / 'lib'}", f"-Wl,-rpath,{root / 'lib'}"]
    out = _library_path("torch_ops", *(p.read_bytes() for p in sources),
                        " ".join([cc, *COMPILE_FLAGS, *cxx_flags, *link, torch.__version__]).encode())
    compiles = [([cc, *COMPILE_FLAGS], source) for source in sources[:-1]] + [(cxx_flags, sources[-1])]
    return _compile_and_link(out, compiles, link, ["-lc10", "-ltorch_cpu", "-lm"])


def _library_path(name: str, *parts: bytes) -> Path:
    """Where the library built from `parts` (sources, command lines), csrc's headers and this CPU is cached."""
    headers = [h.read_bytes() for h in sorted(SOURCE_DIR.glob("*.h"))]
    digest = hashlib.sha256(b"\0".join([*parts, *headers, _cpu_signature()])).hexdigest()[:16]
    return cache_dir() / f"{name}-{digest}.so"


def _compile_and_link(out: Path, compiles: list[tuple[list[str], Path]], link: list[str], libs: list[str]) -> Path:
    """Each (command, source) compiled to an object, then `link` makes them `out` (unless it exists). A build of
    several sources (the C++ operators: about 10 s on a 2-core CPU, once per machine) shows a progress bar."""
    if out.exists():
        return out
    from tqdm.auto import tqdm

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    objects = [out.with_suffix(f".{os.getpid()}.{i}.o") for i in range(len(compiles))]
    try:
        commands = [[*cmd, "-c", str(src), "-o", str(obj)] for (cmd, src), obj in zip(compiles, objects)]
        steps = [*commands, [*link, *map(str, objects), "-o", str(tmp), *libs]]
        for cmd in tqdm(steps, desc=f"building {out.name.rsplit('-', 1)[0]} (once per machine)",
                        disable=len(compiles) < 2, leave=False):
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr.strip()}")
        os.replace(tmp, out)  # atomic: another process building the same library at once is harmless
    finally:
        for path in [*objects, tmp]:
            path.unlink(missing_ok=True)
    return out


@functools.cache
def _paged_lib(num_heads: int, num_kv_heads: int, head_dim: int, layout: tuple = ()):
    """csrc/paged_decode.c built for this shape and loaded, or None (no compiler, or the build failed: said once).
    layout: ((name, value), ...) fixing the chunk kernel's vector layout (LANES, RT, KB, PC) instead of the one
    this CPU's registers pick, so that tests check every layout's logic on any CPU."""
    if compiler() is None:
        return None
    try:
        defines = {"HQ": num_heads, "HKV": num_kv_heads, "HEAD_DIM": head_dim, **dict(layout)}
        lib = ctypes.CDLL(str(build("paged_decode", defines)))
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        warnings.warn(f"the C paged-attention kernels could not be built; the PyTorch path runs instead ({e})")
        return None
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.paged_decode_f32.argtypes = [p, p, p, p, p, p, i, i, i, ctypes.c_float]
    lib.paged_chunk_f32.argtypes = [p, p, p, p, p, p, i, i, i, i, ctypes.c_float]
    lib.paged_decode_f32.restype, lib.paged_chunk_f32.restype = i, None
    return lib


def paged_decode_supported(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> bool:
    """Whether `paged_decode` (q [S, Hq, D]) or `paged_chunk` (q [S, Q, Hq, D]) can run these: fp32 CPU tensors,
    contiguous pools of one shape (the kernels read them in place), GQA with whole groups, a head size that is a
    multiple of 8, and kernels that built on this machine."""
    return (q.device.type == "cpu" and q.dim() in (3, 4) and q.dtype == k_pool.dtype == v_pool.dtype == torch.float32
            and k_pool.dim() == 4 and k_pool.shape == v_pool.shape and k_pool.is_contiguous()
            and v_pool.is_contiguous() and q.shape[-2] % k_pool.shape[2] == 0 and q.shape[-1] == k_pool.shape[3]
            and q.shape[-1] % 8 == 0
            and _paged_lib(q.shape[-2], k_pool.shape[2], q.shape[-1]) is not None)


def _check_tables(block_tables: torch.Tensor, seen: torch.Tensor, num_blocks: int, block_size: int) -> None:
    """The kernels read wherever the tables point: every context must fit its table and every block id read
    must lie in the pool. seen: each sequence's context length [S], or each query row's visible length [S, Q]
    (the last one the context, none larger). A step passes the same tensors to each of its layers, so the last
    few pairs checked (a step's decodes, verify chunks and prefill chunks) are remembered by identity and
    version, and not checked again."""
    # Inference-mode tensors keep no version counter: those are checked every time.
    tracked = not (block_tables.is_inference() or seen.is_inference())
    key = (block_tables._version, seen._version, num_blocks, block_size) if tracked else None
    if tracked and any(t is block_tables and v is seen and k == key for t, v, k in _CHECKED):
        return
    lens = seen if seen.dim() == 1 else seen[:, -1]
    if seen.dim() == 2 and (int(seen.min()) < 1 or bool((seen.amax(dim=1) != lens).any())):
        raise ValueError(f"visible must be >= 1 and at most each row's last entry, got {seen.tolist()}")
    width = block_tables.shape[1]
    if int(lens.min()) < 1 or int(lens.max()) > width * block_size:
        raise ValueError(f"context_lens must lie in [1, {width * block_size}] (block_tables' width {width} x "
                         f"block_size {block_size}), got {lens.tolist()}")
    used = torch.arange(width)[None, :] * block_size < lens[:, None]  # the entries the kernel reads
    ids = block_tables[used]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        raise ValueError(f"block_tables must hold block ids in [0, {num_blocks}) where a context reads them")
    if tracked:
        _CHECKED.append((block_tables, seen, key))
        del _CHECKED[:-_CHECKED_KEPT]


_CHECKED: list = []  # (block_tables, seen, (versions, pool shape)) last checked by _check_tables, newest last
_CHECKED_KEPT = 8


def paged_decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Decode attention read in place from a paged pool, as `kernels.paged_decode_attention` on a GPU:
    q [S, Hq, D] fp32; k_pool/v_pool [num_blocks, block_size, Hkv, D] fp32 (one layer's); block_tables [S, W]
    int32 covering each context; context_lens [S] int32, each >= 1. Returns [S, Hq, D]."""
    if q.dim() != 3 or not paged_decode_supported(q, k_pool, v_pool):
        raise ValueError("paged_decode needs q [S, Hq, D], fp32 CPU tensors, contiguous pools, Hq a multiple of Hkv, "
                         "a head size that is a multiple of 8 and a C compiler (check paged_decode_supported first)")
    fn = _paged_lib(q.shape[1], k_pool.shape[2], q.shape[2]).paged_decode_f32
    s, w = block_tables.shape
    if q.shape[0] != s or context_lens.shape != (s,):
        raise ValueError(f"q, block_tables and context_lens must have one row per sequence: {q.shape[0]}, {s}, "
                         f"{tuple(context_lens.shape)}")
    if s == 0:
        return torch.empty_like(q)
    lens, tables = context_lens.to(torch.int32).contiguous(), block_tables.to(torch.int32).contiguous()
    _check_tables(tables, lens, k_pool.shape[0], k_pool.shape[1])
    q = q.contiguous()
    out = torch.empty_like(q)
    status = fn(q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), tables.data_ptr(), lens.data_ptr(),
                out.data_ptr(), s, k_pool.shape[1], w, q.shape[2] ** -0.5 if scale is None else scale)
    if status != 0:
        raise MemoryError("paged_decode: the kernel could not allocate its scratch buffer")
    return out


def contiguous_decode_supported(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether `contiguous_decode` can run q [S, Hq, D] against one layer of the contiguous cache, k/v
    [num_slots, Hkv, max_len, D]: fp32 CPU tensors, contiguous caches, GQA with whole groups, and a kernel that
    built on this machine."""
    return (q.device.type == "cpu" and q.dim() == 3 and q.dtype == k_cache.dtype == v_cache.dtype == torch.float32
            and k_cache.dim() == 4 and k_cache.shape == v_cache.shape and k_cache.is_contiguous()
            and v_cache.is_contiguous() and q.shape[1] % k_cache.shape[1] == 0 and q.shape[2] == k_cache.shape[3]
            and _lib("contiguous_decode") is not None)


def contiguous_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                      context_lens: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Decode attention read in place from one layer of the contiguous cache: q [S, Hq, D] fp32, k/v_cache
    [num_slots, Hkv, max_len, D] fp32, sequence s reading the first context_lens[s] positions of slot slots[s]
    (both [S] int32). Returns [S, Hq, D]. Check `contiguous_decode_supported` first."""
    if not contiguous_decode_supported(q, k_cache, v_cache):
        raise ValueError("contiguous_decode needs q [S, Hq, D] and caches [slots, Hkv, max_len, D], fp32 CPU "
                         "tensors, contiguous caches, Hq a multiple of Hkv and a C compiler (check "
                         "contiguous_decode_supported first)")
    s = q.shape[0]
    if slots.shape != (s,) or context_lens.shape != (s,):
        raise ValueError(f"q, slots and context_lens must have one row per sequence: {s}, {tuple(slots.shape)}, "
                         f"{tuple(context_lens.shape)}")
    if s == 0:
        return torch.empty_like(q)
    lens, slots, q = context_lens.to(torch.int32).contiguous(), slots.to(torch.int32).contiguous(), q.contiguous()
    out = torch.empty_like(q)
    status = _lib("contiguous_decode").contiguous_decode_f32(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), lens.data_ptr(), out.data_ptr(), s,
        k_cache.shape[0], k_cache.shape[2], q.shape[1], k_cache.shape[1], q.shape[2],
        q.shape[2] ** -0.5 if scale is None else scale)
    if status == -2:  # the kernel checks before it reads: a slot or length that would read outside the cache
        raise ValueError(f"slots must lie in [0, {k_cache.shape[0]}) and context_lens in [1, {k_cache.shape[2]}], "
                         f"got {slots.tolist()} and {lens.tolist()}")
    if status != 0:
        raise MemoryError("contiguous_decode: the kernel could not allocate its scratch buffer")
    return out


def paged_chunk(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                visible: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Chunks read in place from a paged pool (prefill chunks, a speculative step's verify chunks):
    q [S, Q, Hq, D] fp32, query j of sequence s attending to the first visible[s, j] positions (its own
    included), visible [S, Q] int32, each >= 1 and at most the row's last entry; pools and block_tables as for
    `paged_decode`.
    Returns [S, Q, Hq, D]."""
    if q.dim() != 4 or not paged_decode_supported(q, k_pool, v_pool):
        raise ValueError("paged_chunk needs q [S, Q, Hq, D], fp32 CPU tensors, contiguous pools, Hq a multiple of "
                         "Hkv, a head size that is a multiple of 8 and a C compiler (check paged_decode_supported "
                         "first)")
    s, w = block_tables.shape
    if q.shape[0] != s or visible.shape != q.shape[:2]:
        raise ValueError(f"q [S, Q, ...], block_tables [S, W] and visible [S, Q] must agree: {tuple(q.shape)}, "
                         f"{tuple(block_tables.shape)}, {tuple(visible.shape)}")
    if s == 0:
        return torch.empty_like(q)
    visible, tables = visible.to(torch.int32).contiguous(), block_tables.to(torch.int32).contiguous()
    _check_tables(tables, visible, k_pool.shape[0], k_pool.shape[1])
    q = q.contiguous()
    out = torch.empty_like(q)
    _paged_lib(q.shape[2], k_pool.shape[2], q.shape[3]).paged_chunk_f32(
        q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), tables.data_ptr(), visible.data_ptr(), out.data_ptr(),
        s, q.shape[1], k_pool.shape[1], w, q.shape[3] ** -0.5 if scale is None else scale)
    return out


_P, _I = ctypes.c_void_p, ctypes.c_int
# The kernels built without -D constants: source name -> the argument types of its <name>_f32 (which returns int).
_ARGTYPES = {"int4_gemm": [_P, _P, _P, _P, _I, _I, _I, _I, _I, _I],
             "int4_gemm_amx": [_P, _P, _P, _P, _I, _I, _I, _I, _I, _I],
             "int8_gemm": [_P, _P, _P, _P, _I, _I, _I], "int8_gemm_amx": [_P, _P, _P, _P, _I, _I, _I],
             "f32_gemm": [_P, _P, _P, _I, _I, _I],
             "contiguous_decode": [_P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, ctypes.c_float]}


@functools.cache
def _lib(name: str):
    """csrc/<name>.c (a key of _ARGTYPES) built and loaded, or None (no compiler, not an x86 CPU with AVX2, or
    the build failed: said once)."""
    if compiler() is None or b"avx2" not in _cpu_signature():
        return None
    try:
        lib = ctypes.CDLL(str(build(name, {})))
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        warnings.warn(f"the C {name} kernel could not be built; the PyTorch forms run instead ({e})")
        return None
    fn = getattr(lib, f"{name}_f32")
    fn.argtypes, fn.restype = _ARGTYPES[name], _I
    return lib


@functools.cache
def load_torch_ops() -> bool:
    """csrc/torch_ops.cpp built (`build_torch_ops`) and loaded: whether `torch.ops.mini_engine_cpp` holds the
    int4, int8 and fp32 products, the contiguous cache's decode attention and a layer's small operations. False
    without compilers, on a CPU without AVX2, or when the build fails (said once); the graphs then call the
    Python-registered operators, and eager steps the ctypes kernels and PyTorch's ops."""
    if cxx_compiler() is None or b"avx2" not in _cpu_signature():
        return False
    try:
        torch.ops.load_library(str(build_torch_ops()))
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        warnings.warn(f"the C++ operators could not be built; graphs call the kernels through Python instead ({e})")
        return False
    torch.library.register_fake("mini_engine_cpp::int4_gemm")(
        lambda x, packed, scales, n, group_size, block_n: x.new_empty(x.shape[0], n))
    torch.library.register_fake("mini_engine_cpp::int4_gemm_amx")(
        lambda x, packed, scales, n, group_size, block_n: x.new_empty(x.shape[0], n))
    for name in ("int8_gemm", "int8_gemm_amx"):
        torch.library.register_fake(f"mini_engine_cpp::{name}")(
            lambda x, q, scales: x.new_empty(x.shape[0], q.shape[0]))
    torch.library.register_fake("mini_engine_cpp::contiguous_decode")(lambda q, *caches_and_lens: torch.empty_like(q))
    return True


def has_amx() -> bool:
    """Whether this CPU has Intel AMX with bf16 (and AVX512-BF16), what csrc/int4_gemm_amx.c needs."""
    flags = _cpu_signature()
    return all(f in flags for f in (b"amx_tile", b"amx_bf16", b"avx512_bf16", b"avx512bw"))


def int4_gemm_supported(n: int, k: int, group_size: int, block_n: int, halves: bool, amx: bool = False) -> bool:
    """Whether `int4_gemm` takes a weight of [n, k] in torch's packed layout with rows in blocks of `block_n`
    (`halves`: byte j of a block holds rows j and j + block_n / 2) and groups of `group_size`, on this machine;
    with `amx`, whether its AMX kernel does (a CPU with AMX, groups a multiple of 32)."""
    if not (halves and block_n in (32, 64) and n % block_n == 0 and group_size > 0 and k % group_size == 0):
        return False
    if amx:
        return group_size % 32 == 0 and has_amx() and _lib("int4_gemm_amx") is not None
    return _lib("int4_gemm") is not None


def int4_gemm(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, n: int, group_size: int,
              block_n: int, amx: bool = False) -> torch.Tensor:
    """y = x W^T for fp32 x [M, K] and an int4 weight W [n, K] kept as torch's packed CPU kernel keeps it:
    `packed`, its codes in blocks of `block_n` rows ("halves" layout), and `scales`: either [K / group_size, n, 2]
    bf16 scales and zeros (w = (q - 8) * scale + zero), or the compact int16 form of `quant.compact_scales`
    (8-bit codes of Q4_1's d and m and each row's two factors, w = d * q + m). Returns [M, n] fp32. `amx`: the
    AMX kernel (csrc/int4_gemm_amx.c), which rounds x to bf16 first. Check `int4_gemm_supported` first."""
    m, k = x.shape
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"int4_gemm needs fp32 CPU activations, got {x.dtype} on {x.device}")
    compact = scales.dtype == torch.int16
    want = (k // group_size * n + 4 * n,) if compact else (k // group_size, n, 2)
    if packed.numel() != n * k // 2 or tuple(scales.shape) != want or scales.dtype not in (torch.bfloat16, torch.int16):
        raise ValueError(f"int4_gemm: packed must hold {n} x {k} codes ({n * k // 2} bytes, got {packed.numel()}) "
                         f"and scales be bf16 [{k // group_size}, {n}, 2] or compact int16 [{want[0]}], got "
                         f"{scales.dtype} {tuple(scales.shape)}")
    x = x.contiguous()
    y = torch.empty(m, n, dtype=torch.float32)
    if m == 0:
        return y
    name = "int4_gemm_amx" if amx else "int4_gemm"
    status = getattr(_lib(name), f"{name}_f32")(x.data_ptr(), packed.data_ptr(), scales.contiguous().data_ptr(),
                                                 y.data_ptr(), m, n, k, group_size, block_n, int(compact))
    if status == -2:
        raise MemoryError("int4_gemm: the kernel could not allocate its scratch buffer")
    if status == -3:
        raise RuntimeError("int4_gemm: this CPU or operating system does not allow AMX (the kernel was built "
                           "without it, or arch_prctl refused the tile registers)")
    if status != 0:
        raise ValueError(f"int4_gemm does not take block_n={block_n}, n={n}, k={k}, group_size={group_size}")
    return y


def int8_gemm_supported(n: int, k: int, amx: bool = False) -> bool:
    """Whether `int8_gemm` takes an int8 weight of [n, k] on this machine; with `amx`, whether its AMX kernel does
    (a CPU with AMX, n and k multiples of 32)."""
    if amx:
        return n % 32 == 0 and k % 32 == 0 and has_amx() and _lib("int8_gemm_amx") is not None
    return n % 4 == 0 and k % 8 == 0 and _lib("int8_gemm") is not None


def int8_gemm(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, amx: bool = False) -> torch.Tensor:
    """y = x W^T for fp32 x [M, K] and an int8 weight W = q * scales[:, None]: q [N, K] int8 (row-major, as
    `_weight_int8pack_mm` reads it), scales [N] bf16. Returns [M, N] fp32. `amx`: the AMX kernel
    (csrc/int8_gemm_amx.c), which rounds x to bf16 first. Check `int8_gemm_supported` first."""
    m, k = x.shape
    n = q.shape[0]
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"int8_gemm needs fp32 CPU activations, got {x.dtype} on {x.device}")
    if q.dtype != torch.int8 or q.shape != (n, k) or scales.shape != (n,) or scales.dtype != torch.bfloat16:
        raise ValueError(f"int8_gemm: q must be int8 [N, {k}] and scales bf16 [N], got {q.dtype} "
                         f"{tuple(q.shape)} and {scales.dtype} {tuple(scales.shape)}")
    x = x.contiguous()
    y = torch.empty(m, n, dtype=torch.float32)
    if m == 0:
        return y
    name = "int8_gemm_amx" if amx else "int8_gemm"
    status = getattr(_lib(name), f"{name}_f32")(x.data_ptr(), q.contiguous().data_ptr(),
                                                 scales.contiguous().data_ptr(), y.data_ptr(), m, n, k)
    if status == -2:
        raise MemoryError("int8_gemm: the kernel could not allocate its scratch buffer")
    if status == -3:
        raise RuntimeError("int8_gemm: this CPU or operating system does not allow AMX (the kernel was built "
                           "without it, or arch_prctl refused the tile registers)")
    if status != 0:
        raise ValueError(f"int8_gemm does not take n={n}, k={k} (n must be a multiple of {32 if amx else 4}, "
                         f"k of {32 if amx else 8})")
    return y


@functools.cache
def f32_panel() -> int | None:
    """How many weight rows one panel of `f32_pack` holds on this CPU (48 with AVX-512, 16 with AVX2), or None
    where the kernel is not built."""
    lib = _lib("f32_gemm")
    return None if lib is None else lib.f32_gemm_panel()


def f32_gemm_supported(n: int) -> bool:
    """Whether `f32_gemm` takes a weight of n rows here (n a multiple of the panel)."""
    panel = f32_panel()
    return panel is not None and n % panel == 0


HUGE_PAGE = 2 << 20  # x86-64 Linux's transparent huge page
_MADV_HUGEPAGE = 14


@functools.cache
def _madvise():
    """libc's madvise, or None off Linux."""
    if not os.uname().sysname == "Linux":
        return None
    fn = ctypes.CDLL(None, use_errno=True).madvise
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def huge_page_empty(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialised 1-D CPU tensor whose memory starts on a 2 MiB boundary and is advised to Linux as
    transparent-huge-page memory (madvise MADV_HUGEPAGE, which takes effect where THP is "madvise" or
    "always"), before anything is written to it: the first writes then map it in 2 MiB pages.
    Why: a product that streams a weight reads a new 4 KiB page every 64 cache lines, and each is a TLB miss
    and a page walk; the model's 540 MB of fp32 weights are 130,000 small pages and 260 huge ones. On a 2-core
    Xeon with AMX the one-row products of a decode step (weights in fp32 panels, caches flushed) took 13.5-13.8 ms
    against 14.7-15.1 ms with small pages; at 16 and 32 rows, where arithmetic hides the walks, no change.
    Elsewhere (no madvise, THP off) it is an ordinary tensor: the padding before the boundary is never touched,
    so it costs address space, not memory."""
    size = numel * dtype.itemsize
    if size < HUGE_PAGE or _madvise() is None:
        return torch.empty(numel, dtype=dtype)
    length = -(-size // HUGE_PAGE) * HUGE_PAGE
    raw = torch.empty(length + HUGE_PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    _madvise()(raw.data_ptr() + start, length, _MADV_HUGEPAGE)  # advice only: a refusal leaves small pages
    return raw[start:start + size].view(dtype)


def f32_pack(w: torch.Tensor) -> torch.Tensor:
    """The fp32 weight W [N, K] packed for `f32_gemm`: [N / P, K, P], panel p holding rows p P .. p P + P - 1
    column after column (P = `f32_panel()`), in huge pages where Linux gives them (`huge_page_empty`)."""
    n, k = w.shape
    if w.dtype != torch.float32 or w.device.type != "cpu" or not f32_gemm_supported(n):
        raise ValueError(f"f32_pack needs an fp32 CPU weight whose rows are a multiple of {f32_panel()}, got "
                         f"{w.dtype} {tuple(w.shape)} on {w.device}")
    panels = w.detach().view(n // f32_panel(), f32_panel(), k).transpose(1, 2)
    return huge_page_empty(w.numel()).view(panels.shape).copy_(panels)


def f32_gemm(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """y = x W^T for fp32 x [M, K] and W packed by `f32_pack`; [M, N] fp32. Through the C++ operator
    (`torch.ops.mini_engine_cpp.f32_gemm`, the same checks) where it is built: a decode step makes 121 of these
    calls, and the checks below and the ctypes call cost more in Python than the dispatcher's one call."""
    if load_torch_ops():
        return torch.ops.mini_engine_cpp.f32_gemm(x, packed)
    if packed.dim() != 3:
        raise ValueError(f"f32_gemm: packed must come from f32_pack ([N / P, K, P]), got {tuple(packed.shape)}")
    panels, k, panel = packed.shape
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"f32_gemm needs fp32 CPU activations [M, {k}], got {x.dtype} {tuple(x.shape)} on {x.device}")
    if panel != f32_panel() or packed.dtype != torch.float32 or not packed.is_contiguous():
        raise ValueError(f"f32_gemm: packed must come from f32_pack (panels of {f32_panel()} rows), got "
                         f"{packed.dtype} {tuple(packed.shape)}")
    x = x.contiguous()
    y = torch.empty(x.shape[0], panels * panel, dtype=torch.float32)
    if x.shape[0] and _lib("f32_gemm").f32_gemm_f32(x.data_ptr(), packed.data_ptr(), y.data_ptr(), x.shape[0],
                                                    panels * panel, k) != 0:
        raise ValueError(f"f32_gemm does not take k={k}, n={panels * panel}")
    return y
