"""Each widget builds without a kernel, redraws when a control moves, and shows the formulas' numbers."""
import io

import ipywidgets as W
import matplotlib
import pytest

matplotlib.use("Agg")

from mini_engine.course import widgets  # noqa: E402


class View:
    """Reach into a widget the way a student's mouse would: controls by their label."""

    def __init__(self, box: W.VBox):
        assert isinstance(box, W.VBox)
        panel, self.summary, self.plot, self.errors = box.children
        self.controls = {c.description: c for c in panel.children}

    def move(self, label: str, value):
        before = (self.summary.value, self.plot.value)
        self.controls[label].value = value
        assert not [o for o in self.errors.outputs if o.get("output_type") == "error"]
        assert (self.summary.value, self.plot.value) != before, f"moving {label!r} changed nothing"
        assert bytes(self.plot.value[:4]) == b"\x89PNG"
        return self.summary.value


def test_naive_cost_widget():
    view = View(widgets.naive_cost_widget())
    assert "683" in view.summary.value  # Σi²/Σi at 1024 tokens
    text = view.move("tokens", 256)
    assert "171" in text  # (2 · 256 + 1) / 3
    view.move("model", "llama-7b")


def test_roofline_widget():
    view = View(widgets.roofline_widget(peak_flops=312e12, peak_bw=2.039e12))
    assert "memory-bound" in view.summary.value
    view.move("context", 1)
    assert "compute-bound" in view.move("batch", 512)
    view.move("dtype", "fp32")


def test_kv_memory_widget_reproduces_the_textbook():
    view = View(widgets.kv_memory_widget())
    text = view.summary.value
    assert "<b>35</b> such requests fit" in text  # Llama-2-13B, 2048 tokens, 80 GiB
    assert "0.781 MiB per token" in text
    for book_value in ("2.00", "40.00", "320.00"):  # Llama-7B at 4K, Llama-70B at 128K with 8 and 64 KV heads
        assert book_value in text
    text = view.move("KV heads", 1)
    assert "0.020 MiB per token" in text  # MQA keeps one of 40 KV heads
    view.move("model", "llama-70b-gqa")
    assert view.controls["KV heads"].value == 0  # back to the new model's own heads
    assert "as trained (8)" in [label for label, _ in view.controls["KV heads"].options]
    assert "does <b>not</b> fit" in view.move("batch", 64)


def test_batching_widget():
    view = View(widgets.batching_widget(batch=8, spread=1.0, requests=64))
    text = view.move("length spread", 0.0)
    assert text.count("100%") == 2  # equal lengths: both policies keep every lane busy
    view.move("batch", 16)


def test_speculative_widget():
    view = View(widgets.speculative_widget(k=4, alpha=0.8))
    assert "3.36 tokens per target pass" in view.summary.value
    text = view.move("k", 5)
    view.move("alpha", 0.7)
    assert "2.56×" in view.summary.value  # the textbook's table: k = 5, α = 0.7, draft 50× cheaper, 5% overhead
    assert text != view.summary.value


def test_fragmentation_widget_shows_internal_and_external_fragmentation():
    view = View(widgets.fragmentation_widget())
    text = view.summary.value
    # 64 reservations of 2048 in the budget, a chat mix averaging 512: inside the textbook's "60–80%" waste.
    assert "<b>78%</b> of the reserved slots never hold a token" in text and "<b>64</b> contiguous" in text
    assert "never more than block_size − 1 = 15 per request" in text
    assert "no external fragmentation" in text  # equal reservations: a freed one always fits
    text = view.move("reserve", "per request")
    assert "<b>external fragmentation</b>" in text and "no external" not in text
    text = view.move("max_model_len", 4096)
    view.move("reserve", "max_model_len")
    view.move("length mix", "uniform")
    view.move("block", 64)
    view.move("mean length", 1024)
    view.move("KV budget (tokens)", 1 << 18)


def test_prefix_cache_widget():
    view = View(widgets.prefix_cache_widget())
    assert "41×" in view.summary.value
    view.move("own tokens", 500)



