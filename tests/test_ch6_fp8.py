"""Chapter 6's FP8 section: the launcher's argument checks on a CPU, the kernel compiled for the
H100/H200 without a GPU (e4m3 ``tl.dot`` on both GEMMs, in the PTX), and the checks' own
arithmetic (the rotation's gain is real on their inputs; the rounding bound holds for
round-to-nearest e4m3). Each exercise's known-wrong variants are in solutions/variants/ch6.py
(tests/test_chapters.py)."""
import math

import pytest
import torch

from aot_compile import compile_script, too_big
from flashbook.chapters import ch6
from flashbook.chapters.ch6 import fp8, fp8_checks


def test_the_fp8_kernel_refuses_a_cpu_with_a_clear_error():
    q8 = torch.zeros(1, 1, 128, 64).to(ch6.E4M3)
    s = torch.ones(1, 1, 1)
    with pytest.raises(ValueError, match="fp8 tensor cores"):
        ch6.attention_fp8(q8, s, q8, s, q8.transpose(-1, -2).contiguous(), s)


@pytest.mark.parametrize("block_m,block_n", [(32, 32), (32, 64), (64, 32)])
@pytest.mark.parametrize("causal", [False, True])
def test_the_fp8_kernel_in_the_interpreter_matches_float64_attention(causal, block_m, block_n):
    """The kernel itself (``fp8.launch``: the launch without the GPU check), run by Triton's CPU
    interpreter on block-quantized Gaussian inputs: within e4m3's error of float64 attention,
    with unequal tiles (the causal split's two loops meet inside a tile) and N not a power of
    two. A missing rescale, a wrong V-scale fold or a mask on the wrong side is off by 0.1 or
    more."""
    torch.manual_seed(block_m + block_n)
    B, H, N, d = 1, 2, 192, 64
    q, k, v = (torch.randn(B, H, N, d) for _ in range(3))

    def quantize(x, block):                          # Exercise 5's scheme
        xb = x.reshape(B, H, N // block, block, d)
        scale = xb.abs().amax(dim=(-1, -2)) / fp8.E4M3_MAX
        return (xb / scale[..., None, None]).reshape(x.shape).to(fp8.E4M3), scale.contiguous()
    (q8, qs), (k8, ks), (v8, vs) = quantize(q, block_m), quantize(k, block_n), quantize(v, block_n)
    o = fp8.launch(q8, qs, k8, ks, v8.transpose(-1, -2).contiguous(), vs, causal, torch.float32,
                   block_m, block_n, 4, 1)
    want = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                                            is_causal=causal)
    rms = (o.double() - want).pow(2).mean().sqrt().item()
    assert rms < 0.02, rms


def test_e4m3_round_to_nearest_meets_the_bound_the_check_states():
    """The bound of Exercise 5's check, max(2**-4 |x|, 2**-10 scale), on PyTorch's own cast over
    e4m3's whole range, subnormals included (a bound the right answer could miss would fail
    students for nothing)."""
    x = torch.cat([torch.linspace(-448, 448, 200001), torch.linspace(-0.02, 0.02, 20001)])
    back = x.to(ch6.E4M3).float()
    assert bool(((back - x).abs() <= torch.maximum(2.0 ** -4 * x.abs(),
                                                   torch.full_like(x, 2.0 ** -10)) * 1.0001).all())


def test_the_rotation_check_rests_on_a_real_gain():
    """On the check's outlier inputs a Sylvester Hadamard matrix with random signs cuts the
    error of the e4m3 Q K^T by well over ROTATION_GAIN; a permutation does not cut it at all."""
    for d in (16, 64, 128):
        h = torch.ones(1, 1)
        while h.shape[0] < d:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
        m = (h * (torch.randint(0, 2, (d,)) * 2 - 1) / math.sqrt(d)).double()
        q, k = fp8_checks.outlier_inputs((96, d), 7 + d), fp8_checks.outlier_inputs((80, d), 8 + d)
        plain = fp8_checks._qk_error(q, k)
        assert plain / fp8_checks._qk_error(q.double() @ m, k.double() @ m) > \
            fp8_checks.ROTATION_GAIN * 1.2
        perm = torch.eye(d, dtype=torch.float64)[torch.randperm(d)]
        assert plain / fp8_checks._qk_error(q.double() @ perm, k.double() @ perm) < 1.1


AOT = r'''
from flashbook.chapters.ch6 import fp8
k = fp8.fp8_attention_kernel
res = []
for d, causal in ((128, True), (64, False)):      # the masked loop, and the other d
    const = dict(HEAD_DIM=d, BLOCK_M=64, BLOCK_N=128, CAUSAL=causal)     # the default tiles
    ptr = dict(Q="*fp8e4nv", K="*fp8e4nv", VT="*fp8e4nv", O="*fp16", QS="*fp32", KS="*fp32",
               VS="*fp32", qk_scale="fp32")
    c = triton.compile(ASTSource(fn=k, signature=signature(k, ptr, const), constexprs=const),
                       target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=3))
    ptx = c.asm["ptx"]
    res.append(dict(cc=90, d=d, causal=causal, shared=c.metadata.shared,
                    fp8_mma=ptx.count("e4m3.e4m3")))
print("RESULT" + json.dumps(res))
'''


