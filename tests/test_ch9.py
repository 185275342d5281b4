"""Chapter 9's own tests (the contract tests in test_chapters.py run its exercises, stubs and
known-wrong variants): the launchers' argument errors, the tiled PyTorch backward and the
assembled kernel backward against float64 autograd, determinism, the bytes saved for the
backward, the training run, the benchmark's FLOP count, and the kernels compiling ahead of time
for sm_75 and sm_90 within shared memory."""
from pathlib import Path

import pytest
import torch

from flashbook import sources
from flashbook.cases import AttnCase
from flashbook.chapters import ch9

from aot_compile import compile_script, too_big

ROOT = Path(__file__).resolve().parents[1]
ONE_KERNEL = sources.course_module("extras/ch9_one_kernel.py", ROOT)
GLUON = sources.course_module("extras/ch9_gluon_bwd.py", ROOT)


@pytest.fixture(scope="module")
def solution():
    return sources.solution_namespace("ch9", ROOT)


def _inputs(case, seed=0):
    return ch9.backward_inputs(case, seed)


@pytest.mark.parametrize("causal", [False, True])
def test_tiled_backward_matches_autograd(solution, causal):
    case = AttnCase("t", seqlens=(21, 0, 9), seqlens_k=(13, 2, 9), H_q=4, H_kv=2, d=8,
                    causal=causal, dtype=torch.float64, scale=0.4)
    q, k, v, do, o, lse, want = _inputs(case)
    got = solution["tiled_backward_packed"](q, k, v, o, lse, do, case.cu_seqlens(),
                                            case.cu_seqlens(True), causal, 0.4)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-6)   # LSE is float32


def test_kernel_backward_matches_autograd_and_is_deterministic(solution):
    case = AttnCase("t", seqlens=(30, 5), seqlens_k=(18, 5), H_q=4, H_kv=1, d=16, causal=True)
    q, k, v, do, o, lse, want = _inputs(case, 3)
    args = (q, k, v, o, lse, do, case.cu_seqlens(), case.cu_seqlens(True), 30, 18, True)
    first, second = solution["attention_backward"](*args), solution["attention_backward"](*args)
    for a, b, w in zip(first, second, want):
        assert torch.equal(a, b)
        torch.testing.assert_close(a.double(), w, atol=1e-4, rtol=1e-4)