def test_prefix_cache_widget_counts_full_blocks_and_prices_ttft_on_a_roofline():
    view = View(widgets.prefix_cache_widget())
    text = view.summary.value
    assert "serves 2000 of 2050 prompt tokens" in text and "hit rate <b>97%</b>" in text
    assert "<b>13.4×</b>" in text and "memory-bound" in text  # a 50-token suffix on an A100
    text = view.move("block", 256)
    assert "serves 1792 of 2050" in text and "<b>8×</b>" in text  # 7 full blocks; 258 tokens left to compute
    view.move("block", 16)
    view.move("own tokens", 160)
    text = view.move("shared prefix", 6400)  # 400 blocks; a 160-token suffix is compute-bound on an A100
    assert "<b>41×</b>" in text and "<b>41.0×</b>" in text and "compute-bound" in text
    view.move("dtype", "fp32")


def test_block_boundary_widget_prices_whole_pages_against_a_match_at_any_token():
    view = View(widgets.block_boundary_widget())
    text = view.summary.value
    assert "pages of 16) serves 288 tokens" in text and "partial block) 300" in text and "<b>12</b> tokens lost" in text
    assert "(B − 1) / 2 = <b>7.5</b>" in text and "7,500 tokens over 1,000 matches" in text
    text = view.move("block size", 128)
    assert "serves 256 tokens" in text and "<b>44</b> tokens lost" in text and "<b>63.5</b>" in text
    assert "<b>0</b> tokens lost" in view.move("block size", 1)
    assert "<b>0</b> tokens lost" in view.move("shared prefix", 256)
    view.move("matches", 10)


# ---------------------------------------------------------------- chapter 09: the serving simulation

STEP_S = {1: 0.030, 2: 0.034, 4: 0.045, 8: 0.070, 16: 0.120}  # a CPU-like decode step: seconds per batch size


def test_step_seconds_interpolates_and_extends_the_measured_costs():
    from mini_engine.course.serving_sim import step_seconds
    assert step_seconds(STEP_S, 4) == 0.045
    assert abs(step_seconds(STEP_S, 6) - 0.0575) < 1e-12  # halfway between 4 and 8
    assert abs(step_seconds(STEP_S, 32) - 0.220) < 1e-12  # the last two points' line: 0.050 s per 8 requests
    assert step_seconds({8: 0.07}, 1) == 0.07
    for bad in ({}, {0: 0.1}, {1: 0.0}):
        with pytest.raises(ValueError, match="step_s"):
            step_seconds(bad, 1)


def test_simulated_server_one_place_no_waiting_is_the_step_cost():
    from mini_engine.course.serving_sim import simulate_load
    # Requests one hour apart never meet: each gets a batch of its own and 10 steps of 30 ms, plus its prefill.
    run = simulate_load(STEP_S, rate=1 / 3600, max_batch=4, tokens=10, prompt_s=0.2, requests=20)
    assert abs(run.ttft_p50 - 0.23) < 1e-9 and abs(run.e2e_p50 - 0.5) < 1e-9
    assert abs(run.tpot_p50 - 0.03) < 1e-9 and run.mean_batch == 1.0


def test_simulated_server_all_at_once_runs_full_batches():
    from mini_engine.course.serving_sim import capacity, simulate_load
    # 8 requests at t = 0, 4 places, 32 tokens: two full batches of 32 steps at 45 ms each.
    run = simulate_load(STEP_S, rate=float("inf"), max_batch=4, tokens=32, requests=8)
    assert run.mean_batch == 4.0
    assert abs(run.tok_s - 8 * 32 / (64 * 0.045)) < 1e-6
    assert abs(run.e2e_p99 - 64 * 0.045) < 1e-9
    assert abs(run.ttft_p99 - 33 * 0.045) < 1e-9, "the second four wait for the first batch, then take a step"
    assert abs(capacity(STEP_S, 4, 32) - 4 / (32 * 0.045)) < 1e-12
    assert abs(run.tok_s - 32 * capacity(STEP_S, 4, 32)) < 1e-6


