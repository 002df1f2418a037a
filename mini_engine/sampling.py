"""Sampling (chapter 01): greedy, temperature, top-k, top-p, seeded. Parameters are validated where they are made."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    temperature: float = 0.0          # 0 (or below 1e-5, see greedy) means greedy (argmax)
    top_k: int = 0                    # 0 disables
    top_p: float = 1.0                # 1 disables
    max_tokens: int = 64
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    n: int = 1                        # parallel sampling: n completions of the one prompt (chapter 08)
    logprobs: int | None = None       # each output token's log-probability and the top k there (`logprobs_of`)
    prompt_logprobs: int | None = None  # the same for every prompt token but the first
    MAX_LOGPROBS = 20  # as OpenAI's API: top_logprobs <= 20

    def __post_init__(self):
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise ValueError(f"n must be an int >= 1 (completions per prompt), got {self.n!r}")
        if not isinstance(self.temperature, (int, float)) or not 0 <= self.temperature < float("inf"):
            raise ValueError(f"temperature must be finite and >= 0 (0 = greedy), got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not -2**63 <= self.seed < 2**64):
            raise ValueError(f"seed must be an int that fits in 64 bits, got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= self.MAX_LOGPROBS):
                raise ValueError(f"{name} must be None or an int in [0, {self.MAX_LOGPROBS}], got {k!r}")

    @property
    def greedy(self) -> bool:  # as vLLM: dividing by a temperature below 1e-5 can overflow fp32 logits to inf
        return self.temperature < 1e-5


def _seed64(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a request seeded with `seed`: the seed itself for sample 0 (so n=1 draws
    what it always drew), otherwise 64 bits of SHA-256 over both, so that sample 1 of seed 0 is not sample 0
    of seed 1, as `seed + index` would make it."""
    return seed if index == 0 else _seed64(f"{seed}/{index}")


def make_generator(params: SamplingParams, device="cpu", index: int = 0, stream: str = "") -> torch.Generator | None:
    """A sample's own random stream: its draws depend on its seed and its index among the request's n samples
    alone, not on what else is in the batch. A named `stream` ("draft": a sampling draft model's) is another
    stream of the same sample, so what it draws never shifts the sample's own."""
    if params.greedy or params.seed is None:
        return None
    seed = sample_seed(params.seed, index)
    return torch.Generator(device=device).manual_seed(_seed64(f"{stream}/{seed}") if stream else seed)


def stop_tokens(params: SamplingParams, eos_token_id: int | None) -> frozenset[int]:
    """The tokens that end a sequence: the request's stop tokens, and EOS unless it is ignored."""
    eos = set() if params.ignore_eos or eos_token_id is None else {eos_token_id}
    return frozenset(params.stop_token_ids) | eos


def apply_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits of each row (ties at the boundary kept), set the rest to -inf."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches p (nucleus sampling)."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits.float(), dim=-1)
    # Drop a token when the mass of the tokens strictly before it already reaches p; the first always stays.
    drop_sorted = (probs.cumsum(-1) - probs) >= p
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None] | None = None) -> list[int]:
    """One next token per row of logits [S, vocab], each row with its own parameters and random stream."""
    if len(params) != logits.shape[0]:
        raise ValueError(f"params must have one entry per logits row: {len(params)} != {logits.shape[0]}")
    generators = generators or [None] * len(params)
    tokens = logits.argmax(dim=-1)  # the greedy answer, replaced below for sampled rows
    for i, (sp, gen) in enumerate(zip(params, generators)):
        if sp.greedy:
            continue
        row = logits[i].float() / sp.temperature
        row = apply_top_p(apply_top_k(row, sp.top_k), sp.top_p)
        tokens[i] = torch.multinomial(torch.softmax(row, dim=-1), 1, generator=gen)[0]
    return tokens.tolist()  # the step's one wait for the device: not one per row


def logprobs_of(logits: torch.Tensor, tokens: list[int], k: int) -> list[dict[int, float]]:
    """For each row of logits [R, vocab], {token id: log-probability} of tokens[r] and of the k most likely
    tokens. These are the model's raw log-probabilities (log_softmax in fp32, before temperature, top-k or top-p:
    vLLM's default), read from the logits the step sampled from: no second forward pass."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, torch.tensor(tokens, device=logits.device)[:, None])[:, 0].tolist()
    top_p, top_ids = (t.tolist() for t in logp.topk(k, dim=-1)) if k else ([[]] * len(tokens),) * 2
    return [{**dict(zip(ids, ps)), token: p} for token, p, ids, ps in zip(tokens, chosen, top_ids, top_p)]
