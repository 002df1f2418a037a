"""Speculative decoding's engine-independent pieces: the rejection sampler (lossless: the tokens it emits
follow the target's distribution), the n-gram proposer, and the draft-model proposer on the real model."""
import pytest
import torch

import mini_engine as me
from mini_engine import formulas
from mini_engine.speculative import (DraftModelProposer, NgramProposer, draw_randoms, num_drafts_of,
                                     rejection_sample, rejection_sample_from_randoms, target_probs_from_logits)

# ---------------------------------------------------------------- helpers

P = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.04])  # the target, V = 6
Q = torch.tensor([0.05, 0.10, 0.15, 0.20, 0.20, 0.30])  # a draft that disagrees a lot: α = Σ min(P, Q) = 0.5


def batch(p_rows, q_rows, num_seqs, gen):
    """num_seqs copies of one step: target rows p_0..p_k [k+1, V], draft rows q_0..q_{k-1} [k, V], and drafts
    drawn from q (as a sampled proposer draws them)."""
    k = q_rows.shape[0]
    target = p_rows.expand(num_seqs, k + 1, -1)
    draft = q_rows.expand(num_seqs, k, -1)
    drafts = torch.multinomial(draft.reshape(-1, draft.shape[-1]), 1, generator=gen).view(num_seqs, k)
    return target, drafts, draft


def frequencies(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).double() / len(tokens)


def bound(p: torch.Tensor, n: int) -> torch.Tensor:
    """Five standard deviations of an empirical frequency over n samples: a correct sampler stays inside
    (the seed is fixed, so the test is deterministic, but it would pass for almost any seed)."""
    return 5 * (p.double() * (1 - p.double()) / n).sqrt() + 1e-4


def sample_rows(target, drafts, draft, gen) -> torch.Tensor:
    """`rejection_sample`'s CPU path without its list output (200k Python lists take longer than the
    sampling): [S, k + 1] rows of tokens padded with -1."""
    k = drafts.shape[1]
    uniforms, inv_exp = draw_randoms([k] * len(drafts), k, target.shape[-1], gen)
    return rejection_sample_from_randoms(target, drafts, num_drafts_of(drafts), draft, uniforms, inv_exp)


# ---------------------------------------------------------------- the rejection sampler

def test_every_draft_is_accepted_when_q_equals_p():
    gen = torch.Generator().manual_seed(0)
    target, drafts, draft = batch(P.expand(5, -1), P.expand(4, -1), 2000, gen)
    out = rejection_sample(target, drafts, draft, gen)
    assert all(len(row) == 5 for row in out), "with q = p every draft passes: u · q(x) < p(x) for u < 1"
    assert [row[:4] for row in out] == drafts.tolist()


def test_no_draft_is_accepted_when_q_misses_ps_support():
    gen = torch.Generator().manual_seed(1)
    p = torch.tensor([0.5, 0.3, 0.2, 0.0, 0.0, 0.0])
    q = torch.tensor([0.0, 0.0, 0.0, 0.2, 0.3, 0.5])
    target, drafts, draft = batch(p.expand(4, -1), q.expand(3, -1), 20000, gen)
    out = rejection_sample(target, drafts, draft, gen)
    assert all(len(row) == 1 for row in out), "p(x) = 0 for every draft: each one must be rejected"
    tokens = torch.tensor([row[0] for row in out])
    assert tokens.max() <= 2, "the residual max(0, p - q) is p itself here: only tokens 0-2"
    assert (frequencies(tokens, 6) - p).abs().le(bound(p, len(tokens))).all()


def wrong_first_tokens(p, q, num_seqs, gen, after_rejection):
    """A one-position sampler with a known bug: after a rejection it draws from `after_rejection` instead of
    the normalised residual max(0, p - q). Used to show the statistical test below can tell."""
    x = torch.multinomial(q, num_seqs, replacement=True, generator=gen)
    accept = torch.rand(num_seqs, generator=gen) * q[x] < p[x]
    other = torch.multinomial(after_rejection, num_seqs, replacement=True, generator=gen)
    return torch.where(accept, x, other)


