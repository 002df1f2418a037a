import pytest
import torch

import mini_engine as me


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model(0)


def test_naive_stops_on_eos(real, chat_prompts):
    model, tok = real
    out = me.generate_naive(model, chat_prompts[0], max_new_tokens=40)
    assert out[-1] == tok.eos_token_id and len(out) < 40
    assert "Paris" in tok.decode(out)


def test_naive_respects_max_tokens_and_ignore_eos(tiny):
    out = me.generate_naive(tiny, [1, 2, 3], max_new_tokens=7)
    assert len(out) == 7
    eos = out[2]
    stopped = me.generate_naive(tiny, [1, 2, 3], max_new_tokens=7, eos_token_id=eos)
    assert stopped == out[:out.index(eos) + 1]
    ignored = me.generate_naive(tiny, [1, 2, 3], 7, me.SamplingParams(max_tokens=7, ignore_eos=True), eos_token_id=eos)
    assert ignored == out


@pytest.mark.parametrize("bad,match", [([], "prompt_ids"), ([1] * 300, "positions")])
def test_bad_prompts_are_rejected(tiny, bad, match):
    with pytest.raises(ValueError, match=match):
        me.generate_naive(tiny, bad, max_new_tokens=4)


def test_seeded_sampling_reproducible(tiny):
    p = me.SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=10)
    assert me.generate_naive(tiny, [5, 6], 10, p) == me.generate_naive(tiny, [5, 6], 10, p)


def test_last_only_logits_equal_the_last_row(tiny):
    ids = torch.randint(0, 128, (2, 9))
    torch.testing.assert_close(tiny(ids, last_only=True), tiny(ids)[:, -1:], atol=1e-5, rtol=0)