def test_simulated_server_queues_past_its_capacity():
    from mini_engine.course.serving_sim import capacity, simulate_load
    cap = capacity(STEP_S, 4, 32)
    below, past = (simulate_load(STEP_S, f * cap, 4, 32, requests=300) for f in (0.5, 2.0))
    assert below.tok_s < past.tok_s <= 32 * cap * 1.001, "throughput levels off at the capacity"
    assert past.ttft_p50 > 20 * below.ttft_p50, "past the capacity, requests wait for a place"
    assert simulate_load(STEP_S, 2 * cap, 16, 32, requests=300).tok_s > past.tok_s, "more places, more throughput"
    for kwargs in ({"rate": 0}, {"max_batch": 0}, {"tokens": 0}, {"prompt_s": -1.0}):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            simulate_load(STEP_S, **{"rate": 1.0, "max_batch": 4, **kwargs})


def test_load_widget():
    view = View(widgets.load_widget(STEP_S, prompt_s=0.2, max_batch=4))
    assert "below its capacity" in view.summary.value and "4 places" in view.summary.value
    fastest = 10 ** view.controls["arrival rate (req/s)"].max  # a log slider's bounds are exponents
    assert "past its capacity" in view.move("arrival rate (req/s)", fastest)
    text = view.move("max batch", 64)
    assert "extrapolated" in text  # the step costs were measured up to batch 16
    view.move("tokens per request", 128)


# ---------------------------------------------------------------- chapter 10: bits per weight on the roofline

def test_quantized_ceilings_follow_the_roofline():
    from mini_engine import formulas
    from mini_engine.course.rooflines import GPU_ROOFS, Roof, quantized_decode_ceilings
    a100 = GPU_ROOFS["A100"]
    rows = {r.machine: r for r in quantized_decode_ceilings("llama-7b", 4, batch=1, context=1024)}
    assert set(rows) == set(GPU_ROOFS)
    r = rows["A100"]
    assert r.tok_s == formulas.predicted_decode_tok_s("llama-7b", 1, 1024, 2, a100.peak_flops, a100.peak_bw, 4)
    assert r.bytes_per_token == formulas.decode_bytes_per_token("llama-7b", 1, 1024, 2, 4)
    assert 3.5 < r.speedup < 4 and r.bound == "memory"  # 16 -> 4 bits: 4x the weights, less the K/V
    assert all(x.bits_at_ridge == 0 for x in rows.values()), "at batch 1 no bit count makes a GPU step compute-bound"
    # A slow-compute machine: the step turns compute-bound below some bits, and fewer bits stop paying there.
    slow = {"slow": Roof("slow", 100e9, 17e9)}
    (at4,) = quantized_decode_ceilings("llama-7b", 4, 1, 1024, roofs=slow)
    (at2,) = quantized_decode_ceilings("llama-7b", 2, 1, 1024, roofs=slow)
    assert 2 < at4.bits_at_ridge < 4 and at4.bound == "memory" and at2.bound == "compute"
    assert at2.tok_s < 1.2 * formulas.predicted_decode_tok_s("llama-7b", 1, 1024, 2, 100e9, 17e9,
                                                             at4.bits_at_ridge)
    (big,) = quantized_decode_ceilings("llama-7b", 4, 256, 1024, roofs={"A100": a100})
    assert big.speedup < 1.1, "at batch 256 the fp16 K/V reads dwarf the weights"
    for kwargs in ({"weight_bits": 0.5}, {"batch": 0}, {"context": 0}, {"kv_bytes": 0}, {"roofs": {}}):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            quantized_decode_ceilings(**{"model": "llama-7b", "weight_bits": 4, **kwargs})


def test_quant_roofline_widget():
    from mini_engine.course.rooflines import GPU_ROOFS, Roof
    view = View(widgets.quant_roofline_widget({**GPU_ROOFS, "this CPU": Roof("this CPU", 100e9, 17e9)}))
    text = view.summary.value
    for name in (*GPU_ROOFS, "this CPU"):
        assert f">{name}<" in text
    assert "3.59×" in text  # llama-7b, 4 bits against 16, batch 1, 1K context
    assert "compute" in view.move("bits per weight", 2.0)  # the slow CPU turns compute-bound below 2.2 bits
    view.move("batch", 64)
    view.move("context", 4096)
    view.move("model", "smollm2-135m")


# ---------------------------------------------------------------- chapter 11: tensor parallelism

