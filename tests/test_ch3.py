"""Chapter 3: the solution's kernels pass their checks, every known-wrong variant fails the check
of its exercise, the out-of-bounds guard turns a missing mask into a check failure that names
the access, the wrappers reject bad inputs, and every kernel compiles ahead of time for
sm_75/sm_80/sm_90 with the configs the chapter picks, within each GPU's shared memory."""
import functools
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from flashbook import notebooks, oob
from flashbook.chapters import ch3
from flashbook.check import CheckFailure

sys.path.insert(0, str(Path(__file__).resolve().parent))
from known_wrong.ch3 import VARIANTS  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CHECKS = {
    "ch3_softmax_kernel": ("softmax_kernel", ch3.check_softmax_kernel),
    "ch3_attn_tile": ("attn_fwd_kernel", ch3.check_attention_kernel),
    "ch3_attn_kernel": ("attn_fwd_kernel", ch3.check_attention_kernel),
    "ch3_merge_kernel": ("merge_kernel", ch3.check_merge_kernel),
    "ch3_two_tiles_kernel": ("attn_fwd_two_tiles",
                             functools.partial(ch3.check_attention_kernel, two_tiles=True)),
}


def namespace(replace: dict | None = None) -> dict:
    """The chapter's definition cells (no tests, no demos), optionally with cells replaced."""
    return notebooks.solution_namespace("ch3", ROOT, replace=replace)


@pytest.fixture(scope="module")
def solution():
    return namespace()


@pytest.mark.parametrize("gid", sorted(set(CHECKS) - {"ch3_attn_tile"}))
def test_solution_passes_visible_checks(solution, gid):
    kernel, check = CHECKS[gid]
    check(solution[kernel])


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_known_wrong_variant_fails_its_check(name):
    v = VARIANTS[name]
    kernel, check = CHECKS[v["grade_id"]]
    ns = namespace({v["grade_id"]: v["source"]})
    with pytest.raises(CheckFailure) as e:
        check(ns[kernel])
        check(ns[kernel], hidden=True)
    # it must fail on its bug, not because the edited source stopped running
    assert "the kernel raised" not in str(e.value), str(e.value)


@pytest.mark.parametrize("name", sorted(n for n, v in VARIANTS.items()
                                        if v["grade_id"] == "ch3_attn_tile"))
def test_two_tile_kernel_inherits_a_wrong_tile_step(name):
    """The two-tile kernel is built from the student's attn_scores/attn_update: a bug there
    must show up in its check too (the kernel adds no masking or rescaling of its own)."""
    ns = namespace({"ch3_attn_tile": VARIANTS[name]["source"]})
    with pytest.raises(CheckFailure) as e:
        ch3.check_attention_kernel(ns["attn_fwd_two_tiles"], two_tiles=True)
        ch3.check_attention_kernel(ns["attn_fwd_two_tiles"], hidden=True, two_tiles=True)
    assert "the kernel raised" not in str(e.value), str(e.value)


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
    ns = namespace({"ch3_attn_tile": VARIANTS["attn_unmasked_tail_loads"]["source"]})
    with pytest.raises(CheckFailure) as e:
        ch3.check_attention_kernel(ns["attn_fwd_kernel"])
    msg = str(e.value)
    assert "out-of-bounds load" in msg and "kT = tl.load(k_ptrs)" in msg and "`K`" in msg, msg


# ------------------------------------------------------------------------ the OOB guard

import triton  # noqa: E402  (conftest switched on the interpreter)
import triton.language as tl  # noqa: E402


@triton.jit
def _copy_unmasked_load(X, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs)
    tl.store(Y + offs, x, mask=offs < n)


@triton.jit
def _copy_unmasked_store(X, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < n, other=0.0)
    tl.store(Y + offs, x)


@triton.jit
def _copy_far_away(X, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs + 1_000_000_000)           # would segfault without the guard
    tl.store(Y + offs, x, mask=offs < n)


@triton.jit
def _copy_masked(X, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + offs, tl.load(X + offs, mask=offs < n), mask=offs < n)


def _copy(kernel, n=37):
    x = torch.randn(n)
    y = torch.zeros(n)
    kernel[(triton.cdiv(n, 16),)](x, y, n, BLOCK=16)
    return x, y


