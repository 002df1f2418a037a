"""The plain speculative loop (`generate_speculative`, chapter 06): greedy output equal to `generate_cached`
with every proposer, stop tokens inside accepted drafts, the max_new_tokens budget, rollback after rejections
(the rejected rows are poisoned and never read), seeded sampling reproducible, and the stats it reports."""
import copy

import pytest
import torch

import mini_engine as me
from mini_engine.speculative import DraftModelProposer, NgramProposer

GREEDY = me.SamplingParams(temperature=0.0, ignore_eos=True)


class Oracle:
    """Proposes the reference continuation, optionally wrong at some positions; records every request."""

    def __init__(self, prompt, reference, wrong_every=0, seed=0):
        self.prompt, self.reference, self.wrong_every = prompt, reference, wrong_every
        self.gen = torch.Generator().manual_seed(seed)
        self.asked: list[int] = []

    def propose(self, token_ids, k):
        self.asked.append(k)
        done = len(token_ids) - len(self.prompt)
        drafts = list(self.reference[done:done + k])
        if self.wrong_every and drafts:
            # corrupt one draft in most rounds, at a random place: rounds then keep a few drafts and reject one
            at = int(torch.randint(0, self.wrong_every, (1,), generator=self.gen))
            if at < len(drafts):
                drafts[at] = (drafts[at] + 1 + int(torch.randint(0, 50, (1,), generator=self.gen))) % 128
        return drafts


class Poisoner:
    """Wraps a proposer: before each round, fills every cache row at or past the valid length with NaN. The
    loop's cache holds keys/values for all of token_ids but the last; a loop that read a rejected row (or any
    row past its length) would turn the logits into NaN and the tokens into garbage."""

    def __init__(self, inner, kv_cache):
        self.inner, self.kv_cache, self.poisoned = inner, kv_cache, 0

    def propose(self, token_ids, k):
        self.kv_cache.data[:, :, 0, :, len(token_ids) - 1:] = float("nan")
        self.poisoned += 1
        return self.inner.propose(token_ids, k)


# ---------------------------------------------------------------- mechanics, on a tiny random model

tiny_only = pytest.mark.usefixtures("one_thread")  # see conftest: the tiny model's ops are too small to split

PROMPT = [3, 17, 42, 5, 99, 8]


@tiny_only
def test_all_accepted_drafts_give_k_plus_one_tokens_per_step(tiny_model):
    model = tiny_model(0)
    ref = me.generate_cached(model, PROMPT, 21, GREEDY)
    out, stats = me.generate_speculative(model, PROMPT, Oracle(PROMPT, ref), k=4, max_new_tokens=21, params=GREEDY)
    assert out == ref
    # the prefill gives token 1; then four rounds of 4 drafts + 1 token each: 21 tokens
    assert stats.target_steps == 4 and stats.num_draft_tokens == stats.num_accepted_tokens == 16
    assert stats.tokens_per_step == 5.0 and stats.alpha == stats.acceptance_rate == 1.0
    assert [accepted for _, accepted in stats.rounds] == [4, 4, 4, 4]


@tiny_only
def test_stop_token_inside_accepted_drafts_ends_there(tiny_model):
    model = tiny_model(0)
    ref = me.generate_cached(model, PROMPT, 20, GREEDY)
    # token 3 of the output is the third draft of the first round (token 0 comes from the prefill)
    j = next(j for j in (3, 2, 1) if ref[j] not in ref[:j])
    stop = ref[j]
    for params, eos in ((me.SamplingParams(stop_token_ids=[stop], ignore_eos=True), None), (GREEDY, None),
                        (me.SamplingParams(), stop)):
        want = me.generate_cached(model, PROMPT, 20, params, eos_token_id=eos)
        out, stats = me.generate_speculative(model, PROMPT, Oracle(PROMPT, ref), k=4, max_new_tokens=20,
                                             params=params, eos_token_id=eos)
        assert out == want
        if want == ref[:j + 1]:
            assert stats.rounds[0] == (ref[1:5], 4), "the stop token was an accepted draft, not the last token"
            assert out[-1] == stop and len(out) == j + 1, "nothing after the stop token may be emitted"


