"""Chapter 4's own tests (the contract tests in test_chapters.py run its exercises, stubs and
known-wrong variants): the public wrapper, with the two-tile kernel and with the one-tile
kernel while the optional two-tile exercise is a stub, the canaries and the load counter the
checks rely on, the low-level launcher's own checks, and every kernel compiling ahead of time
for sm_75 and sm_90 within shared memory."""
from pathlib import Path

import pytest
import torch

from flashbook import oob, reference, sources
from flashbook.cases import AttnCase, make_inputs
from flashbook.chapters import ch4
from flashbook.chapters.ch4 import checks
from flashbook.check import CheckFailure, simulated_capture

from aot_compile import compile_script, too_big

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {v.name: v for v in sources.variants("ch4")}
CELLS = sources.cells_by_id(sources.read(sources.source("ch4", ROOT).path))


def namespace(variant: str | None = None) -> dict:
    v = VARIANTS[variant] if variant else None
    return sources.solution_namespace("ch4", ROOT, replace=v and {v.cell: v.apply(CELLS[v.cell])})


@pytest.fixture(scope="module")
def solution():
    return namespace()


def packed(lens_q, lens_k, H=2, d=16, dtype=torch.float32):
    case = AttnCase("t", seqlens=tuple(lens_q), seqlens_k=tuple(lens_k), H_q=H, d=d, dtype=dtype)
    q, k, v = make_inputs(case, 3)
    return q, k, v, case.cu_seqlens(), case.cu_seqlens(keys=True)


@pytest.mark.parametrize("causal, window", [(False, (-1, -1)), (True, (-1, -1)),
                                            (False, (4, 2)), (True, (6, -1))])
def test_public_wrapper_two_tile_kernel_matches_the_reference(solution, causal, window):
    q, k, v, cu_q, cu_k = packed([0, 1, 40, 23], [3, 1, 40, 60])
    o, lse = solution["attention_varlen"](q, k, v, cu_q, cu_k, 40, 60, causal=causal,
                                          window_size=window)
    want, want_lse = reference.attention_varlen(q.double(), k.double(), v.double(), cu_q, cu_k,
                                                causal=causal, window=window)
    torch.testing.assert_close(o.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse.double(), atol=1e-4, rtol=1e-4)


def test_public_wrapper_refuses_a_bad_call_before_any_kernel_runs(solution):
    q, k, v, cu_q, cu_k = packed([5, 3], [5, 3])
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        solution["attention_varlen"](q, k, v, cu_q.flip(0), cu_k, 5, 5)
    with pytest.raises(ValueError, match="max_seqlen_k"):
        solution["attention_varlen"](q, k, v, cu_q, cu_k, 5, 4)


def test_validator_reads_cu_seqlens_once_and_not_at_all_while_a_graph_is_captured(
        solution, monkeypatch):
    """Issue 27: the benchmark times attention_varlen replayed from a CUDA graph, and a copy to
    the host (cu.tolist()) during the capture failed it on every GPU."""
    q, k, v, cu_q, cu_k = packed([5, 3], [5, 3])
    validate = solution["validate_varlen"]
    with simulated_capture():                  # a copy to the host would raise
        validate(q, k, v, cu_q, cu_k, 5, 5)
        validate(q, k, v, cu_q.flip(0), cu_k, 5, 5)          # values: skipped while capturing
        with pytest.raises(ValueError, match="cu_seqlens_q"):  # types: checked while capturing
            validate(q, k, v, cu_q.long(), cu_k, 5, 5)
    reads, tolist = [], torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t) or tolist(t))
    for _ in range(3):
        validate(q, k, v, cu_q, cu_k, 5, 5)
    assert len(reads) == 2                     # cu_seqlens_q and cu_seqlens_k, once each
    with pytest.raises(ValueError, match="cu_seqlens_q"):    # a bad value: still refused
        validate(q, k, v, cu_q.flip(0), cu_k, 5, 5)


def test_two_tile_kernel_inherits_a_wrong_mask():
    """The fast kernel is built from the student's visible_pairs/key_tiles: a bug there breaks
    it too (it adds no masking of its own)."""
    ns = namespace("mask_top_left_alignment")
    q, k, v, cu_q, cu_k = packed([2, 9], [5, 37])
    o, _ = ns["attention_varlen"](q, k, v, cu_q, cu_k, 9, 37, causal=True)
    want, _ = reference.attention_varlen(q.double(), k.double(), v.double(), cu_q, cu_k,
                                         causal=True)
    assert (o.double() - want).abs().max() > 1e-2


