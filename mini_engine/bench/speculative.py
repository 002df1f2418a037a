"""`python -m mini_engine bench --workload speculative`: the serving engine with and without n-gram speculation,
at batch 1 and batch 16, on an input-grounded workload (repeat or proofread a given text: the output copies the
input, where prompt lookup finds its drafts) and on open chat (where it finds little).

Before anything is timed, every product's form is tuned for each row count a step can bring (`backends.cpu.warm_up`) and
each configuration runs once: a speculative step has 1 + k rows per request, row counts a plain engine never
meets, and a tuning run inside the clock made speculation look twice as costly as it is.

Per run: output tokens/s, the measured α (accepted / tested drafts: a draft is tested only if every draft before
it in its round was accepted), tokens per decode round, and beside them the formula's prediction from that α and
the measured cost of a step, (tokens per round predicted) x (plain step time / speculative step time). Greedy, so
the two engines must produce the same tokens; the table says whether they did.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..engine import LLM
from ..course.formulas import expected_tokens_per_step
from ..sampling import SamplingParams

TEXTS = [
    "Tides rise and fall twice a day because the moon pulls on the oceans. The side of the earth facing the moon "
    "bulges toward it, and the far side bulges too, so most coasts see two high tides and two low tides.",
    "To make bread, mix flour, water, salt and yeast, knead the dough for ten minutes, and let it rise for an hour. "
    "Shape the loaf, let it rise again, then bake it in a hot oven until the crust is brown.",
    "A hash map stores each key in a bucket chosen by the key's hash. Looking a key up hashes it again and checks "
    "only that bucket, so the average lookup takes constant time however many keys the map holds.",
]
# Tasks whose answer is the given text, as a copy or with small edits. SmolLM2-135M asked to "rewrite this text
# word for word" paraphrases it instead (measured α 0.6); these two it follows (α about 0.9).
GROUNDED_TASKS = ["Repeat this text exactly:\n\n{text}", "Fix the spelling in this text and return it in full:\n\n{text}"]
QUESTIONS = ["Why do cats purr?", "Give me three ideas for a birthday party.", "What makes a good story?",
             "How do airplanes stay in the air?", "Suggest a name for a small coffee shop."]


def prompts_for(tok, workload: str, n: int) -> list[list[int]]:
    if workload == "grounded":
        messages = [[{"role": "user", "content": GROUNDED_TASKS[i % 2].format(text=TEXTS[i % len(TEXTS)])}]
                    for i in range(n)]
    elif workload == "chat":
        messages = [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(n)]
    else:
        raise ValueError(f"workload must be 'grounded' or 'chat', got {workload!r}")
    return [tok.encode(tok.apply_chat_template(m)) for m in messages]


@dataclass
class SpecRun:
    workload: str
    batch: int
    speculative: bool
    seconds: float
    output_tokens: int
    steps: int                          # engine steps (forward passes)
    rounds: list[tuple[int, int]]       # per request and sampling step: (drafts verified, drafts accepted)
    outputs: list[list[int]]

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def alpha(self) -> float:
        accepted = sum(a for _, a in self.rounds)
        tested = accepted + sum(a < d for d, a in self.rounds)
        return accepted / tested if tested else 0.0

    @property
    def tokens_per_round(self) -> float:
        return sum(a + 1 for _, a in self.rounds) / len(self.rounds)

    def predicted_tokens_per_round(self, alpha: float) -> float:
        return sum(float(expected_tokens_per_step(d, alpha)) if d else 1.0 for d, _ in self.rounds) / len(self.rounds)


def run_spec(model, tok, prompts: list[list[int]], batch: int, speculative: dict | None, max_tokens: int,
             workload: str = "") -> SpecRun:
    llm = LLM.from_model(model, tok, max_num_seqs=batch, speculative=speculative)
    scheduler, rounds, steps = llm.engine.scheduler, [], [0]
    update = scheduler.update

    def counted(chunks, sampled, now):  # one round per sampling chunk: its drafts and how many were accepted
        before = [(c.request, len(c.draft_token_ids), c.request.num_accepted_tokens) for c in chunks if c.samples]
        finished = update(chunks, sampled, now)
        rounds.extend((d, r.num_accepted_tokens - a) for r, d, a in before)
        steps[0] += 1
        return finished
    scheduler.update = counted
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    return SpecRun(workload, batch, speculative is not None, seconds, sum(len(o.token_ids) for o in outs), steps[0],
                   rounds, [o.token_ids for o in outs])


def bench_speculative(device: str = "cpu", dtype: str = "float32", batches=(1, 16), max_tokens: int = 48,
                      k: int = 4, requests_at_batch_1: int = 2, print_fn=print) -> list[tuple[SpecRun, ...]]:
    """For each workload and batch: (plain run, n-gram run, n-gram run drafting k every round) on the same
    requests; prints one table."""
    from tqdm.auto import tqdm

    from ..course.hardware import describe_machine

    from ..backends.cpu import warm_up
    from ..loading.loader import load_model

    model, tok = load_model("smollm2-135m", device=device, dtype=dtype)
    ngram = {"method": "ngram", "k": k, "ngram_min": 1, "ngram_max": 4}
    specs = (None, ngram, {**ngram, "adaptive": False})
    warm_up(model, rows=[1 << i for i in range(9)])  # every row bucket, 1 to 256 (`autotune.row_bucket`)
    configs = [(workload, batch, spec) for workload in ("grounded", "chat") for batch in batches for spec in specs]
    runs = []
    for workload, batch, spec in tqdm(configs, desc="speculative bench", unit="run"):
        prompts = prompts_for(tok, workload, requests_at_batch_1 if batch == 1 else batch)
        run_spec(model, tok, prompts, batch, spec, max_tokens, workload)  # warm-up: tuning and allocation
        runs.append(run_spec(model, tok, prompts, batch, spec, max_tokens, workload))
    triples = [tuple(runs[i:i + 3]) for i in range(0, len(runs), 3)]
    print_fn(describe_machine(device))
    print_fn(f"device={device} dtype={dtype} threads={torch.get_num_threads()}; n-gram speculation k={k} "
             f"(ngram 1..4), greedy, up to {max_tokens} output tokens per request")
    print_fn(f"{'workload':9} {'batch':>5} {'plain tok/s':>11} {'spec tok/s':>10} {'speedup':>7} {'alpha':>6} "
             f"{'tok/round':>9} {'predicted':>9} {'pred. speedup':>13} {'fixed k':>7} {'same output':>11}")
    for plain, spec, fixed in triples:
        alpha = spec.alpha
        predicted = spec.predicted_tokens_per_round(alpha)
        # The formula's tokens per round over what a round costs, measured: time per round (a request's sampling
        # step; a batched step serves many) with speculation relative to without.
        round_cost = (spec.seconds / len(spec.rounds)) / (plain.seconds / len(plain.rounds))
        predicted_speedup = predicted / round_cost
        same = spec.outputs == plain.outputs == fixed.outputs
        print_fn(f"{spec.workload:9} {spec.batch:5d} {plain.tok_s:11.1f} {spec.tok_s:10.1f} "
                 f"{spec.tok_s / plain.tok_s:6.2f}x {alpha:6.2f} {spec.tokens_per_round:9.2f} {predicted:9.2f} "
                 f"{predicted_speedup:12.2f}x {fixed.tok_s / plain.tok_s:6.2f}x {'yes' if same else 'NO':>11}")
    print_fn("alpha: accepted / tested drafts; tok/round: tokens a request gets per step it samples in (1 without "
             "speculation); predicted: the formula (1 - a^(d+1)) / (1 - a) over the rounds' draft counts d; pred. "
             "speedup: that over the measured cost of a speculative round relative to a plain one; fixed k: the "
             "speedup when every round drafts k (speculative['adaptive']=False) instead of one more than the "
             "request's last round accepted")
    return triples
