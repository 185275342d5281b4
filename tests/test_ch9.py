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


AOT_SCRIPT = r'''
from flashbook.chapters.ch9 import bwd_config
ns = sources.solution_namespace("ch9")
res = []
for cc, dtype, d in ((75, torch.float16, 128), (90, torch.float16, 128)):
    ty = "*fp16" if dtype == torch.float16 else "*bf16"
    ptr = dict(Q=ty, K=ty, V=ty, DO=ty, O=ty, DK=ty, DV=ty, DQ=ty, LSE="*fp32", Delta="*fp32",
               CU_Q="*i32", CU_K="*i32", sm_scale="fp32", qk_scale="fp32")
    for kernel, which in (("bwd_dkdv_kernel", "dkdv"), ("bwd_dq_kernel", "dq")):
        k = ns[kernel]
        cfg = bwd_config(which, d, dtype, (cc // 10, cc % 10))
        const = dict(CAUSAL=True, GROUP=2, HEAD_DIM=d, BLOCK_M=cfg.BLOCK_M,
                     BLOCK_N=cfg.BLOCK_N, DOT_PRECISION="tf32")
        warps, stages = cfg.num_warps, cfg.num_stages
        c = triton.compile(ASTSource(fn=k, signature=signature(k, ptr, const), constexprs=const),
                           target=GPUTarget("cuda", cc, 32),
                           options=dict(num_warps=warps, num_stages=stages))
        res.append(dict(kernel=kernel, cc=cc, d=d, shared=c.metadata.shared))
print("RESULT" + json.dumps(res))
'''


@pytest.mark.slow
def test_kernels_compile_for_t4_and_h100_and_fit_shared_memory(tmp_path):
    res = compile_script(AOT_SCRIPT, tmp_path)
    assert len(res) == 4
    assert not too_big(res), f"configs that do not fit shared memory: {too_big(res)}"