def test_function_trains_like_sdpa_on_dense_inputs(solution):
    """The dense wrapper through the Function gives SDPA's gradients (fp32, causal GQA)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 20, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 2, 20, 16, generator=g, requires_grad=True) for _ in range(2))
    o = solution["flash_attention"](q, k, v, causal=True)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                             enable_gqa=True)
    torch.testing.assert_close(o, want, atol=1e-5, rtol=1e-5)
    do = torch.randn(o.shape, generator=g)
    got = torch.autograd.grad(o, (q, k, v), do)
    ref = torch.autograd.grad(want, (q, k, v), do)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_training_losses_agree_with_sdpa(solution):
    attn = solution["flash_attention"]
    ours = ch9.train(lambda q, k, v: attn(q, k, v, causal=True), 3, batch=2)
    base = ch9.train(ch9.sdpa_attention, 3, batch=2)
    assert ours[0] > ours[-1] and max(abs(a - b) for a, b in zip(ours, base)) < 1e-4


def test_function_saves_linear_memory(solution):
    table = ch9.saved_bytes_table(solution["flash_attention"], lengths=(512,))
    ratio = int(table.splitlines()[-1].split("|")[-2].strip().rstrip("x"))
    assert ratio > 20, table


@pytest.mark.parametrize("change, text", [
    (dict(lse=lambda t: t[:, :-1].contiguous()), "lse must be"),
    (dict(do=lambda t: t[:-1]), "need do like q"),
    (dict(do=lambda t: t.half()), "share a dtype"),
    (dict(q=lambda t: t.bfloat16(), k=lambda t: t.bfloat16(), v=lambda t: t.bfloat16(),
          do=lambda t: t.bfloat16()), "bf16"),
    (dict(k=lambda t: torch.cat([t, t[:, :1]], 1), v=lambda t: torch.cat([t, t[:, :1]], 1)),
     "multiple of h_kv"),
])
def test_launchers_name_the_bad_argument(solution, change, text):
    case = AttnCase("t", seqlens=(10,), H_q=4, H_kv=2, d=16)
    q, k, v, do, o, lse, _ = _inputs(case)
    args = dict(q=q, k=k, v=v, do=do, lse=lse, delta=lse.clone())
    args.update({n: f(args[n]) for n, f in change.items()})
    for launch, kernel, n in ((ch9.launch_dkdv, "bwd_dkdv_kernel", 10),
                              (ch9.launch_dq, "bwd_dq_kernel", 10)):
        with pytest.raises(ValueError, match=text):
            launch(solution[kernel], *args.values(), case.cu_seqlens(), case.cu_seqlens(True),
                   n, causal=False)


def test_bwd_flops_and_configs():
    f = ch9.benchmark.bwd_flops(1, 16, 16384, 128, False, "bwd")
    assert f == 2.5 * 4 * 16 * 16384 ** 2 * 128
    assert ch9.benchmark.bwd_flops(1, 16, 16384, 128, True, "fwdbwd") == 3.5 / 2.5 * f / 2
    assert ch9.bwd_config("dq", 16, torch.float32, None).BLOCK_M == 16
    with pytest.raises(ValueError, match="dkdv"):
        ch9.bwd_config("dv", 128, torch.float16, (9, 0))


@pytest.mark.parametrize("case", [
    AttnCase("GQA, causal, packed", seqlens=(17, 33), seqlens_k=(20, 33), H_q=4, H_kv=2, d=16,
             causal=True),
    AttnCase("packed, an empty sequence, N_q > N_k", seqlens=(9, 0, 30), seqlens_k=(5, 3, 30),
             H_q=2, d=16, causal=True, scale=0.3),
    AttnCase("fp16, non-causal", seqlens=(40,), H_q=2, d=32, dtype=torch.float16),
], ids=lambda c: c.name)
def test_fused_backward_matches_autograd(case):
    """The one-kernel backward (``solutions/extras/ch9_one_kernel.py``; scalar atomics in the
    interpreter) gives the float64 gradients, packed sequences and empty rows included."""
    q, k, v, do, o, lse, want = _inputs(case, 5)
    got = ONE_KERNEL.fused_backward(q, k, v, o, lse, do, case.cu_seqlens(), case.cu_seqlens(True),
                                   max(case.seqlens), max(case.seqlens_k or case.seqlens),
                                   case.causal, case.scale)
    tol = 1e-2 if case.dtype == torch.float16 else 1e-4
    for name, g, w in zip(("dQ", "dK", "dV"), got, want):
        assert g.dtype == case.dtype, name
        torch.testing.assert_close(g.double(), w, atol=tol, rtol=tol, msg=name)


def test_fused_backward_names_the_bad_argument():
    case = AttnCase("t", seqlens=(10,), H_q=4, H_kv=2, d=16)
    q, k, v, do, o, lse, _ = _inputs(case)
    cu = case.cu_seqlens()
    with pytest.raises(ValueError, match="must be shaped like q"):
        ONE_KERNEL.fused_backward(q, k, v, o[:-1], lse, do, cu, cu, 10, 10)
    with pytest.raises(ValueError, match="lse must be"):
        ONE_KERNEL.fused_backward(q, k, v, o, lse[:1].contiguous(), do, cu, cu, 10, 10)
    with pytest.raises(ValueError, match="contiguous"):
        ONE_KERNEL.launch_fused(q, k, v, do.transpose(0, 1).contiguous().transpose(0, 1), lse,
                               lse.clone(), cu, cu, 10, causal=False)


def test_forward_takes_bf16_only_where_chapter_5s_kernels_are_right():
    """Chapter 9's forward lets bf16 through to Chapter 5's launch on a GPU of compute
    capability 8.0 or newer only (a bf16 ``tl.dot`` is wrong in the CPU interpreter), by
    argument: Chapter 5's own launch still refuses it."""
    from flashbook.chapters import ch5
    case = AttnCase("t", seqlens=(12,), H_q=2, d=16)
    q, k, v = (t.bfloat16() for t in _inputs(case)[:3])
    cu = case.cu_seqlens()
    with pytest.raises(ValueError, match="bf16 needs a GPU"):
        ch9.forward(q, k, v, cu, cu, 12, 12)
    with pytest.raises(ValueError, match="dtype"):
        ch5.validate_packed(q, k, v, cu, cu, 12, 12)
    ch5.validate_packed(q, k, v, cu, cu, 12, 12, dtypes=(torch.bfloat16,))