@tiny_only
@pytest.mark.parametrize("max_new_tokens", [1, 2, 3, 4, 5, 7])
def test_max_new_tokens_is_never_overshot(tiny_model, max_new_tokens):
    model = tiny_model(0)
    ref = me.generate_cached(model, PROMPT, max_new_tokens, GREEDY)
    oracle = Oracle(PROMPT, me.generate_cached(model, PROMPT, 12, GREEDY))
    streamed = []
    out, stats = me.generate_speculative(model, PROMPT, oracle, k=4, max_new_tokens=max_new_tokens, params=GREEDY,
                                         on_token=streamed.append)
    assert out == ref == streamed and len(out) == max_new_tokens
    # a round yields its drafts plus one token: the proposer is never asked for more than the budget leaves
    # room for (and not at all when the budget leaves room for the target's token only)
    have, want = 1, []  # the prefill gave the first token
    for _, accepted in stats.rounds:
        if min(4, max_new_tokens - have - 1) > 0:
            want.append(min(4, max_new_tokens - have - 1))
        have += accepted + 1
    assert oracle.asked == want and have == max_new_tokens


@tiny_only
@pytest.mark.parametrize("wrong_every", [1, 3, 5])
def test_rollback_after_many_rejections(tiny_model, wrong_every):
    model = tiny_model(1)
    ref = me.generate_cached(model, PROMPT, 40, GREEDY)
    kv = me.generate.ContiguousKVCache(model.config, 1, len(PROMPT) + 40)
    proposer = Poisoner(Oracle(PROMPT, ref, wrong_every=wrong_every), kv)
    out, stats = me.generate_speculative(model, PROMPT, proposer, k=4, max_new_tokens=40, params=GREEDY,
                                         kv_cache=kv)
    rejections = sum(a < len(d) for d, a in stats.rounds)
    assert rejections >= 5 and proposer.poisoned >= stats.target_steps - 1  # not asked when the budget is 1
    assert out == ref, "after rejected drafts were rolled back, the output must still be generate_cached's"
    # and the same cache serves a following request, with no reset in between
    out2, _ = me.generate_speculative(model, PROMPT[:4], NgramProposer(), k=3, max_new_tokens=12, params=GREEDY,
                                      kv_cache=kv)
    assert out2 == me.generate_cached(model, PROMPT[:4], 12, GREEDY)


@tiny_only
def test_a_proposer_that_finds_nothing_is_plain_decoding(tiny_model):
    model = tiny_model(2)
    ref = me.generate_cached(model, [1, 2, 3], 15, GREEDY)
    out, stats = me.generate_speculative(model, [1, 2, 3], NgramProposer(ngram_min=4, ngram_max=4), k=4,
                                         max_new_tokens=15, params=GREEDY)
    assert out == ref and stats.num_draft_tokens == 0 and stats.target_steps == 14
    assert stats.tokens_per_step == 1.0 and stats.alpha == 0.0


@tiny_only
@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_seeded_sampling_is_reproducible(tiny_model, proposer):
    model = tiny_model(3)

    def run(seed):
        prop = NgramProposer(1, 2) if proposer == "ngram" else DraftModelProposer(model, max_len=64)
        params = me.SamplingParams(temperature=1.0, top_p=0.95, seed=seed, ignore_eos=True)
        return me.generate_speculative(model, PROMPT, prop, k=3, max_new_tokens=24, params=params)

    (a, sa), (b, sb), (c, _) = run(7), run(7), run(8)
    assert a == b and sa.rounds == sb.rounds, "the same seed must give the same tokens and the same verdicts"
    assert a != c, "another seed, another sample"
    if proposer == "draft":
        # the draft is the target itself, sampled from the same processed distribution: q = p, all accepted
        # (up to rounding between the draft's one-token passes and the target's chunk)
        assert sa.num_draft_tokens > 0 and sa.acceptance_rate > 0.9


class Fixed:
    """Always proposes the same tokens: a deterministic proposer that is sometimes right."""

    def __init__(self, tokens):
        self.tokens = tokens

    def propose(self, token_ids, k):
        return self.tokens[:k]


