"""Log-probabilities (SamplingParams.logprobs and prompt_logprobs): the model's raw log_softmax, read from the
logits the engine's step computed, equal to a full forward pass's on the real model, whatever the engine does
around them (chunked prefill, a warm prefix cache, speculative steps, a compiled-free paged or contiguous
cache, parallel samples)."""
import pytest
import torch

from mini_engine.engine import LLM
from mini_engine.sampling import SamplingParams, logprobs_of


def _reference(model, ids: list[int]) -> torch.Tensor:
    """log_softmax of a full forward pass over `ids`: row p scores token p + 1."""
    with torch.inference_mode():
        logits = model(torch.tensor([ids]))[0]
    return torch.log_softmax(logits.float(), dim=-1)


def _check(model, prompt: list[int], out, k: int, prompt_k: int | None) -> None:
    ids = prompt + out.token_ids
    ref = _reference(model, ids)
    got = out.outputs[0].logprobs
    assert len(got) == len(out.token_ids)
    for j, (token, entry) in enumerate(zip(out.token_ids, got)):
        row = ref[len(prompt) - 1 + j]
        assert entry[token] == pytest.approx(row[token].item(), abs=1e-3), f"output token {j}"
        top = row.topk(k)
        for t, p in zip(top.indices.tolist(), top.values.tolist()):
            assert entry[t] == pytest.approx(p, abs=1e-3), f"output token {j}: top-{k} entry {t}"
        assert len(entry) <= k + 1
    if prompt_k is not None:
        scored = out.prompt_logprobs
        assert len(scored) == len(prompt) and scored[0] is None
        for p in range(1, len(prompt)):
            assert scored[p][prompt[p]] == pytest.approx(ref[p - 1, prompt[p]].item(), abs=1e-3), f"prompt token {p}"
            assert len(scored[p]) <= prompt_k + 1


@pytest.mark.parametrize("engine_kwargs", [
    {},
    {"chunked_prefill_tokens": 16},
    {"kv_cache": "contiguous"},
    {"speculative": {"method": "ngram", "k": 3}},
], ids=["paged", "chunked-prefill", "contiguous", "ngram-speculation"])
def test_logprobs_equal_a_full_forward_pass(real, chat_prompts, engine_kwargs):
    model, tok = real
    llm = LLM.from_model(model, tok, max_num_seqs=4, **engine_kwargs)
    greedy = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=8, ignore_eos=True, logprobs=1)
    outs = llm.generate(chat_prompts[:2], [greedy, seeded])
    _check(model, chat_prompts[0], outs[0], 3, 2)
    _check(model, chat_prompts[1], outs[1], 1, None)
    assert outs[1].prompt_logprobs is None
    assert max(outs[0].outputs[0].logprobs[0], key=outs[0].outputs[0].logprobs[0].get) == outs[0].token_ids[0]


def test_logprobs_do_not_change_the_tokens(real, chat_prompts):
    model, tok = real
    llm = LLM.from_model(model, tok, max_num_seqs=4)
    plain = SamplingParams(temperature=0.8, seed=3, max_tokens=10, ignore_eos=True)
    scored = SamplingParams(temperature=0.8, seed=3, max_tokens=10, ignore_eos=True, logprobs=5, prompt_logprobs=5)
    assert llm.generate(chat_prompts[0], scored)[0].token_ids == llm.generate(chat_prompts[0], plain)[0].token_ids


def test_prompt_logprobs_are_computed_even_when_the_prefix_cache_holds_the_prompt(real, chat_prompts):
    """A prefix-cache hit skips the rows that score the prompt, so a request that wants them takes none."""
    model, tok = real
    llm = LLM.from_model(model, tok, max_num_seqs=2, enable_prefix_caching=True, block_size=16)
    llm.generate(chat_prompts[0], SamplingParams(max_tokens=2))  # fills the cache with the prompt's blocks
    again = llm.generate(chat_prompts[0], SamplingParams(max_tokens=2))[0]
    assert again.num_cached_tokens > 0
    out = llm.generate(chat_prompts[0], SamplingParams(max_tokens=2, prompt_logprobs=0, logprobs=0))[0]
    assert out.num_cached_tokens == 0
    _check(model, chat_prompts[0], out, 0, 0)


def test_parallel_samples_each_get_their_own_logprobs(real, chat_prompts):
    model, tok = real
    llm = LLM.from_model(model, tok, max_num_seqs=4)
    out = llm.generate(chat_prompts[1], SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=5,
                                                       ignore_eos=True, logprobs=0))[0]
    ref = [_reference(model, chat_prompts[1] + c.token_ids) for c in out.outputs]
    for c, r in zip(out.outputs, ref):
        for j, token in enumerate(c.token_ids):
            assert c.logprobs[j][token] == pytest.approx(r[len(chat_prompts[1]) - 1 + j, token].item(), abs=1e-3)


def test_logprobs_of_a_row():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    logp = torch.log_softmax(logits, -1)[0]
    got = logprobs_of(logits, [0], 2)[0]
    assert got == pytest.approx({3: logp[3].item(), 2: logp[2].item(), 0: logp[0].item()})
    assert logprobs_of(logits, [1], 0) == [pytest.approx({1: logp[1].item()})]


@pytest.mark.parametrize("field,value", [("logprobs", 21), ("logprobs", -1), ("prompt_logprobs", True),
                                         ("prompt_logprobs", 1.5), ("seed", 2**80), ("seed", "7")])
def test_out_of_range_values_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})