def _with_stub(cell: str) -> dict:
    """The solution with one cell's solution regions stubbed, as the student notebook has them."""
    import re
    stub = re.sub(r"^([ \t]*)### BEGIN SOLUTION\n.*?^[ \t]*### END SOLUTION[ \t]*\n?",
                  r"\1raise NotImplementedError()\n", CELLS[cell], flags=re.S | re.M)
    return sources.solution_namespace("ch4", ROOT, replace={cell: stub})


def test_public_wrapper_runs_the_one_tile_kernel_while_the_two_tile_one_is_a_stub(capsys):
    """The optional exercise left as its stub: attention_varlen says so once, in words that are
    none of the self-check's failure phrases, and answers with Exercise 2b's kernel."""
    from flashbook import selftest
    from flashbook.chapters.ch4 import launch
    ns = _with_stub("ch4_two_tiles")
    q, k, v, cu_q, cu_k = packed([2, 9, 0], [5, 37, 4])
    launch._NOTED.discard("attention_varlen")          # said once per process
    for _ in range(2):
        o, _ = ns["attention_varlen"](q, k, v, cu_q, cu_k, 9, 37, causal=True)
    note = capsys.readouterr().out
    assert note.count("attn_masked_two_tiles") == 1 and "one-tile attn_masked_kernel" in note
    assert not selftest.failure_phrase(note), note
    want, _ = reference.attention_varlen(q.double(), k.double(), v.double(), cu_q, cu_k,
                                         causal=True)
    torch.testing.assert_close(o.double(), want, atol=1e-5, rtol=1e-5)
    two_tiles = namespace()["attn_masked_two_tiles"]               # written: taken, silently
    capsys.readouterr()
    assert ch4.pick_kernel(two_tiles, ns["attn_masked_kernel"], "attention_varlen") == \
        (two_tiles, True)
    assert capsys.readouterr().out == ""


def test_canaries_sit_between_sequences_and_after_the_last():
    case = AttnCase("t", seqlens=(2, 0), seqlens_k=(3, 1), H_q=1, d=16)
    q, k, v = make_inputs(case, 0)
    qc, kc, vc, cu_q, cu_k, rows, seq_index = checks.with_canaries(case, q, k, v)
    nq, nk = checks.CANARY
    assert cu_q.tolist() == [0, 2, 2 + nq, 2 + nq, 2 + 2 * nq]
    assert cu_k.tolist() == [0, 3, 3 + nk, 4 + nk, 4 + 2 * nk]
    assert rows.tolist() == [0, 1] and seq_index == [0, 2]
    assert torch.isnan(kc[3:3 + nk]).all() and torch.isnan(kc[cu_k[-1]:]).all()
    assert kc.shape[0] == cu_k[-1] + nk                       # NaN rows after the last canary
    torch.testing.assert_close(kc[:3], k[:3])
    torch.testing.assert_close(kc[3 + nk:4 + nk], k[3:4])


def test_expected_loads_count_the_causal_triangle():
    """A causal sequence of 8 tiles of 16: program from the end p visits 8 - p tiles."""
    layout = ([0, 128], [0, 128], 128, [0], ch4.window_bounds((-1, -1), True, 128, 128), 1)
    want = checks.expected_loads(layout, H=1, BM=16, BN=16)
    assert want == {(p, 0): (8 - p, 0) for p in range(8)}
    assert sum(t for t, _ in want.values()) == 36


def test_expected_loads_follow_program_tile_with_sections():
    """Two heads in one section: program ids interleave the heads, the last tile first."""
    layout = ([0, 32], [0, 32], 32, [0], ch4.window_bounds((-1, -1), True, 32, 32), 2)
    want = checks.expected_loads(layout, H=2, BM=16, BN=16)
    assert want == {(0, 0): (2, 0), (1, 0): (2, 1), (2, 0): (1, 0), (3, 0): (1, 1)}


def test_load_counter_counts_per_program_and_tensor(solution):
    q, k, v, cu_q, cu_k = packed([32], [48], H=1)
    guard = oob.Guard()
    with guard:
        ch4.launch_varlen(solution["attn_varlen_kernel"], q, k, v, cu_q, cu_k, 32, 48,
                          config=ch4.Config(16, 16, 4, 1))
    loads = {key: n for key, n in guard.loads.items() if key[1] in ("Q", "K")}
    assert loads == {((0, 0, 0), "Q"): 1, ((1, 0, 0), "Q"): 1,
                     ((0, 0, 0), "K"): 3, ((1, 0, 0), "K"): 3}


def test_window_bounds():
    assert ch4.window_bounds((-1, -1), False, 10, 30) == (40, 40)
    assert ch4.window_bounds((-1, -1), True, 10, 30) == (40, 0)
    assert ch4.window_bounds((5, 3), True, 10, 30) == (5, 0)
    assert ch4.window_bounds((0, -1), False, 1, 1) == (0, 2)