@pytest.mark.slow
def test_the_fp8_kernel_compiles_for_sm90_with_fp8_tensor_core_instructions(tmp_path):
    """PTX for the H100/H200: both GEMMs are e4m3 wgmma (no silent upcast to fp16), and the
    tiles fit the 227 KB of shared memory a block may use."""
    res = compile_script(AOT, tmp_path, ptx_only_for=(90,))
    assert len(res) == 2 and not too_big(res), res
    assert all(r["fp8_mma"] >= 2 for r in res), res


def test_the_fp8_benchmark_says_what_it_needs_on_a_cpu(capsys):
    from flashbook import fp8_bench
    assert fp8_bench.main(["--out", "/nonexistent"]) == 2
    assert "fp8 tensor cores" in capsys.readouterr().err


SASS = {"default": dict(n=864, MUFU=131, keys=128), "exp2_fma": dict(n=1313, MUFU=67, keys=128),
        "sperm": dict(n=807, MUFU=131, keys=128), "sperm_fma4": dict(n=1033, MUFU=99, keys=128),
        "sperm_fma8": dict(n=920, MUFU=115, keys=128)}


def _fp8_record(f=1.0):
    """An FP8 record as ``fp8_bench`` writes it, its numbers scaled by ``f``."""
    from flashbook import fp8_bench
    from flashbook.chapters.ch6 import fp8_recorded
    speed = [dict(kernel=k, causal=c, ms=1.0, tflops=t * f * (0.8 if c else 1), note=note)
             for k, t, note in (("ch6_attention_fp8", 700, fp8_recorded.default_config()),
                                ("ch6_attention_fp8", 750,
                                 "BLOCK_M=128 BLOCK_N=128 warps=8 stages=3"),
                                ("ch6_attention_fp8_gluon", 840, "BLOCK_M=64 BLOCK_N=256"),
                                ("ch6_attention_fp8_gluon_exp2_fma", 720, "BLOCK_M=64 BLOCK_N=256"),
                                ("ch6_attention_fp8_gluon_sperm", 860, "BLOCK_M=64 BLOCK_N=256"),
                                ("ch6_attention_fp8_gluon_sperm_fma4", 850, "BLOCK_M=64"),
                                ("ch6_attention_fp8_gluon_sperm_fma8", 900, "BLOCK_M=64"),
                                ("ch6_attention_fa3_fp16", 600, ""),
                                ("sdpa_cudnn_fp16", 610, ""))
             for c in (False, True)]
    accuracy = [dict(kernel=k, causal=c, rms_error=e * f * (1.1 if c else 1))
                for k, e in (("fp8", 0.3), ("fp8_rotated", 0.1), ("fp8_gluon", 0.31),
                             ("fp8_gluon_exp2_fma", 0.32), ("fp8_gluon_sperm_fma8", 0.33),
                             ("fp16_sdpa", 0.004))
                for c in (False, True)]
    sass = {label: {k: v * f if k == "n" else v for k, v in loop.items()}
            for label, loop in SASS.items()}
    return dict(provenance=dict(gpu="NVIDIA H100 80GB HBM3", date="2026-12-06", command="x"),
                shape=[1, 16, 16384, 128], accuracy_shape=[1, 4, 2048, 128], speed=speed,
                accuracy=accuracy, sass=sass | {"figures": fp8_bench.sass_figures(sass)})


def test_the_sass_figures_are_per_key_a_thread_holds():
    """``fp8_bench.sass_figures``: each variant's instructions per key of a tile a thread holds
    and the clocks its exponentials hold MUFU (8 a warp instruction), the default's besides
    MUFU, and what exp2_fma adds per exponential it moves (half the keys)."""
    from flashbook import fp8_bench
    got = fp8_bench.sass_figures(SASS)
    assert got == pytest.approx(dict(
        other_per_key_default=733 / 128, added_per_emulated=449 / 64,
        **{f"per_key_{k}": c["n"] / 128 for k, c in SASS.items()},
        **{f"mufu_clocks_{k}": 8 * c["MUFU"] / 128 for k, c in SASS.items()}))
    assert got["mufu_clocks_sperm_fma8"] == pytest.approx(7.1875)


