"""`python -m mini_engine ...` in process: each generate mode streams its tokens and reports its speed, and
contradictory or bad flags exit with status 2 and a message naming them."""
import pytest
import torch

from mini_engine.__main__ import build_parser, main, with_default_dtype


@pytest.mark.parametrize("flags,kind", [(["--naive"], "naive (no cache)"), ([], "KV cache,"),
                                        (["--compile"], "KV cache, compiled step")])
def test_generate_streams_and_reports_its_mode(capsys, flags, kind):
    main(["generate", "Name a color.", "--max-tokens", "3", *flags])
    out = capsys.readouterr().out
    assert "3 tokens in" in out and kind in out, f"generate {flags} printed:\n{out}"
    if "--compile" in flags:
        assert "compiled the decode step in" in out, "the one-time compile should be reported apart"


def test_generate_with_int4_weights(capsys):
    main(["generate", "Name a color.", "--max-tokens", "3", "--quantization", "int4"])
    assert "3 tokens in" in capsys.readouterr().out


@pytest.mark.parametrize("argv,named", [
    (["generate", "hi", "--naive", "--compile"], "--naive and --compile"),
    (["bench", "--rung", "cached", "--rung", "continuous"], "one-stream rungs"),
    (["bench", "--workload", "serving", "--batch", "0"], "--batch"),
    (["bench", "--workload", "paging", "--rung", "continuous"], "takes no --rung"),
    (["bench", "--workload", "paging", "--max-model-len", "1"], "--max-model-len"),
    (["bench", "--ladder", "--rung", "cached"], "takes no --rung"),
    (["bench", "--ladder", "--requests", "0"], "--requests"),
    (["bench", "--workload", "server", "--rate", "0"], "rate"),
    (["bench", "--workload", "prefix", "--quantization", "int4"], "--quantization adds rows"),
    (["bench", "--workload", "radix", "--scale", "0"], "--scale"),
    (["bench", "--workload", "radix", "--num-kv-blocks", "0"], "--num-kv-blocks"),
    (["bench", "--workload", "radix", "--rung", "cached"], "no --rung"),
    (["generate", "hi", "--quantization", "int3"], "--quantization"),
    (["bench", "--ladder", "--quantization", "int4"], "not --ladder"),
])
def test_bad_flags_exit_2_with_a_message(capsys, argv, named):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err


@pytest.mark.parametrize("capability,expected", [((7, 5), "float16"), ((8, 0), "bfloat16"), ((9, 0), "bfloat16")],
                         ids=["sm75", "sm80", "sm90"])
def test_the_dtype_defaults_to_the_devices(monkeypatch, capability, expected):
    """No --dtype: float32 on a CPU; on a GPU what mini_engine.default_dtype says (fp16 on a T4). A --dtype given
    is kept."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    for command in (["demo"], ["generate", "hi"], ["bench"], ["serve"]):
        def dtype(*flags):
            return with_default_dtype(build_parser().parse_args([*command, *flags])).dtype
        assert dtype("--device", "cuda") == expected, command
        assert dtype("--device", "cpu") == "float32", command
        assert dtype("--device", "cuda", "--dtype", "float32") == "float32", command


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for a GPU this machine has")
def test_a_gpu_this_machine_lacks_exits_2_naming_the_device(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--device", "cuda"])
    assert exit_info.value.code == 2 and "--device cuda" in capsys.readouterr().err
