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
# # Lab 08 · Prefix caching: hash chains, shared blocks, LRU eviction, a radix tree
#
# Open `labs/lab08_prefix_caching.py` and fill in the functions marked `TODO`: `hash_block` and `block_hashes`
# (the hash chain), then `allocate`, `free`, `release`, `lookup`, `cache_full_blocks` and `admit` of `PrefixCache`,
# and last `match`, `insert`, `lock`, `unlock` and `evict` of `RadixBlockTree`, SGLang's radix tree over the KV blocks.
# This notebook hashes a few prompts with your code, serves a stream of requests that share a system prompt
# through your cache and checks its hits against the closed form in `mini_engine.course.formulas`, shrinks the pool
# until least-recently-used eviction starts to cost hits, turns hits into time to first token, serves requests
# with the real engine running on your cache, then a conversation on your radix tree, and then runs the grader, the
# same tests CI runs against the reference solution:
#
#     pytest tests/labs/test_lab08.py --impl=labs
#
# Re-run the notebook after each edit (the first cell reloads your module).

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

    course_setup.install(home, lab=True)

# %%
import importlib
from pathlib import Path

ROOT = Path.cwd().parent if Path.cwd().name == "labs" else Path.cwd()
sys.path.insert(0, str(ROOT))
import labs.lab08_prefix_caching as lab

importlib.reload(lab)  # pick up your latest edits

import matplotlib.pyplot as plt
import numpy as np
from IPython.display import display

from mini_engine import formulas

from mini_engine.course import widgets


def attempt(part, fn):
    """Run one part of the lab; say which TODO is still open instead of stopping the notebook."""
    try:
        return fn()
    except NotImplementedError as err:
        print(f"{part}: not implemented yet: {err}")
        return None


# %% [markdown]
# ## 1. A hash names a whole prefix
# A toy tokenizer (one id per word) is enough to see the chain. Two chat requests open with the same system
# prompt. Cut into blocks of 4 tokens, their blocks hash alike up to the first block where they differ, and
# differently from there on: the hash of block i covers block i − 1's hash, so it stands for all the tokens up
# to the end of block i. That is what the cache needs, since a block's keys and values depend on every token
# before it. The question's last tokens fill only part of a block: that block gets no hash yet.

# %%
BLOCK_SIZE = 4
vocab: dict[str, int] = {}


def tokenize(text):
    return [vocab.setdefault(word, len(vocab)) for word in text.split()]


SYSTEM = ("system: you are a patient tutor for a course on serving language models . answer in two sentences , "
          "define every term you use and end with one question that checks understanding . user :")
QUESTIONS = ["what is a kv cache ?", "why is decode memory bound ?", "what does a block table hold ?",
             "what is a kv cache for ?", "why do long prompts prefill fast ?", "what is paged attention ?"]
prompts = [tokenize(f"{SYSTEM} {q}") for q in QUESTIONS]
print(f"system prompt: {len(tokenize(SYSTEM))} tokens; prompts of {[len(p) for p in prompts]} tokens")


def show_chain():
    for q, prompt in zip(QUESTIONS[:2], prompts[:2]):
        hashes = lab.block_hashes(prompt, BLOCK_SIZE)
        print(f"{q!r:32} {len(prompt)} tokens, {len(hashes)} full blocks:", " ".join(h.hex()[:4] for h in hashes))
    repeated = tokenize("a b c d")
    first, second = (lab.block_hashes(tokenize(start) + repeated, BLOCK_SIZE)[1] for start in ("w x y z", "z y x w"))
    print("the block 'a b c d' after 'w x y z' and after 'z y x w':", first.hex()[:8], second.hex()[:8])


attempt("the hash chain", show_chain)

# %% [markdown]
# ## 2. A stream of requests through your cache
# The six requests arrive one after another. Each is admitted (its cached blocks first, fresh ones after), its
# prefill writes the rest of its prompt and registers its full blocks, and it finishes. The formula counts
# what a perfect cache serves: the full blocks of the longest prefix the request shares with any earlier one,
# never the last token (`formulas.cached_prefix_tokens`). With a pool large enough to keep everything, your
# cache must serve exactly that.

