"""Grades lab 06 (the n-gram proposer, the lossless rejection sampler and the speculative loop) in either tree.

    pytest tests/labs/test_lab06.py --impl=labs        # your work
    pytest tests/labs/test_lab06.py --impl=solutions   # the reference answers

The statistical tests draw 100,000 sequences from your sampler in one call and compare how often each token
comes out with the target distribution p. Five standard deviations of slack let a correct sampler through;
a sampler that skips the residual, accepts too often or draws the bonus token from the wrong row misses by
far more (`test_the_check_catches_a_sampler_that_skips_the_residual` shows that the check catches such a
sampler). The loop is run on a toy target whose logits depend on the last two tokens in its cache, so a cache
that was not rolled back shows, then on the real model against the engine's own loop; the last tests serve
requests with the real engine, `LLM`, drafting with your proposer.
"""
import importlib
import random

import pytest
import torch

import mini_engine as me
from mini_engine import formulas, generate, speculative
from mini_engine.engine import LLM
from mini_engine.speculative import NgramProposer

LAB = "lab06_speculative"
# The engine's own proposer, sampler and loop already do these jobs, and so does its Triton rejection sampler (its
# kernel and wrapper): calling them fails the test (see conftest.py).
KERNEL = importlib.import_module("mini_engine.kernels.rejection_sampler")
SHORTCUTS = {"ngram_propose": [speculative], "residual_distribution": [speculative, KERNEL],
             "rejection_sample": [speculative, KERNEL],
             "generate_speculative": [generate.generate_speculative, speculative.verify, speculative.rejection_sample,
                                      speculative.rejection_sample_from_randoms, KERNEL]}

P = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.04])   # the target
Q = torch.tensor([0.05, 0.10, 0.15, 0.20, 0.20, 0.30])   # a draft that disagrees a lot: α = Σ min(P, Q) = 0.5
N = 100_000


# ---------------------------------------------------------------- ngram_propose

def test_ngram_proposes_what_followed_the_suffix(impl):
    tokens = [5, 6, 7, 8, 9, 1, 5, 6, 7]
    got = impl.ngram_propose(tokens, 2)
    assert got == [8, 9], (f"the last tokens [5, 6, 7] appeared before, followed by 8, 9: propose those, got {got}")


def test_ngram_returns_fewer_than_k_when_the_sequence_ends(impl):
    got = impl.ngram_propose([5, 6, 7, 8, 9, 1, 5, 6, 7], 10)
    assert got == [8, 9, 1, 5, 6, 7], f"only 6 tokens follow the match: return those 6, got {got}"


def test_ngram_without_a_match_returns_nothing(impl):
    assert impl.ngram_propose([1, 2, 3, 4], 3) == [], "no earlier occurrence of the last token: return []"
    assert impl.ngram_propose([7], 3) == [], "a single token has no earlier occurrence: return []"
    assert impl.ngram_propose([1, 2, 1], 0) == [], "k = 0: return []"
    got = impl.ngram_propose([1, 2, 3, 1], 3, ngram_min=2)
    assert got == [], f"only a 1-token match exists and ngram_min is 2: return [], got {got}"


def test_ngram_takes_the_latest_occurrence(impl):
    got = impl.ngram_propose([1, 2, 10, 1, 2, 20, 30, 1, 2], 2)
    assert got == [20, 30], f"[1, 2] occurs at 0 and 3: the LATEST one (3) is followed by 20, 30; got {got}"


def test_ngram_tries_longer_matches_first(impl):
    tokens = [2, 3, 4, 5, 7, 3, 9, 2, 3]
    got = impl.ngram_propose(tokens, 2, ngram_max=2)
    assert got == [4, 5], (f"the 2-gram [2, 3] occurs at 0 (followed by 4, 5); only the 1-gram [3] occurs later "
                           f"(followed by 9): n counts DOWN from ngram_max, so [4, 5]; got {got}")
    got = impl.ngram_propose(tokens, 2, ngram_max=1)
    assert got == [9, 2], f"with ngram_max = 1 only [3] is matched, latest at 5, followed by 9, 2; got {got}"