@pytest.mark.parametrize("proposer", ["sampled", "deterministic"])
def test_emitted_tokens_follow_the_target_distribution(proposer):
    """200k sequences, k = 3, a different target row at every position: the first emitted token must follow
    p_0, the second (where the first draft was accepted) p_1, and so on, whatever q was."""
    gen = torch.Generator().manual_seed(2)
    n, k = 200_000, 3
    p_rows = torch.stack([P, P.flip(0), torch.full((6,), 1 / 6), P.roll(2)])
    if proposer == "sampled":
        target, drafts, draft = batch(p_rows, torch.stack([Q, Q.flip(0), Q.roll(1)]), n, gen)
    else:  # n-gram-like: always the same guesses, q one-hot
        target, drafts, draft = p_rows.expand(n, -1, -1), torch.tensor([[0, 5, 2]]).expand(n, -1), None
    out = sample_rows(target, drafts, draft, gen)
    for position in range(k + 1):
        tokens = out[:, position][out[:, position] >= 0]
        assert len(tokens) > 2000
        p = p_rows[position]
        error = (frequencies(tokens, 6) - p).abs()
        assert (error <= bound(p, len(tokens))).all(), (
            f"position {position}: token frequencies {frequencies(tokens, 6).numpy().round(4)} vs target "
            f"{p.numpy()}: the sampler is not lossless")


def test_the_bound_catches_a_sampler_that_skips_the_residual():
    """The same bound as above, applied to two wrong samplers: one that resamples p after a rejection (it
    over-weights tokens the draft likes), one that always accepts (it emits q). Both must fail it, by far."""
    gen = torch.Generator().manual_seed(3)
    n = 200_000
    right = wrong_first_tokens(P, Q, n, gen, after_rejection=(P - Q).clamp_min(0))  # the correct residual
    assert ((frequencies(right, 6) - P).abs() <= bound(P, n)).all(), "the residual sampler must pass"
    for name, tokens in (("resamples p", wrong_first_tokens(P, Q, n, gen, after_rejection=P)),
                         ("always accepts", torch.multinomial(Q, n, replacement=True, generator=gen))):
        excess = ((frequencies(tokens, 6) - P).abs() / bound(P, n)).max()
        assert excess > 3, f"a sampler that {name} should fail the bound by far, got {excess:.2f}x the bound"


@pytest.mark.parametrize("k", [1, 4])
def test_mean_emitted_tokens_match_the_formula(k):
    gen = torch.Generator().manual_seed(4)
    n = 100_000
    target, drafts, draft = batch(P.expand(k + 1, -1), Q.expand(k, -1), n, gen)
    out = sample_rows(target, drafts, draft, gen)
    alpha = formulas.acceptance_rate(P.numpy(), Q.numpy())
    assert alpha == pytest.approx(0.5)
    mean = (out >= 0).sum().item() / n
    expected = formulas.expected_tokens_per_step(k, alpha)
    assert mean == pytest.approx(expected, abs=0.015), f"{mean:.4f} tokens per step, formula {expected:.4f}"


def test_greedy_target_rows_reduce_to_accept_while_equal_to_argmax():
    gen = torch.Generator().manual_seed(5)
    s, k, vocab = 64, 4, 50
    logits = torch.randn(s, k + 1, vocab, generator=gen)
    target = target_probs_from_logits(logits, me.SamplingParams(temperature=0.0))
    argmax = logits.argmax(-1)
    # Drafts: the argmax for a random number of positions, then something else.
    agree = torch.randint(0, k + 1, (s,), generator=gen)
    drafts = torch.where(torch.arange(k) < agree[:, None], argmax[:, :k], (argmax[:, :k] + 1) % vocab)
    expected = [argmax[i, :a + 1].tolist() for i, a in enumerate(agree.tolist())]
    for seed in (0, 1):  # whatever the random numbers
        assert rejection_sample(target, drafts, None, torch.Generator().manual_seed(seed)) == expected
    assert rejection_sample(target, drafts, target[:, :k], gen) == expected