# %%
def shared_with_earlier(prompts):
    """For each prompt, its longest common prefix with any earlier prompt (0 for the first)."""
    def common(a, b):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n
    return [max((common(p, q) for q in prompts[:i]), default=0) for i, p in enumerate(prompts)]


def serve(prompts, num_blocks, cache_class=None):
    """Serve `prompts` one at a time through a fresh cache (yours by default); the cached tokens of each."""
    cache = (cache_class or lab.PrefixCache)(num_blocks, BLOCK_SIZE)
    cached = []
    for prompt in prompts:
        blocks, num_cached = cache.admit(prompt)
        cache.cache_full_blocks(prompt, blocks)  # after the prefill step has written the prompt's KV
        cache.release(blocks)
        cached.append(num_cached)
    assert cache.num_available() == num_blocks, "blocks still held after every request finished"
    return cached


shared = shared_with_earlier(prompts)
predicted = formulas.cached_prefix_tokens(np.array([len(p) for p in prompts]), np.array(shared), BLOCK_SIZE)
measured = attempt("serve the stream", lambda: serve(prompts, num_blocks=64))
if measured:
    print(f"{'question':38} tokens  shared  cached (yours)  cached (formula)")
    for q, p, s, m, f in zip(QUESTIONS, prompts, shared, measured, predicted):
        print(f"{q!r:38} {len(p):6} {s:7} {m:15} {f:17}")
    hit_rate = sum(measured) / sum(len(p) for p in prompts)
    print(f"hit rate: yours {100 * hit_rate:.1f}%, formula "
          f"{100 * formulas.prefix_hit_rate([len(p) for p in prompts], shared, BLOCK_SIZE):.1f}%")
    print("your cache serves what the formula predicts:", list(measured) == list(predicted))

# %% [markdown]
# The fourth question repeats the first one's opening words, "what is a kv cache", so it hits a block beyond
# the system prompt; the block after the system prompt's end holds both its last tokens and the question's first,
# so two prompts share it only when their questions start alike.
#
# ## 3. A pool too small to keep everything
# Now two assistants with different system prompts take turns, each request with its own question: prompts of
# 40 and 29 tokens, 10 and 8 blocks. With 17 blocks or more both system prompts stay cached beside the running
# request. Below that, each new request must evict someone's blocks, and the least recently used belong to the
# other assistant's prompt. Which of them go first matters: `release` frees a table's last block first, so the
# tail of a prompt is evicted before its head, and a request still hits the blocks that are left. Freeing the
# head first (the subclass below) keeps tails whose prefix is gone, which no lookup can ever reach.

# %%
other = "system: act as a terse code reviewer . point out one bug per answer and suggest a fix in one line . user :"
stream = [tokenize(f"{SYSTEM if i % 2 == 0 else other} question {i} about blocks ?") for i in range(40)]
pools = np.arange(10, 25)  # 10 blocks: the longer prompt alone


class HeadFirst(lab.PrefixCache):
    """Your cache, except that a finished request's blocks are freed first block first."""

    def release(self, block_ids):
        for block in block_ids:
            self.free(block)


def hit_rates(cache_class=None):
    tokens = sum(len(p) for p in stream)
    return np.array([sum(serve(stream, int(n), cache_class)) / tokens for n in pools])


rates = attempt("the pool sweep", lambda: (hit_rates(), hit_rates(HeadFirst)))
if rates:
    fig, ax = plt.subplots(figsize=(7, 3))
    ax.plot(pools, 100 * rates[0], "o-", label="release: last block first (yours)")
    ax.plot(pools, 100 * rates[1], "s--", label="first block first")
    ax.set(xlabel="pool size (blocks)", ylabel="hit rate (%)", title="two system prompts taking turns, LRU eviction")
    ax.legend()
    plt.tight_layout()
    plt.show()
    for n in (12, 15, 17):
        i = list(pools).index(n)
        print(f"{n} blocks: hit rate {100 * rates[0][i]:.0f}% freeing the tail first, {100 * rates[1][i]:.0f}% the head first")