@tiny_only
def test_sampled_output_follows_the_target(tiny_model):
    """600 seeded runs of 3 tokens each, with and without speculation: tokens 2 and 3 (the ones the drafts
    decide) come out with the same frequencies, within 5 standard deviations of the difference."""
    model = tiny_model(4)
    params = lambda s: me.SamplingParams(temperature=3.0, seed=s, ignore_eos=True)
    plain = torch.tensor([me.generate_cached(model, PROMPT, 3, params(s)) for s in range(600)])
    guess = [int(plain[:, 1].mode().values), int(plain[:, 2].mode().values)]  # right often enough to matter
    spec = torch.tensor([me.generate_speculative(model, PROMPT, Fixed(guess), 2, 3, params(s))[0]
                         for s in range(600)])
    assert (spec[:, 1] == guess[0]).any() and (spec[:, 1] != guess[0]).any(), "both verdicts must occur"
    for pos in (1, 2):
        a = torch.bincount(spec[:, pos], minlength=128).double() / 600
        b = torch.bincount(plain[:, pos], minlength=128).double() / 600
        sd = ((a * (1 - a) + b * (1 - b)) / 600).sqrt()
        assert ((a - b).abs() <= 5 * sd + 2 / 600).all(), f"token {pos + 1}'s distribution changed"


@tiny_only
def test_bad_arguments(tiny_model):
    model = tiny_model(0)
    with pytest.raises(ValueError, match="k"):
        me.generate_speculative(model, PROMPT, NgramProposer(), k=-1)
    with pytest.raises(ValueError, match="prompt_ids"):
        me.generate_speculative(model, [], NgramProposer())
    with pytest.raises(ValueError, match="max_"):
        me.generate_speculative(model, PROMPT, NgramProposer(), max_new_tokens=0)
    with pytest.raises(ValueError, match="kv_cache"):
        me.generate_speculative(model, PROMPT, NgramProposer(), max_new_tokens=8,
                                kv_cache=me.generate.ContiguousKVCache(model.config, 1, 8))


# ---------------------------------------------------------------- the real model, both proposers

EDIT = ("Fix the spelling in this sentence and repeat it: The comittee aproved the new budjet for the city park, "
        "wich includes funds for new benches and better lighting.")


@pytest.fixture(scope="module")
def edit_prompt(real):
    _, tok = real
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": EDIT}]))


@pytest.fixture(scope="module")
def bf16_copy(real):
    return copy.deepcopy(real[0]).to(torch.bfloat16)


@pytest.mark.parametrize("which", ["edit", "chat"])
def test_ngram_greedy_equals_generate_cached(real, edit_prompt, chat_prompts, assert_greedy_match, which):
    model, _ = real
    prompt = edit_prompt if which == "edit" else chat_prompts[1]
    ref = me.generate_cached(model, prompt, 20, GREEDY)
    out, stats = me.generate_speculative(model, prompt, NgramProposer(1, 4), k=4, max_new_tokens=20, params=GREEDY)
    assert_greedy_match(model, prompt, out, ref)
    assert len(out) == 20 and stats.num_draft_tokens > 0
    if which == "edit":
        assert stats.num_accepted_tokens > 0, "the edit repeats its input: lookup must hit"


@pytest.mark.parametrize("draft", ["same", "bf16"])
def test_draft_model_greedy_equals_generate_cached(real, edit_prompt, bf16_copy, assert_greedy_match, draft):
    model, tok = real
    ref = me.generate_cached(model, edit_prompt, 14, GREEDY)
    proposer = DraftModelProposer(model if draft == "same" else bf16_copy, vocab_size=model.config.vocab_size,
                                  max_len=512)
    out, stats = me.generate_speculative(model, edit_prompt, proposer, k=4, max_new_tokens=14, params=GREEDY)
    assert_greedy_match(model, edit_prompt, out, ref)
    assert stats.num_accepted_tokens > 0
    if draft == "same":
        assert stats.tokens_per_step > 3, "a draft equal to the target is (up to ties) always right"


def test_stop_token_inside_drafts_on_the_real_model(real, edit_prompt):
    """The model's own end-of-turn token, reached while the draft model's proposals are being accepted."""
    model, tok = real
    params = me.SamplingParams(temperature=0.0)  # stops at eos
    prompt = tok.encode(tok.apply_chat_template([{"role": "system", "content": "Answer with one word."},
                                                 {"role": "user", "content": "Name a color."}]))
    ref = me.generate_cached(model, prompt, 12, params)
    assert ref[-1] == model.config.eos_token_id and len(ref) < 12
    out, stats = me.generate_speculative(model, prompt, DraftModelProposer(model, max_len=256), k=8,
                                         max_new_tokens=12, params=params)
    assert out == ref
    drafted = [t for drafts, a in stats.rounds for t in drafts[:a]]
    assert model.config.eos_token_id in drafted, "eos came as an accepted draft; the loop stopped right there"
