"""hardware: the CPU is named in every benchmark, with the instruction sets that decide which forms win."""
from mini_engine.backends.cpu.autotune import Autotuner
from mini_engine.course.hardware import cpu_info, describe_machine
from mini_engine.backends.cpu import format_tuned_forms, tuned_forms

XEON = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8488C
flags\t\t: fpu sse2 avx avx2 fma avx512f avx512bw avx512_bf16 avx512_fp16 amx_bf16 amx_tile
processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8488C
"""
EPYC_AVX2 = "model name\t: AMD EPYC 7B13\nflags\t\t: fpu sse2 avx avx2 fma\n"
GRAVITON = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics sve\nCPU part\t: 0xd40\n"


def test_cpu_info_names_the_isa_extensions_that_matter():
    xeon = cpu_info(XEON)
    assert xeon.model == "Intel(R) Xeon(R) Platinum 8488C"
    assert xeon.isa == ("AVX2", "AVX-512", "AVX-512 BF16", "AVX-512 FP16", "AMX-BF16")
    assert cpu_info(EPYC_AVX2).isa == ("AVX2",)
    assert cpu_info(GRAVITON).isa == ("NEON", "SVE")
    assert "AVX-512 BF16" in str(xeon) and f"{xeon.cores} cores" in str(xeon)


def test_this_machine_is_described():
    here = cpu_info()
    assert here.model and here.cores >= 1
    machine, backend = describe_machine("cpu").splitlines()
    assert machine.startswith("CPU: ") and here.model in machine and "threads" in machine
    assert backend.startswith("CPU backend: on;") and "timed now" in backend, "the backend's state, in one line"


def test_tuned_forms_report_every_decision():
    tuner = Autotuner(forced={"product": "linear"})
    tuner.choose("product", ((8, 4), 1, "torch.float32", "cpu"), lambda: {"linear": lambda: None})
    rows = tuned_forms(tuner)
    assert rows == [{"op": "product", "case": ((8, 4), 1, "torch.float32", "cpu"), "form": "linear",
                     "times_ms": {}, "speedup": 1.0}]
    table = format_tuned_forms(tuner)
    assert "forced" in table and "(8, 4) 1 float32 cpu" in table
    assert "(8, 4)" not in format_tuned_forms(tuner, rows=16), "rows=16 shows only the 16-row bucket"
