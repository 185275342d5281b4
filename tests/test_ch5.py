"""Chapter 5's own tests (the contract tests in test_chapters.py run its exercises, stubs and
known-wrong variants): the public wrappers against the float64 reference (the two-tile one
also while its optional exercise is a stub), paged against contiguous caches, the
materialised-K/V ablation, the launch checks, and the kernels compiling ahead of time for sm_75
and sm_90 within shared memory."""
import inspect
from pathlib import Path

import pytest
import torch

from flashbook import reference, sources
from flashbook.cases import AttnCase, expected, make_inputs
from flashbook.chapters import ch5
from flashbook.check import simulated_capture

from aot_compile import compile_script, too_big

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def solution():
    return sources.solution_namespace("ch5", ROOT)


@pytest.mark.parametrize("wrapper", ["attention_gqa", "attention_gqa_per_head",
                                     "attention_gqa_two_tiles"])
@pytest.mark.parametrize("causal, window", [(True, (-1, -1)), (False, (-1, -1)), (False, (4, 2))])
def test_prefill_wrappers_match_the_reference(solution, wrapper, causal, window):
    """Ragged lengths, so the last key tile is partial: with no mask and no window the two-tile
    kernel masks it on its keys alone (WINDOWED False)."""
    case = AttnCase("t", seqlens=(9, 0, 30), seqlens_k=(12, 3, 30), H_q=8, H_kv=2, d=16,
                    causal=causal, window=None if window == (-1, -1) else window)
    q, k, v = make_inputs(case, 4)
    o, lse = solution[wrapper](q, k, v, case.cu_seqlens(), case.cu_seqlens(keys=True), 30, 30,
                               causal=causal, window_size=window)
    want, want_lse = expected(case, q, k, v)
    torch.testing.assert_close(o.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse.double(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("seqlens_q, seqlens_k, H_q, H_kv, tiles", [
    ((31,), (263,), 4, 1, (256, 64)),          # the H200's d = 64 two-tile config
    ((20, 5), (200, 70), 2, 2, (128, 64)),
    ((1,), (135,), 2, 1, (128, 64)),
])
def test_two_tile_kernel_sees_every_key_of_a_short_sequence_with_the_gpus_tiles(
        solution, seqlens_q, seqlens_k, H_q, H_kv, tiles):
    """With no mask and no window, a sequence much shorter than the tile's positions: the tile's
    padding rows must not turn the first key tiles into a left band that only the windowed loop
    visits (the kernel lost them: max |O - ref| 0.24-0.51 on these cases, 0.40 on an H200)."""
    from flashbook.tiles import Config
    case = AttnCase("t", seqlens=seqlens_q, seqlens_k=seqlens_k, H_q=H_q, H_kv=H_kv, d=64)
    q, k, v = make_inputs(case, 5)
    o, lse = solution["attention_gqa_two_tiles"](
        q, k, v, case.cu_seqlens(), case.cu_seqlens(keys=True), max(seqlens_q), max(seqlens_k),
        config=Config(*tiles, 4, 2))
    want, want_lse = expected(case, q, k, v)
    torch.testing.assert_close(o.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse.double(), atol=1e-4, rtol=1e-4)


def test_two_tile_wrapper_runs_the_one_tile_kernel_while_the_two_tile_one_is_a_stub(capsys):
    """The optional exercise left as its stub (both functions of its cell): the wrapper says so
    once and answers with Exercise 1's kernel; the package's generated copy is the solved one."""
    import re
    from flashbook import selftest
    from flashbook.chapters.ch4 import launch
    cell = sources.cells_by_id(sources.read(sources.source("ch5", ROOT).path))["ch5_two_tiles"]
    stub = re.sub(r"^([ \t]*)### BEGIN SOLUTION\n.*?^[ \t]*### END SOLUTION[ \t]*\n?",
                  r"\1raise NotImplementedError()\n", cell, flags=re.S | re.M)
    assert stub.count("raise NotImplementedError()") == 2
    ns = sources.solution_namespace("ch5", ROOT, replace={"ch5_two_tiles": stub})
    case = AttnCase("t", seqlens=(9, 30), seqlens_k=(12, 30), H_q=8, H_kv=2, d=16, causal=True)
    q, k, v = make_inputs(case, 4)
    launch._NOTED.discard("attention_gqa_two_tiles")
    for _ in range(2):
        o, lse = ns["attention_gqa_two_tiles"](q, k, v, case.cu_seqlens(),
                                               case.cu_seqlens(keys=True), 30, 30, causal=True)
    note = capsys.readouterr().out
    assert note.count("attn_gqa_two_tiles") == 1 and "one-tile attn_gqa_kernel" in note
    assert not selftest.failure_phrase(note), note
    want, want_lse = expected(case, q, k, v)
    torch.testing.assert_close(o.double(), want, atol=1e-5, rtol=1e-5)
    from flashbook import gqa_kernels as forward_kernels
    assert "raise NotImplementedError" not in inspect.getsource(forward_kernels)


def test_paged_decode_equals_contiguous_and_the_reference(solution):
    B, n_new, h_q, h_kv, d = 3, 2, 8, 2, 16
    lengths = torch.tensor([40, 2, 33], dtype=torch.int32)
    q = torch.randn(B, n_new, h_q, d)
    k, v = torch.randn(B, 48, h_kv, d), torch.randn(B, 48, h_kv, d)
    o, lse = solution["decode"](q, k, v, lengths)
    kp, vp, table = ch5.paged_cache(k, v, 16, seed=1, spare=3)
    o_paged, lse_paged = solution["decode"](q, kp, vp, lengths, table)
    torch.testing.assert_close(o_paged, o)
    torch.testing.assert_close(lse_paged, lse)
    for b, n in enumerate(lengths.tolist()):
        want = reference.attention(q[b].transpose(0, 1)[None].double(),
                                   k[b, :n].transpose(0, 1)[None].double(),
                                   v[b, :n].transpose(0, 1)[None].double(), causal=True)
        torch.testing.assert_close(o[b].transpose(0, 1).double(), want[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("wrapper", ["attention_gqa", "attention_gqa_two_tiles"])
@pytest.mark.parametrize("H_q, H_kv", [(6, 2), (6, 1), (5, 1), (7, 1), (71, 1)])
def test_prefill_takes_group_sizes_that_do_not_divide_the_tile(solution, wrapper, H_q, H_kv,
                                                               monkeypatch):
    """G = 3, 5, 6, 7, 71 (Qwen2.5-7B's G is 7, Falcon-7B's 71): launch_gqa once refused them
    ("BLOCK_M=32 must be a multiple of 1 x G=3"), then repeated K/V for the part of G that did
    not divide the tile; the kernels now fold the flattened (position, head) pairs (PackGQA),
    and nothing copies K or V."""
    case = AttnCase("t", seqlens=(16, 5), seqlens_k=(16, 21), H_q=H_q, H_kv=H_kv, d=32,
                    causal=True)
    q, k, v = make_inputs(case, 6)
    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "repeat_interleave", None)      # no copy of K and V
        o, lse = solution[wrapper](q, k, v, case.cu_seqlens(), case.cu_seqlens(keys=True), 16,
                                   21, causal=True)
    want, want_lse = expected(case, q, k, v)
    torch.testing.assert_close(o.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse.double(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("causal", [True, False])
def test_decode_of_many_new_tokens_is_taken_in_tiles_of_bounded_height(solution, monkeypatch,
                                                                        causal):
    """G x n_new rows made one tile of next_pow2(G x n_new) rows, without a cap (1,024 rows
    needed 256 KB of shared memory on an H200). Now at most DECODE_MAX_ROWS rows a launch (8
    here, so 4 heads x 9 new tokens take five launches); the answer is the same."""
    from flashbook.chapters.ch5 import launch
    monkeypatch.setattr(launch, "DECODE_MAX_ROWS", 8)
    B, n_new, h_q, h_kv, d = 2, 9, 4, 1, 16
    lengths = torch.tensor([30, 9], dtype=torch.int32)
    q = torch.randn(B, n_new, h_q, d)
    k, v = torch.randn(B, 32, h_kv, d), torch.randn(B, 32, h_kv, d)
    heights = []                                  # rows (G x new tokens) of each launch

    class Spy:                                    # the kernel, seeing each launch's q chunk
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(q_chunk, *args, **kwargs):
                heights.append(h_q // h_kv * q_chunk.shape[1])
                return self.kernel[grid](q_chunk, *args, **kwargs)
            return launch
    monkeypatch.setitem(solution, "decode_kernel", Spy(solution["decode_kernel"]))
    o, lse = solution["decode"](q, k, v, lengths, causal=causal)
    assert max(heights) <= 8 and len(heights) == 5, heights
    for b, n in enumerate(lengths.tolist()):
        kv = [t[b, :n].repeat_interleave(h_q // h_kv, 1).transpose(0, 1)[None].double()
              for t in (k, v)]
        want = reference.attention(q[b].transpose(0, 1)[None].double(), *kv, causal=causal)
        torch.testing.assert_close(o[b].transpose(0, 1).double(), want[0], atol=1e-5, rtol=1e-5)
    assert lse.shape == (B, h_q, n_new) and torch.isfinite(lse).all()


def test_paged_cache_pool_holds_the_pages_where_the_table_says():
    k = torch.arange(2 * 32 * 1 * 16, dtype=torch.float32).view(2, 32, 1, 16)
    kp, vp, table = ch5.paged_cache(k, k.clone(), 16, seed=3, spare=2)
    assert kp.shape == (6, 16, 1, 16) and table.dtype == torch.int32
    assert sorted(table.flatten().tolist()) == sorted(set(table.flatten().tolist()))
    for b in range(2):
        for j in range(2):
            assert torch.equal(kp[table[b, j]], k[b, 16 * j:16 * (j + 1)])
    spare = sorted(set(range(6)) - set(table.flatten().tolist()))
    assert len(spare) == 2 and torch.isnan(kp[spare]).all()


@pytest.mark.parametrize("change, text", [
    (dict(k=lambda t: torch.cat([t, t[:, :1]], 1)), "h_kv dividing"),   # 3 K/V heads for 4
    (dict(cu_seqlens_q=lambda c: c.flip(0)), "cu_seqlens_q"),
    (dict(max_seqlen_k=lambda m: m - 1), "max_seqlen_k"),
])
def test_validate_packed_names_the_argument(change, text):
    case = AttnCase("t", seqlens=(5, 7), H_q=4, H_kv=2, d=16)
    q, k, v = make_inputs(case, 0)
    args = dict(q=q, k=k, v=v, cu_seqlens_q=case.cu_seqlens(), cu_seqlens_k=case.cu_seqlens(),
                max_seqlen_q=7, max_seqlen_k=7)
    args.update({n: f(args[n]) for n, f in change.items()})
    if "k" in change:
        args["v"] = args["k"]
    with pytest.raises(ValueError, match=text):
        ch5.validate_packed(**args)


def test_validators_read_nothing_on_the_host_while_a_graph_is_captured(solution, monkeypatch):
    """Issue 27: validate_packed (attention_gqa, Chapter 9's forward) and the solution's
    validate_decode read cu_seqlens, cache_seqlens and the block table once per tensor, and not
    at all during a CUDA-graph capture; a bad value is still a ValueError."""
    from flashbook.chapters.ch5.checks import _valid_decode
    case = AttnCase("t", seqlens=(5, 7), H_q=4, H_kv=2, d=16)
    q, k, v = make_inputs(case, 0)
    cu = case.cu_seqlens()
    paged = _valid_decode(paged=True)
    with simulated_capture():
        ch5.validate_packed(q, k, v, cu, cu, 7, 7)
        solution["validate_decode"](**paged)
        with pytest.raises(ValueError, match="cu_seqlens_k"):
            ch5.validate_packed(q, k, v, cu, cu.long(), 7, 7)
    reads, tolist = [], torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t) or tolist(t))
    for _ in range(3):
        ch5.validate_packed(q, k, v, cu, cu, 7, 7)
        solution["validate_decode"](**paged)
    assert len(reads) == 3                     # cu, cache_seqlens and block_table, once each
    with pytest.raises(ValueError, match="max_seqlen_q"):
        ch5.validate_packed(q, k, v, cu, cu, 6, 7)
    with pytest.raises(ValueError, match="block_table"):
        solution["validate_decode"](**{**paged, "block_table": paged["block_table"] + 10})


AOT_SCRIPT = r'''
from flashbook.chapters.ch3 import pick_config
from flashbook.chapters.ch5 import decode_config
ns = sources.solution_namespace("ch5")
ptr = dict(Q="*fp16", K="*fp16", V="*fp16", O="*fp16", LSE="*fp32", CU_Q="*i32", CU_K="*i32",
           CACHE_SEQLENS="*i32", BLOCK_TABLE="*i32", qk_scale="fp32")
res = []
for cc in (75, 90):
    cfg = pick_config(128, torch.float16, (cc // 10, cc % 10))
    two = pick_config(128, torch.float16, (cc // 10, cc % 10), two_tiles=True)   # as launched
    dec = decode_config((cc // 10, cc % 10))
    for kernel, const, warps, stages in (
            ("attn_gqa_kernel", dict(GROUP=4, BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N),
             cfg.num_warps, cfg.num_stages),
            ("decode_kernel", dict(GROUP=4, PAGED=True, BLOCK_M=16, BLOCK_N=dec[0]), dec[1],
             dec[2]),
            ("attn_gqa_two_tiles", dict(GROUP=4, BLOCK_M=two.BLOCK_M, BLOCK_N=two.BLOCK_N,
                                        WINDOWED=True), two.num_warps, two.num_stages),
            # G = 7 (Qwen2.5-7B's), which divides no tile: PackGQA's fold, compiled
            ("attn_gqa_kernel", dict(GROUP=7, BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N),
             cfg.num_warps, cfg.num_stages),
            ("attn_gqa_two_tiles", dict(GROUP=7, BLOCK_M=two.BLOCK_M, BLOCK_N=two.BLOCK_N,
                                        WINDOWED=False), two.num_warps, two.num_stages)):
        const.update(HEAD_DIM=128, DOT_PRECISION="tf32")
        k = ns[kernel]
        c = triton.compile(ASTSource(fn=k, signature=signature(k, ptr, const), constexprs=const),
                           target=GPUTarget("cuda", cc, 32),
                           options=dict(num_warps=warps, num_stages=stages))
        res.append(dict(kernel=kernel, G=const.get("GROUP"), cc=cc, shared=c.metadata.shared))
print("RESULT" + json.dumps(res))
'''


@pytest.mark.slow
def test_kernels_compile_for_t4_and_h100_and_fit_shared_memory(tmp_path):
    """A cubin for the T4; PTX for the H100, whose shared memory is known once LLVM lowers the
    kernel (ptxas is skipped there). The prefill kernels with G = 4 and with G = 7, which
    divides no tile (the folded rows' positions and heads are computed, not constants)."""
    res = compile_script(AOT_SCRIPT, tmp_path, ptx_only_for=(90,))
    assert len(res) == 10 and sorted({r["G"] for r in res}) == [4, 7]
    assert not too_big(res), f"configs that do not fit shared memory: {too_big(res)}"


def test_no_heads_at_all_is_nothing_to_compute_and_no_kv_heads_for_some_is_refused(solution):
    """A packed batch with no heads (h_q = h_kv = 0: an empty dense batch folded into the heads)
    gives empty O and LSE; K/V with no heads for q's heads is refused with a ValueError, not a
    division by zero."""
    cu = torch.tensor([0, 4], dtype=torch.int32)
    none = torch.randn(4, 0, 16)
    o, lse = solution["attention_gqa"](none, none, none, cu, cu, 4, 4)
    assert o.shape == (4, 0, 16) and lse.shape == (0, 4)
    with pytest.raises(ValueError, match="h_kv dividing q's 3 heads"):
        solution["attention_gqa"](torch.randn(4, 3, 16), none, none, cu, cu, 4, 4)


def test_a_head_dim_the_tiles_cannot_take_is_refused_with_the_reason_and_the_way_out():
    """d = 96 (Chapter 5's table has models with d = 96-256) is refused by every launcher and
    wrapper check of Chapters 4, 5 and 8, saying why and what to do, never deep in a kernel."""
    from flashbook.chapters import ch4, ch8
    q, k = torch.randn(16, 6, 96), torch.randn(16, 2, 96)
    cu = torch.tensor([0, 16], dtype=torch.int32)
    calls = [lambda: ch5.launch_gqa(None, q, k, k, cu, cu, 16, 16, window=(32, 32)),
             lambda: ch4.launch_varlen(None, q, q, q, cu, cu, 16, 16),
             lambda: ch5.validate_packed(q, k, k, cu, cu, 16, 16),
             lambda: ch8.validate_split_decode(torch.randn(2, 1, 6, 96), torch.randn(2, 8, 2, 96),
                                               torch.randn(2, 8, 2, 96),
                                               torch.tensor([3, 8], dtype=torch.int32))]
    for call in calls:
        with pytest.raises(ValueError, match=r"d=96.*power of two.*zero-pad"):
            call()


@pytest.mark.parametrize("kind", ["numpy ints", "torch ints", "a tensor", "a list"])
def test_window_size_of_numpy_or_torch_integers_is_taken_as_python_ints(solution, kind):
    """flash-attn users pass window_size from configs (NumPy ints) or as a tensor: Chapters 4
    and 5's wrappers give the same O as with Python ints; floats and bools are still refused."""
    import numpy as np
    ch4_solution = sources.solution_namespace("ch4", ROOT)
    window = {"numpy ints": (np.int64(5), np.int32(2)), "torch ints": (torch.tensor(5), 2),
              "a tensor": torch.tensor([5, 2]), "a list": [5, 2]}[kind]
    case = AttnCase("t", seqlens=(9, 20), seqlens_k=(12, 20), H_q=4, H_kv=2, d=16, window=(5, 2))
    q, k, v = make_inputs(case, 6)
    want, _ = expected(case, q, k, v)
    args = (q, k, v, case.cu_seqlens(), case.cu_seqlens(keys=True), 20, 20)
    o, _ = solution["attention_gqa"](*args, window_size=window)
    torch.testing.assert_close(o.double(), want, atol=1e-5, rtol=1e-5)
    case1 = AttnCase("t", seqlens=(9, 20), seqlens_k=(12, 20), H_q=2, d=16, window=(5, 2))
    q1, k1, v1 = make_inputs(case1, 6)
    o1, _ = ch4_solution["attention_varlen"](q1, k1, v1, *args[3:], window_size=window)
    torch.testing.assert_close(o1.double(), expected(case1, q1, k1, v1)[0], atol=1e-5, rtol=1e-5)
    for bad in ((5.0, 2), (True, 2), torch.tensor([5.0, 2.0]), (np.int64(5),)):
        with pytest.raises(ValueError, match="window_size"):
            solution["attention_gqa"](*args, window_size=bad)
        with pytest.raises(ValueError, match="window_size"):
            ch4_solution["attention_varlen"](q1, k1, v1, *args[3:], window_size=bad)


def test_bf16_is_refused_in_cpu_mode_saying_where_it_is_taken():
    """bf16 on a CPU runtime: the prefill's dtypes leave it out (the interpreter's bf16 tl.dot
    is wrong), and the refusal says so and where bf16 is taken."""
    assert torch.bfloat16 not in ch5.prefill_dtypes()
    q = torch.randn(16, 2, 16, dtype=torch.bfloat16)
    cu = torch.tensor([0, 16], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"bfloat16.*compute capability 8\.0.*interpreter"):
        ch5.validate_packed(q, q, q, cu, cu, 16, 16)


def test_the_benchmark_times_the_reference_call_as_a_reader_makes_it(solution, monkeypatch):
    # measure stubbed (no timing on a CPU); the public rows' calls run for real, once each
    from flashbook import bench
    from flashbook.chapters.ch5 import benchmark as ch5b
    from flashbook.results import Row

    def measure(kernel, role, setup, *, B, H_q, H_kv, N_q, N_k, d, causal, flops, nbytes,
                note="", hbm=False):
        return Row(kernel, role, B, H_q, H_kv, N_q, N_k, d, "float16", causal, 2.0, 10.0, 5.0,
                   1.0)
    outputs = []
    monkeypatch.setattr(ch5b, "measure", measure)
    monkeypatch.setattr(bench, "time_ms", lambda fn, graph=False: outputs.append(fn()) or 4.0)
    rows = ch5b.prefill_rows(solution, None, 1, 4, 2, 32, 16, device="cpu")
    public = [r for r in rows if r.role == "public"]
    assert [(r.kernel, r.causal) for r in public] == [("ch5_two_tiles", True),
                                                      ("ch5_two_tiles", False)]
    assert all(r.tflops == 5.0 and "attention_gqa_two_tiles(" in r.note for r in public)
    assert [tuple(o.shape) for o, _ in outputs] == [(32, 4, 16)] * 2
    outputs.clear()
    rows = ch5b.decode_rows(solution, None, 2, 4, 2, 48, 16, page_sizes=(16,), device="cpu")
    assert [r.kernel for r in rows if r.role == "public"] == ["ch5_decode"]
    assert [tuple(o.shape) for o, _ in outputs] == [(2, 1, 4, 16)]
