"""Each widget builds without a kernel, redraws when a control moves, and shows the formulas' numbers."""
import ipywidgets as W
import matplotlib

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


def test_kv_memory_widget_reproduces_the_seed():
    view = View(widgets.kv_memory_widget())
    text = view.summary.value
    assert "<b>35</b> such requests fit" in text  # Llama-2-13B, 2048 tokens, 80 GiB
    assert "0.781 MiB per token" in text
    for seed_value in ("2.00", "40.00", "320.00"):  # Llama-7B at 4K, Llama-70B at 128K with 8 and 64 KV heads
        assert seed_value in text
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
    assert "2.56×" in view.summary.value  # the seed: k = 5, α = 0.7, draft 50× cheaper, 5% overhead
    assert text != view.summary.value


def test_fragmentation_widget():
    view = View(widgets.fragmentation_widget())
    assert "75%" in view.summary.value
    view.move("block", 64)


def test_prefix_cache_widget():
    view = View(widgets.prefix_cache_widget())
    assert "41×" in view.summary.value
    view.move("own tokens", 500)



def test_kv_budget_widget_reproduces_the_seed():
    view = View(widgets.kv_budget_widget())
    text = view.summary.value
    assert "fits <b>64</b> requests" in text and "<b>77%</b>" in text  # 64 reservations of 2048 in the budget
    assert "never more than block_size − 1 = 15" in text
    text = view.move("max_model_len", 4096)
    assert "fits <b>32</b> requests" in text and "<b>8.0×</b>" in text  # the seed's "up to ~8×"
    view.move("length mix", "uniform")
    view.move("block", 64)
    view.move("mean length", 1024)
    view.move("KV budget (tokens)", 1 << 20)


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
