"""Chapter 3's own tests (the contract tests in test_chapters.py run its exercises, stubs and
known-wrong variants): a wrong tile step breaks the two-tile kernel too, the out-of-bounds guard
names a missing mask, the wrappers reject bad inputs, the configs, and every kernel compiles ahead
of time for sm_75/sm_80/sm_90 with the configs the chapter picks, within each GPU's shared memory."""
from pathlib import Path

import pytest
import torch

from flashbook import sources
from flashbook.chapters import ch3
from flashbook.check import CheckFailure

from aot_compile import compile_script, too_big

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {v.name: v for v in sources.variants("ch3")}
CELLS = sources.cells_by_id(sources.read(sources.source("ch3", ROOT).path))


def namespace(variant: str | None = None) -> dict:
    """The chapter's definition cells (no tests, no demos), with one known-wrong variant."""
    v = VARIANTS[variant] if variant else None
    return sources.solution_namespace("ch3", ROOT, replace=v and {v.cell: v.apply(CELLS[v.cell])})


@pytest.fixture(scope="module")
def solution():
    return namespace()


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(n for n, v in VARIANTS.items() if v.cell == "ch3_attn_tile"))
def test_two_tile_kernel_inherits_a_wrong_tile_step(name):
    """The two-tile kernel is built from the student's attn_scores/attn_update: a bug there
    must show up in its check too (the kernel adds no masking or rescaling of its own)."""
    kernel = namespace(name)["attn_fwd_two_tiles"]
    try:
        ch3.check_attention_kernel(kernel, two_tiles=True)
    except CheckFailure as e:
        failure = str(e)
    else:
        with pytest.raises(CheckFailure) as e:
            ch3.check_attention_kernel(kernel, hidden=True, two_tiles=True)
        failure = str(e.value)
    assert "the kernel raised" not in failure, failure


def test_pick_config_two_tiles():
    for cc in ((7, 5), (8, 0), (8, 9), (9, 0), None):
        for d in (16, 64, 128):
            for dtype in (torch.float16, torch.float32):
                cfg = ch3.pick_config(d, dtype, cc, two_tiles=True)
                assert cfg.BLOCK_M % 2 == 0 and cfg.BLOCK_M // 2 >= 16 and cfg.BLOCK_N >= 16
                if cc != (9, 0) or dtype == torch.float32:   # measured only on Hopper, fp16
                    assert cfg == ch3.pick_config(d, dtype, cc)
    assert ch3.pick_config(128, torch.float16, (9, 0), two_tiles=True).BLOCK_M == 256


def test_unmasked_tail_loads_are_named_by_the_guard():
    with pytest.raises(CheckFailure) as e:
        ch3.check_attention_kernel(namespace("attn_unmasked_tail_loads")["attn_fwd_kernel"])
    msg = str(e.value)
    assert "out-of-bounds load" in msg and "kT = tl.load(k_ptrs)" in msg and "`K`" in msg, msg


# --------------------------------------------------- the warm-up and the tile-step check

def test_copy_tiles_wrapper_and_check(solution, capsys):
    kernel = solution["copy_tile_kernel"]
    x = torch.randn(20, 37).t()                      # strided: (37, 20), strides (1, 37)
    torch.testing.assert_close(ch3.copy_tiles(kernel, x, 16, 8), x, rtol=0, atol=0)
    with pytest.raises(ValueError, match="power of two"):
        ch3.copy_tiles(kernel, x, 12, 8)
    with pytest.raises(ValueError, match="2 dimensions"):
        ch3.copy_tiles(kernel, torch.randn(3, 4, 5))
    ch3.check_tile_load(kernel, hidden=True)
    assert capsys.readouterr().out == ""
    ch3.check_tile_load(kernel)
    assert capsys.readouterr().out == "PASSED tile copy kernel: 6/6 cases\n"
    assert any(not x.is_contiguous() for _, x in ch3.tile_cases())


@pytest.mark.parametrize("variant, text", [
    ("tile_load_without_mask", "out-of-bounds load"),
    ("tile_load_swapped_strides", "values are wrong"),
])
def test_check_tile_load_rejects_known_wrong_kernels(variant, text):
    with pytest.raises(CheckFailure, match=text):
        ch3.check_tile_load(namespace(variant)["copy_tile_kernel"])


@pytest.mark.parametrize("variant, which", [
    ("attn_no_score_mask_in_tail", "attn_scores"),
    ("attn_missing_rescale_of_l", "attn_update"),
    ("attn_missing_rescale_of_acc", "attn_update"),
    ("attn_update_unmasked_v_load", "attn_update"),
])
def test_tile_step_check_names_the_wrong_function(variant, which):
    ns = namespace(variant)
    with pytest.raises(CheckFailure) as e:
        ch3.check_attn_tile_step(ns["attn_scores"], ns["attn_update"])
    assert str(e.value).startswith(which + ", case"), str(e.value)[:300]


def test_tile_step_check_passes_the_solution_and_reports_stubs(solution, capsys):
    ch3.check_attn_tile_step(solution["attn_scores"], solution["attn_update"], hidden=True)
    assert capsys.readouterr().out == ""
    ch3.check_attn_tile_step(solution["attn_scores"], solution["attn_update"])
    assert "PASSED attention tile step" in capsys.readouterr().out
    cases = ch3.tile_step_cases()
    assert any(n_k < start + bn for _, _, bn, _, n_k, start, _, _ in cases)    # a masked tail
    assert any(state == "running" for *_, state in cases)


