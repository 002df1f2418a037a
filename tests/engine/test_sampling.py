import pytest
import torch

from mini_engine.sampling import SamplingParams, apply_top_k, apply_top_p, make_generator, sample


@pytest.mark.parametrize("kwargs,name", [
    ({"temperature": -0.1}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"), ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": float("nan")}, "temperature"), ({"temperature": float("inf")}, "temperature"),
])
def test_bad_arguments_name_themselves(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_a_temperature_too_small_to_divide_by_is_greedy():
    # logits / 1e-40 overflows fp32 to inf and softmax to NaN: multinomial would raise inside the engine's step,
    # failing every request in it. As vLLM does, such a temperature is greedy.
    logits = torch.randn(3, 50) * 10
    for t in (1e-40, 1e-20, 5e-6):
        p = SamplingParams(temperature=t, seed=0)
        assert p.greedy and sample(logits, [p] * 3, [make_generator(p)] * 3) == logits.argmax(-1).tolist()
    assert not SamplingParams(temperature=1e-4).greedy


def test_greedy_is_argmax():
    logits = torch.randn(4, 50)
    assert sample(logits, [SamplingParams()] * 4) == logits.argmax(-1).tolist()


def test_seeded_sampling_is_deterministic():
    logits = torch.randn(1, 1000)
    p = SamplingParams(temperature=1.0, seed=123)
    run = lambda: [sample(logits, [p], [g])[0] for g in [make_generator(p)] for _ in range(20)]
    assert run() == run()
    other = SamplingParams(temperature=1.0, seed=124)
    g = make_generator(other)
    assert [sample(logits, [other], [g])[0] for _ in range(20)] != run()


def test_top_k_never_emits_a_masked_token():
    torch.manual_seed(0)
    logits = torch.randn(1, 200)
    allowed = set(torch.topk(logits[0], 5).indices.tolist())
    p = SamplingParams(temperature=2.0, top_k=5, seed=1)
    g = make_generator(p)
    seen = {sample(logits, [p], [g])[0] for _ in range(300)}
    assert seen <= allowed and len(seen) > 1


def test_top_p_never_emits_a_masked_token():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.0625, 0.0625]]))  # exact in binary
    assert torch.isinf(apply_top_p(logits, 0.75)[0, 2:]).all()       # 0.5 + 0.25 reaches 0.75
    assert not torch.isinf(apply_top_p(logits, 0.76)[0, :3]).any()   # needs the third token
    p = SamplingParams(temperature=1.0, top_p=0.75, seed=3)
    g = make_generator(p)
    seen = {sample(logits, [p], [g])[0] for _ in range(300)}
    assert seen == {0, 1}


def test_top_k_keeps_exactly_k_without_ties():
    logits = torch.arange(10.0).view(1, -1)
    kept = ~torch.isinf(apply_top_k(logits, 3))
    assert kept[0].nonzero().flatten().tolist() == [7, 8, 9]


def test_temperature_sharpens():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    cold, hot = SamplingParams(temperature=0.05, seed=0), SamplingParams(temperature=5.0, seed=0)
    gc, gh = make_generator(cold), make_generator(hot)
    cold_draws = [sample(logits, [cold], [gc])[0] for _ in range(200)]
    hot_draws = [sample(logits, [hot], [gh])[0] for _ in range(200)]
    assert cold_draws.count(0) == 200 and hot_draws.count(0) < 150