def test_the_fp8_figures_follow_the_record(tmp_path, monkeypatch):
    """Section 8's quoted figures come from the FP8 record: the speed of ``attention_fp8``'s
    default tiles (not a faster config it does not run) over the fp16 forward and cuDNN, the
    errors and their ratio; each moves when its data moves (the
    chapter test exempts ch6_fp8_* from its benchmark-row perturbation for this test)."""
    import json

    from flashbook.chapters.ch6 import fp8_recorded
    monkeypatch.setattr(fp8_recorded, "DATA_DIR", tmp_path)
    assert fp8_recorded.record() is None
    (tmp_path / "h100.json").write_text(json.dumps(_fp8_record()))
    v = fp8_recorded.values(fp8_recorded.record())
    assert v["ch6_fp8_gpu"] == "H100 80GB HBM3"
    assert v["ch6_fp8_tflops_noncausal"] == 700 and v["ch6_fp8_tflops_causal"] == 560
    assert v["ch6_fp8_vs_fp16_noncausal"] == pytest.approx(700 / 600)
    assert v["ch6_fp8_vs_cudnn_causal"] == pytest.approx(700 / 610)
    assert v["ch6_fp8_err_gain_noncausal"] == pytest.approx(3.0)
    rec = _fp8_record()
    rec["speed"][0]["tflops"] *= 1.01             # the fp8 rows, one field at a time
    rec["speed"][1]["tflops"] *= 1.02
    rec["speed"][2]["tflops"] *= 9                # a faster other config is not quoted
    for i, r in enumerate(rec["speed"][4:]):
        r["tflops"] *= 1.03 + 0.01 * i
    for i, r in enumerate(rec["accuracy"]):
        r["rms_error"] *= 1.07 + 0.01 * i
    rec["sass"]["figures"] = {k: v * 1.5 for k, v in rec["sass"]["figures"].items()}
    rec["provenance"]["gpu"] = "NVIDIA H200"
    moved = fp8_recorded.values(rec)
    assert {k for k in v if moved[k] == v[k]} == set()
    assert moved["ch6_fp8_sass_added_per_emulated"] == pytest.approx(1.5 * 449 / 64)
    assert moved["ch6_fp8_sperm_fma8_vs_fp16_noncausal"] == pytest.approx(900 * 1.11 / (600 * 1.13))
    assert moved["ch6_fp8_tflops_noncausal"] == pytest.approx(707)
    assert fp8_recorded.plot(rec) is not None
    (tmp_path / "h200.json").write_text(json.dumps(rec))
    with pytest.raises(ValueError, match="several GPUs"):
        fp8_recorded.record()


def test_the_gluon_fp8_figures_and_exp2_fma_follow_the_record():
    """ch6_fp8_gluon_* and ch6_fp8_exp2_fma_*: the Gluon kernel's TFLOP/s and its ratio to the
    fp16 forward; with exp2_fma, its TFLOP/s and ratio to the default; both errors; each moving
    with its row. A record without the exp2_fma rows is refused by name."""
    from flashbook.chapters.ch6 import fp8_recorded
    rec = _fp8_record()
    v = fp8_recorded.values(rec)
    assert v["ch6_fp8_gluon_tflops_noncausal"] == 840 and v["ch6_fp8_gluon_tflops_causal"] == 672
    assert v["ch6_fp8_gluon_vs_fp16_causal"] == pytest.approx(840 / 600)
    assert v["ch6_fp8_exp2_fma_vs_mufu_noncausal"] == pytest.approx(720 / 840)
    assert v["ch6_fp8_gluon_exp2_fma_err_causal"] == pytest.approx(0.32 * 1.1)
    assert v["ch6_fp8_sass_per_key_default"] == pytest.approx(864 / 128)
    assert v["ch6_fp8_sperm_tflops_causal"] == 688
    assert v["ch6_fp8_sperm_fma4_vs_fp16_noncausal"] == pytest.approx(850 / 600)
    assert v["ch6_fp8_gluon_sperm_fma8_err_noncausal"] == pytest.approx(0.33)
    assert v["ch6_fp8_tflops_noncausal"] == 700        # the Triton kernel's figures stay
    fma = [r for r in rec["speed"] if r["kernel"] == fp8_recorded.GLUON_EXP2_FMA]
    for r, g in zip(fma, (1.01, 1.02)):
        r["tflops"] *= g
    moved = fp8_recorded.values(rec)
    assert {k for k in v if "exp2_fma_t" in k and moved[k] == v[k]} == set()
    assert fp8_recorded.plot(rec) is not None
    rec["speed"] = [r for r in rec["speed"] if r["kernel"] != fp8_recorded.GLUON_EXP2_FMA]
    with pytest.raises(ValueError, match="no ch6_attention_fp8_gluon_exp2_fma row"):
        fp8_recorded.values(rec)