def test_forward_is_the_packages_generated_chapter5_kernel(solution):
    """``ch9.forward`` launches the package's copy of Chapter 5's two-tile kernel (generated
    from its solution: no checkout needed), and agrees with the float64 reference."""
    import sys
    from flashbook import gqa_kernels as forward_kernels
    forward_module = sys.modules["flashbook.chapters.ch9.forward"]
    assert "sources" not in vars(forward_module)
    case = AttnCase("t", seqlens=(17, 0, 30), seqlens_k=(20, 4, 30), H_q=4, H_kv=1, d=16,
                    causal=True)
    q, k, v, do, o, lse, _ = _inputs(case)
    got_o, got_lse = ch9.forward(q, k, v, case.cu_seqlens(), case.cu_seqlens(True), 30, 30,
                                 causal=True)
    torch.testing.assert_close(got_o.double(), o.double(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_lse, lse, atol=1e-5, rtol=1e-5)
    assert forward_kernels.attn_gqa_two_tiles.fn.__module__ == forward_kernels.__name__


# ------------------------------------------- tensors made where the inputs are (a GPU's 'cuda')

def test_tiled_backward_makes_its_tensors_on_the_inputs_device(solution):
    """On the 'meta' device (shapes only), as on a GPU, an index tensor made on the CPU beside
    inputs on another device fails: the tiled backward makes its tensors on q's device."""
    case = AttnCase("t", seqlens=(21, 9), seqlens_k=(13, 9), H_q=4, H_kv=2, d=8, causal=True)
    q, k, v, do, o, lse, _ = _inputs(case)
    meta = [t.to("meta") for t in (q, k, v, o, lse, do)]
    for causal in (False, True):
        got = solution["tiled_backward_packed"](*meta, case.cu_seqlens(), case.cu_seqlens(True),
                                                causal)
        assert [(g.device.type, g.shape) for g in got] == [("meta", t.shape) for t in (q, k, v)]


class _LaunchSpy:
    """A stand-in for a student's Triton kernel: ``kernel[grid](*args)`` records the device of
    every tensor argument; ``fn`` carries a real function for the stub check."""
    def __init__(self, devices):
        self.devices, self.fn = devices, _LaunchSpy.__init__

    def __getitem__(self, grid):
        return lambda *args, **kw: self.devices.append(
            {a.device.type for a in args if isinstance(a, torch.Tensor)})


def test_checks_hand_student_code_tensors_on_the_inputs_device(monkeypatch, capsys):
    """The graded checks with their inputs on the 'meta' device (the stand-in for a GPU):
    every kernel launch gets cu_seqlens beside q, and the training run puts its model there.
    (Values are not compared: meta tensors have none.)"""
    import sys
    import types
    from flashbook import cases
    from flashbook.chapters.ch9 import checks
    train = sys.modules["flashbook.chapters.ch9.train"]       # ch9.train is its function
    fake = types.SimpleNamespace(device="meta", capability=(9, 0), gpu=True)
    monkeypatch.setattr(cases, "current", lambda: fake)      # backward_inputs: on 'meta'
    monkeypatch.setattr(checks, "current", lambda: fake)     # no CPU guard; the model's device
    for name in ("assert_close", "_compare", "no_nan"):
        monkeypatch.setattr(checks, name, lambda *a, **kw: None)
    devices = []
    checks.check_preprocess(_LaunchSpy(devices))
    checks.check_dkdv(_LaunchSpy(devices), _LaunchSpy(devices))
    checks.check_dq(_LaunchSpy(devices), _LaunchSpy(devices))
    assert devices and all(d == {"meta"} for d in devices), devices
    trained = []
    monkeypatch.setattr(train, "train", lambda *a, device="cpu", **kw: trained.append(device)
                        or [0.0] * a[1])

    class Through(torch.autograd.Function):       # one node over q, k, v, as the check asks
        @staticmethod
        def forward(ctx, q, k, v):
            return q * 1.0

        @staticmethod
        def backward(ctx, do):
            return do, None, None

    def dense(q, k, v, causal=False, softmax_scale=None, layout="bhnd", return_lse=False):
        lse = q.new_empty(q.shape[:3] if layout == "bhnd" else (q.shape[0], q.shape[2],
                                                                  q.shape[1]))
        o = Through.apply(q, k, v)
        return (o, lse) if return_lse else o
    checks.check_training(dense)
    assert trained == ["meta", "meta"]
    assert "PASSED" in capsys.readouterr().out


def test_the_notebook_benchmark_reads_nothing_of_the_checkout(monkeypatch):
    """The benchmark cell (``ch9.benchmark.run(ns=globals())``) times the student's backward
    and the SDPA baselines only: the one-kernel designs of solutions/extras (course material,
    absent from a student's install) are for ``flashbook bench ch9``."""
    from flashbook.chapters.ch9 import benchmark

    def checkout(*a, **kw):
        raise AssertionError("the benchmark read the checkout")
    timed = []
    monkeypatch.setattr(benchmark, "_row", lambda kernel, *a: timed.append(kernel))
    monkeypatch.setattr(benchmark, "public_row", lambda row, fn, call: timed.append("public"))
    monkeypatch.setattr(benchmark, "sdpa_grads_fn", checkout)        # no SDPA run here
    monkeypatch.setattr(sources, "course_module", checkout)
    monkeypatch.setattr(sources, "solution_namespace", checkout)
    case = ((1, 2, 16, 16, torch.float32, False, ("bwd", "fwdbwd")),)
    benchmark.run(case, device="cpu", ns={"attention_backward": None})
    assert not [k for k in timed if "atomic" in k or "fused" in k or "gluon" in k], timed
    assert "ch9_bwd" in timed and "ch9_fwdbwd" in timed
    assert timed[timed.index("ch9_fwdbwd") + 1] == "public"         # the step as a reader writes it
    timed.clear()
    monkeypatch.setattr(sources, "solution_namespace", lambda chapter: {})
    benchmark.run(case, device="cpu")                                 # flashbook bench ch9
    assert {"ch9_bwd_atomic", "ch9_bwd_fused", "ch9_bwd_gluon", "ch9_bwd_gluon_ws"} <= set(timed)


def _dense(B=1, H=2, N=40, d=64, dtype=torch.float16):
    q, k, v, do, o = (torch.randn(B, H, N, d, dtype=dtype) for _ in range(5))
    return q, k, v, o, torch.zeros(B, H, N), do


@pytest.mark.parametrize("change, text", [
    (lambda a: dict(a, lse=a["lse"][:, :, :-1]), "lse must be float32"),
    (lambda a: dict(a, o=a["o"].float()), "o must be a contiguous tensor like q"),
    (lambda a: dict(a, do=a["do"].transpose(2, 3)), "do must be a contiguous tensor like q"),
    (lambda a: dict(a, k=a["k"][:, :1].contiguous()), "k and v must be"),
    (lambda a: dict(a, q=a["q"].float()), "must share a dtype"),
    (lambda a: dict(a, config=GLUON.GluonBwdConfig(64, 96, 2)), "is not supported"),
    (lambda a: dict(a, config=(32, 128, 3)), "must be a GluonBwdConfig"),
    (lambda a: dict(a, softmax_scale=-1.0), "positive finite"),
    (lambda a: a, "needs an sm_90 GPU"),
], ids=["lse", "o dtype", "do strides", "heads", "q dtype", "tile", "config type", "scale",
        "cpu"])
def test_gluon_backward_names_the_bad_argument(change, text):
    """The Gluon backward (``solutions/extras/ch9_gluon_bwd.py``) checks every argument on
    the host before it touches a GPU: on a CPU machine a good call says it needs sm_90."""
    q, k, v, o, lse, do = _dense()
    args = change(dict(q=q, k=k, v=v, o=o, lse=lse, do=do))
    with pytest.raises(ValueError, match=text):
        GLUON.gluon_backward(**args)


AOT_SCRIPT = r'''
import re
from flashbook.chapters.ch9 import bwd_config
fused = sources.course_module("extras/ch9_one_kernel.py")
ns = sources.solution_namespace("ch9")
T = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
res = []
for cc, dtype, d in ((75, torch.float16, 128), (90, torch.float16, 128), (90, torch.bfloat16, 64)):
    ty = "*" + T[dtype]
    ptr = dict(Q=ty, K=ty, V=ty, DO=ty, O=ty, DK=ty, DV=ty, DQ=ty, LSE="*fp32", Delta="*fp32",
               CU_Q="*i32", CU_K="*i32", sm_scale="fp32", qk_scale="fp32")
    for kernel, which in (("bwd_dkdv_kernel", "dkdv"), ("bwd_dq_kernel", "dq")):
        k = ns[kernel]
        cfg = bwd_config(which, d, dtype, (cc // 10, cc % 10))
        const = dict(CAUSAL=True, GROUP=2, HEAD_DIM=d, BLOCK_M=cfg.BLOCK_M,
                     BLOCK_N=cfg.BLOCK_N, DOT_PRECISION="tf32")
        c = triton.compile(ASTSource(fn=k, signature=signature(k, ptr, const), constexprs=const),
                           target=GPUTarget("cuda", cc, 32),
                           options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
        res.append(dict(kernel=kernel, cc=cc, d=d, dtype=T[dtype], shared=c.metadata.shared))
# the one-kernel backward with dQ reduced by the TMA (the Hopper path the interpreter lacks)
cfg = fused.fused_config(128, torch.float16, (9, 0))
k = fused.bwd_fused_kernel
const = dict(CAUSAL=True, GROUP=2, DQ_TMA=True, LOAD_TMA=False, HEAD_DIM=128,
             BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, DOT_PRECISION="tf32")
ptr = dict(Q="*fp16", K="*fp16", V="*fp16", DO="*fp16", DK="*fp16", DV="*fp16",
           DQ=f"tensordesc<fp32[{cfg.BLOCK_M}, 128]>", LSE="*fp32", Delta="*fp32",
           CU_Q="*i32", CU_K="*i32", sm_scale="fp32", qk_scale="fp32")
c = triton.compile(ASTSource(fn=k, signature=signature(k, ptr, const), constexprs=const),
                   target=GPUTarget("cuda", 90, 32),
                   options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
res.append(dict(kernel="bwd_fused_kernel", cc=90, d=128, dtype="fp16", shared=c.metadata.shared,
                reduces=c.asm["ptx"].count("cp.reduce.async.bulk.tensor"),
                atomics=len(re.findall(r"(?<![\w.])(?:red|atom)\.global", c.asm["ptx"]))))
# the Gluon one-kernel backward, at its default tiles (sm_90 only)
gluon = sources.course_module("extras/ch9_gluon_bwd.py")
for d, dtype, cfg in ((128, torch.float16, None), (64, torch.bfloat16, None),
                      (128, torch.float16, gluon.GluonBwdConfig(32, 64, 2))):
    c = gluon.compile_for_sm90(d, dtype, causal=True, config=cfg)
    ptx = c.asm["ptx"]
    res.append(dict(kernel="gluon_bwd", cc=90, d=d, dtype=T[dtype], shared=c.metadata.shared,
                    reduces=ptx.count("cp.reduce.async.bulk.tensor"),
                    wgmma=ptx.count("wgmma.mma_async"),
                    atomics=len(re.findall(r"(?<![\w.])(?:red|atom)\.global", ptx))))
print("RESULT" + json.dumps(res))
'''


@pytest.mark.slow
def test_kernels_compile_for_t4_and_h100_and_fit_shared_memory(tmp_path):
    """Every tile config ``bwd_config`` picks, the fused kernel's TMA path and the Gluon
    backward: a cubin for the T4, PTX for the H100 (its shared memory is known once LLVM lowers
    the kernel). The one-kernel forms add dQ by TMA reduces, never by scalar atomics."""
    res = compile_script(AOT_SCRIPT, tmp_path, ptx_only_for=(90,))
    assert len(res) == 10
    for row in res[-4:]:
        assert row["reduces"] >= 1 and row["atomics"] == 0, row
    assert all(row["wgmma"] > 0 for row in res[-3:]), res[-3:]
    assert not too_big(res), f"configs that do not fit shared memory: {too_big(res)}"


def test_recorded_figures_need_their_rows():
    """The quoted figures come from the record; a record without a row they quote is an
    error that names it, not a sentence with a hole."""
    from flashbook import results
    rows = results.recorded("ch9").rows
    got = ch9.recorded.quoted_values(rows)
    assert got["ch9_fused_ms"] < got["ch9_atomic_ms"], got       # the TMA reduce beats atomics
    for kernel in ("ch9_bwd_fused", "ch9_bwd_gluon"):
        with pytest.raises(ValueError, match=kernel):
            ch9.recorded.quoted_values([r for r in rows if r.kernel != kernel])
    assert "ours/sdpa_cudnn" in ch9.recorded.summary(rows)


def test_profile_figures_are_read_from_the_profile(tmp_path):
    """Section 7's Nsight Compute figures come from the stored profile: other numbers in the
    file give other figures, and a profile without one of them is an error naming it."""
    real = ch9.recorded.profile_metrics()
    assert 0 < real["tensor"] < 100 and 0 < real["no_eligible"] < 100, real
    text = ch9.recorded.PROFILE.read_text()
    fake = tmp_path / "p.txt"
    fake.write_text(text.replace(f"pipeline ({real['tensor']:.1f}%)", "pipeline (81.2%)"))
    assert ch9.recorded.profile_metrics(fake) == {**real, "tensor": 81.2}
    fake.write_text(text.replace("No Eligible", "Not Eligible"))
    with pytest.raises(ValueError, match="no_eligible"):
        ch9.recorded.profile_metrics(fake)


def test_the_benchmarks_training_step_is_the_chapters_call_with_autograd():
    from flashbook.chapters.ch9 import benchmark
    ns = sources.solution_namespace("ch9", ROOT)
    g = torch.Generator().manual_seed(3)
    q, k, v, do = (torch.randn(1, 2, 24, 16, generator=g) for _ in range(4))
    dq, dk, dv = benchmark.training_step(ns, q, k, v, do, True)()
    leaves = tuple(t.double().requires_grad_() for t in (q, k, v))
    want = torch.autograd.grad(ch9.dense_attention(*leaves, causal=True)[0], leaves, do.double())
    for got, ref in zip((dq, dk, dv), want):
        torch.testing.assert_close(got.double(), ref, atol=2e-4, rtol=2e-4)


def _dense_qkv(layout, how, g, B=2, H_q=4, H_kv=2, N_q=12, N_k=20, d=16):
    """q, k, v in ``layout``: as allocated, or transposed from the other layout (the batch
    then folds the other way), or with a strided last dimension (copied)."""
    def one(H, N):
        shape = (B, H, N, d) if layout == "bhnd" else (B, N, H, d)
        if how == "allocated":
            return torch.randn(shape, generator=g)
        if how == "transposed":
            return torch.randn(shape[0], shape[2], shape[1], d, generator=g).transpose(1, 2)
        return torch.randn(*shape, 2, generator=g)[..., 0]           # last stride 2
    return one(H_q, N_q), one(H_kv, N_k), one(H_kv, N_k)


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("how", ["allocated", "transposed", "strided"])
def test_the_forward_without_autograd_gives_the_functions_values(solution, layout, how):
    g = torch.Generator().manual_seed(7)
    q, k, v = _dense_qkv(layout, how, g)
    attn = solution["flash_attention"]
    leaves = tuple(t.clone().requires_grad_() for t in (q, k, v))
    o_fn, lse_fn = attn(*leaves, True, 0.3, layout=layout, return_lse=True)
    assert o_fn.grad_fn is not None                                  # through the Function
    for _ in range(2):                                               # its plan, then again
        o, lse = attn(q, k, v, True, 0.3, layout=layout, return_lse=True)
        assert o.grad_fn is None and torch.equal(o, o_fn.detach()) and torch.equal(lse, lse_fn)
    with torch.no_grad():
        assert torch.equal(attn(*leaves, True, 0.3, layout=layout), o_fn.detach())
    qb, kb, vb = (t if layout == "bhnd" else t.transpose(1, 2) for t in (q, k, v))
    want, want_lse = ch9.dense_attention(qb.double(), kb.double(), vb.double(), 0.3, True)
    got = o if layout == "bhnd" else o.transpose(1, 2)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout, how", [("bhnd", "allocated"), ("bhnd", "transposed"),
                                         ("bnhd", "allocated"), ("bnhd", "transposed")])
