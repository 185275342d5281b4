"""The benchmarks' shared measurer and setups, on the CPU: a failing setup is a row that says
why, the rates follow the arguments, and a chapter kernel is timed without its checks."""
import pytest
import torch

from flashbook import bench_setups as bs


def _ns():
    """A solution namespace as the chapters' are: a wrapper calling its validator."""
    calls = []
    src = '''
def validate_decode(x):
    calls.append("checked")
    if x < 0:
        raise ValueError("x must be >= 0")

def decode(x):
    validate_decode(x)
    return (torch.full((2,), float(x)),)
'''
    ns = {"calls": calls, "torch": torch}
    exec(compile(src, "<solution>", "exec"), ns)
    return ns, calls


def test_quiet_makes_the_validators_no_ops_and_leaves_the_namespace_alone():
    ns, calls = _ns()
    fast = bs.quiet(ns)["decode"]
    assert fast(-1)[0].tolist() == [-1.0, -1.0] and calls == []       # no check ran
    with pytest.raises(ValueError, match="x must be"):
        ns["decode"](-1)                                               # the original checks


def test_ours_checks_one_call_then_times_the_unchecked_one(monkeypatch):
    ns, calls = _ns()
    fn, note = bs.ours(ns, "decode", (3,), check=lambda o: f"got {o[0].item():g}")()
    assert note == "got 3" and calls == ["checked"]
    assert fn()[0].tolist() == [3.0, 3.0] and calls == ["checked"]
    ns["opaque"] = lambda x: (torch.zeros(1),)    # not defined in the namespace: kept as is
    _, note = bs.ours(ns, "opaque", (1,))()
    assert note == "timed with its argument checks"


def test_measure_gives_rates_from_its_arguments_and_a_failure_as_a_note(monkeypatch):
    monkeypatch.setattr(bs, "timed_ms", lambda fn: (fn() or 2.0, ""))
    monkeypatch.setattr(bs, "gpu_peak", lambda: None)
    cols = dict(B=1, H_q=4, H_kv=2, N_q=1, N_k=1024, d=64, dtype=torch.float16, causal=True)
    r = bs.measure("k", "reference", lambda: ((lambda: None), "checked"), flops=4e9,
                   nbytes=8e6, note="n", **cols)
    assert (r.ms, r.tflops, r.gbps, r.dtype, r.H_kv, r.N_k) == (2.0, 2.0, 4.0, "float16", 2, 1024)
    assert r.note == "n; checked" and r.pct_peak is None
    ceiling = bs.measure("hbm_read", "baseline", lambda: ((lambda: None), ""), flops=0,
                         nbytes=8e6, **cols)
    assert ceiling.tflops is None and ceiling.gbps == 4.0

    def refused():
        raise RuntimeError("refused: no kernel for d=64")
    failed = bs.measure("sdpa_cudnn", "baseline", refused, flops=1.0, nbytes=1.0, **cols)
    assert failed.ms is None and failed.tflops is None and "no kernel for d=64" in failed.note


def test_arithmetic_of_the_decode_rows():
    assert bs.cu_seqlens([3, 0, 5]).tolist() == [0, 3, 3, 8]
    assert bs.cu_seqlens([3]).dtype == torch.int32
    assert bs.decode_flops(2, 8, 1, 100, 64) == 4 * 2 * 8 * 100 * 64
    assert bs.kv_bytes(2, 100, 4, 64) == 2 * 2 * 100 * 4 * 64 * 2
    assert bs.err_note("cuDNN", torch.ones(3))(torch.ones(3) * 1.5) == "max|O-cuDNN|=5.0e-01"
    assert bs.err_note("cuDNN", None)(torch.ones(3)) == ""
    assert bs.max_err(torch.ones(2), torch.ones(3)) != bs.max_err(torch.ones(2), torch.ones(3))


@pytest.mark.parametrize("error, says", [
    (RuntimeError("refused: cuDNN needs d <= 256\nsecond line"), "RuntimeError: refused: cuDNN"),
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 40 GiB"), "out of memory"),
    (ModuleNotFoundError("No module named 'jax'"), "ModuleNotFoundError: No module named 'jax'"),
])
def test_a_failure_is_one_line_of_the_rows_note(error, says):
    failed = bs.measure("k", "variant", bs.refused_setup(error), flops=1.0, nbytes=1.0, B=1,
                        H_q=1, N_q=1, d=64, dtype=torch.float16, causal=False, note="cfg")
    assert failed.note.startswith("cfg; not measured: " + says) and "second" not in failed.note


def test_a_failure_without_a_message_says_where_it_was_raised():
    def setup():
        raise AssertionError            # what a bare assert raises (no message)
    failed = bs.measure("k", "variant", setup, flops=1.0, nbytes=1.0, B=1, H_q=1, N_q=1, d=64,
                        dtype=torch.float16, causal=False)
    assert failed.note.startswith("not measured: AssertionError at test_bench_setups.py:")
    assert failed.note.endswith("(raise AssertionError            # what a bare assert raises "
                                "(no message))")


def test_the_check_flags_an_error_past_its_tolerance():
    note = bs.err_note("cuDNN", torch.zeros(3), tolerance=0.1)
    assert note(torch.zeros(3) + 0.05) == "max|O-cuDNN|=5.0e-02"
    assert note(torch.ones(3)) == "max|O-cuDNN|=1.0e+00 WRONG (> 0.1)"
    assert note(torch.full((3,), float("nan"))).endswith("WRONG (> 0.1)")
