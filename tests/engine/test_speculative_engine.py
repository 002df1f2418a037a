"""Speculative decoding inside the serving engine: greedy outputs equal the engine's without speculation with
each proposer (single requests, mixed batches where some prefill while others speculate), stops inside accepted
drafts, max_tokens and max_model_len never overshot, exact rollback (the paged pool all free when idle, the
contiguous cache's lengths right, no prefix-cache hash over a rejected token), seeded sampling reproducible,
bad configurations refused by key, and the per-request draft counts."""
import copy
import random

import pytest
import torch

import mini_engine as me
from mini_engine.loading import loader
from mini_engine.config import ModelConfig
from mini_engine.engine import LLM
from mini_engine.model import LlamaModel
from mini_engine.paging import block_hashes

pytestmark = pytest.mark.usefixtures("one_thread")

NGRAM = {"method": "ngram", "k": 4, "ngram_min": 1, "ngram_max": 4}


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model(1)


@pytest.fixture(scope="module")
def noisy_draft(tiny):
    """The tiny target with a little noise on every weight: a draft of the same vocabulary that agrees with the
    target on some tokens and not on others (a different random model agrees on none)."""
    draft = copy.deepcopy(tiny)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.03)
    return draft


def run(llm, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


def ids(outs):
    return [o.token_ids for o in outs]


def spy_steps(llm) -> list[tuple[bool, bool]]:
    """Per step: (a chunk carried drafts, a chunk was a prefill), recorded as the runner executes it."""
    runner, seen = llm.engine.runner, []
    execute = runner.execute

    def spied(chunks, block_copies=()):
        seen.append((any(c.draft_token_ids for c in chunks), any(c.request.is_prefill for c in chunks)))
        return execute(chunks, block_copies)
    runner.execute = spied
    return seen


def random_workload(n: int, seed: int, temperature: float = 0.0):
    rng = random.Random(seed)
    # Short alphabets make the n-gram proposer find matches, most of them wrong: many rejections.
    prompts = [[rng.randrange(6) for _ in range(rng.randint(2, 30))] for _ in range(n)]
    params = [me.SamplingParams(max_tokens=rng.randint(1, 40), ignore_eos=True, temperature=temperature, seed=i)
              for i in range(n)]
    return prompts, params


# ---------------------------------------------------------------- greedy equivalence on the real model

@pytest.fixture(scope="module")
def grounded_prompt(real):
    _, tok = real
    text = "The quick brown fox jumps over the lazy dog near the river bank."
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": f"Repeat this sentence twice: {text}"}]))


@pytest.mark.parametrize("kv_cache", ["paged", "contiguous"])
def test_real_model_ngram_greedy_equals_plain_alone_and_mixed(real, chat_prompts, grounded_prompt, kv_cache):
    model, tok = real
    # Two slots and different lengths: requests are admitted while others decode, and a prompt that leaves
    # some of the step's 64 tokens over shares its step with drafts.
    params = [me.SamplingParams(max_tokens=24, ignore_eos=True)] + [me.SamplingParams(max_tokens=n) for n in (6, 10, 8)]
    kwargs = {"kv_cache": kv_cache, "max_num_seqs": 2, "max_model_len": 160, "chunked_prefill_tokens": 64}
    plain = run(LLM.from_model(model, tok, **kwargs), [grounded_prompt] + chat_prompts, params)
    alone = run(LLM.from_model(model, tok, speculative=NGRAM, **kwargs), [grounded_prompt], params[0])[0]
    assert alone.token_ids == plain[0].token_ids
    assert alone.metrics.num_accepted_tokens > 0, "the grounded prompt should have n-gram drafts accepted"
    spec = LLM.from_model(model, tok, speculative=NGRAM, **kwargs)
    steps = spy_steps(spec)
    mixed = run(spec, [grounded_prompt] + chat_prompts, params)
    assert ids(mixed) == ids(plain)
    assert any(drafts and prefill for drafts, prefill in steps), "no step packed drafts with a prefill chunk"
    if kv_cache == "paged":
        assert spec.engine.num_free_blocks == spec.engine.num_kv_blocks


def test_real_model_draft_proposers_greedy_equal_plain(real, grounded_prompt):
    model, tok = real
    params = me.SamplingParams(max_tokens=12)
    kwargs = {"max_num_seqs": 2, "max_model_len": 128}
    plain = run(LLM.from_model(model, tok, **kwargs), [grounded_prompt], params)[0]
    same = run(LLM.from_model(model, tok, speculative={"method": "draft", "model": model, "k": 4}, **kwargs),
               [grounded_prompt], params)[0]
    assert same.token_ids == plain.token_ids
    m = same.metrics
    assert m.num_draft_tokens > 0 and m.num_accepted_tokens == m.num_draft_tokens, \
        "the target as its own draft: every draft is the argmax"
    bf16 = LLM.from_model(model, tok, speculative={"method": "draft", "model": "smollm2-135m", "dtype": "bfloat16",
                                                   "k": 4}, **kwargs)
    out = run(bf16, [grounded_prompt], params)[0]
    assert out.token_ids == plain.token_ids
    assert 0 < out.metrics.num_accepted_tokens <= out.metrics.num_draft_tokens


# ---------------------------------------------------------------- stops and limits (tiny model, no ties)

def test_stop_token_inside_accepted_drafts_ends_the_request_there(tiny):
    prompt = [3, 9, 27, 81, 115]
    plain = run(LLM.from_model(tiny, max_num_seqs=2), [prompt], me.SamplingParams(max_tokens=20))[0].token_ids
    spec = LLM.from_model(tiny, max_num_seqs=2, speculative={"method": "draft", "model": tiny, "k": 4})
    full = run(spec, [prompt], me.SamplingParams(max_tokens=20))[0]
    assert full.token_ids == plain and full.metrics.num_accepted_tokens == full.metrics.num_draft_tokens > 0
    for stop in sorted(set(plain[2:12])):  # each lands somewhere inside a run of accepted drafts
        j = plain.index(stop)
        out = run(spec, [prompt], me.SamplingParams(max_tokens=20, stop_token_ids=[stop]))[0]
        assert out.token_ids == plain[:j + 1] and out.finish_reason == "stop"
        assert out.metrics.num_accepted_tokens <= out.metrics.num_draft_tokens
    assert spec.engine.num_free_blocks == spec.engine.num_kv_blocks


@pytest.mark.parametrize("kv_cache", ["paged", "contiguous"])
def test_max_tokens_smaller_than_k_and_max_model_len_never_overshot(tiny, kv_cache):
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    spec_cfg = {"method": "draft", "model": tiny, "k": 6}
    for max_tokens in (1, 2, 3, 5):
        params = me.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        plain = run(LLM.from_model(tiny, kv_cache=kv_cache, max_num_seqs=2), [prompt], params)[0]
        out = run(LLM.from_model(tiny, kv_cache=kv_cache, max_num_seqs=2, speculative=spec_cfg), [prompt], params)[0]
        assert out.token_ids == plain.token_ids and len(out.token_ids) == max_tokens
    for room in (1, 2, 4, 7):  # max_model_len leaves `room` new tokens
        kwargs = {"kv_cache": kv_cache, "max_num_seqs": 2, "max_model_len": len(prompt) + room}
        params = me.SamplingParams(max_tokens=50, ignore_eos=True)
        plain = run(LLM.from_model(tiny, **kwargs), [prompt], params)[0]
        out = run(LLM.from_model(tiny, speculative=spec_cfg, **kwargs), [prompt], params)[0]
        assert out.token_ids == plain.token_ids and len(out.token_ids) == room and out.finish_reason == "length"


# ---------------------------------------------------------------- rollback

@pytest.mark.parametrize("speculative", [NGRAM, "other-draft"])
def test_many_rejections_paged_pool_all_free_and_outputs_unchanged(tiny, noisy_draft, speculative, guard_writes):
    if speculative == "other-draft":
        speculative = {"method": "draft", "model": noisy_draft, "k": 4}
    prompts, params = random_workload(8, seed=3)
    plain = run(LLM.from_model(tiny, max_num_seqs=8, block_size=4), prompts, params)
    # A small pool forces preemptions (recompute) on top of the rollbacks.
    spec = guard_writes(LLM.from_model(tiny, max_num_seqs=8, block_size=4, num_kv_blocks=24, speculative=speculative,
                                       enable_prefix_caching=False))
    outs = run(spec, prompts, params)
    assert ids(outs) == ids(plain)
    drafted = sum(o.metrics.num_draft_tokens for o in outs)
    accepted = sum(o.metrics.num_accepted_tokens for o in outs)
    assert 0 < accepted < drafted, "the workload must mix acceptances and rejections"
    assert all(o.metrics.num_accepted_tokens <= o.metrics.num_draft_tokens for o in outs)
    assert spec.engine.scheduler.num_preemptions > 0
    assert spec.engine.num_free_blocks == spec.engine.num_kv_blocks


def test_many_rejections_contiguous_cache_counts_stay_right(tiny, noisy_draft):
    prompts, params = random_workload(6, seed=4)
    spec = LLM.from_model(tiny, kv_cache="contiguous", max_num_seqs=3,
                          speculative={"method": "draft", "model": noisy_draft, "k": 4})
    plain = run(LLM.from_model(tiny, kv_cache="contiguous", max_num_seqs=3), prompts, params)
    outs = run(spec, prompts, params)
    assert ids(outs) == ids(plain)
    assert sum(o.metrics.num_accepted_tokens for o in outs) < sum(o.metrics.num_draft_tokens for o in outs)
    # Slots reused after many rollbacks: a following request still matches the one-sequence loop.
    prompt = [1, 2, 3, 4, 1, 2, 3]
    after = run(spec, [prompt], me.SamplingParams(max_tokens=24, ignore_eos=True))[0]
    assert after.token_ids == me.generate_cached(tiny, prompt, 24)


def test_prefix_caching_never_registers_rejected_tokens(tiny, noisy_draft, guard_writes):
    prompts, params = random_workload(8, seed=5)
    prompts += [p + [1] for p in prompts[:3]]  # shared prefixes: hits on blocks written speculatively
    params += params[:3]
    plain = run(LLM.from_model(tiny, max_num_seqs=8, block_size=4, enable_prefix_caching=False), prompts, params)
    spec = guard_writes(LLM.from_model(tiny, max_num_seqs=8, block_size=4, enable_prefix_caching=True,
                                       speculative={"method": "draft", "model": noisy_draft, "k": 4}))
    scheduler = spec.engine.scheduler
    blocks = scheduler.blocks
    update = scheduler.update

    def checked_update(chunks, sampled, now):
        finished = update(chunks, sampled, now)
        for r in scheduler.running:  # every registered block of a running request holds kept tokens only
            verified = block_hashes(r.tokens[:r.num_computed], blocks.block_size)
            for i, block in enumerate(blocks.block_table(r.request_id)):
                if blocks.block_hash[block] is not None:
                    assert i < len(verified) and blocks.block_hash[block] == verified[i], \
                        f"block {block} of request {r.request_id} hashes tokens that are not its kept ones"
            assert len(blocks.block_table(r.request_id)) == blocks.blocks_for(r.num_computed), "rollback left blocks"
        return finished
    scheduler.update = checked_update
    assert ids(run(spec, prompts, params)) == ids(plain)
    assert ids(run(spec, prompts, params)) == ids(plain), "a second run, served from the cache, is unchanged"
    assert blocks.num_cached_blocks > 0
    assert spec.engine.num_free_blocks == spec.engine.num_kv_blocks


# ---------------------------------------------------------------- sampling

@pytest.mark.parametrize("speculative", [NGRAM, "draft"])
def test_seeded_sampling_with_speculation_is_reproducible(tiny, noisy_draft, speculative):
    if speculative == "draft":
        speculative = {"method": "draft", "model": noisy_draft, "k": 3}
    prompts, params = random_workload(5, seed=6, temperature=1.0)

    def once():
        return ids(run(LLM.from_model(tiny, max_num_seqs=4, block_size=4, speculative=speculative), prompts, params))
    assert once() == once()


def test_requests_without_drafts_draw_what_they_would_without_speculation(tiny):
    prompts, params = random_workload(4, seed=7, temperature=1.0)
    plain = run(LLM.from_model(tiny, max_num_seqs=4), prompts, params)
    never = {"method": "ngram", "k": 4, "ngram_min": 200, "ngram_max": 200}  # never matches: no drafts at all
    outs = run(LLM.from_model(tiny, max_num_seqs=4, speculative=never), prompts, params)
    assert ids(outs) == ids(plain)
    assert all(o.metrics.num_draft_tokens == 0 for o in outs)


@pytest.mark.parametrize("adaptive", [True, False])
def test_adaptive_speculation_drafts_one_more_than_last_accepted(tiny, noisy_draft, adaptive):
    """Adaptive: each round drafts min(k, accepted last round + 1), starting at k; fixed: k every round (within
    max_tokens). Either way the tokens are those of the engine without speculation."""
    prompts, params = random_workload(4, seed=5)
    spec = LLM.from_model(tiny, max_num_seqs=4, speculative={"method": "draft", "model": noisy_draft, "k": 4,
                                                             "adaptive": adaptive})
    rounds: dict[int, list[tuple[int, int]]] = {}  # request id -> (drafts, accepted) per round
    scheduler, update = spec.engine.scheduler, spec.engine.scheduler.update

    def counted(chunks, sampled, now):
        before = [(c.request, len(c.draft_token_ids), c.request.num_accepted_tokens) for c in chunks
                  if c.draft_token_ids]
        finished = update(chunks, sampled, now)
        for r, d, a in before:
            rounds.setdefault(r.request_id, []).append((d, r.num_accepted_tokens - a))
        return finished
    scheduler.update = counted
    outs = run(spec, prompts, params)
    assert ids(outs) == ids(run(LLM.from_model(tiny, max_num_seqs=4), prompts, params))
    max_tokens = {o.request_id: p.max_tokens for o, p in zip(outs, params)}
    shrank = False
    for rid, rs in rounds.items():
        emitted, wanted = 1, 4  # the prefill's token; the first round drafts k
        for d, a in rs:
            # The draft model always proposes what it is asked for; only max_tokens cuts a round shorter.
            assert d == min(wanted, max_tokens[rid] - emitted - 1), \
                f"request {rid}: drafted {d} after {emitted} tokens, wanted {wanted} (max_tokens {max_tokens[rid]})"
            emitted += a + 1
            shrank |= adaptive and a + 1 < 4 and emitted < max_tokens[rid] - 1
            wanted = min(4, a + 1) if adaptive else 4
    assert rounds and (shrank or not adaptive), "the workload must have rounds that reject drafts"


# ---------------------------------------------------------------- configuration

@pytest.mark.parametrize("speculative,match", [
    ({"method": "ngram", "k": 0}, r"speculative\['k'\] must be an int >= 1"),
    ({"method": "ngram", "k": 2.5}, r"speculative\['k'\]"),
    ({"method": "medusa", "k": 4}, r"speculative\['method'\]"),
    ({"k": 4}, r"speculative\['method'\]"),
    ({"method": "ngram", "k": 4, "ngram_mx": 3}, r"speculative\['ngram_mx'\]: unknown key"),
    ({"method": "ngram", "k": 4, "model": "smollm2-135m"}, r"speculative\['model'\]: unknown key"),
    ({"method": "ngram", "ngram_min": 3, "ngram_max": 2}, r"speculative\['ngram_max'\]"),
    ({"method": "draft", "k": 4}, r"speculative\['model'\] is required"),
    ({"method": "draft", "model": "smollm2-135m", "dtype": "fp8"}, r"speculative\['dtype'\]"),
    ({"method": "ngram", "adaptive": "yes"}, r"speculative\['adaptive'\] must be True or False"),
    ("ngram", "speculative must be a dict"),
])
def test_bad_speculative_config_names_the_key_before_weights_load(monkeypatch, speculative, match):
    def no_load(*args, **kwargs):
        raise AssertionError("weights loaded before the configuration was checked")
    monkeypatch.setattr(loader, "load_model", no_load)
    with pytest.raises(ValueError, match=match):
        LLM("smollm2-135m", speculative=speculative)


def test_draft_model_with_another_vocabulary_is_refused(tiny):
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=16, max_position_embeddings=256, eos_token_id=None)
    with pytest.raises(ValueError, match=r"speculative\['model'\].*vocabulary"):
        LLM.from_model(tiny, speculative={"method": "draft", "model": LlamaModel(cfg).eval(), "k": 2})
    with pytest.raises(ValueError, match=r"speculative\['dtype'\]"):
        LLM.from_model(tiny, speculative={"method": "draft", "model": tiny, "dtype": "bfloat16"})


def test_parallel_sampling_with_speculation_is_refused(tiny):
    llm = LLM.from_model(tiny, speculative=NGRAM)
    with pytest.raises(ValueError, match="n=2: parallel sampling is not supported with speculative decoding"):
        run(llm, [[1, 2, 3]], me.SamplingParams(n=2, temperature=1.0, seed=0))
    assert "speculative={'method': 'ngram'" in repr(llm)
    assert torch.equal(torch.tensor(run(llm, [[1, 2, 3]], me.SamplingParams(max_tokens=3))[0].token_ids),
                       torch.tensor(me.generate_cached(tiny, [1, 2, 3], 3)))