@pytest.mark.parametrize("change, text", [
    (dict(cu_seqlens_q=lambda c: c.long()), "int32"),
    (dict(q=lambda t: t[..., :12].contiguous(), k=lambda t: t[..., :12].contiguous(),
          v=lambda t: t[..., :12].contiguous()), "head dimension"),
    (dict(q=lambda t: t.double()), "dtype"),
    (dict(q=lambda t: t[None]), "3 dimensions"),
])
def test_launcher_rejects_what_would_break_the_launch(solution, change, text):
    q, k, v, cu_q, cu_k = packed([5, 3], [5, 3])
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    args.update({n: f(args[n]) for n, f in change.items()})
    with pytest.raises(ValueError, match=text):
        ch4.launch_varlen(solution["attn_varlen_kernel"], args["q"], args["k"], args["v"],
                          args["cu_seqlens_q"], args["cu_seqlens_k"], 5, 5)


def test_mask_check_reports_a_stub():
    stub = namespace()
    src = CELLS["ch4_masks"]
    body = src[src.index("    ### BEGIN SOLUTION"):src.index("    ### END SOLUTION")]
    ns = sources.solution_namespace("ch4", ROOT, replace={"ch4_masks": src.replace(
        body, "    raise NotImplementedError()\n", 1)})
    with pytest.raises(CheckFailure, match="not implemented"):
        ch4.check_mask_helpers(ns["visible_pairs"], stub["key_tiles"])


# ----------------------------------------------------------- ahead-of-time GPU compilation

AOT_SCRIPT = r'''
from flashbook.chapters import ch4
ns = sources.solution_namespace("ch4")
ptr = dict(Q="*fp16", K="*fp16", V="*fp16", O="*fp16", LSE="*fp32", CU_Q="*i32", CU_K="*i32",
           qk_scale="fp32")
res = []
for cc in (75, 90):
    for kernel, two in (("attn_masked_two_tiles", True), ("attn_masked_kernel", False)):
        cfg = ch4.pick_config(128, torch.float16, (cc // 10, cc % 10), two_tiles=two)
        const = dict(HEAD_DIM=128, BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, DOT_PRECISION="tf32")
        k = ns[kernel]
        c = triton.compile(ASTSource(fn=k, signature=signature(k, ptr, const), constexprs=const),
                           target=GPUTarget("cuda", cc, 32),
                           options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
        res.append(dict(kernel=kernel, cc=cc, cfg=str(cfg), shared=c.metadata.shared,
                        wgmma="wgmma.mma_async" in c.asm["ptx"]))
print("RESULT" + json.dumps(res))
'''


@pytest.mark.slow
def test_masked_kernels_compile_for_t4_and_h100_and_fit_shared_memory(tmp_path):
    """A cubin for the T4 (students' Colab GPU); PTX for the H100, whose shared memory and
    wgmma instructions are known there (ptxas is skipped; the H200 runs these kernels for real)."""
    res = compile_script(AOT_SCRIPT, tmp_path, ptx_only_for=(90,))
    assert len(res) == 4
    assert not too_big(res), f"configs that do not fit shared memory: {too_big(res)}"
    for r in res:
        assert r["wgmma"] == (r["cc"] == 90), r       # Hopper's asynchronous tensor-core matmul


def test_the_benchmark_times_the_reference_call_as_a_reader_makes_it(monkeypatch):
    # measure stubbed (no timing on a CPU); the public rows' calls run for real, once each
    from flashbook import bench
    from flashbook.chapters.ch4 import benchmark as ch4b
    from flashbook.results import Row
    ns = sources.solution_namespace("ch4", ROOT)

    def measure(kernel, role, setup, *, B, N, causal, flops, tokens, note=""):
        return Row(kernel, role, B, 16, 16, N, N, 128, "float16", causal, 2.0, 10.0, 5.0, 1.0,
                   note=note)
    outputs = []
    monkeypatch.setattr(ch4b, "measure", measure)
    monkeypatch.setattr(bench, "time_ms", lambda fn, graph=False: outputs.append(fn()) or 4.0)
    rows = ch4b.dense_rows(ns, None, 1, 16, 32, 128, device="cpu")
    public = [r for r in rows if r.role == "public"]
    assert [(r.kernel, r.causal) for r in public] == [("ch4_two_tiles", True)]
    assert public[0].note == ("attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, 32, 32, "
                              "causal=True)") and public[0].tflops == 5.0
    assert [tuple(o.shape) for o, _ in outputs] == [(32, 16, 128)]
    from flashbook.chapters.ch4 import recorded
    assert recorded.section(public[0]) == "public"     # kept out of the chapter's comparisons