def test_rows_padded_with_minus_one_have_fewer_drafts():
    # One-hot targets make the outcome certain: p_j says token 10 + j.
    target = torch.zeros(3, 4, 20)
    target[:, torch.arange(4), 10 + torch.arange(4)] = 1.0
    drafts = torch.tensor([[10, 11, 12], [10, 11, -1], [-1, -1, -1]])
    assert num_drafts_of(drafts).tolist() == [3, 2, 0]
    out = rejection_sample(target, drafts)
    assert out == [[10, 11, 12, 13], [10, 11, 12], [10]], "the bonus token comes from p at the row's own n"


def test_each_sequence_keeps_its_own_random_stream():
    """With one generator per sequence, a sequence's tokens do not depend on what else is in the batch."""
    gen = torch.Generator().manual_seed(6)
    target, drafts, draft = batch(torch.stack([P, P.flip(0), P]), torch.stack([Q, Q]), 8, gen)
    drafts[2, 1] = -1
    alone = [rejection_sample(target[i:i + 1], drafts[i:i + 1], draft[i:i + 1],
                              [torch.Generator().manual_seed(100 + i)])[0] for i in range(8)]
    together = rejection_sample(target, drafts, draft, [torch.Generator().manual_seed(100 + i) for i in range(8)])
    assert together == alone


def test_draw_randoms_spends_one_uniform_per_draft_per_sequence():
    gens = [torch.Generator().manual_seed(7) for _ in range(2)]
    uniforms, inv_exp = draw_randoms([2, 0], 3, 5, gens)
    assert uniforms[1].tolist() == [0, 0, 0], "a sequence without drafts draws no uniform"
    assert torch.equal(uniforms[0, :2], torch.rand(2, generator=torch.Generator().manual_seed(7)))
    assert inv_exp.shape == (2, 5) and torch.isfinite(inv_exp).all() and (inv_exp >= 1 / 100).all()


def test_the_reference_never_returns_a_token_outside_the_vocabulary():
    # Validation stops bad ids at the public entry; the step itself must stay safe when given one anyway.
    gen = torch.Generator().manual_seed(8)
    target = torch.softmax(torch.randn(4, 3, 7, generator=gen), -1)
    drafts = torch.tensor([[7, 1], [-5, 2], [100, 100], [3, 4]])
    uniforms, inv_exp = draw_randoms([2] * 4, 2, 7, gen)
    out = rejection_sample_from_randoms(target, drafts, torch.tensor([2, 2, 2, 2], dtype=torch.int32), None,
                                        uniforms, inv_exp)
    assert (out[:3, 0] >= 0).all() and (out[:3, 0] < 7).all() and (out[:3, 1:] == -1).all(), \
        "an out-of-vocabulary draft is rejected and replaced by a token in [0, V)"


@pytest.mark.parametrize("args, match", [
    (dict(target_probs=torch.rand(2, 3, 5), draft_token_ids=torch.zeros(2, 3, dtype=torch.long)), "k \\+ 1"),
    (dict(target_probs=torch.rand(2, 3), draft_token_ids=torch.zeros(2, 2, dtype=torch.long)), "target_probs"),
    (dict(target_probs=torch.rand(2, 3, 5), draft_token_ids=torch.zeros(2, 2)), "draft_token_ids"),
    (dict(target_probs=torch.rand(2, 3, 5), draft_token_ids=torch.tensor([[0, 5], [0, 1]])), "draft_token_ids"),
    (dict(target_probs=torch.rand(2, 3, 5), draft_token_ids=torch.tensor([[-1, 2], [0, 1]])), "pad the end"),
    (dict(target_probs=torch.rand(2, 3, 5), draft_token_ids=torch.zeros(2, 2, dtype=torch.long),
          draft_probs=torch.rand(2, 2, 4)), "draft_probs"),
])
def test_bad_inputs_name_the_argument(args, match):
    with pytest.raises(ValueError, match=match):
        rejection_sample(**args)


