"""Quality, measured: perplexity on a fixed text, greedy agreement with a reference model, largest logit gap.

Used to compare a quantized model (mini_engine/quant) with the float model it came from, but any two models with the
same tokenizer compare (bf16 against fp32, say). Nothing here needs the network: the text ships below.

- `perplexity(model, tokenizer)`: exp of the mean negative log-likelihood of each token of `PERPLEXITY_TEXT`
  given the ones before it, in one forward pass (no cache).
- `greedy_agreement(model, reference, prompts)`: the reference decodes each prompt greedily; then both models
  read the same tokens (teacher forcing) and we count the positions where the model's argmax is the
  reference's token. Free-running greedy decodes part ways at their first disagreement and never meet again,
  which would make one early near-tie look like a broken model; teacher forcing counts every position on
  its own. The report also gives the largest |logit difference| over those positions and where the
  free-running decodes first part.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

# The project's own prose (written for this course), a few hundred tokens of plain English with some technical
# words: the fixed text every perplexity in the course is measured on.
PERPLEXITY_TEXT = """\
A language model writes one token at a time. To choose the next token it reads every weight of the network \
once, multiplies them with the activations of the tokens so far, and turns the last row of the result into a \
probability for each word of its vocabulary. On a laptop the arithmetic is cheap and the reading is not: a \
processor can multiply far faster than its memory can deliver the numbers to multiply, so a step of decoding \
waits on memory, and the time it takes grows with the number of bytes the weights occupy.

That is why the course keeps measuring bytes. The key and value cache saves the work of reading the prompt \
again at every step. Batching lets many requests share one pass over the weights. Paged memory gives each \
request only the blocks it fills, and prefix caching lets requests that begin with the same instructions \
share the blocks that hold them. Speculative decoding guesses several tokens and checks them in a single \
pass. Each of these ideas changes how often the weights are read, or how many tokens one reading serves.

Quantization changes the size of the weights themselves. Instead of a thirty-two bit number, each weight \
is stored as a small integer, four or eight bits wide, together with a scale shared by a group of its \
neighbours. The model then reads a quarter or an eighth of the bytes at every step, and decoding speeds up \
almost in proportion. The price is a small error in every weight. Whether that error matters is a question \
for measurement: we compare the answers, the probabilities and the perplexity of the quantized model with \
those of the original, on the same text and the same prompts, and report what we find.
"""

# The course's chapter prompts: the questions the notebooks ask the model.
QUALITY_PROMPTS = [
    "What is the capital of France?",
    "Tell me a fun fact about octopuses.",
    "Why is the sky blue?",
    "Write a haiku about the sea.",
    "Give me three ideas for a rainy weekend with children.",
    "Give me a name for a new bicycle shop.",
    "Explain, step by step, how a bicycle stays upright while moving.",
    "Name five fruits that are red.",
]


def chat_prompt_ids(tokenizer, questions=QUALITY_PROMPTS) -> list[list[int]]:
    """Each question as a one-turn chat, tokenized."""
    return [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}])) for q in questions]


@torch.inference_mode()
def perplexity(model, tokenizer=None, text: str = PERPLEXITY_TEXT, token_ids: list[int] | None = None) -> float:
    """exp(mean NLL) of the text's tokens, each given those before it (one forward pass, no cache)."""
    ids = list(token_ids) if token_ids is not None else tokenizer.encode(text)
    if len(ids) < 2:
        raise ValueError("text must have at least two tokens")
    logits = model(torch.tensor([ids], device=model.device))[0, :-1].float()
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:], device=logits.device))
    return math.exp(nll.item())


@dataclass
class Agreement:
    """What `greedy_agreement` measured."""
    matches: int                  # positions where the model's argmax is the reference's greedy token
    positions: int                # positions compared (every generated token of every prompt)
    max_logit_diff: float         # largest |model - reference| logit over those positions and the vocabulary
    first_divergence: list[int | None] = field(default_factory=list)  # per prompt: where free-running greedy parts

    @property
    def rate(self) -> float:
        return self.matches / self.positions if self.positions else float("nan")

    def __str__(self) -> str:
        return (f"greedy agreement {self.matches}/{self.positions} = {100 * self.rate:.1f}% of positions, "
                f"largest logit difference {self.max_logit_diff:.3f}")


@torch.inference_mode()
def greedy_agreement(model, reference, prompts: list[list[int]], max_new_tokens: int = 32,
                     free_running: bool = False, reference_tokens: list[list[int]] | None = None) -> Agreement:
    """Teacher-forced greedy agreement of `model` with `reference` over `prompts` (token ids): see the module
    docstring. free_running=True also decodes with `model` and records where each prompt's tokens first differ.
    reference_tokens: the reference's greedy continuations when already known (`reference_greedy`)."""
    from ..generate import generate_cached
    from ..sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True)
    if reference_tokens is None:
        reference_tokens = reference_greedy(reference, prompts, max_new_tokens)
    matches = positions = 0
    worst = 0.0
    firsts = []
    for prompt, ref_tokens in zip(prompts, reference_tokens):
        seq = torch.tensor([prompt + ref_tokens], device=model.device)
        start = len(prompt) - 1  # logits at position i predict token i + 1
        ours = model(seq)[0, start:start + len(ref_tokens)].float()
        theirs = reference(seq.to(reference.device))[0, start:start + len(ref_tokens)].float().to(ours.device)
        matches += int((ours.argmax(dim=-1) == torch.tensor(ref_tokens, device=ours.device)).sum())
        positions += len(ref_tokens)
        worst = max(worst, float((ours - theirs).abs().max()))
        if free_running:
            mine = generate_cached(model, prompt, max_new_tokens, params)
            firsts.append(next((i for i, (a, b) in enumerate(zip(mine, ref_tokens)) if a != b), None))
    return Agreement(matches, positions, worst, firsts)


def reference_greedy(reference, prompts: list[list[int]], max_new_tokens: int = 32) -> list[list[int]]:
    """The reference's greedy continuation of each prompt (EOS ignored, so every one has max_new_tokens)."""
    from ..generate import generate_cached
    from ..sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True)
    return [generate_cached(reference, prompt, max_new_tokens, params) for prompt in prompts]
