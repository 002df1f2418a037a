"""Grades lab 06 (the n-gram proposer and the lossless rejection sampler) in either tree.

    pytest tests/labs/test_lab06.py --impl=labs        # your work
    pytest tests/labs/test_lab06.py --impl=solutions   # the reference answers

The statistical tests draw 100,000 sequences from your sampler in one call and compare how often each token
comes out with the target distribution p. Five standard deviations of slack let a correct sampler through;
a sampler that skips the residual, accepts too often or draws the bonus token from the wrong row misses by
far more (the last test shows that the check catches such a sampler).
"""
import pytest
import torch

from mini_engine import formulas, speculative

LAB = "lab06_speculative"
# The engine's own proposer and sampler already do these jobs: calling them fails the test (see conftest.py).
SHORTCUTS = {"ngram_propose": [speculative], "residual_distribution": [speculative],
             "rejection_sample": [speculative]}

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
    assert isinstance(out, list) and len(out) == len(drafts), "return one list of token ids per sequence"
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