def test_the_fp8_benchmark_times_the_gluon_kernel_with_its_default_config():
    """``fp8_bench.speed_cases``: attention_fp8 in each config, then attention_fp8_gluon on
    inputs with K/V scales in blocks of 256 keys and V transposed, which its default config
    (the fastest measured) takes: on a CPU the call passes every check but the device's."""
    from flashbook import fa3_fp8_launch, fp8_bench
    from flashbook.chapters.ch6 import fp8_recorded

    def quantize_blocks(x, block):           # shapes and dtypes as the solution's
        return x.to(torch.float8_e4m3fn), torch.ones(*x.shape[:-2], -(-x.shape[-2] // block))
    q, k, v = (torch.randn(1, 2, 512, 128, dtype=torch.float16) for _ in range(3))
    cases = fp8_bench.speed_cases(dict(quantize_blocks=quantize_blocks), q, k, v, True)
    assert [kernel for kernel, _, _ in cases] == [
        fp8_recorded.FP8] * len(fp8_bench.CONFIGS) + [
        fp8_recorded.GLUON, fp8_recorded.GLUON_EXP2_FMA, fp8_recorded.GLUON_SPERM,
        fp8_recorded.GLUON_SPERM_FMA4, fp8_recorded.GLUON_SPERM_FMA8, fp8_recorded.FP16,
        fp8_recorded.CUDNN]
    _, note, call = cases[len(fp8_bench.CONFIGS)]
    assert call.func is fa3_fp8_launch.attention_fp8_gluon and call.keywords["block_n"] == 256
    assert fa3_fp8_launch.default_config(256) == fa3_fp8_launch.FASTEST
    assert note.startswith("BLOCK_M=64 BLOCK_N=256 stages=2 p_path=smem (the default)")
    assert call.args[4].shape == (1, 2, 128, 512)           # V^T
    _, fma_note, fma_call = cases[len(fp8_bench.CONFIGS) + 1]
    assert fma_call.keywords["exp2_fma"] is True and "exp2_fma" not in call.keywords
    assert fma_note == note + ", exp2_fma=True"
    _, eighth_note, eighth = cases[len(fp8_bench.CONFIGS) + 4]
    assert eighth.keywords["p_path"] == "sperm" and eighth.keywords["exp2_fma"] == 3
    assert eighth_note == note.replace("p_path=smem (the default)", "p_path=sperm") + \
        ", exp2_fma=3"
    assert eighth.args[4].vt.shape == (1, 2, 128, 512)      # V^T, its keys permuted
    assert torch.equal(eighth.args[4].vt, fa3_fp8_launch.permute_keys(call.args[4]).vt)
    with pytest.raises(ValueError, match="CUDA GPU"):
        call()


def test_the_fp8_benchmark_times_the_default_tiles_first():
    """fp8_bench's first config is what ``attention_fp8`` runs by default, the row the book
    quotes (``fp8_recorded.default_config``)."""
    import inspect

    from flashbook import fp8_bench
    p = inspect.signature(ch6.attention_fp8).parameters
    assert fp8_bench.CONFIGS[0] == tuple(p[k].default for k in
                                         ("block_m", "block_n", "num_warps", "num_stages"))


def test_the_quoted_fp8_profile_figures_are_read_from_the_stored_profile(tmp_path):
    """Section 8's ch6_fp8_prof_* are the stored Nsight Compute report's numbers (tensor and XU
    pipes, issue slots, no eligible warp, ncu's clock, the GPU): each moves when its line
    does, and a report without one of the lines is refused by name."""
    import re

    from flashbook.chapters.ch6 import fp8_recorded
    text = fp8_recorded.PROFILE.read_text()
    before = fp8_recorded.profile_values()
    assert before["ch6_fp8_prof_gpu"] == re.search(r"# gpu: NVIDIA ([^,]+),", text).group(1)
    assert before["ch6_fp8_prof_issue"] == float(
        re.search(r"Issue Slots Busy\s+%\s+([\d.]+)", text).group(1))
    assert 0 < before["ch6_fp8_prof_tensor"] < 100 and 0 < before["ch6_fp8_prof_xu"] < 100
    moved = re.sub(r"(_active\s+%\s+|Busy\s+%\s+|No Eligible\s+%\s+|Frequency\s+Ghz\s+)([\d.]+)",
                   lambda m: m.group(1) + str(float(m.group(2)) + 1), text)
    moved = moved.replace("# gpu: NVIDIA H100 80GB HBM3", "# gpu: NVIDIA H200")
    path = tmp_path / fp8_recorded.PROFILE.name
    path.write_text(moved)
    after = fp8_recorded.profile_values(path)
    assert [k for k in before if after[k] == before[k]] == []
    path.write_text(text.replace("sm__inst_executed_pipe_xu", "sm__inst_executed_pipe"))
    with pytest.raises(ValueError, match=f"{path.name} has no xu"):
        fp8_recorded.profile_values(path)
