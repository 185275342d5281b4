"""Chapter 3's own tests (the contract tests in test_chapters.py run its exercises, stubs and
known-wrong variants): a wrong tile step breaks the two-tile kernel too, the out-of-bounds guard
names a missing mask, the wrappers reject bad inputs, the configs, and every kernel compiles ahead
of time for sm_75/sm_80/sm_90 with the configs the chapter picks, within each GPU's shared memory."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from flashbook import sources
from flashbook.chapters import ch3
from flashbook.check import CheckFailure

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {v.name: v for v in ch3.VARIANTS}
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
    from flashbook import sources
    from flashbook.chapters import ch3
    ns = sources.solution_namespace("ch3")
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


@pytest.mark.slow
def test_kernels_compile_for_t4_a100_h100_and_fit_shared_memory(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FLASHBOOK_FORCE_CPU")}
    env["PYTHONPATH"] = str(ROOT / "src")
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    script = tmp_path / "aot.py"
    script.write_text(AOT_SCRIPT)
    proc = subprocess.run([sys.executable, str(script)], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.split("RESULT", 1)[1])
    too_big = [r for r in res if r["shared"] > LIMITS[r["cc"]]]
    assert not too_big, f"configs that do not fit shared memory: {too_big}"
    assert len(res) == 20