def test_ngram_match_may_run_into_the_suffix(impl):
    got = impl.ngram_propose([7, 7, 7, 7], 3)
    assert got == [7], f"[7, 7, 7] matches at 0 (not at 1: that is the suffix itself), followed by one 7; got {got}"


# ---------------------------------------------------------------- residual_distribution

def test_residual_is_what_p_wants_beyond_q(impl):
    got = impl.residual_distribution(torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.1, 0.6, 0.3]))
    assert torch.allclose(got, torch.tensor([1.0, 0.0, 0.0])), f"max(0, p - q) = [0.4, 0, 0], normalised; got {got}"
    got = impl.residual_distribution(torch.tensor([0.6, 0.3, 0.1]), torch.tensor([0.0, 1.0, 0.0]))
    assert torch.allclose(got, torch.tensor([6 / 7, 0.0, 1 / 7])), \
        f"a one-hot q removes its token from p and renormalises: expected [6/7, 0, 1/7], got {got}"


def test_residual_works_on_batches_and_sums_to_one(impl):
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(4, 3, 9, generator=gen), -1)
    q = torch.softmax(torch.randn(4, 3, 9, generator=gen), -1)
    got = impl.residual_distribution(p, q)
    assert got.shape == p.shape, f"keep the input shape [..., V]: expected {tuple(p.shape)}, got {tuple(got.shape)}"
    assert (got >= 0).all(), "clamp negative differences to 0"
    assert torch.allclose(got.sum(-1), torch.ones(4, 3)), "normalise over the LAST axis only (keepdim=True)"


def test_an_empty_residual_falls_back_to_p(impl):
    p = torch.tensor([[0.2, 0.8], [0.5, 0.5]])
    got = impl.residual_distribution(p, p)
    assert torch.equal(got, p), f"p = q leaves nothing: return p for such rows (no 0/0 NaN); got {got}"


# ---------------------------------------------------------------- rejection_sample

def batch(p_rows, q_rows, n, gen):
    """n copies of one step, drafts drawn from q: target [n, k+1, V], drafts [n, k], q [n, k, V]."""
    k = q_rows.shape[0]
    q = q_rows.expand(n, k, -1)
    drafts = torch.multinomial(q.reshape(-1, q.shape[-1]), 1, generator=gen).view(n, k)
    return p_rows.expand(n, k + 1, -1), drafts, q


def check_shape(out, drafts):
    k = drafts.shape[1]
    assert isinstance(out, list) and len(out) == len(drafts), "return a list holding one list of token ids per sequence"
    for row, d in zip(out[:50], drafts[:50].tolist()):
        assert 1 <= len(row) <= k + 1, f"each sequence gets 1 to k + 1 = {k + 1} tokens, got {row}"
        assert row[:-1] == d[:len(row) - 1], f"the tokens before the last must be the accepted drafts {d}, got {row}"


def frequencies(tokens, vocab):
    return torch.bincount(torch.as_tensor(tokens), minlength=vocab).double() / len(tokens)


def deviation(tokens, p):
    """The worst token's distance from p, in units of five standard deviations (a correct sampler: < 1)."""
    n = len(tokens)
    sigma5 = 5 * (p.double() * (1 - p.double()) / n).sqrt() + 1e-4
    return ((frequencies(tokens, len(p)) - p).abs() / sigma5).max().item()


def test_all_drafts_accepted_when_q_equals_p(impl):
    gen = torch.Generator().manual_seed(1)
    target, drafts, q = batch(P.expand(4, -1), P.expand(3, -1), 2000, gen)
    out = impl.rejection_sample(target, drafts, q, gen)
    check_shape(out, drafts)
    short = sum(len(r) < 4 for r in out)
    assert short == 0, (f"{short} of 2000 sequences rejected a draft although q = p: accept when u * q(x) < p(x), "
                        "which always holds for u in [0, 1) when q(x) = p(x)")