# ---------------------------------------------------------------- the n-gram proposer

def test_ngram_proposes_what_followed_the_last_tokens_before():
    proposer = NgramProposer(ngram_min=1, ngram_max=3)
    assert proposer.propose([5, 6, 7, 8, 9, 1, 5, 6, 7], 2) == [8, 9]
    assert proposer.propose([5, 6, 7, 8, 9, 1, 5, 6, 7], 10) == [8, 9, 1, 5, 6, 7], \
        "fewer than k tokens follow the match: propose what there is"
    assert proposer.propose([5, 6, 7, 8, 9, 1, 5, 6, 7], 0) == []


def test_ngram_without_a_match_proposes_nothing():
    proposer = NgramProposer(1, 4)
    assert proposer.propose([1, 2, 3, 4], 3) == []
    assert proposer.propose([1], 3) == [] and proposer.propose([], 3) == []
    assert NgramProposer(2, 4).propose([1, 2, 3, 1], 3) == [], "a 1-token match is below ngram_min = 2"


def test_ngram_the_latest_occurrence_wins():
    assert NgramProposer(1, 2).propose([1, 2, 10, 1, 2, 20, 30, 1, 2], 2) == [20, 30]


def test_ngram_prefers_the_longest_match():
    # The last token 3 was last seen followed by 9, but the 2-gram (2, 3) was followed by 4.
    tokens = [2, 3, 4, 5, 7, 3, 9, 2, 3]
    assert NgramProposer(1, 2).propose(tokens, 2) == [4, 5]
    assert NgramProposer(1, 1).propose(tokens, 2) == [9, 2]
    # A match longer than ngram_max is not needed; n counts down from ngram_max.
    assert NgramProposer(1, 4).propose(tokens, 1) == [4]


def test_ngram_match_may_overlap_the_suffix():
    assert NgramProposer(1, 3).propose([7, 7, 7, 7], 3) == [7], "the 3-gram at 0 is followed by the last 7"


@pytest.mark.parametrize("kwargs, match", [(dict(ngram_min=0), "ngram_min"), (dict(ngram_min=1.5), "ngram_min"),
                                           (dict(ngram_min=3, ngram_max=2), "ngram_max")])
def test_ngram_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        NgramProposer(**kwargs)
    with pytest.raises(ValueError, match="k"):
        NgramProposer().propose([1, 2, 1], -1)


# ---------------------------------------------------------------- the draft-model proposer (real model)

@pytest.fixture(scope="module")
def greedy():
    return me.SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)


def reference(model, tokens, n, greedy):
    return me.generate_cached(model, tokens, n, params=greedy)


