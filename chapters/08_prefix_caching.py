# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 08 · Prefix caching: compute a shared prompt once
#
# Chat and agent traffic repeats itself. Every request of an assistant opens with the same system prompt;
# a few-shot prompt repeats the same worked examples; a conversation sends the whole history again with
# one more turn at the end. Attention is causal, so the keys and values of a prompt's first tokens depend
# on those tokens alone: a request that starts like an earlier one could *read* the earlier one's KV
# blocks instead of computing them again.
#
# The paged cache of chapter 07 makes this cheap to build. A **full** block is named by a hash of its
# tokens chained with its parent block's hash, so the hash names the whole prefix up to the block's end.
# A new request looks its blocks up in a hash → block map; every hit takes one more **reference** on the
# cached block instead of computing it. When the last holder lets go, the block stays cached but
# **evictable**: it counts as free, and is overwritten (least recently used first) only when the free list
# is empty. vLLM calls this automatic prefix caching; SGLang's RadixAttention is the same idea on a tree.
#
# This chapter:
#
# 1. hashes blocks by hand and watches the block manager hit, share and evict;
# 2. draws the block tables of several requests pointing at the same blocks, with their reference counts;
# 3. serves many short questions behind one long system prompt, with prefix caching off and on;
# 4. holds a multi-turn conversation whose every turn reuses the previous turns' blocks;
# 5. samples four answers to one prompt that share its blocks, copying a block only when a sample writes;
# 6. puts the measured TTFT gain beside the formula's prediction, with the savings calculator;
# 7. puts three designs side by side, SGLang's radix tree, vLLM's hashed blocks and this engine's tree with a shared
#    partial block: what a page boundary costs each (a formula, then counts on three workloads), the engine's tree
#    after a few conversations, and scheduling with a prefix cache (longest prefix first, holding a request back
#    until its prefix is cached, aging). Exercises close the chapter.

# %%
# Setup. On Colab: fetch the course from its repository and install it (the package, the model and,
# in a lab, the labs/, solutions/ and tests/ trees). Locally (make lab) all is installed: nothing to do.
import os
import subprocess
import sys

COURSE_URL = "https://github.com/llm-inference-course/mini-engine"  # set in tools/course_setup.py
if "google.colab" in sys.modules or "MINI_ENGINE_COURSE_URL" in os.environ:
    home = os.environ.setdefault("MINI_ENGINE_HOME", os.path.abspath("mini-engine"))
    if not os.path.isdir(home):
        url = os.environ.get("MINI_ENGINE_COURSE_URL", COURSE_URL)
        subprocess.run(["git", "clone", "-q", "--depth", "1", url, home], check=True)
    sys.path.insert(0, os.path.join(home, "tools"))
    import course_setup

    course_setup.install(home, lab=False)

# %%
import time

import matplotlib.pyplot as plt
import numpy as np
from IPython.display import display
from tqdm.auto import tqdm

import mini_engine as me
from mini_engine import formulas
from mini_engine.course.devices import default_device, warm_up
from mini_engine.engine import LLM, LLMEngine, request_steps
from mini_engine.course.hardware import describe_machine
from mini_engine.course.metrics import percentile
from mini_engine.course.prefix_designs import DESIGNS, LABELS, expected_loss, replay, served
from mini_engine.paging import BlockManager, hash_block
from mini_engine.course.widgets import block_boundary_widget, prefix_cache_widget
from mini_engine.bench.radix import StructuredWorkload, run_structured
from mini_engine.prefix.radix_cache import RadixBlockManager

device = default_device()
dtype = me.default_dtype(device)
model, tok = me.load_model("smollm2-135m", device=device, dtype=dtype)
warm_up(model, 512)  # one-time choices for steps of up to 512 tokens, made now, off the clock
print(describe_machine(device))
print(f"device: {device}, dtype: {dtype}")

# %% [markdown]
# ## 1. The hash chain and the block manager
#
# `paging.hash_block(parent_hash, token_ids)` is SHA-256 over the parent's hash and the block's token ids:
# stable from one process to the next (Python's own `hash()` is salted per process), and strong enough that
# a collision, which would hand one prompt another prompt's keys and values, is not a practical worry.
# The chain is what makes a block's identity its *whole prefix*: the same four tokens behind two
# different beginnings are two different blocks.

# %%
same = [5, 6, 7, 8]
a1, b1 = hash_block(None, [1, 2, 3, 4]), hash_block(None, [9, 2, 3, 4])
print("block 1 of 'a':", hash_block(a1, same).hex()[:16], "   block 1 of 'b':", hash_block(b1, same).hex()[:16],
      "   same tokens, different prefixes: different hashes")

# %% [markdown]
# The block manager with `enable_prefix_caching=True`: a request first takes the cached blocks its tokens
# start with (`allocate_cached`), then fresh blocks for the rest (`append_slots`); once a step has written
# a full block's keys and values, `cache_blocks` registers it (never before: a lookup must not find a
# block still being filled). Blocks of 4 tokens here, so the numbers stay readable:

# %%
bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)


def serve(seq, tokens):
    cached = bm.allocate_cached(seq, tokens)
    bm.append_slots(seq, len(tokens))
    bm.cache_blocks(seq, tokens, len(tokens))  # as if the step had computed them
    print(f"{seq}: {len(tokens)} tokens, {cached} from the cache, table {bm.block_table(seq)}, "
          f"ref counts {[bm.ref_counts[b] for b in bm.block_table(seq)]}")


system = list(range(100, 108))                   # two full blocks of "system prompt"
serve("A", system + [1, 2, 3])
serve("B", system + [4, 5])                      # hits both system blocks
serve("C", system)                               # a full hit: the last block is recomputed anyway
bm.free("A"), bm.free("B"), bm.free("C")
print(f"all released: {bm.num_free_blocks} of {bm.num_blocks} blocks free, of which {len(bm.evictable)} still "
      f"cached (evictable, least recently used first: {list(bm.evictable)})")
serve("D", system + [6])                         # the cached blocks come back from the evictable set

# %% [markdown]
# Two rules to notice in that output:
#
# - **C's whole prompt is cached, yet only 4 of its 8 tokens come from the cache.** The step must compute
#   at least the prompt's last token, whose logits give the first output token; so a hit never covers the
#   block holding the last token, which C recomputes into a block of its own. (Engines that let a full hit
#   through crashed on a step with nothing to compute.) As a bonus, no request ever writes into a block
#   another one holds: a registered block is full, and writes only go past what is computed.
# - **Released blocks are not forgotten.** They join the evictable queue, tail first, and count as free;
#   `D` finds them there. A block is overwritten only when the free list is empty, and then its hash is
#   dropped. `llm.reset_prefix_cache()` forgets every evictable block at once.
#
# ## 2. Shared blocks in the real engine
#
# A system prompt served once, then three questions behind it admitted together: after one step, their
# block tables start with the same blocks, each held three times.

# %%
engine = LLMEngine.from_model(model, tok, block_size=16, max_num_seqs=4, num_kv_blocks=24)
shop = {"role": "system", "content": "You are a concise assistant for a bicycle shop in the city centre. The shop "
        "sells, rents and repairs bicycles, and is open from nine to six on weekdays. Answer in one sentence."}
sys_ids = tok.encode(tok.apply_chat_template([shop]))
questions = ["Do you fix flat tyres?", "Are you open on Sunday?", "How much is a new chain?"]
engine.add_request(sys_ids, me.SamplingParams(max_tokens=1))
while engine.has_unfinished():
    engine.step()
ids = [engine.add_request(tok.encode(tok.apply_chat_template([shop, {"role": "user", "content": q}])),
                          me.SamplingParams(max_tokens=8)) for q in questions]
engine.step()
snap = engine.block_pool()