@pytest.mark.parametrize("kernel, op, line, tensor", [
    (_copy_unmasked_load, "load", "x = tl.load(X + offs)", "`X`"),
    (_copy_unmasked_store, "store", "tl.store(Y + offs, x)", "`Y`"),
    (_copy_far_away, "load", "x = tl.load(X + offs + 1_000_000_000)", "none of the kernel's tensors"),
])
def test_guard_reports_the_offending_access(kernel, op, line, tensor):
    with pytest.raises(CheckFailure) as e:
        oob.call(_copy, kernel, what="copy")
    msg = str(e.value)
    assert f"out-of-bounds {op}" in msg and line in msg and tensor in msg, msg
    assert "program id (2, 0, 0)" in msg or "program id (0, 0, 0)" in msg, msg


def test_guard_passes_correct_kernels_and_unpatches():
    from triton.runtime import interpreter
    with oob.Guard() as g:
        x, y = _copy(_copy_masked)
    assert torch.equal(x, y) and g.checked >= 2
    assert "create_masked_load" not in vars(interpreter.interpreter_builder)


def test_guard_catches_lanes_that_land_in_a_neighbouring_tensor():
    # X and Y share one buffer: an overrun of X lands in Y; only the lane count tells.
    buf = torch.randn(64)
    x, y = buf[:37], buf[40:]

    def run():
        _copy_unmasked_load[(3,)](x, y, 24, BLOCK=16)
    with pytest.raises(CheckFailure, match="out-of-bounds load"):
        oob.call(run, what="neighbour")


def test_canaries():
    t = oob.embed(torch.arange(6.0).view(2, 3), pad=4)
    assert oob.canaries_intact(t) and torch.equal(t, torch.arange(6.0).view(2, 3))
    t._flashbook_canary[0][-1] = 1.0
    assert not oob.canaries_intact(t)


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

AOT_SCRIPT = textwrap.dedent(r'''
    import itertools, json, linecache, os, sys
    import flashbook, flashbook.device as dv
    fake = dv.Backend(True, "AOT", (9, 0), dv.GPU_SIZES)      # compile for GPUs, do not interpret
    flashbook.setup = lambda verbose=True: fake
    dv._current = fake
    import torch, triton
    from triton.compiler import ASTSource
    from triton.backends.compiler import GPUTarget
    sys.path.insert(0, sys.argv[1])
    from test_ch3 import namespace
    from flashbook.chapters import ch3
    ns = namespace()
    T = {torch.float16: "fp16", torch.float32: "fp32"}

    def sig(kernel, ptr, const):
        out = {}
        for n in kernel.arg_names:
            out[n] = "constexpr" if n in const else ptr.get(n, "i32")
        return out

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
            s = sig(k, dict(Q="*" + t, K="*" + t, V="*" + t, O="*" + t, LSE="*fp32",
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
            c = triton.compile(ASTSource(fn=k, signature=sig(k, ptr, const), constexprs=const),
                               target=GPUTarget("cuda", cc, 32), options=dict(num_warps=4))
            res.append(dict(kernel=name, cc=cc, shared=c.metadata.shared))
    print("RESULT" + json.dumps(res))
''')

LIMITS = {75: 64 * 1024, 80: 163 * 1024, 90: 227 * 1024}


def test_kernels_compile_for_t4_a100_h100_and_fit_shared_memory(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FLASHBOOK_FORCE_CPU")}
    env["PYTHONPATH"] = str(ROOT / "src")
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    script = tmp_path / "aot.py"
    script.write_text(AOT_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(Path(__file__).parent)], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.split("RESULT", 1)[1])
    too_big = [r for r in res if r["shared"] > LIMITS[r["cc"]]]
    assert not too_big, f"configs that do not fit shared memory: {too_big}"
    assert len(res) == 20


def test_chapter_text_quotes_the_recorded_benchmark():
    """The figures the chapter's prose quotes are the ones in the committed H200 data."""
    rows = ch3.load_bench("h200")
    assert rows, "no recorded Chapter 3 benchmark"
    by = {(r["kernel"], r["B"], r["N_q"], r["d"]): r["tflops"] for r in rows}
    text = (ROOT / "solutions" / "ch3_online_softmax.py").read_text()
    ref, cudnn = by[("ch3_two_tiles", 1, 16384, 128)], by[("sdpa_cudnn", 1, 16384, 128)]
    assert f"{ref / cudnn:.2f}x cuDNN at `(1, 16, 16384, 128)` ({ref:.0f} against {cudnn:.0f}" in text
    shapes = {(b, n, d) for _, b, n, d in by}
    vs_fa2 = sorted(by[("ch3_two_tiles", *s)] / by[("sdpa_flash", *s)] for s in shapes)
    assert f"by {vs_fa2[0]:.2f}x to {vs_fa2[-1]:.2f}x" in text