def test_no_draft_accepted_when_q_misses_ps_support(impl):
    gen = torch.Generator().manual_seed(2)
    p = torch.tensor([0.5, 0.3, 0.2, 0.0, 0.0, 0.0])
    q = torch.tensor([0.0, 0.0, 0.0, 0.2, 0.3, 0.5])
    target, drafts, q_rows = batch(p.expand(3, -1), q.expand(2, -1), 2000, gen)
    out = impl.rejection_sample(target, drafts, q_rows, gen)
    check_shape(out, drafts)
    long = sum(len(r) > 1 for r in out)
    assert long == 0, f"{long} sequences accepted a draft the target gives probability 0: never accept those"
    bad = sum(r[0] > 2 for r in out)
    assert bad == 0, f"{bad} sequences drew a token p gives probability 0: after a rejection draw from the residual"


def test_greedy_target_accepts_while_the_draft_is_the_argmax(impl):
    gen = torch.Generator().manual_seed(3)
    s, k, vocab = 32, 3, 20
    logits = torch.randn(s, k + 1, vocab, generator=gen)
    argmax = logits.argmax(-1)
    target = torch.nn.functional.one_hot(argmax, vocab).float()  # greedy: p is one-hot at the argmax
    agree = torch.randint(0, k + 1, (s,), generator=gen)
    drafts = torch.where(torch.arange(k) < agree[:, None], argmax[:, :k], (argmax[:, :k] + 1) % vocab)
    out = impl.rejection_sample(target, drafts, None, gen)
    expected = [argmax[i, :a + 1].tolist() for i, a in enumerate(agree.tolist())]
    wrong = [i for i in range(s) if out[i] != expected[i]]
    assert not wrong, (f"sequence {wrong[0]}: with one-hot p, keep drafts while they equal the argmax, then emit the "
                       f"argmax: expected {expected[wrong[0]]}, got {out[wrong[0]]}")


@pytest.mark.parametrize("proposer", ["sampled", "deterministic"])
def test_emitted_tokens_follow_the_target(impl, proposer):
    gen = torch.Generator().manual_seed(4)
    p_rows = torch.stack([P, P.flip(0), P.roll(2)])  # a different target at each of the k + 1 = 3 positions
    if proposer == "sampled":
        target, drafts, q = batch(p_rows, torch.stack([Q, Q.roll(3)]), N, gen)
    else:  # the same guesses everywhere, as an n-gram lookup makes: q is one-hot
        target, drafts, q = p_rows.expand(N, -1, -1), torch.tensor([[0, 5]]).expand(N, -1), None
    out = impl.rejection_sample(target, drafts, q, gen)
    check_shape(out, drafts)
    for position, p in enumerate(p_rows):
        tokens = [r[position] for r in out if len(r) > position]
        off = deviation(tokens, p)
        assert off < 1, (
            f"{proposer} drafts, position {position}: token frequencies {frequencies(tokens, 6).numpy().round(3)} "
            f"vs the target's {p.numpy()} ({off:.1f}x the allowed deviation). After a rejection, draw from "
            f"residual_distribution(p_j, q_j) (not from p_j); after k accepted drafts draw the bonus from p_k; "
            f"accept with probability min(1, p/q), i.e. u * q(x) < p(x)")


def test_mean_tokens_per_step_match_the_formula(impl):
    gen = torch.Generator().manual_seed(5)
    k = 3
    target, drafts, q = batch(P.expand(k + 1, -1), Q.expand(k, -1), N, gen)
    out = impl.rejection_sample(target, drafts, q, gen)
    mean = sum(map(len, out)) / N
    alpha = formulas.acceptance_rate(P.numpy(), Q.numpy())
    expected = formulas.expected_tokens_per_step(k, alpha)
    assert abs(mean - expected) < 0.02, (
        f"{mean:.3f} tokens per step, but with α = Σ min(p, q) = {alpha:.2f} and k = {k} the formula gives "
        f"{expected:.3f}: check the accept test (u * q(x) < p(x)) and that a sequence stops at its first rejection")