# %% [markdown]
# ## 4. From hits to time to first token
# A hit saves the prefill of the cached tokens, but the request still computes its own tokens, and they attend
# to the whole prefix. The textbook's claim, that caching a shared prefix "cuts TTFT ~40×", is the FLOP ratio of a
# 2000-token system prompt and 50-token questions: (2000 + 50) / 50 = 41. The roofline adds a caveat: on a GPU
# a 50-token prefill is memory-bound (it reads every weight for only 50 tokens), so the time ratio is smaller;
# on a CPU, whose ridge point is a few FLOP per byte, it is the full 41×.

# %%
machines = [("A100, fp16 (312 TFLOP/s, 2.04 TB/s)", 2, 312e12, 2.039e12), ("2-core CPU, fp32 (60 GFLOP/s, 17 GB/s)", 4, 60e9, 17e9)]
flop_ratio = formulas.prefix_cache_savings(2000, 50, 1000, "llama-2-13b", block_size=16).ttft_ratio
print(f"Llama-2-13B, 2000 + 50 tokens, blocks of 16: prefill FLOPs without / with a hit = {flop_ratio:.0f}x")
for name, dtype_bytes, peak_flops, peak_bw in machines:
    without, with_hit = formulas.prefix_cache_ttft("llama-2-13b", 2000, 50, dtype_bytes, peak_flops, peak_bw, 16)
    print(f"  {name:40} TTFT {without:8.3g} s -> {with_hit:8.3g} s: {without / with_hit:4.1f}x")

# %% [markdown]
# Move the sliders: the block size decides how much of a prefix that is not a whole number of blocks is reused,
# and a longer suffix makes its prefill compute-bound again, where the two ratios meet.

# %%
display(widgets.prefix_cache_widget())

# %% [markdown]
# ## 5. Your cache serves requests
# `EngineBlockManager` (given, in your lab file) runs the engine's paged pool and prefix cache on your
# `PrefixCache` and your hashes: a new request takes its cached blocks through your `lookup`, every other block
# through your `allocate`, registers its full blocks with your `cache_full_blocks`, and gives them back with your
# `release`. The engine takes it through a hook, `LLM(..., block_manager=lab.EngineBlockManager)`. Chapter 08's
# workload: a bicycle shop's long system prompt and short questions behind it, served one at a time, on the
# engine's own block manager and then on yours. The tokens, and the prompt tokens each request finds cached,
# must be the same; the time to first token shows what the hits save.

# %%
import mini_engine as me
from mini_engine.engine import LLM

model, tok = me.load_model("smollm2-135m", device="cpu", dtype="float32")
rules = [f"Rule {i}: when a customer asks about item {i}, check the stock list, give the price in euros, "
         f"mention the warranty of {i % 3 + 1} years and offer a test ride if the item is a bicycle." for i in range(24)]
shop = "You are the assistant of a bicycle shop. Follow these rules.\n" + "\n".join(rules)
asks = ["Do you fix flat tyres?", "Are you open on Sunday?", "How much is a new chain?", "Can I rent a bike?"]
shop_prompts = [tok.encode(tok.apply_chat_template([{"role": "system", "content": shop},
                                                    {"role": "user", "content": q}])) for q in asks]


def serve_shop(block_manager=None):
    llm = LLM.from_model(model, tok, block_manager=block_manager, block_size=16, max_num_seqs=4,
                         max_model_len=max(map(len, shop_prompts)) + 16)
    return [llm.generate([p], me.SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)[0]
            for p in shop_prompts]


yours = attempt("the engine on your cache", lambda: serve_shop(lab.EngineBlockManager))
if yours:
    engine_own = serve_shop()
    print(f"{'question':28} {'prompt':>6} {'cached (yours)':>14} {'cached (engine)':>15} {'TTFT (yours)':>12}")
    for q, p, a, b in zip(asks, shop_prompts, engine_own, yours):
        print(f"{q:28} {len(p):6} {b.num_cached_tokens:14} {a.num_cached_tokens:15} {b.metrics.ttft_s * 1e3:9.0f} ms")
    same = all(a.token_ids == b.token_ids and a.num_cached_tokens == b.num_cached_tokens
               for a, b in zip(engine_own, yours))
    print("same tokens and the same hits as the engine's own cache:", same)