def test_the_dense_wrapper_hands_the_kernel_the_callers_tensors(solution, layout, how):
    """No copy of q, k, v on the dense path: the forward kernel's launch gets tensors that start
    at the caller's data pointers (a view's), with and without autograd, first call and
    remembered plan alike."""
    from flashbook import plans
    g = torch.Generator().manual_seed(8)
    q, k, v = _dense_qkv(layout, how, g)
    attn = solution["flash_attention"]
    for inputs in ((q, k, v), tuple(t.detach().requires_grad_() for t in (q, k, v))):
        for _ in range(2):
            with plans.recorded_launches() as made:
                attn(*inputs, True, layout=layout)
            assert len(made) == 1
            assert [t.data_ptr() for t in made[0][1][:3]] == [t.data_ptr() for t in (q, k, v)]


def test_packed_views_fold_the_batch_where_the_strides_allow(solution):
    g = torch.Generator().manual_seed(9)
    q, k, v = _dense_qkv("bhnd", "allocated", g)
    *views, S = ch9.packed_views(q, k, v)
    assert S == 1 and views[0].shape == (12, 8, 16)                  # one sequence, B*h heads
    q, k, v = _dense_qkv("bnhd", "allocated", g)
    *views, S = ch9.packed_views(q, k, v, "bnhd")
    assert S == 2 and views[0].shape == (24, 4, 16)                  # B sequences
    q, k, v = _dense_qkv("bhnd", "strided", g)
    *views, S = ch9.packed_views(q, k, v)
    assert S == 2 and all(t.is_contiguous() for t in views)          # copied
    with pytest.raises(ValueError, match="layout"):
        ch9.packed_views(q, k, v, "bshd")


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
def test_an_empty_batch_is_refused_with_the_reason(solution, layout):
    """B = 0: no packed view of zero rows keeps N, so O could not be given back in q's shape;
    the dense calls refuse it with a ValueError that says so (not a division by zero)."""
    g = torch.Generator().manual_seed(10)
    q, k, v = (t[:0] for t in _dense_qkv(layout, "allocated", g))
    with pytest.raises(ValueError, match="the batch is empty"):
        ch9.packed_views(q, k, v, layout)
    with pytest.raises(ValueError, match="the batch is empty"):
        solution["flash_attention"](q, k, v, False, None, layout=layout)