def draw_block_tables(snap, ids, labels, title):
    """One row per request: its block table, each block with its id and reference count."""
    width = max(len(snap.block_tables[i]) for i in ids)
    fig, ax = plt.subplots(figsize=(9, 0.55 * len(ids) + 0.6))
    for row, rid in enumerate(ids):
        for col, block in enumerate(snap.block_tables[rid]):
            shared = snap.ref_counts[block] > 1
            ax.add_patch(plt.Rectangle((col, row), 0.95, 0.9, color="tab:orange" if shared else "tab:blue"))
            ax.text(col + 0.47, row + 0.45, f"{block}\nref {snap.ref_counts[block]}", ha="center", va="center",
                    color="white", fontsize=8)
    ax.set_xlim(0, width), ax.set_ylim(len(ids), 0)
    ax.set_yticks(np.arange(len(ids)) + 0.45, labels)
    ax.set_xticks(np.arange(width) + 0.47, [f"block {j}" for j in range(width)])
    ax.set_title(title)
    plt.show()


draw_block_tables(snap, ids, [f"request {i}: {q}" for i, q in zip(ids, questions)],
                  "block tables after one step: orange blocks are shared (ref count > 1), blue ones private")
for rid in ids:
    print(f"request {rid}: table {list(snap.block_tables[rid])}")
while engine.has_unfinished():
    engine.step()
print(f"after the run: {engine.num_free_blocks} of {engine.num_kv_blocks} blocks free "
      f"({engine.scheduler.blocks.num_cached_blocks} of them still cached)")

# %% [markdown]
# ## 3. Many short questions behind one long system prompt
#
# An assistant's system prompt of about a thousand tokens (rules, a price list, opening hours), and short
# questions behind it. The same requests run on two engines, prefix caching off and on, one request at a
# time, so each TTFT is that request's prefill alone. With caching on, the first request computes the
# system prompt and every later one finds it cached.

# %%
rules = [f"Rule {i}: when a customer asks about item {i}, check the stock list, give the price in euros, "
         f"mention the warranty of {i % 3 + 1} years and offer a test ride if the item is a bicycle." for i in range(24)]
long_system = "You are the assistant of a bicycle shop. Follow these rules.\n" + "\n".join(rules)
asks = ["Do you fix flat tyres?", "Are you open on Sunday?", "How much is a new chain?", "Can I rent a bike?",
        "Do you sell helmets?", "Where is the shop?"]
prompts = [tok.encode(tok.apply_chat_template([{"role": "system", "content": long_system},
                                               {"role": "user", "content": q}])) for q in asks]
P = next(i for i, ts in enumerate(zip(*prompts)) if len(set(ts)) > 1)  # tokens every prompt shares
print(f"{len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, the first {P} shared")

runs, engines = {}, {}
for caching in (False, True):
    llm = LLM.from_model(model, tok, enable_prefix_caching=caching, block_size=16, max_num_seqs=8,
                         max_model_len=max(map(len, prompts)) + 16, record_trace=True)
    outs = [llm.generate([p], me.SamplingParams(max_tokens=1), use_tqdm=False)[0]
            for p in tqdm(prompts, desc=f"prefix caching {'on' if caching else 'off'}")]
    runs[caching], engines[caching] = outs, llm.engine
same_answers = all(a.token_ids == b.token_ids for a, b in zip(runs[False], runs[True]))
print(f"{'':20}{'TTFT p50':>11}{'TTFT p99':>11}{'prompt tokens computed':>24}{'hit rate':>10}")
for caching, outs in runs.items():
    ttft = [o.metrics.ttft_s for o in outs]
    total, cached = sum(len(o.prompt_token_ids) for o in outs), sum(o.num_cached_tokens for o in outs)
    print(f"prefix caching {'on ' if caching else 'off'}  {percentile(ttft, 50) * 1e3:8.0f} ms"
          f"{percentile(ttft, 99) * 1e3:8.0f} ms{total - cached:>24}{cached / total:>10.1%}")
print(f"first tokens identical with and without caching: {same_answers}")
print("per request, TTFT off / on:", [f"{a.metrics.ttft_s / b.metrics.ttft_s:.1f}x" for a, b in zip(*runs.values())])

# %% [markdown]
# The first request pays for the system prompt either way (its TTFT is the p99 with caching on); every
# later one computes only its question and the shared tokens past the system prompt's last full block,
# since hits come in whole blocks. The hit rate is the share of prompt tokens served from the cache,
# the same number `formulas.prefix_hit_rate` computes from the lengths alone:

# %%
later = [len(p) for p in prompts[1:]]
predicted_rate = formulas.prefix_hit_rate([len(prompts[0])] + later, [0] + [P] * len(later), block_size=16)
measured_rate = sum(o.num_cached_tokens for o in runs[True]) / sum(len(o.prompt_token_ids) for o in runs[True])
print(f"hit rate: measured {measured_rate:.1%}, formula {predicted_rate:.1%}")

# %% [markdown]
# ## 4. A conversation: each turn reuses the previous turns' blocks
#
# A chat client sends the whole history every turn: system prompt, every question, every answer, and the
# new question. Generated tokens land in full blocks too, and those are cached as soon as they are
# computed, so turn *t* finds turns 1 … t − 1 in the cache, answers included.

# %%
chat = LLM.from_model(model, tok, block_size=16, max_num_seqs=4, max_model_len=1024)
messages = [{"role": "system", "content": "You are a helpful assistant. Keep answers short."}]
turns = ["What is a bicycle derailleur?", "How do I adjust it?", "And if the chain still skips?",
         "Thanks! Which tools do I need?"]
conversation = []
for q in tqdm(turns, desc="turns"):
    messages.append({"role": "user", "content": q})
    prompt = tok.encode(tok.apply_chat_template(messages))
    out = chat.generate([prompt], me.SamplingParams(max_tokens=16), use_tqdm=False)[0]
    messages.append({"role": "assistant", "content": out.text})
    conversation.append((len(prompt), out.num_cached_tokens, out.metrics.ttft_s))
print(f"{'turn':>4}{'prompt tokens':>15}{'from the cache':>16}{'computed':>10}{'TTFT':>10}")
for t, (n, c, ttft) in enumerate(conversation, 1):
    print(f"{t:>4}{n:>15}{c:>16}{n - c:>10}{ttft * 1e3:>8.0f} ms")

# %% [markdown]
# From the second turn on, the prompt grows but the computed part stays small: only the tail of the last
# answer, the new question and the block boundary's remainder. (The chat template may re-render the
# previous answer slightly differently from the tokens the model produced, e.g. around the end-of-turn
# marker; the hit then stops at the first block that differs, which is why it is a little shorter than the
# previous prompt plus its answer.)
#
# ## 5. Parallel sampling: share the prompt, copy on write
#
# `SamplingParams(n=4)` asks for four answers to one prompt (to pick the best, or to show a user options).
# The four samples have the same prompt, so on the paged cache they need its keys and values only once:
# the engine prefills the prompt for sample 0, then **forks** the other three from it. A fork copies no
# data: each new sample gets a block table holding the same blocks, and each block's reference count
# goes up by one.
#
# Full blocks stay shared for good, since nobody writes into a full block again. The prompt's last block
# is usually only partly filled, though, and every sample is about to write its own next token into it.
# Four different tokens into one block would mix four streams (an engine that skipped this check would
# return garbage after the first token). So the first time a sample writes into a block it shares, the
# block manager gives that sample a fresh block in its table alone and asks the KV cache to copy the
# shared block's contents into it: **copy-on-write**. The last holder left writes in place.
#
# With a seed, sample *i* draws from a random stream of its own (seeded from the seed and *i*), so the four
# answers differ, and the same seed gives the same four answers; sample 0 draws what `n=1` would.

# %%
cow = LLMEngine.from_model(model, tok, block_size=16, max_num_seqs=4, num_kv_blocks=16, record_trace=True)
ask = [{"role": "user", "content": "Give me a name for a new bicycle shop."}]
name_prompt = tok.encode(tok.apply_chat_template(ask))
cow.add_request(name_prompt, me.SamplingParams(n=4, temperature=0.8, top_p=0.95, seed=0, max_tokens=20))
cow.step()                                  # the one prefill; samples 1-3 fork from it
forked = cow.block_pool()
samples = sorted(forked.block_tables)
print(f"prompt: {len(name_prompt)} tokens = {len(name_prompt) // 16} full blocks + {len(name_prompt) % 16} tokens "
      "in a partly filled one")