def test_tile_figure_shows_full_tiles_and_one_masked_tail():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig = ch3.plot_tiles(N_q=128, N_k=150, block_m=32, block_n=32, program=1)
    try:
        patches = fig.axes[0].patches
        hatched = [p for p in patches if p.get_hatch()]
        tiles = [p for p in patches if not p.get_hatch() and p.get_fill() and p.get_width() > 0]
        assert len(hatched) == 1 and hatched[0].get_x() == 150     # only keys past N_k
        assert [p.get_width() for p in tiles] == [32, 32, 32, 32, 22]
    finally:
        plt.close(fig)


# ---------------------------------------------------------------------------- wrappers

@pytest.mark.parametrize("make, text", [
    (lambda: (torch.randn(2, 16, 16),) * 3, "4 dimensions"),
    (lambda: (torch.randn(1, 1, 8, 16, dtype=torch.bfloat16),) * 3, "dtype"),
    (lambda: (torch.randn(1, 1, 8, 48),) * 3, "head dim"),
    (lambda: (torch.randn(1, 1, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)), "shapes"),
    (lambda: (torch.randn(1, 1, 16, 8).transpose(-1, -2),) * 3, "stride"),
    (lambda: (torch.randn(1, 1, 8, 16), torch.randn(1, 1, 8, 16).half(), torch.randn(1, 1, 8, 16)), "dtype"),
])
@pytest.mark.parametrize("wrapper", ["attention", "attention_two_tiles"])
def test_attention_wrapper_rejects_bad_inputs(solution, make, text, wrapper):
    with pytest.raises(ValueError, match=text):
        solution[wrapper](*make())


def test_attention_wrapper_edge_cases(solution):
    q = torch.randn(1, 2, 5, 16)
    o, lse = solution["attention"](q, torch.randn(1, 2, 0, 16), torch.randn(1, 2, 0, 16))
    assert torch.all(o == 0) and torch.all(lse == float("-inf"))
    with pytest.raises(ValueError, match="scale"):
        solution["attention"](q, q, q, scale=-1.0)
    with pytest.raises(ValueError, match="at least 16"):
        solution["attention"](q, q, q, config=ch3.Config(8, 16, 4, 1))
    with pytest.raises(ValueError, match="two tiles"):
        solution["attention_two_tiles"](q, q, q, config=ch3.Config(16, 16, 4, 1))
    o2, lse2 = solution["attention_two_tiles"](q, torch.randn(1, 2, 0, 16), torch.randn(1, 2, 0, 16))
    assert torch.all(o2 == 0) and torch.all(lse2 == float("-inf"))


# ----------------------------------------------------------- ahead-of-time GPU compilation

AOT_SCRIPT = r'''
from flashbook.chapters import ch3
ns = sources.solution_namespace("ch3")
T = {torch.float16: "fp16", torch.float32: "fp32"}

res = []
for cc in (75, 80, 90):
    for (dtype, d), (kernel, two) in itertools.product(
            ((torch.float16, 64), (torch.float16, 128), (torch.float32, 128)),
            (("attn_fwd_kernel", False), ("attn_fwd_two_tiles", True))):
        cfg = ch3.pick_config(d, dtype, (cc // 10, cc % 10), two_tiles=two)
        k = ns[kernel]
        t = T[dtype]
        const = dict(HEAD_DIM=d, BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N,
                     DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32")
        s = signature(k, dict(Q="*" + t, K="*" + t, V="*" + t, O="*" + t, LSE="*fp32",
                        qk_scale="fp32"), const)
        c = triton.compile(ASTSource(fn=k, signature=s, constexprs=const),
                           target=GPUTarget("cuda", cc, 32),
                           options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
        res.append(dict(kernel=kernel, cc=cc, dtype=t, d=d, cfg=str(cfg),
                        shared=c.metadata.shared))
    for name, ptr, const in (
            ("softmax_kernel", dict(X="*fp16", Y="*fp16", LSE="*fp32"), dict(BLOCK=1024)),
            ("merge_kernel", dict(O_a="*fp16", LSE_a="*fp32", O_b="*fp16", LSE_b="*fp32",
                                  O="*fp16", LSE="*fp32"), dict(HEAD_DIM=128, BLOCK_R=64))):
        if cc != 75:
            continue
        k = ns[name]
        c = triton.compile(ASTSource(fn=k, signature=signature(k, ptr, const), constexprs=const),
                           target=GPUTarget("cuda", cc, 32), options=dict(num_warps=4))
        res.append(dict(kernel=name, cc=cc, shared=c.metadata.shared))
print("RESULT" + json.dumps(res))
'''


def test_shared_memory_limits_are_the_per_block_values():
    assert ch3.SHARED_MEMORY_PER_BLOCK[(8, 0)] == 163 * 1024 == 166912       # A100 (SM: 164 KB)
    assert ch3.SHARED_MEMORY_PER_BLOCK[(7, 5)] == 64 * 1024
    assert ch3.SHARED_MEMORY_PER_BLOCK[(9, 0)] == 227 * 1024                 # H100/H200 (SM: 228 KB)
    text = sources.source("ch3", ROOT).path.read_text()
    assert "163 KB" in text and "164 KB" not in text.replace("SM has 164 KB", "")


@pytest.mark.slow
def test_kernels_compile_for_t4_a100_h100_and_fit_shared_memory(tmp_path):
    """A cubin for the T4 (students' Colab GPU); PTX for the A100 and H100, whose shared memory
    is known once LLVM lowers the kernel (ptxas, a third of the time, is skipped there; the
    H200 runs these kernels for real)."""
    res = compile_script(AOT_SCRIPT, tmp_path, ptx_only_for=(80, 90))
    assert not too_big(res), f"configs that do not fit shared memory: {too_big(res)}"
    assert len(res) == 20