# %% [markdown]
# ## 6. Your radix tree serves a conversation
# SGLang's RadixAttention keeps its prefix cache as a radix tree instead of a map of hashes. Your `RadixBlockTree` is
# such a tree over the engine's real blocks: each node owns one full block, a prompt's cached blocks are the path its
# tokens walk down from the root (`match`), a request's computed blocks are hung in the tree as its steps write them
# (`insert`), a running request locks the path it uses so that no node of it is evicted (`lock`, `unlock`: SGLang's
# `lock_ref`), and when the pool runs dry the least recently used unlocked leaf goes (`evict`), so a trunk that many
# branches share outlives them. The given rest of the class turns the engine's calls into yours, and the engine runs
# it as it runs the hashed cache: `LLM(..., block_manager=lab.RadixBlockTree)`.
#
# A chat client sends the whole history every turn. Below, one user holds a conversation; each turn's prompt is the
# previous prompt, the answer the engine gave and the next question, as token ids. It is served three times: on the
# engine's own hashed blocks, on your tree, and on the engine's own tree (`prefix_cache="radix"`). Your tree matches
# whole blocks, so it must find exactly what the hashed blocks find. The engine's tree
# (mini_engine/prefix/radix_cache.py) also shares a partly matched last block and copies it on the first write, so
# it finds a little more each turn; SGLang itself matches any token at a page size of 1 and rounds down to whole
# pages above that.

# %%
def turn(question):
    """A user turn in the chat template's markup, after the previous answer's tokens."""
    return tok.encode(f"<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")


chat_questions = ["What is a bicycle derailleur?", "How do I adjust it?", "And if the chain still skips?",
                  "Which tools do I need?"]


def chat(**engine_kwargs):
    """The conversation on one engine: every turn's output, and the engine's block manager at the end."""
    llm = LLM.from_model(model, tok, block_size=16, max_num_seqs=1, max_model_len=512, **engine_kwargs)
    prompt = tok.encode(tok.apply_chat_template([{"role": "system", "content": shop[:400]},
                                                 {"role": "user", "content": chat_questions[0]}]))
    outs = []
    for question in chat_questions:
        if outs:
            prompt = list(outs[-1].prompt_token_ids) + outs[-1].token_ids + turn(question)
        outs.append(llm.generate([prompt], me.SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)[0])
    return outs, llm.engine.scheduler.blocks


on_your_tree = attempt("the engine on your radix tree", lambda: chat(block_manager=lab.RadixBlockTree))
if on_your_tree:
    (yours, your_tree), (hashed, _) = on_your_tree, chat()
    radix, _ = chat(prefix_cache="radix")
    print(f"{'turn':>4} {'prompt':>6} {'cached: yours':>13} {'hashed':>7} {'engine tree':>11}")
    for t, (a, b, c) in enumerate(zip(yours, hashed, radix), 1):
        print(f"{t:4} {len(a.prompt_token_ids):6} {a.num_cached_tokens:13} {b.num_cached_tokens:7} "
              f"{c.num_cached_tokens:11}")
    print("same tokens as the engine's own, every turn:",
          all(a.token_ids == b.token_ids == c.token_ids for a, b, c in zip(yours, hashed, radix)))
    print("your tree finds what the hashed blocks find:",
          [a.num_cached_tokens for a in yours] == [b.num_cached_tokens for b in hashed])
    nodes = your_tree.node_of.values()
    print(f"your tree at the end: {len(your_tree.node_of)} nodes (blocks), "
          f"{sum(n.lock_ref > 0 for n in nodes)} locked, {len(your_tree.evictable)} evictable, "
          f"{your_tree.num_evictions} evictions")

# %% [markdown]
# Every later turn finds the previous turns, answers included: the tree hangs each full block in as soon as a step
# has written it. What it misses is the previous turn's last partial block and the block boundary's remainder; that
# gap, at most a block per turn, is what the engine's tree wins back by sharing the partly matched block. When the
# conversation ends nothing is locked any more: every node is evictable, and stays cached until the pool needs its
# block.
#
# ## 7. Grade
# The grader prints one line per test; a failing test says what to fix.

# %%
import pytest

code = pytest.main([str(ROOT / "tests/labs/test_lab08.py"), "--impl=labs", "-q", "--no-header",
                    "-p", "no:cacheprovider", "--rootdir", str(ROOT)])
print("all tests pass: well done!" if code == 0 else "some tests still fail: read the messages above")