@pytest.fixture
def fresh_plans(monkeypatch):
    """Chapter 9's remembered forwards and packings emptied for one test, and every call of
    Chapter 5's launch, its argument checks and ``packed_views``' packing counted."""
    import collections
    import sys
    from flashbook.plans import Plans
    forward_module = sys.modules["flashbook.chapters.ch9.forward"]
    dense_module = sys.modules["flashbook.chapters.ch9.dense"]
    monkeypatch.setattr(forward_module, "_PLANS", Plans(), raising=False)
    monkeypatch.setattr(dense_module, "_PACKINGS", Plans(), raising=False)
    monkeypatch.setattr(dense_module, "_PLANS", Plans(), raising=False)
    calls = collections.Counter()

    def counted(name, f):
        def call(*args, **kwargs):
            calls[name] += 1
            return f(*args, **kwargs)
        return call
    for module, name in ((forward_module, "launch_gqa"), (forward_module, "validate_packed"),
                         (dense_module, "_packing")):
        monkeypatch.setattr(module, name, counted(name, getattr(module, name)))
    return calls


@pytest.mark.parametrize("values", [False, True])
def test_the_training_call_checks_and_plans_once_per_metadata(solution, fresh_plans, values):
    """The call a training step makes (inputs that require grad) runs Chapter 5's checks, its
    launch and ``packed_views``' packing on its first call with inputs of this metadata only;
    a later one launches the remembered kernel, and its backward packs by the remembered
    recipe. Where values are checked (CPU mode, the graded checks) this holds too: a dense
    call's offsets are the package's own (``dense_offsets``), right by construction."""
    from flashbook.launcher import check_values
    attn = solution["flash_attention"]
    g = torch.Generator().manual_seed(11)
    dense = tuple(torch.randn(2, 2, 13, 16, generator=g) for _ in range(3))
    with check_values(values):
        for step in range(3):
            leaves = tuple(t.clone().requires_grad_() for t in dense)   # a new step's tensors
            o = attn(*leaves, causal=True)
            o.sum().backward()
            assert all(t.grad is not None for t in leaves)
            assert fresh_plans["launch_gqa"] == fresh_plans["_packing"] == 1
            assert fresh_plans["validate_packed"] == 1


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
def test_autograd_records_one_node_for_the_training_call(solution, layout):
    """The dense call that autograd records is one node, the dense Function's, whose inputs
    are the caller's leaves: no view, transpose or permute node between them (each is host
    time on every training step; the packing happens inside the Function)."""
    g = torch.Generator().manual_seed(13)
    leaves = tuple(t.requires_grad_() for t in _dense_qkv(layout, "allocated", g))
    o, lse = solution["flash_attention"](*leaves, True, None, layout=layout, return_lse=True)
    assert type(o.grad_fn).__name__ == "DenseFlashAttentionFnBackward"
    assert [type(f).__name__ for f, _ in o.grad_fn.next_functions] == ["AccumulateGrad"] * 3
    assert not lse.requires_grad


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("how", ["allocated", "transposed", "strided"])
def test_the_remembered_training_call_gives_the_first_calls_bits(solution, fresh_plans,
                                                                  layout, how):
    """O, the LSE and the gradients of the training call through the remembered launch and
    packing are bit for bit those of its first call, which runs Chapter 5's launch and its
    checks (the path every call took before plans were remembered)."""
    attn = solution["flash_attention"]
    g = torch.Generator().manual_seed(12)
    q, k, v = _dense_qkv(layout, how, g, B=2, H_q=4, H_kv=2, N_q=11, N_k=19)
    do = torch.randn(q.shape, generator=g)
    runs = []
    for _ in range(3):
        leaves = tuple(t.clone().requires_grad_() for t in (q, k, v))
        o, lse = attn(*leaves, True, 0.3, layout=layout, return_lse=True)
        runs.append((o.detach(), lse, *torch.autograd.grad(o, leaves, do)))
    assert fresh_plans["launch_gqa"] == 1
    for again in runs[1:]:
        assert all(torch.equal(a, b) and a.stride() == b.stride() for a, b in zip(runs[0], again))


def test_dense_offsets_are_kept_except_those_made_while_a_graph_is_captured():
    """A training step's offsets are a dict lookup; one made during a CUDA graph's capture is
    filled only when the graph replays, so it is not kept (one kept before is read by it)."""
    from flashbook.check import simulated_capture
    kept = ch9.dense_offsets(3, 29, torch.device("cpu"))
    assert kept.tolist() == [0, 29, 58, 87]
    assert ch9.dense_offsets(3, 29, torch.device("cpu")) is kept
    with simulated_capture():
        assert ch9.dense_offsets(3, 29, torch.device("cpu")) is kept
        during = ch9.dense_offsets(5, 31, torch.device("cpu"))
    assert ch9.dense_offsets(5, 31, torch.device("cpu")) is not during
