"""The warp-specialized Gluon backward (``solutions/extras/ch9_gluon_ws_bwd.py``): its argument
checks on a CPU, its ahead-of-time compile for sm_90a (a producer warp, two consumer
warpgroups with setmaxnreg budgets, dQ by TMA reduce-adds, within shared memory), and the
gradient check Chapter 9's benchmark makes before timing it."""
import dataclasses
from pathlib import Path

import pytest
import torch

from flashbook import sources

from aot_compile import compile_script, too_big

ROOT = Path(__file__).resolve().parents[1]
WS = sources.course_module("extras/ch9_gluon_ws_bwd.py", ROOT)


def _dense(B=1, H=4, H_kv=2, N=40, d=64, dtype=torch.float16):
    q, do, o = (torch.randn(B, H, N, d, dtype=dtype) for _ in range(3))
    k, v = (torch.randn(B, H_kv, N, d, dtype=dtype) for _ in range(2))
    return dict(q=q, k=k, v=v, o=o, lse=torch.zeros(B, H, N), do=do)


@pytest.mark.parametrize("change, text", [
    (lambda a: dict(a, lse=a["lse"][:, :, :-1]), "lse must be float32"),
    (lambda a: dict(a, o=a["o"].float()), "o must be a contiguous tensor like q"),
    (lambda a: dict(a, do=a["do"].transpose(2, 3)), "do must be a contiguous tensor like q"),
    (lambda a: dict(a, k=a["k"][:, :1].repeat(1, 3, 1, 1),
                    v=a["v"][:, :1].repeat(1, 3, 1, 1)), "H_kv dividing q's 4 heads"),
    (lambda a: dict(a, v=a["v"][:, :1].contiguous()), "k and v must be"),
    (lambda a: dict(a, k=a["k"].bfloat16(), v=a["v"].bfloat16()), "H_kv dividing"),
    (lambda a: dict(a, q=a["q"].float()), "is not supported"),
    (lambda a: dict(a, q=a["q"][..., :48].contiguous()), "head dim d=48"),
    (lambda a: dict(a, config=WS.WsBwdConfig(96, 2)), "is not supported"),
    (lambda a: dict(a, config=(64, 2)), "must be a WsBwdConfig"),
    (lambda a: dict(a, softmax_scale=-1.0), "positive finite"),
    (lambda a: a, "needs an sm_90 GPU"),
], ids=["lse", "o dtype", "do strides", "heads", "k vs v", "k dtype", "q dtype", "head dim", "tile",
        "config type", "scale", "cpu"])
def test_ws_backward_names_the_bad_argument(change, text):
    """Every argument is checked on the host before a GPU is touched; a good call (grouped
    heads included) on a CPU machine says it needs sm_90."""
    with pytest.raises(ValueError, match=text):
        WS.ws_backward(**change(_dense()))


def test_ws_config_at_d128_is_the_one_that_fits():
    """At d = 128 a 128-row tile or a third ring slot overflows registers or shared memory, at
    any d a 128-row tile with a third slot overflows shared memory (Triton's "out of resource"
    on an H100 otherwise); at d = 64 the default is the fastest measured, masked or not."""
    assert WS.ws_bwd_config(128) == WS.ws_bwd_config(128, causal=True) == WS.WsBwdConfig(64, 2)
    assert WS.ws_bwd_config(64) == WS.WsBwdConfig(64, 2)
    assert WS.ws_bwd_config(64, causal=True) == WS.WsBwdConfig(64, 4)
    with pytest.raises(ValueError, match="only"):
        WS.ws_backward(**_dense(d=128), config=WS.WsBwdConfig(64, 3))
    for stages in (3, 4):
        with pytest.raises(ValueError, match="128-row tiles with two slots only"):
            WS.ws_backward(**_dense(d=64), config=WS.WsBwdConfig(128, stages))


AOT_SCRIPT = r'''
ws = sources.course_module("extras/ch9_gluon_ws_bwd.py")
res = []
for d, dtype, causal, group in ((128, torch.float16, False, 1), (128, torch.bfloat16, True, 4),
                                (64, torch.float16, True, 1), (64, torch.bfloat16, False, 2)):
    c = ws.compile_for_sm90(d, dtype, causal=causal, group=group)
    ptx = c.asm["ptx"]
    res.append(dict(d=d, causal=causal, cc=90, shared=c.metadata.shared,
                    reduces=ptx.count("cp.reduce.async.bulk.tensor"),
                    wgmma=ptx.count("wgmma.mma_async"),
                    tma_loads=ptx.count("cp.async.bulk.tensor") - ptx.count("cp.reduce"),
                    setmaxnreg=sorted({int(l.split()[-1].rstrip(";")) for l in ptx.splitlines()
                                       if "setmaxnreg" in l}),
                    named_barriers=sorted({l.split()[1].rstrip(",;") for l in ptx.splitlines()
                                           if l.strip().startswith("bar.sync")})))
print("RESULT" + json.dumps(res))
'''