def test_the_check_catches_a_sampler_that_skips_the_residual():
    """Not graded on your code: proof that the statistical test above fails a sampler that draws from p after a
    rejection, and one that always accepts."""
    gen = torch.Generator().manual_seed(6)
    x = torch.multinomial(Q, N, replacement=True, generator=gen)
    accept = torch.rand(N, generator=gen) * Q[x] < P[x]
    from_p = torch.where(accept, x, torch.multinomial(P, N, replacement=True, generator=gen))
    from_residual = torch.where(accept, x, torch.multinomial((P - Q).clamp_min(0), N, replacement=True, generator=gen))
    assert deviation(from_residual.tolist(), P) < 1
    assert deviation(from_p.tolist(), P) > 3
    assert deviation(x.tolist(), P) > 3  # always accepting emits q


# ---------------------------------------------------------------- generate_speculative

class ToyTarget:
    """Stands in for `Target`: a 6-token vocabulary whose next-token logits depend on the last TWO tokens in the
    cache, so a cache that still holds a rejected draft, or lacks a kept token, changes them. `passes` records
    each forward pass as (its first position, its tokens)."""
    V = 6

    def __init__(self, seed: int, sharpness: float = 4.0):
        self.table = torch.randn(self.V, self.V, self.V, generator=torch.Generator().manual_seed(seed)) * sharpness
        self.cache: list[int] = []  # the token at each cached position (rows past num_cached are stale)
        self.num_cached = self.num_passes = 0
        self.passes: list[tuple[int, list[int]]] = []

    def next_logits(self, tokens):
        return self.table[tokens[-2] if len(tokens) > 1 else 0, tokens[-1]]

    def forward(self, token_ids):
        start = self.num_cached
        assert token_ids, "forward() needs at least one token"
        self.cache[start:] = list(token_ids)
        self.num_cached, self.num_passes = start + len(token_ids), self.num_passes + 1
        self.passes.append((start, list(token_ids)))
        return torch.stack([self.next_logits(self.cache[:p + 1]) for p in range(start, self.num_cached)])

    def rollback(self, num_tokens):
        assert 0 <= num_tokens <= self.num_cached, f"rollback({num_tokens}) with {self.num_cached} positions cached"
        self.num_cached = num_tokens


def greedy_chain(target, prompt, n):
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(target.next_logits(tokens).argmax()))
    return tokens[len(prompt):]


def sometimes_right(target, seed):
    """A proposer that guesses the greedy continuation, then goes wrong at a random point: rounds accept all,
    some or none of their drafts."""
    rng = random.Random(seed)

    def propose(token_ids, k):
        right = greedy_chain(target, token_ids, k)
        wrong_from = rng.randrange(k + 1)
        return right[:wrong_from] + [(t + 1) % ToyTarget.V for t in right[wrong_from:]]
    return propose


@pytest.mark.parametrize("seed", range(4))
def test_loop_gives_greedy_decodings_tokens(impl, seed):
    target = ToyTarget(seed)
    prompt = [seed % 6, (seed + 2) % 6, 1]
    expected = greedy_chain(target, prompt, 14)
    out, rounds = impl.generate_speculative(target, prompt, sometimes_right(target, seed), 3, 14)
    assert out == expected, (
        f"greedy speculative decoding must give plain greedy decoding's tokens: expected {expected}, got {out}. "
        "Keep only the drafts rejection_sample accepts, and roll the cache back to the tokens kept")
    assert any(0 < a < d for d, a in rounds) and any(a == d > 0 for d, a in rounds), \
        f"this proposer's rounds accept some and all of their drafts; your rounds say {rounds}"