draw_block_tables(forked, samples, [f"sample {i}" for i in range(4)],
                  "after the prefill and the fork: every block shared by all four samples")
cow.step()                                  # the first decode: each sample writes its token after the prompt
written = cow.block_pool()
copies = list(cow.scheduler.block_copies)
print(f"copy-on-write in that step, (shared block, its copy): {copies}")
draw_block_tables(written, samples, [f"sample {i}" for i in range(4)],
                  f"after the first decode: full prompt blocks still shared, the last one copied {len(copies)} times")
finished = []
while cow.has_unfinished():
    finished += cow.step()
answer = finished[0]                        # one RequestOutput; its .outputs holds the four completions
for o in answer.outputs:
    print(f"sample {o.index} ({o.finish_reason}): {o.text!r}")
prefill_tokens = sum(n for step in cow.trace[:1] for _, _, n, _ in step.chunks)
print(f"prompt tokens computed: {prefill_tokens} for four samples (the contiguous cache computes "
      f"{4 * len(name_prompt)}: one prefill per sample, in a slot of its own); all blocks back: "
      f"{cow.num_free_blocks == cow.num_kv_blocks}")

# %% [markdown]
# The blocks before the partly filled one keep reference count 4 while all four samples run: four samples,
# one copy of their keys and values. Each copy-on-write is one block (here 16 positions × 30 layers ×
# keys and values), far cheaper than the prefill it saves, and it happens once per sample, at its first
# decode. The same mechanism lets beam search or a "regenerate" button share a prompt's blocks.
#
# ## 6. Measured against the formula
#
# `formulas.prefix_cache_savings` counts prefill FLOPs: without the cache a request computes its P + S
# tokens; with a hit of C tokens it computes P + S − C of them, attending to all P + S. On a CPU a long
# prefill is compute-bound, so one might expect the TTFT ratio to approach the FLOP ratio; the engine's
# per-step costs (scheduling, the LM head, sampling, Python) are the same either way, and bring the measured
# ratio below. So does something larger, which the steps below show.

# %%
S = int(np.median([len(p) for p in prompts[1:]])) - P
flop_ratio = formulas.prefix_cache_savings(P, S, len(prompts), model.config, block_size=16).ttft_ratio
measured_ratio = (percentile([o.metrics.ttft_s for o in runs[False][1:]], 50)
                  / percentile([o.metrics.ttft_s for o in runs[True][1:]], 50))
print(f"shared prefix P = {P} tokens, own tokens S = {S} (median), blocks of 16")
print(f"TTFT ratio off / on (p50 of the requests that could hit): measured {measured_ratio:.1f}x, "
      f"FLOP ratio {flop_ratio:.1f}x")

# %% [markdown]
# Where the two TTFTs go, step by step. The engine splits a long prompt into chunks of at most
# `chunked_prefill_tokens` tokens (512 by default; vLLM's `max_num_batched_tokens`), one chunk a step, so
# the uncached request's TTFT is several steps and the cached request's is one. The trace of each engine
# (`record_trace=True`) times every step:

# %%
# The request whose cached TTFT is the median of those that could hit (a request's first step at a new
# shape can include one-time costs), on both engines.
hits = sorted(range(1, len(prompts)), key=lambda i: runs[True][i].metrics.ttft_s)
median_request = hits[len(hits) // 2]
req_steps = {c: [(n, sec * 1e3) for n, sec in request_steps(engines[c].trace, runs[c][median_request].request_id)]
             for c in (False, True)}
for caching, steps in req_steps.items():
    print(f"request {median_request}, caching {'on ' if caching else 'off'}: " + "; ".join(
        f"{n} tokens in {ms:.0f} ms ({ms / n:.2f} ms a token)" for n, ms in steps))

fig, ax = plt.subplots(figsize=(9, 1.8))
longest = max(sum(ms for _, ms in steps) for steps in req_steps.values())
for row, caching in enumerate((True, False)):
    left = 0.0
    for i, (n, ms) in enumerate(req_steps[caching]):
        ax.barh(row, ms, left=left, color=f"C{i}", edgecolor="white")
        wide = ms > 0.1 * longest  # a short segment gets its label beside it
        ax.text(left + ms / 2 if wide else left + ms + 0.01 * longest, row, f"{n} tok ({ms:.0f} ms)",
                ha="center" if wide else "left", va="center", fontsize=8)
        left += ms
ax.set_yticks([0, 1], ["caching on", "caching off"])
ax.set_xlabel("ms until the first token (one segment per engine step)")
ax.set_title(f"Request {median_request}'s prefill, step by step")
plt.tight_layout()
plt.show()

# %% [markdown]
# Why the measured ratio stays below the FLOP ratio, as the milliseconds a token above show: the FLOP ratio
# prices every token the same, but a step also pays costs that do not shrink with its tokens. The cached
# request's short step still reads all the weights once and still runs every small operation of every layer,
# for a few dozen tokens instead of hundreds, so each of its tokens costs more than a token of the long
# uncached prefill. Skipping the prefix's FLOPs is real; the fixed cost of a step is not skipped. The FLOP
# ratio above is a ceiling no engine reaches. (What those fixed costs are on a CPU, and how the engine keeps
# them down: appendix [A1](A1_fast_on_a_cpu.ipynb).)
#
# ## The textbook's 40× and 52 PFLOP
#
# The textbook (chapter 00 introduces it) sums prefix caching up in one sentence: "because transformers are
# causal, a shared prefix's KV is bit-for-bit identical across requests, so caching it once cuts TTFT ~40× and
# skips ~52 PFLOP of redundant prefill across 1,000 requests; the same mechanism the Claude API exposes as
# prompt caching". Its figures fit a 13B model (Llama-2-13B here) answering 1,000 requests that share a
# 2,000-token system prompt, each with a 50-token question of its own. The formulas give both:

# %%
book = formulas.prefix_cache_savings(2000, 50, 1000, "llama-2-13b", block_size=16)
weights_only = 2 * formulas.ModelShape.of("llama-2-13b").n_params * 2000 * 999  # the prefix's weight products
print(f"Llama-2-13B, 1,000 requests, 2,000 shared tokens + 50 own: {book.cached_tokens} tokens served from the "
      f"cache per hit")
print(f"prefill skipped: {weights_only / 1e15:.0f} PFLOP in the weight products, {book.flops_skipped / 1e15:.0f} "
      f"with attention, of {book.flops_without / 1e15:.0f} without the cache")
print(f"TTFT ratio if prefill time follows its FLOPs: {book.ttft_ratio:.0f}x")

# %% [markdown]
# The 52 PFLOP are the prefix's weight products, two FLOPs per weight per token, counted again for each of
# the 999 requests after the first: 2 × 13 billion × 2,000 × 999. Attention over the prefix adds a few more.
# The 41× is the whole prompt against the 50 tokens a hit still computes. Both assume that prefill time follows its FLOPs. The calculator below prices
# the same trade on any model and GPU: on an A100's roofline a 50-token suffix is memory-bound (it still
# reads every weight once), which caps the TTFT gain near 13×. Move the sliders to see where the suffix turns
# compute-bound.

# %%
display(prefix_cache_widget())

# %% [markdown]
# **The same mechanism behind an API.** Hosted model APIs sell this chapter as a feature, as the textbook
# says. Anthropic's API calls it prompt caching: a request marks the end of a prefix it will send again (a
# system prompt, a long document, tool definitions), and later requests that start with exactly the same
# tokens are served that prefix from a cache, at a lower price and a shorter time to first token; OpenAI's
# API does the same automatically for long prompts. Whatever each provider runs inside, the rules they
# publish are this chapter's: the cache is keyed by the exact prefix, so one different token makes
# everything after it a miss; entries live for minutes and are evicted when unused; and a hit counts in
# whole units (blocks of 16 tokens here; at OpenAI the first 1,024 tokens, then steps of 128). So put what
# is shared first and what changes last.

# %% [markdown]
# ## 7. Three designs for a prefix that ends inside a block
#
# Everything so far is vLLM's design: a full block is cached under the hash of its whole prefix, and a block still
# being filled is never cached. vLLM's block manager says so where it looks a request up (`get_computed_blocks`,
# in `vllm/v1/core/kv_cache_manager.py`): "Note that the computed blocks must be full." A hit is a whole number of
# blocks.
#
# SGLang's RadixAttention (Zheng et al. 2024) keeps its cache as a **radix tree** over token ids instead: each node
# holds a run of tokens that follows the path from the root, children branch where sequences part, and a lookup
# walks down from the root as far as the tokens agree. With a **page size** of 1 (its KV pool handed out one token
# at a time) a match can end at any token. With larger pages it cannot. SGLang's `RadixCache.match_prefix`
# (`python/sglang/srt/mem_cache/radix_cache.py`) first cuts the lookup key down to whole pages,
#
# ```python
# if self.page_size != 1:
#     page_aligned_len = len(key) // self.page_size * self.page_size
#     key = key[:page_aligned_len]
# ```
#
# and a finished request enters the tree cut the same way (`cache_finished_req` calls
# `page_align_keys(keys, self.page_size)`, then, in its own comment, "free the unaligned tail"). So at one page size
# SGLang's tree and vLLM's hashed blocks serve the same tokens: what a block boundary costs comes from the page
# size, not from a tree or a hash. (Pages of 1 token are not a given: vLLM's blocks hold 16 tokens by default on CUDA,
# and some attention kernels want pages larger still.)
#
# This engine has a third design, its own, not SGLang's: `LLM(enable_prefix_caching=True, prefix_cache="radix")` plugs
# in `mini_engine.prefix.radix_cache.RadixBlockManager`, a tree whose every node owns one KV block of `block_size`
# tokens. As with SGLang at page size 1, a match can end at any token. When it ends inside a block, that partly
# matched block is shared too, and copied the first time the new request writes into it (section 5's copy-on-write); a
# finished request puts its whole computed sequence into the tree, last partial block included. This engine's tree
# keeps its pages of `block_size` and pays one block copy per hit that ends inside a block, so it loses no token. Its
# eviction works as SGLang's does with its default `--radix-eviction-policy lru`: it removes the least recently used
# **leaves** that no request holds, so a trunk that many branches share outlives them.
#
# The three side by side: a 100-token request A has finished; B starts with A's first 70 tokens and adds 30 of its
# own. What each design serves B from the cache (`course.prefix_designs.served`; a prompt's last token is always
# computed, as section 1 showed):

# %%
def draw_designs(shared, own, rows):
    """One row per design: request B's tokens in pages, green served from the cache, red shared with A but computed
    again, grey B's own; an orange outline marks a partly matched block that B copies at its first write."""
    n = shared + own
    fig, ax = plt.subplots(figsize=(10, 0.55 * len(rows) + 1.2))
    for y, (label, page, design) in enumerate(rows):
        hit = served(min(shared, n - 1), page, design)
        for start, stop, color in ((0, hit, "tab:green"), (hit, shared, "tab:red"), (shared, n, "lightgrey")):
            if stop > start:
                ax.barh(y, stop - start, left=start, color=color, height=0.6)
        if page > 1:
            ax.vlines(range(0, n + 1, page), y - 0.3, y + 0.3, color="white", lw=1.5)  # page boundaries
        if design == "partial" and hit % page:
            ax.add_patch(plt.Rectangle((hit // page * page, y - 0.36), page, 0.72, fill=False, ec="tab:orange", lw=2.5))
        ax.text(n + 2, y, f"{hit} served, {shared - hit} lost", va="center", fontsize=8)
    ax.set_yticks(range(len(rows)), [label for label, _, _ in rows])
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(0, n + 28)
    ax.set_xlabel(f"B's tokens: the first {shared} shared with A, then {own} of its own")
    ax.set_title("green: from the cache · red: shared, computed again · grey: B's own · "
                 "orange: copied on first write", fontsize=9)
    plt.tight_layout()
    plt.show()


design_rows = [("SGLang, page size 1", 1, "rounded"), ("SGLang, page size 16", 16, "rounded"),
               ("vLLM, blocks of 16", 16, "hashed"), ("this engine, blocks of 16", 16, "partial")]
draw_designs(70, 30, design_rows)
for label, page, design in design_rows:
    print(f"{label:<28} serves {served(70, page, design):2d} of B's 70 shared tokens")

# %% [markdown]
# ### What a page boundary costs, as a formula
#
# Call L the tokens a request could reuse at the granularity of one token: the most it shares with what earlier
# requests computed, and never its own last token. A design that rounds to pages of P tokens (SGLang's tree at
# P > 1, or vLLM's hashed blocks) serves P · ⌊L / P⌋ of them and loses L mod P, somewhere between 0 and P − 1.
#
# To get a number, assume L mod P is equally likely to be any of 0, 1, …, P − 1. That is fair when the shared
# lengths spread over many pages: a conversation's next turn shares everything up to the end of the last answer,
# and answers end wherever they end. Then the expected loss per hit is
#
# (0 + 1 + … + (P − 1)) / P = (P − 1) / 2,
#
# about half a page: nothing at P = 1, 7.5 tokens at P = 16, 63.5 at P = 128. The assumption breaks when the shared
# prefixes are shorter than a page or two: a match of L < P tokens loses all L, however they spread. The shared
# partial block loses nothing at any page size. (The slider's "radix tree" is a match at any token: SGLang at page
# size 1, or this engine's tree.)

# %%
for shared in (300, 320):
    for block in (16, 128):
        print(f"{shared} shared tokens of a {shared + 30}-token prompt, pages of {block:3d}: rounded to pages "
              f"{formulas.cached_prefix_tokens(shared + 30, shared, block):3d}, at any token "
              f"{formulas.cached_prefix_tokens(shared + 30, shared, 1)}: "
              f"{formulas.block_boundary_loss(shared + 30, shared, block):2d} lost")
print(f"expected loss per hit when L mod P is uniform: {formulas.expected_block_boundary_loss(16)} tokens "
      f"(pages of 16), {formulas.expected_block_boundary_loss(128)} (pages of 128)")
display(block_boundary_widget())

# %% [markdown]
# ### The tree after a few conversations
#
# Three users chat with the same assistant (one system prompt), two turns each; every turn's prompt is the previous
# prompt, the answer the engine gave and the next question, as token ids. The users start one after another, then
# send their second turns together. Then the tree this engine built (`prefix_cache="radix"`), drawn from
# `RadixBlockManager`'s own nodes: one box per node, its block id and how many tokens it holds.

# %%
def turn(question):
    """A user turn in the chat template's markup, after the previous answer's tokens."""
    return tok.encode(f"<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")


radix_chat = LLM.from_model(model, tok, enable_prefix_caching=True, prefix_cache="radix", block_size=16,
                            max_num_seqs=4, max_model_len=512)
helper = {"role": "system", "content": "You are the helpful assistant of a bicycle shop in the city centre. It sells, "
          "rents and repairs bicycles, and opens from nine to six on weekdays. Keep every answer short."}
first_questions = ["Do you repair e-bikes?", "What does a service cost?", "Can I rent a tandem?"]
follow_ups = ["How long does it take?", "Is a chain included?", "For a whole weekend?"]
params8 = me.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
turn1 = [radix_chat.generate([tok.encode(tok.apply_chat_template([helper, {"role": "user", "content": q}]))],
                             params8, use_tqdm=False)[0] for q in first_questions]  # the users arrive one by one
turn2 = radix_chat.generate([list(o.prompt_token_ids) + o.token_ids + turn(q) for o, q in zip(turn1, follow_ups)],
                            params8, use_tqdm=False)
for o1, o2 in zip(turn1, turn2):
    print(f"turn 1: {len(o1.prompt_token_ids):3d} prompt tokens, {o1.num_cached_tokens:3d} from the tree; turn 2: "
          f"{len(o2.prompt_token_ids):3d}, {o2.num_cached_tokens:3d} from the tree (turn 1's prompt and answer: "
          f"{len(o1.prompt_token_ids) + len(o1.token_ids) - 1} computed tokens)")
tree = radix_chat.engine.scheduler.blocks


def draw_tree(tree, title):
    """Each node of a RadixBlockManager's tree as a box (block id, tokens held); leaves side by side, each parent
    above the middle of its children."""
    xs, ys, order = {}, {}, []

    def place(node, depth, next_x):
        kids = sorted(node.children.values(), key=lambda n: n.block)
        for kid in kids:
            next_x = place(kid, depth + 1, next_x)
        xs[node] = sum(xs[k] for k in kids) / len(kids) if kids else next_x
        ys[node] = depth
        order.append(node)
        return next_x + (0 if kids else 1)

    place(tree.root, 0, 0)
    fig, ax = plt.subplots(figsize=(10, 0.75 * max(ys.values()) + 1.4))
    for node in order:
        if node.parent is not None:
            ax.plot([xs[node.parent], xs[node]], [ys[node.parent], ys[node]], color="grey", lw=0.8, zorder=1)
    for node in order:
        full = node.block is not None and len(node.tokens) == tree.block_size
        label = "root" if node.block is None else f"{node.block}\n{len(node.tokens)} tok"
        color = "lightgrey" if node.block is None else ("tab:blue" if full else "tab:orange")
        ax.text(xs[node], ys[node], label, ha="center", va="center", fontsize=7, zorder=2,
                color="black" if node.block is None else "white",
                bbox=dict(boxstyle="round", fc=color, ec="none"))
    ax.set_ylim(max(ys.values()) + 0.6, -0.6)
    ax.set_xlim(-0.7, max(xs.values()) + 0.7)
    ax.axis("off")
    ax.set_title(title)
    plt.show()


draw_tree(tree, "the radix tree after three conversations of two turns: blue full blocks, orange partial leaves")
print(f"{len(tree.node_of)} blocks in the tree, {tree.num_cached_blocks} cached; the root's children: "
      f"{len(tree.root.children)} (the system prompt's first block, shared by all)")

# %% [markdown]
# Read the tree from the top: the blocks every prompt shares in full form one trunk. The block in which the users'
# prompts part is a block of each user's own, so the trunk's last block has three children. (The second and third
# users still matched the first user's tokens into that block: their first turns took the shared tokens past the last
# full block from the tree too, sharing the first user's block and copying it on their first write.) Below, each
# conversation is one chain, usually ending in a partial leaf, the last tokens of its second turn. The tree holds
# every turn's answer, so a third turn would find the whole conversation. (SGLang's tree at page size 1 would find it
# too; at page size 16 it keeps no partial leaves, and a third turn would recompute each answer's last partial page.)
#
# ### The three workloads, measured
#
# Three kinds of traffic that share structure, as `python -m mini_engine bench --workload radix` generates them
# (random token ids, random lengths, so shared prefixes end anywhere in a block), smaller here: a **conversation**
# (two users, three turns: each turn's prompt is the last prompt, its answer and a new question), **few-shot** (two
# tasks, each a block of worked examples, three questions each, all arriving together with the tasks interleaved)
# and **branching** (one context, three continuations of it, each continued once more after its answer). Two
# engines serve each, in arrival order, with blocks of 16: hashed blocks, and this engine's tree with its shared
# partial block. "Ideal" counts, for each request, every prompt token it shares with a request that arrived before
# it, whether or not that one had been computed yet: what a cache that kept everything, token by token, and never
# admitted two sharers together would serve.

# %%
vocab = model.config.vocab_size
small = [StructuredWorkload.conversation(users=2, turns=3, output_len=8, vocab=vocab),
         StructuredWorkload.few_shot(tasks=2, questions=3, examples_len=(60, 110), output_len=4, vocab=vocab),
         StructuredWorkload.branching(contexts=1, branches=3, context_len=(80, 140), output_len=4, vocab=vocab)]
run_structured(model, tok, StructuredWorkload.few_shot(tasks=1, questions=2, examples_len=(60, 110), output_len=4,
                                                       vocab=vocab), block_size=16, max_num_seqs=4)  # warm-up, not shown
measured = {}
for work in tqdm(small, desc="workloads"):
    for cache in ("hashed", "radix"):
        measured[work.name, cache] = run_structured(model, tok, work, cache, block_size=16, max_num_seqs=4)
print(f"{'workload':<14}{'cache':<9}{'prompt tokens':>14}{'reused':>8}{'ideal':>7}{'of ideal':>10}{'TTFT p50':>10}"
      f"{'out tok/s':>10}")
for (name, cache), r in measured.items():
    print(f"{name:<14}{cache:<9}{r.prompt_tokens:>14}{r.reused:>8}{r.ideal:>7}{r.share_of_ideal:>10.1%}"
          f"{percentile(r.ttft, 50) * 1e3:>8.0f}ms{r.tok_s:>10.1f}")
same_tokens = all(measured[w.name, "hashed"].outputs == measured[w.name, "radix"].outputs for w in small)
print(f"greedy outputs identical on both caches: {same_tokens}")

# %% [markdown]
# Read the reuse columns first: they count tokens, so they come out the same on any machine; the times are from one
# short run on your machine: compare them within a workload only. The shared partial block reuses more wherever a
# shared prefix ends inside a block. Neither reaches the ideal: where requests admitted in the same step share a
# prefix that none of them has computed yet, each computes it (the scheduling below is about that).
#
# ### The loss against the page size, on the three workloads
#
# Now every design at pages of 1, 16 and 128 tokens, on the same requests (the prompts and answers just served).
# `course.prefix_designs.replay` serves them one at a time in arrival order, on a cache that keeps everything, and
# counts what each design serves: that isolates the page size from scheduling and eviction. "Lost" is the ideal
# less what a design serves; "formula" is the hits times (P − 1) / 2; "copies" are the partly matched blocks the
# shared partial block copies (one per hit that ends inside a block).

# %%
pages = (1, 16, 128)
print(f"{'workload':<14}{'page':>5}{'hits':>6}{'ideal':>7}  " + "".join(f"{LABELS[d]:>36}" for d in DESIGNS)
      + f"{'formula':>9}{'copies':>8}")
page_table = {}
for work in small:
    r = measured[work.name, "hashed"]
    for page in pages:
        reuse = {d: replay(r.prompts, r.outputs, page, d) for d in DESIGNS}
        page_table[work.name, page] = reuse
        hits, ideal = reuse["hashed"].hits, sum(reuse["hashed"].ideal)
        cells = "".join(f"{f'{x.reused} served, {x.lost} lost ({x.share_of_ideal:.0%})':>36}" for x in reuse.values())
        print(f"{work.name:<14}{page:>5}{hits:>6}{ideal:>7}  {cells}{expected_loss(hits, page):>9.1f}"
              f"{reuse['partial'].copies:>8}")
for page in pages:
    rows = [page_table[w.name, page]["rounded"] for w in small]
    hits, lost = sum(x.hits for x in rows), sum(x.lost for x in rows)
    short = sum(1 for x in rows for i in x.ideal if 0 < i < page)
    same = all(page_table[w.name, page]["rounded"].cached == page_table[w.name, page]["hashed"].cached for w in small)
    print(f"pages of {page:3d}, rounded: {lost / hits:5.1f} tokens lost a hit, the formula says {(page - 1) / 2:5.1f}; "
          f"{short} of {hits} hits match less than one page (lost whole); rounded = hashed on every workload: {same}")

# %% [markdown]
# Read it by page size. At 1, every design serves the ideal. At 16, the two rounding designs serve exactly the same
# tokens, SGLang's tree and vLLM's hashes alike, and lose a few tokens a hit, close to the formula's (P − 1) / 2. At
# 128 the formula's assumption fails, and the rows stray from it both ways: these prefixes are a page of 128 or two
# long, not many pages, so where they end within a page is far from uniform. A match shorter than a page is lost
# whole (the conversation's and the few-shot questions' hits), while a match that ends a little past a page boundary
# loses little (the branches'). Over all three workloads the two errors happen to cancel near the formula's 63.5 a
# hit; that is luck, not the formula. The shared partial block serves the ideal at every page size, for one block
# copy per hit that ends inside a block.
#
# Does the replay count what the engine does? Served one at a time (`max_num_seqs=1`), on a pool large enough that
# nothing is evicted, the engine's own `num_cached_tokens` of every request should equal the replay's count, for the
# two designs the engine has:

# %%
for work in small:
    for cache, design in (("hashed", "hashed"), ("radix", "partial")):
        alone = run_structured(model, tok, work, cache, block_size=16, max_num_seqs=1, num_kv_blocks=256)
        counted = replay(alone.prompts, alone.outputs, 16, design).cached
        print(f"{work.name:<14}{LABELS[design]:<36} engine {alone.reused:4d}, replay {sum(counted):4d}: request by "
              f"request equal {alone.cached == counted} (evictions {alone.num_evictions})")

# %% [markdown]
# ### Scheduling with a prefix cache
#
# The cache decides what a request *can* reuse; the scheduler decides *when* it runs, and so what is cached by then.
# SGLang's scheduler (`python/sglang/srt/managers/schedule_policy.py`) offers several orders for its waiting queue;
# three of its ideas bear on the prefix cache.
#
# - **Longest prefix match** (`--schedule-policy lpm`): the waiting requests with the most cached tokens first. They
#   cost the step least, and they run before their prefix is evicted. Ranking means matching every waiting request
#   against the tree at every step, so past 128 waiting requests SGLang falls back to arrival order, and its reason
#   is cost, in its own comment: "Turn off the expensive prefix matching and sorting when the #queue is large."
# - **In-batch prefix caching.** Requests that arrive together with a prefix nobody has computed yet all miss if they
#   are admitted together: each computes the prefix itself. SGLang matches each waiting request that has few cached
#   tokens (at most 32) against the earlier waiting requests checked the same way and not themselves sorted last, and
#   one that shares at least 32 tokens with them is sorted to the end of the queue for this step ("we prefer to
#   schedule only one of them so that we can increase the cache hit rate"). If the batch fills before the queue's end,
#   it runs a step or more later and finds the prefix cached; if the batch has room left, it is still admitted now.
# - **Aging.** Longest prefix first can starve a request with no hit: while requests with hits keep arriving, each
#   ranks ahead of it, and the queue can stay far shorter than 128 the whole time, so the fallback never comes.
#   Recent SGLang has an `hrrn` policy (highest response ratio next) that ranks a request by how long it has waited
#   against how much it has to compute: it measures the wait by how many prefill tokens the engine has computed
#   since the request arrived, divides by the request's own uncached tokens, and so a waiting request rises until it
#   goes first.
#
# The engine has the first as `scheduling="cache_aware"` (arrival order past 128 waiting requests, too), and the other
# two as its options, in a form of its own (unlike SGLang, it holds such a request back even when the batch has room;
# `mini_engine/prefix/policies.py` says more): `prefix_holding=True` holds back a request that would gain at least 32
# cached tokens (`HOLD_TOKENS` there) by waiting for a request being computed in this step; `aging_s` lets a request
# that has waited that many seconds go first, oldest first, and never holds it back. All three only reorder or delay
# admissions: with greedy sampling every request produces the same output tokens either way, though how many of its
# prompt tokens come from the cache changes.
#
# First the starvation. One request with no cached prefix waits with requests that hit a cached 96-token prefix;
# one request runs at a time (`max_num_seqs=1`), and a new hit arrives each time one finishes, so at most two
# requests ever wait:

# %%
def lonely_wait(scheduling, rounds, **options):
    """How many requests with a hit finish before the one without a hit gets its first token (None: not within
    `rounds`), and the seconds it waited."""
    eng = LLMEngine.from_model(model, tok, enable_prefix_caching=True, prefix_cache="radix", scheduling=scheduling,
                               block_size=16, max_num_seqs=1, max_model_len=256, **options)
    rng = np.random.default_rng(1)
    stem = rng.integers(1000, 20000, 96).tolist()
    eng.add_request(stem, me.SamplingParams(max_tokens=1))
    while eng.has_unfinished():
        eng.step()  # the stem is cached now
    start = time.perf_counter()
    lonely = eng.add_request(rng.integers(1000, 20000, 96).tolist(), me.SamplingParams(max_tokens=1))
    eng.add_request(stem + rng.integers(1000, 20000, 8).tolist(), me.SamplingParams(max_tokens=2))
    served_before = 0
    while served_before < rounds:
        for out in eng.step():
            if out.request_id == lonely:
                return served_before, time.perf_counter() - start
            served_before += 1
            eng.add_request(stem + rng.integers(1000, 20000, 8).tolist(), me.SamplingParams(max_tokens=2))
    return None, time.perf_counter() - start


aging_s, rounds = 0.2, 40
for label, scheduling, options in (("arrival order", "continuous", {}), ("longest prefix", "cache_aware", {}),
                                   (f"longest prefix, aging {aging_s} s", "cache_aware", {"aging_s": aging_s})):
    before, waited = lonely_wait(scheduling, rounds, **options)
    print(f"{label:<32} requests with a hit served before the one without: "
          f"{f'more than {rounds}' if before is None else before} ({waited:.2f} s)")

# %% [markdown]
# Arrival order serves the request without a hit first, since it came first. Longest prefix first serves every hit
# before it, for as long as hits keep coming, with never more than two requests waiting. With aging it goes first
# once it has waited `aging_s`.
#
# Now the four orders on the three workloads, on this engine's tree with blocks of 16. Two requests run at a time
# (`max_num_seqs=2`), so requests queue. TTFT p50 and p99 are over a workload's requests; throughput is output
# tokens a second over the whole workload.

# %%
orders = [("arrival order", "continuous", {}), ("longest prefix", "cache_aware", {}),
          ("+ holding", "cache_aware", {"prefix_holding": True}),
          ("+ holding + aging", "cache_aware", {"prefix_holding": True, "aging_s": aging_s})]
scheduled = {}
for work in tqdm(small, desc="workloads"):
    for label, scheduling, options in orders:
        scheduled[work.name, label] = run_structured(model, tok, work, "radix", scheduling, block_size=16,
                                                     max_num_seqs=2, **options)
print(f"{'workload':<14}{'order':<20}{'reused':>8}{'of ideal':>10}{'evicted':>9}{'blocks':>8}{'TTFT p50':>10}"
      f"{'TTFT p99':>10}{'out tok/s':>11}")
for (name, label), r in scheduled.items():
    print(f"{name:<14}{label:<20}{r.reused:>8}{r.share_of_ideal:>10.1%}{r.num_evictions:>9}{r.num_kv_blocks:>8}"
          f"{percentile(r.ttft, 50) * 1e3:>8.0f}ms{percentile(r.ttft, 99) * 1e3:>8.0f}ms{r.tok_s:>11.1f}")
same_orders = all(scheduled[w.name, label].outputs == measured[w.name, "radix"].outputs
                  for w in small for label, _, _ in orders)
print(f"greedy outputs identical under every order: {same_orders}")

# %% [markdown]
# Read the reuse column first: it counts tokens, so it does not depend on the machine, except under aging, which goes
# by the clock. Holding raises it where
# requests that arrive together share a prefix nobody has computed yet: a conversation's users share the system
# prompt, a context's branches share the context, and a request held back a step finds it cached. Longest prefix
# first alone changes little there, and on few-shot it can lower reuse: the pool is small (by default `max_num_seqs`
# requests of `max_model_len` tokens: the blocks column), too small for both tasks' examples and the questions
# running, and ranking by hits serves one task's questions back to back while the other task's examples are
# evicted (the evicted column). Arrival order alternates the tasks. A hold costs the requests it holds a step or
# more of waiting; aging changes the order only for a request that has waited `aging_s`, and an aged request is
# never held, so where requests wait longer than `aging_s` (a slow machine, a long queue) aging gives back what
# holding gained. The times come from one short run on your machine: compare them within a workload only.
#
# ### When each design wins
#
# - **A match at any token** serves every token an earlier request computed and the cache still holds, wherever the
#   shared prefix ends. SGLang gets it with pages of one token; this engine gets it with pages of 16 by sharing the
#   partly matched block and copying it on first write. It wins where prefixes keep ending inside pages, and the
#   larger the page, the more it wins: a conversation loses the previous turn's tail at every turn otherwise. Its
#   price: a lookup compares tokens down a path instead of looking up one hash per block, a partly matched block
#   costs a copy, and splits, leaves and the tree's own references are more code to get right.
# - **Rounding to pages**, by hashes (vLLM) or in a tree (SGLang at page size > 1), loses under a page per hit, about
#   half a page on average. When shared prefixes are long against a page, or end on page boundaries (a prompt
#   template padded to whole pages), that loss is small and the simpler design does as well.
# - **Tree or hashes** matters for eviction more than for matching: a tree evicts only leaves, so everything it keeps
#   is reachable by construction; a hashed cache orders evictions by release time, and it is releasing each request's
#   blocks tail first (vLLM and this engine both do) that keeps a block's successors from outliving it (exercise 5).
# - **The scheduler** decides what is cached in time. Longest prefix first runs cheap hits first; holding lets a
#   burst that shares a new prefix compute it once; aging bounds how long a request without a hit waits.
#   `python -m mini_engine bench --workload radix` measures the caches and orders on larger workloads.

# %% [markdown]
# ## What you measured

# %%
off, on = runs[False], runs[True]
summary = [
    (f"system prompt {P} tokens, {len(prompts)} questions: TTFT p50 off / on",
     f"{percentile([o.metrics.ttft_s for o in off], 50) * 1e3:.0f} / "
     f"{percentile([o.metrics.ttft_s for o in on], 50) * 1e3:.0f} ms"),
    ("TTFT p99 off / on", f"{percentile([o.metrics.ttft_s for o in off], 99) * 1e3:.0f} / "
                          f"{percentile([o.metrics.ttft_s for o in on], 99) * 1e3:.0f} ms"),
    ("prompt tokens computed off / on", f"{sum(len(o.prompt_token_ids) for o in off)} / "
                                        f"{sum(len(o.prompt_token_ids) - o.num_cached_tokens for o in on)}"),
    ("hit rate: measured, formula", f"{measured_rate:.1%}, {predicted_rate:.1%}"),
    ("TTFT ratio: measured, FLOP ratio", f"{measured_ratio:.1f}x, {flop_ratio:.1f}x"),
    ("first tokens identical on vs off", f"{same_answers}"),
    ("conversation: tokens from the cache per turn", ", ".join(f"{c}/{n}" for n, c, _ in conversation)),
    ("shared-block picture: ref counts of the shared blocks",
     f"{sorted({snap.ref_counts[b] for b in snap.block_tables[ids[0]] if snap.ref_counts[b] > 1})}"),
    ("n=4: prompt tokens computed, blocks copied on write",
     f"{prefill_tokens} of {4 * len(name_prompt)}, {len(copies)} (blocks {sorted({s for s, _ in copies})})"),
    ("n=4: distinct answers", f"{len({tuple(o.token_ids) for o in answer.outputs})} of 4"),
    ("radix tree: a conversation's second turn, tokens from the tree / computed before",
     ", ".join(f"{o2.num_cached_tokens}/{len(o1.prompt_token_ids) + len(o1.token_ids) - 1}" for o1, o2 in zip(turn1, turn2))),
    ("prompt tokens reused, hashed / shared partial block / ideal", "; ".join(
        f"{w.name} {measured[w.name, 'hashed'].reused} / {measured[w.name, 'radix'].reused}"
        f" / {measured[w.name, 'radix'].ideal}" for w in small)),
    ("share of ideal, pages of 1 / 16 / 128: rounded (SGLang, vLLM) | shared partial block", "; ".join(
        f"{w.name} " + " / ".join(f"{page_table[w.name, p]['rounded'].share_of_ideal:.0%}" for p in pages) + " | "
        + " / ".join(f"{page_table[w.name, p]['partial'].share_of_ideal:.0%}" for p in pages) for w in small)),
    ("reused: arrival / longest prefix / + holding / + aging", "; ".join(
        f"{w.name} " + " / ".join(f"{scheduled[w.name, label].reused}" for label, _, _ in orders) for w in small)),
    ("TTFT p99: arrival / longest prefix / + holding / + aging", "; ".join(
        f"{w.name} " + " / ".join(f"{percentile(scheduled[w.name, label].ttft, 99) * 1e3:.0f}"
                                   for label, _, _ in orders) + " ms" for w in small)),
]
width = max(len(k) for k, _ in summary)
for k, v in summary:
    print(f"{k:<{width}}  {v}")

# %% [markdown]
# ## Exercises: predict, then run
#
# Write your prediction down before you run each cell; the answer under it says what you should see and why.
# Each cell takes a few seconds.
#
# **1. Predict the hit.** One engine with blocks of 16 serves five 80-token prompts, one after another: a
# prompt X; X again; X's first 40 tokens followed by 40 others; X with its first token changed; X with its
# token 50 changed. How many prompt tokens does each take from the cache? Predict each with
# `formulas.cached_prefix_tokens(prompt_len, shared_len, block_size)`, where `shared_len` counts the first
# tokens the prompt has in common with one served before it, then run.

# %%
ex_rng = np.random.default_rng(0)
x = ex_rng.integers(1000, 20000, 80).tolist()
others = ex_rng.integers(1000, 20000, 40).tolist()
variants = [("X", x, 0), ("X again", x, 80), ("X[:40] + 40 others", x[:40] + others, 40),
            ("X, first token changed", [7] + x[1:], 0), ("X, token 50 changed", x[:50] + [7] + x[51:], 50)]
hit_llm = LLM.from_model(model, tok, block_size=16, max_num_seqs=1, max_model_len=256, enable_prefix_caching=True)
for name, tokens, shared in variants:
    out = hit_llm.generate([tokens], me.SamplingParams(max_tokens=1), use_tqdm=False)[0]
    print(f"{name:<24} {out.num_cached_tokens:2d} tokens from the cache "
          f"(formula: {formulas.cached_prefix_tokens(len(tokens), shared, 16)})")

# %% [markdown]
# <details><summary>Answer</summary>
#
# 0, 64, 32, 0 and 48. The first X finds an empty cache. X again is cached whole, yet takes 64 tokens, not 80:
# the step must compute the last prompt token to get its logits, so the block holding it is recomputed
# (section 1's request C). The 40 shared tokens fill two blocks; the third mixes 8 of X's tokens with 8
# others, so it is a different block and the hit stops there. Changing the first token loses everything,
# although tokens 1 to 79 are X's: every block's hash chains its parent's, so the first block's change
# reaches all of them. That is what must happen, since through attention every later key and value depends
# on the first token. Changing token 50 keeps the three blocks before the one that holds it: 48 tokens.
# </details>
#
# **2. Eviction.** Four different 32-token prompts A, B, C and D run one after another (one output token each),
# then A again, on pools of 12, 14 and 16 blocks of 8 positions. How many of A's tokens come from the cache the
# second time, on each pool?

# %%
a_to_d = [ex_rng.integers(1000, 20000, 32).tolist() for _ in range(4)]
for blocks in (12, 14, 16):
    pool_llm = LLM.from_model(model, tok, block_size=8, num_kv_blocks=blocks, max_num_seqs=1, max_model_len=256,
                              enable_prefix_caching=True)
    pool_llm.generate(a_to_d, me.SamplingParams(max_tokens=1), use_tqdm=False)  # one at a time: max_num_seqs=1
    again = pool_llm.generate([a_to_d[0]], me.SamplingParams(max_tokens=1), use_tqdm=False)[0]
    print(f"{blocks} blocks: A again takes {again.num_cached_tokens:2d} tokens from the cache; cached blocks "
          f"evicted in all: {pool_llm.engine.scheduler.blocks.num_evictions}")

# %% [markdown]
# <details><summary>Answer</summary>
#
# 24, 16 and 0 from 16, 14 and 12 blocks. Each prompt fills 4 blocks, all full, all cached; when its request
# finishes they become evictable. A new request takes plain free blocks first and evicts only when there are
# none, least recently released first; a finished request releases its blocks tail first. On 16 blocks the
# four prompts fit side by side, and A finds its first three blocks (24, not 32: its last block is recomputed,
# as in exercise 1). On 14, D finds 2 free blocks and evicts 2, A's last two, so A's first two still hit: 16.
# On 12, D evicts all four of A's. Tail first is the useful order: a block can only hit together with every
# block before it, so A's first blocks outlive its last ones. And a prefix that keeps being asked for, such as
# a system prompt every request shares, keeps being held and released again, so it stays at the young end of
# the queue while one-off prompts are evicted. The evictions printed include A's second visit, which evicts
# for the blocks it computes (on 16 blocks, one: its own old last block, the least recently released).
# </details>
#
# **3. Copy-on-write.** Four samples (`n=4`) of a 40-token prompt, then of a 48-token prompt, and two samples of
# the 40-token one, with blocks of 16. At the first decode, how many blocks are copied, and how many blocks do
# the samples hold together after it?

# %%
for prompt_len, n in ((40, 4), (48, 4), (40, 2)):
    fork_engine = LLMEngine.from_model(model, tok, block_size=16, max_num_seqs=4, num_kv_blocks=16)
    fork_engine.add_request(ex_rng.integers(1000, 20000, prompt_len).tolist(),
                            me.SamplingParams(n=n, temperature=0.8, seed=0, max_tokens=3))
    fork_engine.step()  # the prefill, then the fork
    fork_engine.step()  # the first decode
    held = fork_engine.num_kv_blocks - fork_engine.num_free_blocks
    print(f"{prompt_len} tokens, n = {n}: blocks copied {fork_engine.scheduler.block_copies}, {held} blocks held")

# %% [markdown]
# <details><summary>Answer</summary>
#
# 40 tokens are 2 full blocks and 8 tokens in a third. After the fork all four tables hold those 3 blocks. At
# the first decode every sample writes position 40 into the shared third block: the first three to write each
# get a copy of it, and the last one left holding it writes in place. So n − 1 = 3 copies, and 2 shared + 4
# own = 6 blocks. 48 tokens are 3 full blocks: position 48 starts a fourth block, which each sample takes
# fresh, so nothing is copied, and 3 + 4 = 7 blocks. Two samples of 40 tokens: 1 copy, 4 blocks. Either way
# the samples hold ⌊prompt / block_size⌋ shared blocks plus one each; copy-on-write costs at most one block per
# sample, once, and nothing at all when the prompt ends on a block boundary.
# </details>
#
# **4. Hashed blocks against this engine's tree, by hand.** Blocks of 16. A 100-token prompt A is served and
# finishes; then B (A's first 70 tokens and 30 others), C (A again) and D (A followed by 20 more tokens, as a next
# turn would be), one after another. How many prompt tokens does each take from the cache, with hashed blocks and
# with this engine's tree (`prefix_cache="radix"`)? And with SGLang's tree at a page size of 16? The cell drives
# both of the engine's block managers the way the scheduler does (take the matched blocks, copy a partly matched
# one, compute the rest, free at the end), and counts SGLang's with `replay`.

# %%
def serve_alone(manager, seq, tokens):
    """One request whose prompt runs in one step and then finishes; returns the tokens served from the cache."""
    cached = manager.allocate_cached(seq, tokens)
    manager.copy_on_write(seq, cached, len(tokens))
    manager.append_slots(seq, len(tokens))
    manager.cache_blocks(seq, tokens, len(tokens))
    manager.free(seq)
    return cached


a_tokens = ex_rng.integers(1000, 20000, 100).tolist()
requests4 = {"A": a_tokens, "B": a_tokens[:70] + ex_rng.integers(1000, 20000, 30).tolist(), "C": a_tokens,
             "D": a_tokens + ex_rng.integers(1000, 20000, 20).tolist()}
managers = {"hashed": BlockManager(64, 16, enable_prefix_caching=True), "radix": RadixBlockManager(64, 16)}
sglang16 = replay(list(requests4.values()), [[0]] * len(requests4), 16, "rounded").cached  # each computes its prompt
for (name, tokens), sglang in zip(requests4.items(), sglang16):
    print(f"{name}: {len(tokens)} tokens; " + ", ".join(f"{kind} {serve_alone(m, name, tokens):3d} from the cache"
                                                       for kind, m in managers.items())
          + f"; SGLang, pages of 16: {sglang:3d}")

# %% [markdown]
# <details><summary>Answer</summary>
#
# A: 0 and 0. B: 64 and 70: the hashed cache stops at the last full block B shares with A (4 blocks), this engine's
# tree at the 70th token, sharing A's fifth block and copying it when B writes its own token 70. C: 96 and 99: both
# must compute C's last token, but the hashed cache recomputes its whole last block (⌊99 / 16⌋ = 6 blocks), the tree
# just the token. D: 96 and 100: A's last 4 tokens sat in a partial block, which the hashed cache never caches and
# this engine's tree does, when A finishes. That last case is a conversation's next turn: the hashed cache loses the
# previous turn's tail at every turn, on average half a block, as the slider showed. SGLang's tree with pages of 16
# serves what the hashed cache serves, 0, 64, 96 and 96: it cuts each lookup to whole pages, and A entered its tree
# as whole pages only. With pages of 1 it would serve what this engine's tree serves.
# </details>
#
# **5. What the tree evicts.** A tree of 6 blocks of 4 tokens. A trunk T of 8 tokens (two blocks) is served with
# three different 4-token endings, X, then Y, then Z (so T + X, T + Y, T + Z, one after another); then T + X once
# more; then an unrelated 12-token prompt W, which needs 3 blocks. Which blocks does W evict, and how many tokens of
# T + Y and of T + Z are still cached afterwards?

# %%
small_tree = RadixBlockManager(num_blocks=6, block_size=4)
trunk = ex_rng.integers(1000, 20000, 8).tolist()
endings = {e: ex_rng.integers(1000, 20000, 4).tolist() for e in "XYZ"}
for step, tokens in enumerate([trunk + endings["X"], trunk + endings["Y"], trunk + endings["Z"], trunk + endings["X"]]):
    serve_alone(small_tree, f"t{step}", tokens)
before = dict(small_tree.node_of)
serve_alone(small_tree, "W", ex_rng.integers(1000, 20000, 12).tolist())
print(f"evicted: {small_tree.num_evictions} blocks")
for e in "XYZ":
    print(f"T + {e}: {small_tree.num_cached_tokens(trunk + endings[e] + [7])} of 12 tokens still cached")

# %% [markdown]
# <details><summary>Answer</summary>
#
# T + X, T + Y and T + Z fill the two trunk blocks and one leaf block each: 5 blocks, 1 free. W needs 3: it takes the
# free one and evicts two leaves, least recently used first, Y's and Z's (X's was used again by the second T + X). The
# trunk's blocks are never candidates while they have children, so T + Y and T + Z still find 8 tokens, and T + X all
# 12. A hashed cache evicts blocks, not leaves, least recently released first; a block it kept whose predecessor it
# dropped could never hit, since a hit needs every block before it. What prevents that is the order of release: each
# request frees its blocks tail first (vLLM and this engine both do), so a block's predecessors always leave the queue
# after it. The tree needs no such rule: it evicts only leaves, so a trunk goes only after every branch under it.
# </details>
#
# **Lab.** [Lab 08](../labs/lab08_notebook.ipynb) has you write the hash chain and a prefix cache with
# reference counts and least-recently-used eviction, the bookkeeping of this chapter, and, optionally, the radix
# tree's match, insert and evict.