@pytest.mark.slow
def test_ws_backward_compiles_for_h100_within_shared_memory(tmp_path):
    """d = 64 and 128, causal and not, grouped heads: PTX for sm_90a with the producer's and
    the consumers' register budgets, every dQ share added by a TMA reduce, and the consumers'
    barriers named barriers of their own warpgroup (a CTA-wide one would wait forever)."""
    res = compile_script(AOT_SCRIPT, tmp_path, ptx_only_for=(90,))
    assert len(res) == 4
    for row in res:
        assert row["reduces"] >= 1 and row["wgmma"] > 0 and row["tma_loads"] >= 1, row
        assert {24, 240} <= set(row["setmaxnreg"]), row
        assert "0" in row["named_barriers"] and len(row["named_barriers"]) >= 2, row
    assert not too_big(res), f"configs that do not fit shared memory: {too_big(res)}"


def _bench_run(monkeypatch, grads_of):
    """Chapter 9's benchmark on one tiny CPU case with SDPA, the forward and every timing
    faked: only the warp-specialized row's setup runs, its kernel returning ``grads_of(want)``.
    Returns the notes of that row's setup (or the exception it raised)."""
    from flashbook.chapters.ch9 import benchmark
    want = tuple(torch.randn(1, 2, 16, 16) for _ in range(3))
    notes = []

    def row(kernel, role, setup, *a):
        if kernel == "ch9_bwd_gluon_ws":
            try:                      # as bench_setups.measure: a failure becomes a note
                notes.append(setup()[1])
            except Exception as e:    # noqa: BLE001
                notes.append(e)
        return kernel
    fake = type("M", (), dict(ws_backward=staticmethod(lambda *a, **kw: grads_of(want))))
    monkeypatch.setattr(benchmark, "_row", row)
    monkeypatch.setattr(benchmark, "public_row", lambda *a: "public")
    monkeypatch.setattr(benchmark, "sdpa_grads_fn", lambda *a: (None, want))
    monkeypatch.setattr(benchmark, "_dense_forward", lambda *a: (None, None))
    monkeypatch.setattr(sources, "course_module", lambda rel, *a: fake)
    monkeypatch.setattr(sources, "solution_namespace", lambda chapter: {})
    benchmark.run(((1, 2, 16, 16, torch.float32, True, ("bwd",)),), device="cpu")
    return notes


def test_the_benchmark_checks_the_ws_gradients_against_sdpa(monkeypatch):
    """``flashbook bench ch9`` times ``ch9_bwd_gluon_ws`` only after its gradients matched
    SDPA's at the benchmark's inputs; a wrong dK stops the whole run, naming the kernel."""
    from flashbook.chapters.ch9 import benchmark
    notes = _bench_run(monkeypatch, lambda want: tuple(w * (1 + 1e-3) for w in want))
    assert len(notes) == 1 and "max|dQ,dK,dV-sdpa_cudnn|" in notes[0], notes
    with pytest.raises(benchmark.WrongGradients, match="ch9_bwd_gluon_ws: dK differs"):
        _bench_run(monkeypatch, lambda want: (want[0], want[1] * 1.1, want[2]))
    with pytest.raises(benchmark.WrongGradients, match="dV"):
        _bench_run(monkeypatch, lambda want: (want[0], want[1], want[2] * float("nan")))


def test_ws_switches_are_constexprs_of_the_kernel():
    """Every WsBwdConfig switch reaches the kernel (an ablation that changed nothing would time
    the same kernel twice): longest-first, the late dQ wait and the register budgets."""
    cfg = WS.ws_bwd_config(128)
    default = WS._constexprs(cfg, 128)
    for switch in ("longest_first", "dq_wait_late", "setmaxnreg"):
        flipped = dataclasses.replace(cfg, **{switch: not getattr(cfg, switch)})
        other = WS._constexprs(flipped, 128)
        assert other != default and other["HEAD_DIM"] == 128, switch
    assert set(default) <= set(WS.ws_bwd_kernel.arg_names)