def test_loop_verifies_each_round_in_one_pass_after_rolling_back(impl):
    target = ToyTarget(7)
    prompt = [3, 1, 4]
    out, rounds = impl.generate_speculative(target, prompt, sometimes_right(target, 7), 4, 16)
    assert target.passes[0] == (0, prompt), f"the first pass runs the prompt from position 0, got {target.passes[0]}"
    lone = sum(len(chunk) == 1 for _, chunk in target.passes[1:])  # passes that verified no draft
    assert len(target.passes) <= 1 + len(rounds) or lone <= rounds.count((0, 0)), (
        f"{len(target.passes)} forward passes for {len(rounds)} rounds, and {lone} of the passes ran a round with no "
        f"drafts while your rounds hold {rounds.count((0, 0))} (0, 0): record every round, one without drafts as "
        "(0, 0)")
    assert len(target.passes) == 1 + len(rounds), (
        f"{len(target.passes)} forward passes for {len(rounds)} rounds: prefill once, then verify each round's "
        "newest token and drafts together in ONE target.forward")
    sequence, emitted = prompt + out, 1
    for r, ((start, chunk), (drafted, accepted)) in enumerate(zip(target.passes[1:], rounds)):
        newest = len(prompt) + emitted - 1
        assert start == newest, (
            f"round {r} ran its chunk from position {start}, but the newest kept token sits at {newest}: after "
            "a verify pass the cache must hold every kept token but the newest, and nothing of a rejected draft")
        assert chunk[0] == sequence[newest] and len(chunk) == 1 + drafted, \
            f"round {r}: a chunk is the newest token, then the round's {drafted} drafts; got {chunk}"
        emitted += accepted + 1
    assert emitted >= len(out) and sum(d for d, _ in rounds) > 0, \
        f"your rounds {rounds} account for {emitted} tokens, fewer than the {len(out)} you returned"


def test_loop_stops_at_max_new_tokens_and_after_the_stop_token(impl):
    target = ToyTarget(6)
    prompt = [3, 0]
    out, rounds = impl.generate_speculative(target, prompt, sometimes_right(target, 1), 4, 9)
    assert len(out) == 9, f"max_new_tokens=9: got {len(out)} tokens"
    left = 8  # after the prefill's token
    for drafted, accepted in rounds:
        assert drafted <= min(4, left - 1), (f"a round with {left} tokens left drafted {drafted}: ask for at most "
                                             "min(k, tokens left - 1), since the round adds one token of its own")
        left -= accepted + 1
    chain = greedy_chain(target, prompt, 12)
    stop = next(t for t in chain[4:] if t not in chain[:4])  # a token that first appears after a few others
    out, _ = impl.generate_speculative(ToyTarget(6), prompt, sometimes_right(target, 2), 4, 12, stop_token_id=stop)
    assert out == chain[:chain.index(stop) + 1], \
        f"stop right after the stop token {stop} (even inside accepted drafts): expected {chain[:chain.index(stop) + 1]}, got {out}"


def test_loop_samples_the_targets_distribution(impl):
    """Sampled (temperature 1): the first three tokens follow the target's chain of distributions."""
    gen, runs, prompt = torch.Generator().manual_seed(8), 3000, [1, 2]
    probe = ToyTarget(5, sharpness=1.0)
    counts = torch.zeros(6, 6, 6)
    for _ in range(runs):
        target = ToyTarget(5, sharpness=1.0)
        out, _ = impl.generate_speculative(target, prompt, lambda ids, k: [(ids[-1] + 1) % 6] * k, 2, 3, 1.0,
                                           generator=gen)
        counts[tuple(out)] += 1
    p = torch.zeros(6, 6, 6)
    for a in range(6):
        for b in range(6):
            for c in range(6):
                p[a, b, c] = torch.prod(torch.stack([torch.softmax(probe.next_logits(prompt + [a, b, c][:i]), -1)[t]
                                                     for i, t in enumerate((a, b, c))]))
    for axes, name in (((1, 2), "first"), ((0, 2), "second"), ((0, 1), "third")):
        freq, want = counts.sum(axes) / runs, p.sum(axes)
        off = ((freq - want).abs() / (5 * (want * (1 - want) / runs).sqrt() + 1e-3)).max().item()
        assert off < 1, (f"the {name} token's frequencies {freq.numpy().round(3)} are far from the target's "
                         f"{want.numpy().round(3)}: verify with your rejection_sample and draw a round without "
                         "drafts from p_0")


