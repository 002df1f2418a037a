"""The weight products: every form the autotuner can choose computes F.linear's result, and the tuner's
choice is deterministic once made, can be forced, and never trades the plain form for a slower one.
(Which form wins is a measurement, printed by the bench; tests only check that every choice is correct.)"""
import json

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from mini_engine.backends.cpu.attention import attention_in_fp32, run_attention
from mini_engine.backends.cpu.autotune import Autotuner, forced_from_env, row_bucket
from mini_engine.backends.cpu.products import FORMS, PACKERS, Linear, candidate_forms, choose_form, prepare_weight


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 2, 16, 200])
def test_every_candidate_form_equals_f_linear(rows, dtype, tol):
    torch.manual_seed(rows)
    layer = Linear(576, 480).to(dtype)
    x = torch.randn(rows, 576, dtype=dtype)
    expected = F.linear(x.float(), layer.weight.float())
    forms = candidate_forms((480, 576), row_bucket(rows), dtype)
    assert forms[0] == "linear", "the plain form is the first candidate: the one kept on a tie"
    for name in forms:
        got = FORMS[name](x, prepare_weight(name, layer.weight))
        assert got.dtype == dtype and got.shape == (rows, 480), name
        assert got.is_contiguous(), f"{name}: the next layer expects row-major activations"
        torch.testing.assert_close(got.float(), expected, rtol=tol, atol=tol * 10, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("form,dtype", [(f, d) for d in (torch.float32, torch.bfloat16) for f in FORMS
                                        if d != torch.float32 or not f.endswith("_fp32")])
def test_linear_computes_each_forced_form_correctly(form, dtype):
    rows = 1 if form.startswith("two_row") else 3
    tuner = Autotuner(forced={"product": form})
    layer = Linear(64, 48, tuner=tuner).to(dtype)
    x = torch.randn(rows, 64, dtype=dtype)
    # this CPU cannot run it (oneDNN's bf16 packing without AVX-512; the C kernel is fp32 and needs AVX2)
    if form not in candidate_forms((48, 64), rows, dtype):
        with pytest.raises(ValueError, match=f"forced form '{form}'"):
            layer(x)
        return
    got = layer(x)
    assert [c.form for c in tuner.choices.values()] == [form], "the forced form must be the one used"
    assert tuner.timings_run == 0, "a forced form is not timed"
    torch.testing.assert_close(got.float(), F.linear(x.float(), layer.weight.float()), rtol=1e-2, atol=1e-2)


PACKED = [f for f in PACKERS if f in candidate_forms((48, 64), 3, torch.float32)]


@pytest.mark.parametrize("form", PACKED)
def test_a_packed_form_follows_in_place_changes_of_the_weight(form):
    """A packed form runs on a packed copy of the weight: a weight changed in place (as loading a checkpoint
    into a model does) must be packed again, never leave the old copy in use."""
    layer = Linear(64, 48, tuner=Autotuner(forced={"product": form}))
    x = torch.randn(3, 64)
    layer(x)
    with torch.no_grad():
        layer.weight.mul_(-2.0)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("form", PACKED)
def test_a_copied_layer_uses_its_own_weight(form):
    import copy
    layer = Linear(64, 48, tuner=Autotuner(forced={"product": form}))
    x = torch.randn(3, 64)
    layer(x)  # packs the weight
    twin = copy.deepcopy(layer)
    with torch.no_grad():
        twin.weight.mul_(3.0)
    torch.testing.assert_close(twin(x), F.linear(x, twin.weight), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)
    assert twin.tuner is layer.tuner, "a copied layer must decide in its original's tuner, not in a private copy"


def test_a_packed_form_this_machine_cannot_run_is_left_out(monkeypatch):
    """oneDNN may lack a kernel for a dtype on some CPU or build: the tuner must then keep to the other forms
    rather than fail in the middle of a step."""
    import mini_engine.backends.cpu.products as products

    def refuse(w):
        raise RuntimeError("no oneDNN kernel here")
    monkeypatch.setitem(products.PACKERS, "onednn", refuse)
    tuner = Autotuner(repeats=1)
    form = choose_form(torch.randn(48, 64), 3, tuner)
    assert form != "onednn"
    assert "onednn" not in next(iter(tuner.choices.values())).times_ms


def test_compiled_products_reach_a_packed_form_only_through_the_custom_operator(monkeypatch):
    """torch.compile traces the products and cannot trace a packed (opaque) weight: a graph gets the tuned choice
    among the forms it can trace, where a packed form counts only through the `packed_product` operator."""
    import mini_engine.backends.cpu.products as products

    tuner = Autotuner(forced={"product": "onednn"})
    if products.onednn_available() and products._PACKED_OP is not None:
        assert choose_form(torch.randn(48, 64), 3, tuner, packed=False) == "onednn"
    monkeypatch.setattr(products, "_PACKED_OP", None)
    with pytest.raises(ValueError, match="onednn"):
        choose_form(torch.randn(48, 64), 3, Autotuner(forced={"product": "onednn"}), packed=False)


@pytest.mark.parametrize("form", PACKED)
def test_a_compiled_packed_product_runs_the_layers_own_packed_copy(form):
    """Inside a graph the packed form is the operator `packed_product`: F.linear's result, computed on the packed
    copy the layer keeps for its eager calls (no second copy), and re-packed after an in-place change."""
    import mini_engine.backends.cpu.products as products

    if products._PACKED_OP is None:
        pytest.skip("this torch cannot register the packed_product operator")
    layer = Linear(64, 48, tuner=Autotuner(forced={"product": form}))
    x = torch.randn(3, 64)
    with torch.inference_mode():
        eager = layer(x)
        packed = layer._packed[form][2]
        compiled = torch.compile(lambda x: layer(x) * 2, fullgraph=True)
        torch.testing.assert_close(compiled(x), 2 * F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)
    assert layer._packed[form][2] is packed, "the graph must run the layer's packed copy, not pack another"
    torch.testing.assert_close(eager, F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        layer.weight.mul_(3.0)
    with torch.inference_mode():
        torch.testing.assert_close(compiled(x), 2 * F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)


def test_a_layer_with_two_packed_forms_keeps_a_copy_for_each():
    """Row counts may choose different packed forms (oneDNN's for a long prefill chunk, the C kernel's for a decode
    batch): each keeps its own copy, packed once, rather than one repacking over the other on every call."""
    if len(PACKED) < 2:
        pytest.skip(f"only {PACKED} can run here")
    layer = Linear(64, 48, tuner=Autotuner())
    layer._forms.update({(rows, torch.float32): layer._packed_form(form) for rows, form in zip((3, 200), PACKED)})
    xs = {rows: torch.randn(rows, 64) for rows in (3, 200)}
    for rows, x in [*xs.items(), *xs.items()]:
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)
    copies = {form: kept[2] for form, kept in layer._packed.items()}
    assert set(copies) == set(PACKED[:2])
    layer(xs[3])
    assert all(layer._packed[f][2] is c for f, c in copies.items()), "a packed copy was made again without cause"


def test_timing_streams_the_weights_from_memory_below_the_flop_cap():
    """A form is timed on copies of the weight that together exceed the last-level cache (as a decode step
    streams every weight once) unless the pass would pass TIMING_FLOPS; at most 64."""
    from mini_engine.backends.cpu.products import TIMING_BYTES, TIMING_FLOPS, last_level_cache_bytes, timing_copies
    nbytes, macs = 576 * 3072 * 4, 576 * 3072
    for rows in (1, 16, 32, 64, 512):
        copies = timing_copies(nbytes, rows, macs)
        assert 1 <= copies <= 64
        assert copies * nbytes >= min(2 * last_level_cache_bytes(), TIMING_BYTES) or copies == 64 or \
            (copies + 1) * 2 * rows * macs > TIMING_FLOPS, f"{rows} rows: {copies} copies would sit in cache"
        assert (copies - 1) * nbytes < TIMING_BYTES, "no more copies than the byte budget needs"


def test_a_forced_form_that_does_not_apply_is_refused():
    layer = Linear(8, 8, tuner=Autotuner(forced={"product": "two_row"}))
    with pytest.raises(ValueError, match="two_row"):
        layer(torch.randn(4, 8))  # two_row computes one row


def test_choice_is_made_once_per_case_and_then_kept():
    tuner = Autotuner(repeats=2)
    w = torch.randn(32, 16)
    first = choose_form(w, 5, tuner)
    assert tuner.timings_run == 1
    for rows in (5, 6, 7, 8):  # the same bucket (8): looked up, never timed again
        assert choose_form(w, rows, tuner) == first
    assert tuner.timings_run == 1
    choose_form(w, 9, tuner)  # a new bucket (16) is a new case
    assert tuner.timings_run == 2
    choose_form(w.bfloat16(), 5, tuner)  # and so is a new dtype
    assert tuner.timings_run == 3


class FakeClock:
    """Each candidate 'takes' the time its call adds here: timing without timing."""
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@pytest.mark.parametrize("alt_cost,winner", [(0.5, "alt"), (0.99, "plain"), (2.0, "plain")])
def test_an_alternative_must_beat_the_plain_form_by_the_margin(alt_cost, winner):
    clock = FakeClock()
    tuner = Autotuner(margin=0.03, repeats=3, clock=clock)

    def cost(seconds):
        def run():
            clock.now += seconds
        return run
    got = tuner.choose("op", ("case",), lambda: {"plain": cost(1.0), "alt": cost(alt_cost)})
    assert got == winner, f"alt at {alt_cost}x the plain form's time should give {winner!r}"
    choice = tuner.choices[("op", "case")]
    assert choice.times_ms == pytest.approx({"plain": 1000.0, "alt": alt_cost * 1000.0})
    assert choice.speedup == pytest.approx(1 / alt_cost if winner == "alt" else 1.0)


def test_one_lucky_round_does_not_crown_a_form():
    """A busy machine: the alternative is slower in four rounds of five and fast in one. Its best time beats
    the plain form's, but it did not win most rounds, so the plain form stays."""
    clock = FakeClock()
    tuner = Autotuner(repeats=5, clock=clock)
    alt_costs = iter([3.0, 3.0, 0.5, 3.0, 3.0])

    def plain():
        clock.now += 1.0

    def alt():
        clock.now += next(alt_costs, 3.0)
    assert tuner.choose("op", ("busy",), lambda: {"plain": plain, "alt": alt}) == "plain"


@pytest.mark.parametrize("slow", ["plain", "alt"])
def test_a_hopeless_form_is_timed_twice_and_never_chosen(slow):
    """A form 10x slower than the other in its warm-up and first round is not timed again (a bf16 product's
    native forms on a CPU without bf16 instructions); the choice is the one full timing would make."""
    clock = FakeClock()
    tuner = Autotuner(repeats=5, clock=clock)
    calls = {"plain": 0, "alt": 0}

    def form(name):
        def run():
            calls[name] += 1
            clock.now += 10.0 if name == slow else 1.0
        return run
    got = tuner.choose("op", ("case",), lambda: {"plain": form("plain"), "alt": form("alt")})
    fast = "alt" if slow == "plain" else "plain"
    assert got == fast, f"the slow {slow} form was chosen"
    assert calls[slow] == 2, f"the hopeless form ran {calls[slow]} times: warm-up and one round are enough"
    assert calls[fast] == 6, "the other form is timed as always: warm-up and five rounds"
    assert tuner.choices[("op", "case")].times_ms == pytest.approx({slow: 10_000.0, fast: 1000.0})


def test_a_form_slow_only_at_its_warm_up_is_timed_in_full():
    """The first call may pay for allocation or packing: slow there but not in the first round is no reason to
    stop timing a form, and it wins as usual."""
    clock = FakeClock()
    tuner = Autotuner(repeats=5, clock=clock)
    alt_costs = iter([20.0])
    calls = []

    def plain():
        clock.now += 1.0

    def alt():
        calls.append(1)
        clock.now += next(alt_costs, 0.5)
    assert tuner.choose("op", ("warm",), lambda: {"plain": plain, "alt": alt}) == "alt"
    assert len(calls) == 6


def test_forms_can_be_forced_from_the_environment():
    assert forced_from_env("product=linear, attention=fp32") == {"product": "linear", "attention": "fp32"}
    assert forced_from_env("") == {}
    with pytest.raises(ValueError, match="MINI_ENGINE_FORMS"):
        forced_from_env("product")


def untimed(tuner: Autotuner) -> Autotuner:
    """Every form takes no time on this tuner's clock, so the plain one is chosen, never on a busy machine, and a
    kept choice's check keeps it: for tests about what is kept, not about which form wins on a machine that other
    tests keep busy."""
    tuner.clock = tuner.waited = lambda: 0.0
    return tuner


def test_choices_saved_by_one_tuner_start_another_without_timing(tmp_path, monkeypatch):
    """MINI_ENGINE_TUNED: a process (a server started from a notebook) begins with another's choices; a case
    the file lacks is timed as usual, and a forced op keeps its forced form."""
    import mini_engine.backends.cpu.autotune as autotune
    monkeypatch.setenv("MINI_ENGINE_TUNE_CACHE", "0")  # only the file named here, not the machine's store
    tuner = untimed(Autotuner(repeats=2))
    w = torch.randn(32, 16)
    form = choose_form(w, 5, tuner)
    tuner.choose("paged_decode", ("float32", 4, 64, torch.Size([16, 3, 64])), lambda: {"4 at a time": lambda: None})
    path = tmp_path / "tuned.json"
    tuner.save(path)
    monkeypatch.setenv("MINI_ENGINE_TUNED", str(path))
    other = autotune.tuner_from_env()
    assert choose_form(w, 7, other) == form and other.timings_run == 0, "the saved case must not be timed again"
    assert other.choose("paged_decode", ("float32", 4, 64, torch.Size([16, 3, 64])), None) == "4 at a time"
    choose_form(w, 9, other)  # a bucket the file lacks
    assert other.timings_run == 1
    monkeypatch.setenv("MINI_ENGINE_FORMS", "product=linear")
    assert choose_form(w, 5, autotune.tuner_from_env()) == "linear"
    monkeypatch.setenv("MINI_ENGINE_TUNED", str(tmp_path / "missing.json"))
    with pytest.warns(UserWarning, match="MINI_ENGINE_TUNED"):
        autotune.tuner_from_env()


def test_the_process_tuner_keeps_its_timed_choices_for_the_next_process_on_this_machine(tmp_path, monkeypatch):
    """The machine's store: what one process timed, the next starts with; a forced form is not kept; another
    thread count is another machine; MINI_ENGINE_TUNE_CACHE=0 keeps nothing."""
    import mini_engine.backends.cpu.autotune as autotune
    monkeypatch.setenv("MINI_ENGINE_CACHE", str(tmp_path))
    for name in ("MINI_ENGINE_TUNED", "MINI_ENGINE_FORMS", "MINI_ENGINE_TUNE_DIR"):
        monkeypatch.delenv(name, raising=False)
    first = untimed(autotune.tuner_from_env())
    assert first.store is not None and first.store.parent == tmp_path and not first.store.exists()
    w = torch.randn(32, 16)
    form = choose_form(w, 5, first)
    assert first.timings_run == 1 and first.store.exists(), "a timed choice must be written to the machine's store"
    second = untimed(autotune.tuner_from_env())
    assert choose_form(w, 5, second) == form and second.timings_run == 0, "the next process must not time it again"
    choose_form(w, 9, second)  # a bucket the store lacks: timed, and merged with what the file held
    third = untimed(autotune.tuner_from_env())
    assert choose_form(w, 5, third) == form and choose_form(w, 9, third) and third.timings_run == 0
    monkeypatch.setenv("MINI_ENGINE_FORMS", "product=linear")
    forced = untimed(autotune.tuner_from_env())
    choose_form(torch.randn(64, 16), 5, forced)
    monkeypatch.delenv("MINI_ENGINE_FORMS")
    third.forced = {"product": "transposed"}
    assert choose_form(w, 5, third) == "transposed", "a form forced after the case was decided must win"
    assert len(json.loads(first.store.read_text())) == 2, "a forced form says nothing about the machine: not kept"
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert autotune.machine_store() != first.store, "another thread count must time its own forms"
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setenv("MINI_ENGINE_TUNE_CACHE", "0")
    assert autotune.tuner_from_env().store is None


def test_flop_counters_see_the_product_the_model_means():
    """Under FlopCounterMode a single row is one row (no two-row form, whatever is tuned), and no timing
    runs are counted as the model's work."""
    tuner = Autotuner(forced={"product": "two_row"})
    layer = Linear(64, 48, tuner=tuner)
    with FlopCounterMode(display=False) as counter:
        layer(torch.randn(1, 64))
    assert counter.get_total_flops() == 2 * 64 * 48
    assert not tuner.choices, "nothing is tuned while FLOPs are being counted"


def test_linear_keeps_nn_linear_state_dict_names():
    assert set(Linear(4, 3).state_dict()) == {"weight"}, "no bias, same key as nn.Linear(bias=False)"


@pytest.mark.parametrize("batch,queries,context", [(1, 1, 100), (4, 1, 33), (1, 17, 17)])
def test_attention_gives_the_same_result_in_either_dtype_form(batch, queries, context):
    """bf16 attention run as bf16 or converted to fp32: equal to rounding, and the tuner picks one of them."""
    torch.manual_seed(0)
    q = torch.randn(batch, 6, queries, 16, dtype=torch.bfloat16)
    k, v = (torch.randn(batch, 2, context, 16, dtype=torch.bfloat16) for _ in range(2))

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    native, fp32 = run_attention(False, fn, q, k, v), run_attention(True, fn, q, k, v)
    assert native.dtype == fp32.dtype == torch.bfloat16
    torch.testing.assert_close(native, fp32, rtol=2e-2, atol=2e-2)
    tuner = Autotuner(repeats=1)
    assert attention_in_fp32("test", fn, q, k, v, tuner) in (True, False)
    assert [c.form for c in tuner.choices.values()][0] in ("native", "fp32")
    assert not attention_in_fp32("test", fn, q.float(), k.float(), v.float(), tuner), "fp32 has nothing to convert"