def test_draft_proposes_the_greedy_continuation_and_catches_up(real, chat_prompts, greedy, assert_greedy_match,
                                                                monkeypatch):
    model, _ = real
    prompt = chat_prompts[0]
    proposer = DraftModelProposer(model, vocab_size=model.config.vocab_size, max_len=256)
    drafts = proposer.propose(prompt, 4)
    assert_greedy_match(model, prompt, drafts, reference(model, prompt, 4, greedy))

    # Record how many tokens each catch-up pass computes: only those the draft's cache lacks.
    computed = []
    forward = proposer._forward
    monkeypatch.setattr(proposer, "_forward", lambda new, *a: computed.append(len(new)) or forward(new, *a))

    # The target accepted two drafts and then chose another token: the draft's cache keeps prompt + 2 drafts
    # (it holds 3 of its 4 drafts) and computes only the new token.
    other = (drafts[2] + 1) % model.config.vocab_size
    seq = prompt + drafts[:2] + [other]
    drafts = proposer.propose(seq, 3)
    assert computed[0] == 1, f"catch-up after a rejection must compute 1 new token, computed {computed[0]}"
    assert_greedy_match(model, seq, drafts, reference(model, seq, 3, greedy))

    # All 3 accepted plus the target's bonus token: the last draft and the bonus are new to the draft.
    computed.clear()
    bonus = reference(model, seq + drafts, 1, greedy)[0]
    seq = seq + drafts + [bonus]
    drafts = proposer.propose(seq, 2)
    assert computed[0] == 2, f"catch-up after full acceptance must compute 2 tokens, computed {computed[0]}"
    assert_greedy_match(model, seq, drafts, reference(model, seq, 2, greedy))

    # The same sequence again (nothing new): the last token is recomputed for its logits, nothing else.
    computed.clear()
    assert proposer.propose(seq, 2) == drafts and computed[0] == 1


def test_draft_slots_are_independent_and_reusable(real, chat_prompts, greedy, assert_greedy_match):
    model, _ = real
    proposer = DraftModelProposer(model, max_len=256, num_slots=2)
    a, b = chat_prompts[1], chat_prompts[2]
    first_a = proposer.propose(a, 3, slot=0)
    first_b = proposer.propose(b, 3, slot=1)
    assert proposer.propose(a, 3, slot=0) == first_a, "slot 1's work must not disturb slot 0's cache"
    assert_greedy_match(model, b, first_b, reference(model, b, 3, greedy))
    proposer.release(0)
    assert_greedy_match(model, b, proposer.propose(b, 3, slot=0), reference(model, b, 3, greedy))


def test_draft_stops_at_its_cache_length(real, chat_prompts):
    model, _ = real
    prompt = chat_prompts[2]
    proposer = DraftModelProposer(model, max_len=len(prompt) + 2)
    assert len(proposer.propose(prompt, 5)) == 2, "never draft past max_len"
    assert proposer.propose(prompt + [1, 2], 5) == []


def test_draft_sampled_returns_the_distributions_it_drew_from(real, chat_prompts):
    model, _ = real
    prompt = chat_prompts[0]
    proposer = DraftModelProposer(model, max_len=256)
    params = me.SamplingParams(temperature=0.8, top_k=20, seed=0)
    tokens, probs = proposer.propose_sampled(prompt, 3, params, torch.Generator().manual_seed(0))
    assert len(tokens) == 3 and probs.shape == (3, model.config.vocab_size) and probs.dtype == torch.float32
    assert torch.allclose(probs.sum(-1), torch.ones(3)) and ((probs > 0).sum(-1) <= 20).all(), "top-k applied"
    assert all(probs[i, t] > 0 for i, t in enumerate(tokens)), "each draft was drawn from its own row"
    # top_k = 1 leaves one token per row: the greedy drafts, whatever the seed.
    tokens, _ = proposer.propose_sampled(prompt, 3, me.SamplingParams(temperature=1.0, top_k=1), None)
    assert tokens == proposer.propose(prompt, 3)


def test_draft_bad_arguments(real):
    model, _ = real
    with pytest.raises(ValueError, match="model"):
        DraftModelProposer(model, vocab_size=model.config.vocab_size + 1)
    with pytest.raises(ValueError, match="max_len"):
        DraftModelProposer(model, max_len=1)
    with pytest.raises(ValueError, match="num_slots"):
        DraftModelProposer(model, num_slots=0)
    proposer = DraftModelProposer(model, max_len=16)
    with pytest.raises(ValueError, match="token_ids"):
        proposer.propose([], 2)
    with pytest.raises(ValueError, match="slot"):
        proposer.propose([1, 2], 2, slot=1)
    with pytest.raises(ValueError, match="k"):
        proposer.propose([1, 2], -1)