GREEDY = me.SamplingParams(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def repeat_prompt(real_model):
    _, tok = real_model
    text = "The river flows past the old mill and under the stone bridge."
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": "Repeat exactly: " + text}]))


@pytest.mark.engine("your loop on the real model against the engine's own speculative loop, 24 tokens")
def test_loop_gives_the_engines_tokens_on_the_real_model(impl, real_model, repeat_prompt):
    model, _ = real_model
    target = impl.Target(model, len(repeat_prompt) + 24)
    out, rounds = impl.generate_speculative(target, repeat_prompt, NgramProposer(1, 3).propose, 4, 24)
    expected, stats = me.generate_speculative(model, repeat_prompt, NgramProposer(1, 3), k=4, max_new_tokens=24,
                                              params=GREEDY)
    assert out == expected, f"on the real model your loop gives {out}, the engine's {expected}"
    assert rounds == [(len(d), a) for d, a in stats.rounds], "the same drafts must be proposed and accepted"
    assert target.num_passes == 1 + len(rounds) < 24, "one prefill, then one pass per round, fewer than the tokens"


class LabProposer:
    """Your ngram_propose behind the engine's proposer hook: `LLM(speculative={"method": LabProposer(...)})`."""

    def __init__(self, ngram_propose):
        self.ngram_propose = ngram_propose

    def propose(self, token_ids, k):
        return self.ngram_propose(token_ids, k, ngram_min=1, ngram_max=3)


@pytest.mark.engine("2 requests through the real engine drafting with your ngram_propose, then with its own")
def test_the_engine_serves_requests_with_your_proposer(impl, real_model, repeat_prompt):
    model, tok = real_model
    chat = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Give me two ideas for a rainy day."}]))
    params = me.SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    engine_own = LLM.from_model(model, tok, max_num_seqs=2,
                                speculative={"method": "ngram", "k": 4, "ngram_min": 1, "ngram_max": 3})
    yours = LLM.from_model(model, tok, max_num_seqs=2, speculative={"method": LabProposer(impl.ngram_propose), "k": 4})
    b, a = (llm.generate([repeat_prompt, chat], params, use_tqdm=False) for llm in (yours, engine_own))
    for x, y in zip(a, b):
        assert y.token_ids == x.token_ids, "the engine drafting with your proposer must give its own tokens"
        assert (y.metrics.num_draft_tokens, y.metrics.num_accepted_tokens) == \
            (x.metrics.num_draft_tokens, x.metrics.num_accepted_tokens), \
            "your proposer must draft what the engine's n-gram lookup drafts (same n range, latest match)"
    assert b[0].metrics.num_accepted_tokens > 0


# ---------------------------------------------------------------- the guards (see conftest.py)

def residual_by_the_engine(target_probs, draft_probs):
    """max(0, p - q), normalised by the engine's own softmax."""
    residual = (target_probs - draft_probs).clamp_min(0)
    return speculative.target_probs_from_logits(residual.log(), me.SamplingParams(temperature=1.0))


def loop_by_the_engine(target, prompt_ids, propose, k, max_new_tokens, temperature=0.0, stop_token_id=None,
                       generator=None):
    """The whole loop handed to the engine's `generate_speculative`."""
    proposer = type("Wrapped", (), {"propose": staticmethod(propose)})()
    out, stats = me.generate_speculative(target.model, prompt_ids, proposer, k, max_new_tokens, GREEDY)
    return out, [(len(d), a) for d, a in stats.rounds]


def loop_verifying_by_the_engine(target, prompt_ids, propose, k, max_new_tokens, temperature=0.0,
                                 stop_token_id=None, generator=None):
    """The loop written out, but each round's accept and reject handed to the engine's `verify`."""
    out, rounds = [int(target.forward(list(prompt_ids))[-1].argmax())], []
    while len(out) < max_new_tokens:
        tokens = list(prompt_ids) + out
        n = min(k, max_new_tokens - len(out) - 1)
        drafts = list(propose(tokens, n))[:n] if n > 0 else []
        kept = speculative.verify(target.forward([tokens[-1]] + drafts), drafts, None, GREEDY, generator)
        rounds.append((len(drafts), len(kept) - 1))
        target.rollback(len(tokens) + len(kept) - 1)
        out += kept[:max_new_tokens - len(out)]
    return out, rounds


def rejection_sample_by_the_kernel(target_probs, draft_token_ids, draft_probs=None, generator=None):
    """The student's own random numbers, but the engine's Triton kernel does the accepting and the drawing."""
    (s, k), vocab = draft_token_ids.shape, target_probs.shape[-1]
    uniforms = torch.rand(s, k, generator=generator)
    inv_exponentials = 1 / torch.empty(s, vocab).exponential_(generator=generator)
    out = KERNEL.rejection_sampler(target_probs.float(), draft_token_ids, torch.full((s,), k, dtype=torch.int32),
                                   draft_probs, uniforms, inv_exponentials)
    return [[t for t in row if t >= 0] for row in out.tolist()]


# Each part of the lab handed to something that already does it, and a grading test that must fail it.
HAND_OFFS = [
    ("ngram_propose", lambda token_ids, k, ngram_min=1, ngram_max=3:
        NgramProposer(ngram_min, ngram_max).propose(token_ids, k), test_ngram_takes_the_latest_occurrence, {}),
    ("residual_distribution", residual_by_the_engine, test_residual_is_what_p_wants_beyond_q, {}),
    ("rejection_sample", lambda target_probs, draft_token_ids, draft_probs=None, generator=None:
        speculative.rejection_sample(target_probs, draft_token_ids, draft_probs, generator),
     test_greedy_target_accepts_while_the_draft_is_the_argmax, {}),
    ("rejection_sample", rejection_sample_by_the_kernel, test_greedy_target_accepts_while_the_draft_is_the_argmax, {}),
    ("generate_speculative", loop_verifying_by_the_engine, test_loop_gives_greedy_decodings_tokens, {"seed": 0}),
    ("generate_speculative", loop_by_the_engine, test_loop_gives_the_engines_tokens_on_the_real_model, {}),
]


def test_every_part_of_the_lab_has_a_hand_off_check(asked_for):
    missing = set(asked_for(LAB)) - {part for part, *_ in HAND_OFFS}
    assert not missing, f"parts of the lab with no hand-off check above: {sorted(missing)}"


@pytest.mark.parametrize("part,replacement,test,args", HAND_OFFS,
                         ids=[f"{part}-{i}" for i, (part, *_) in enumerate(HAND_OFFS)])
def test_the_grader_fails_a_part_handed_off(hand_off, part, replacement, test, args):
    hand_off(part, replacement, test, **args)


# ---------------------------------------------------------------- wrong answers, and the one line each prints

solution = importlib.import_module(f"solutions.{LAB}")


def loop_without_empty_rounds(target, prompt_ids, propose, k, max_new_tokens, temperature=0.0, stop_token_id=None,
                              generator=None):
    """The solution's loop, but a round with no drafts is left out of `rounds`."""
    out, rounds = solution.generate_speculative(target, prompt_ids, propose, k, max_new_tokens, temperature,
                                                stop_token_id, generator)
    return out, [r for r in rounds if r != (0, 0)]


WRONG_ANSWERS = [
    ({"generate_speculative": loop_without_empty_rounds}, test_loop_verifies_each_round_in_one_pass_after_rolling_back,
     r"\d+ forward passes for \d+ rounds, and [1-9]\d* of the passes ran a round with no drafts while your rounds hold "
     r"0 \(0, 0\): record every round, one without drafts as \(0, 0\)"),
]


@pytest.mark.parametrize("replacements,test,line", WRONG_ANSWERS,
                         ids=[f"{t.__name__.removeprefix('test_')}-{i}" for i, (_, t, _) in enumerate(WRONG_ANSWERS)])
def test_a_wrong_answer_fails_with_one_line_that_says_what_to_fix(wrong_answer, replacements, test, line):
    wrong_answer(test, replacements, line)