def test_tensor_parallel_widget_prices_each_gpu_on_its_own_link():
    from mini_engine.course import interconnects as I
    view = View(widgets.tensor_parallel_widget(model="llama-70b-gqa", batch=8, ranks=4,
                                               system="A100 × NVLink 3 (NVSwitch)"))
    a100 = I.tensor_parallel_decode(I.SYSTEMS["A100 × NVLink 3 (NVSwitch)"], "llama-70b-gqa", 8, 4)
    text = view.summary.value
    # Every number the sentence states is the formula's own.
    for stated in (f"{a100.one_rank_s * 1e3:.3f} ms", f"{a100.compute_s * 1e3:.3f} ms",
                   f"{a100.communication_s * 1e3:.3f} ms", f"{a100.speedup:.2f}×", a100.all_reduce.algorithm,
                   f"{a100.all_reduce.seconds * 1e6:.1f} µs", "160 all-reduces", "312 TFLOP/s"):
        assert stated in text, stated
    # An H100 brings its own compute and bandwidth, not an A100's, and its own link.
    text = view.move("GPUs and link", "H100 × NVLink 4 (NVSwitch)")
    h100 = I.tensor_parallel_decode(I.SYSTEMS["H100 × NVLink 4 (NVSwitch)"], "llama-70b-gqa", 8, 4)
    assert h100.one_rank_s < a100.one_rank_s / 1.5
    assert f"{h100.one_rank_s * 1e3:.3f} ms" in text and "989 TFLOP/s" in text
    # Eight T4s cannot hold a 70B model's 16-bit weights; SmolLM2 on one rank exchanges nothing.
    assert "does not fit" in view.move("GPUs and link", "T4 × PCIe 3 (one host)")
    view.move("ranks", 3)
    assert "vLLM would refuse 3 ranks" in view.summary.value
    view.move("model", "smollm2-135m")
    assert "nothing to exchange" in view.move("ranks", 1)
    view.move("GPUs and link", "H100 × 2 nodes, Ethernet 100 Gb/s")
    view.move("batch", 64)


def test_the_split_is_drawn_from_the_models_own_sizes():
    from mini_engine.config import PRESETS
    from mini_engine.course.tp_drawing import draw_tensor_parallel_split, split_stages
    cfg = PRESETS["smollm2-135m"]  # 9 query heads, 3 KV heads of 64, width 576, MLP 1536, vocabulary 49152
    fig = draw_tensor_parallel_split(cfg, 3)
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert [t for t in texts if t.startswith("rank ")] == ["rank 0", "rank 1", "rank 2"]
    assert "column-parallel [320, 576]\nq heads 3…5, 1 KV head(s)" in texts  # (3 + 2 × 1) × 64 rows on rank 1
    assert sum("row-parallel [576, 512]" in t for t in texts) == 3 and any("ids 32,768…49,151" in t for t in texts)
    kinds = [s.name for s in split_stages(cfg, 3)]
    assert kinds.count("all-reduce") == 3 and kinds[-1] == "gather"
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    assert buf.getvalue()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="ranks: 2 does not divide num_heads = 9"):
        draw_tensor_parallel_split(cfg, 2)


@pytest.mark.parametrize("ranks", [2, 3, 5])
def test_the_ring_drawing_runs_the_ring(ranks):
    from mini_engine.course.ring_drawing import draw_ring_all_reduce, ring_all_reduce_steps
    steps = ring_all_reduce_steps(ranks)
    assert len(steps) == 1 + 2 * (ranks - 1)
    everyone = frozenset(range(ranks))
    halfway = steps[ranks - 1]  # after the reduce-scatter, rank r holds slice r summed over every rank
    assert all(halfway.held[r][r] == everyone for r in range(ranks))
    assert sum(cell == everyone for row in halfway.held for cell in row) == ranks
    assert all(cell == everyone for row in steps[-1].held for cell in row)
    for before, after in zip(steps, steps[1:]):  # each step every rank receives exactly one slice (1/p of the payload)
        changed = [(r, c) for r in range(ranks) for c in range(ranks) if before.held[r][c] != after.held[r][c]]
        assert sorted(r for r, _ in changed) == list(range(ranks))
    fig = draw_ring_all_reduce(ranks)
    assert len(fig.axes) == len(steps)
    with pytest.raises(ValueError, match="ranks must be >= 2"):
        ring_all_reduce_steps(1)