def test_the_ablation_turns_off_every_switch_of_the_config():
    """``ch9_ws_bwd_bench.py --ablation`` (the record Section 7's ablation comes from) times each
    boolean switch of WsBwdConfig off in turn: a switch added to the kernel but not to the
    ablation would go unmeasured."""
    bench = sources.course_module("extras/ch9_ws_bwd_bench.py", ROOT)
    switches = {f.name for f in dataclasses.fields(WS.WsBwdConfig) if f.type in (bool, "bool")}
    assert switches and set(bench.SWITCHES) == switches
    assert bench.WS.WsBwdConfig is not None and bench.ABLATION_SHAPE[-1] == 128


def test_the_recorded_ablation_checked_every_variant_and_names_where_it_ran():
    """The committed ablation (``data/ws_bwd/h100.json``, written by ch9_ws_bwd_bench.py on a
    GPU): every variant timed had its gradients checked against fp32 first, and the record says
    on what, with which versions and by which command."""
    import json
    record = json.loads((ROOT / "src/flashbook/data/ws_bwd/h100.json").read_text())
    prov = record["provenance"]
    assert prov["gpu"].startswith("NVIDIA") and prov["driver"] and prov["git_commit"]
    assert "ch9_ws_bwd_bench.py" in prov["command"] and "--ablation" in prov["command"]
    assert {r["causal"] for r in record["rows"]} == {False, True}
    for row in record["rows"]:
        timed = {k for k in row["tflops"] if k not in ("cudnn",) and not k.startswith("one kernel")}
        assert timed and timed <= set(row["max_rel_err"])
        assert max(row["max_rel_err"].values()) < 1e-2


def test_the_quoted_ablation_figures_follow_the_record(tmp_path, monkeypatch):
    """Section 7's ch9_ws_* figures come from the ablation record: none without one; with a
    record whose every timing is scaled by its own factor, every figure moves; two GPUs' records
    are refused (the prose quotes one)."""
    import json
    from flashbook.chapters.ch9 import ws_recorded
    real = json.loads((ROOT / "src/flashbook/data/ws_bwd/h100.json").read_text())
    monkeypatch.setattr(ws_recorded, "DATA_DIR", tmp_path)
    assert ws_recorded.record() is None
    (tmp_path / "h100.json").write_text(json.dumps(real))
    before = ws_recorded.values(ws_recorded.record())
    causal = next(r for r in real["rows"] if r["causal"])
    assert before["ch9_ws_one_kernel_causal"] == causal["tflops"][
        "one kernel, no warp specialization"]
    for i, row in enumerate(real["rows"]):
        for j, variant in enumerate(row["tflops"]):
            row["tflops"][variant] *= 1 + (10 * i + j + 1) / 128
    (tmp_path / "h100.json").write_text(json.dumps(real))
    after = ws_recorded.values(ws_recorded.record())
    assert set(after) == set(before)
    assert [k for k in before if k != "ch9_ws_gpu" and after[k] == before[k]] == []
    (tmp_path / "h200.json").write_text(json.dumps(real))
    with pytest.raises(ValueError, match="several GPUs"):
        ws_recorded.record()


def test_the_quoted_profile_figures_are_read_from_the_stored_profiles(tmp_path):
    """Section 7's profile figures (ch9_profile_ws_*, ch9_profile_fwd_*) are the stored Nsight
    Compute reports' numbers: each moves when its report's line does, and a report without the
    line is refused by name."""
    import re
    import shutil
    from flashbook.chapters.ch9 import ws_recorded
    before = ws_recorded.profile_values()
    assert before["ch9_profile_ws_pipe_noncausal"] == float(re.search(
        r"Shared is the highest-utilized pipeline \(([\d.]+)%\)",
        (ws_recorded.PROFILES / "ch9_ws_bwd_h100_noncausal_ncu.txt").read_text()).group(1))
    for path in ws_recorded.PROFILES.glob("ch*_h100_*_ncu.txt"):
        shutil.copy(path, tmp_path)
    for path in tmp_path.iterdir():             # every figure of every report, plus one
        text = re.sub(r"(pipeline \(|No Eligible\s+%\s+|Spilling Requests\s+)([\d.,]+)",
                      lambda m: m.group(1) + str(float(m.group(2).replace(",", "")) + 1),
                      path.read_text())
        path.write_text(text)
    after = ws_recorded.profile_values(tmp_path)
    assert [k for k in before if after[k] == before[k]] == []
    report = tmp_path / "ch6_fa3_fwd_h100_noncausal_ncu.txt"
    report.write_text(report.read_text().replace("No Eligible", "No"))
    with pytest.raises(ValueError, match="ch6_fa3_fwd_h100_noncausal_ncu.txt has no no_eligible"):
        ws_recorded.profile_values(tmp_path)
