"""Chapter 6's FP8 forward in Gluon (the toolkit's ``fa3_fp8_kernel`` and ``fa3_fp8_launch``,
FA3's roles with e4m3 GEMMs; ``ch6.attention_fp8_gluon``) on a CPU: the wrapper's argument
checks and default config, V^T's key permutation of the "perm" paths, and the kernel compiled
for sm_90a without a GPU (both GEMMs e4m3 wgmma, P V's A operand from registers or shared
memory as ``p_path`` says, no warp shuffle moving P on the permuted paths, the shared memory
within an H100's block). Its speed on a GPU: ``python -m flashbook.fp8_bench``."""
import inspect

import pytest
import torch

from aot_compile import compile_script, too_big
from flashbook import fa3_fp8_launch as launch
from flashbook.chapters import ch6
from flashbook.fa3_planner import Config
from flashbook.planning import H100

E4M3 = torch.float8_e4m3fn


def _inputs(B=1, H=2, N_q=256, N_k=256, d=64, block_m=64, block_n=128):
    q8 = torch.zeros(B, H, N_q, d).to(E4M3)
    k8 = torch.zeros(B, H, N_k, d).to(E4M3)
    vt8 = torch.zeros(B, H, d, N_k).to(E4M3)
    qs = torch.ones(B, H, -(-N_q // block_m))
    ks, vs = (torch.ones(B, H, -(-N_k // block_n)) for _ in range(2))
    return dict(q8=q8, qs=qs, k8=k8, ks=ks, vt8=vt8, vs=vs)


def test_valid_inputs_on_a_cpu_are_refused_for_the_device_alone():
    with pytest.raises(ValueError, match="CUDA GPU"):
        launch.attention_fp8_gluon(**_inputs())
    with pytest.raises(ValueError, match="CUDA GPU"):                # odd lengths are fine
        launch.attention_fp8_gluon(**_inputs(N_q=100, N_k=77), causal=True)
    args = _inputs(N_k=77)                                # V^T permuted for "sperm"
    args["vt8"] = launch.permute_keys(args["vt8"])
    with pytest.raises(ValueError, match="CUDA GPU"):
        launch.attention_fp8_gluon(**args, p_path="sperm")


@pytest.mark.parametrize("change, kwargs, message", [
    ("q8", dict(q8=torch.zeros(1, 2, 256, 64, dtype=torch.float16)), "q8 must be a 4-D float8"),
    ("vt8", dict(vt8=torch.zeros(1, 2, 256, 64).to(E4M3)), "vt8 .* \\(V transposed\\)"),
    ("k8", dict(k8=torch.zeros(1, 2, 128, 64).to(E4M3)), "k8 must be"),
    ("d", dict(q8=torch.zeros(1, 2, 256, 32).to(E4M3), k8=torch.zeros(1, 2, 256, 32).to(E4M3),
               vt8=torch.zeros(1, 2, 32, 256).to(E4M3)), "head dim d=32"),
    ("contiguous", dict(k8=torch.zeros(1, 2, 64, 256).to(E4M3).transpose(-1, -2)),
     "contiguous"),
    ("qs", dict(qs=torch.ones(1, 2, 2)), "qs must be contiguous float32 of shape \\(1, 2, 4\\)"),
    ("ks", dict(ks=torch.ones(1, 2, 2, dtype=torch.float16)), "ks must be"),
    ("vs", dict(vs=torch.ones(1, 2, 4)), "vs must be"),
    ("out", dict(out_dtype=torch.float32), "out_dtype"),
    ("block", dict(block_m=0), "block_m and block_n"),
    ("config type", dict(config=(64, 128, 2)), "config must be"),
    ("tile", dict(config=Config(BLOCK_M=32)), "two consumers of BLOCK_M"),
    ("scale block", dict(config=Config(BLOCK_N=256)), "BLOCK_N=256 must divide"),
    ("smem", dict(config=Config(BLOCK_N=128, STAGES=16)), "bytes of shared memory"),
    ("p_path", dict(p_path="tmem"), "p_path must be one of"),
    ("exp2_fma", dict(exp2_fma="yes"), "exp2_fma must be True or False"),
    ("exp2_fma n", dict(exp2_fma=4), "or n in 0..3"),
    ("sperm vt8", dict(p_path="sperm"), "takes vt8 as permute_keys\\(V\\^T\\) .* not V\\^T itself"),
    ("perm vt8 width", dict(p_path="perm", vt8=launch.PermutedKeys(
        torch.zeros(1, 2, 64, 250).to(E4M3))), "vt8 .* \\(permute_keys\\(V\\^T\\)\\)"),
    ("permuted vt8 to smem", dict(vt8=launch.PermutedKeys(torch.zeros(1, 2, 64, 256).to(E4M3))),
     "'smem' takes vt8 as V\\^T itself, not permute_keys"),
])
def test_bad_arguments_are_refused_with_a_clear_value_error(change, kwargs, message):
    args = _inputs()
    extra = {k: kwargs.pop(k) for k in ("out_dtype", "block_m", "config", "p_path", "exp2_fma")
             if k in kwargs}
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        launch.attention_fp8_gluon(**args, **extra)


def test_a_repeated_call_reuses_its_plan_and_a_new_one_is_still_checked(monkeypatch):
    """The checks, config, grid and descriptors are worked out once per inputs' metadata: a
    call with new tensors of the same metadata launches at once, on its own tensors (the kept
    descriptors rebased), and V^T is padded per call where N_k % 16; new metadata and bad
    arguments are checked again. The GPU is faked: no kernel runs on a CPU."""
    launched, checked = [], []
    real_validate = launch._validate
    monkeypatch.setattr(launch, "require_sm90", lambda *a: None)
    monkeypatch.setattr(launch, "_validate", lambda *a: checked.append(1) or real_validate(*a))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)   # a CPU tensor's index

    class FakeLaunch:
        def __init__(self, kernel, grid, args, kwargs):
            self.grid, self.args, self.kwargs = grid, args, kwargs

        def __call__(self, *tensors):
            launched.append((self, tensors))
    monkeypatch.setattr(launch, "Launch", FakeLaunch)
    launch._FP8_PLANS.clear()
    first, second = _inputs(N_q=256, N_k=256), _inputs(N_q=256, N_k=256)
    launch.attention_fp8_gluon(**first)
    launch.attention_fp8_gluon(**second)
    assert len(checked) == 1 and launched[0][0] is launched[1][0]      # one plan, two launches
    for (_, tensors), inputs in zip(launched, (first, second)):
        q_desc, k_desc, vt_desc, o, qs, ks, vs = tensors
        assert (q_desc.base, k_desc.base, vt_desc.base) == (inputs["q8"], inputs["k8"],
                                                            inputs["vt8"])
        assert qs is inputs["qs"] and o.shape == inputs["q8"].shape
    assert launched[0][0].grid == (2, 2) and launched[0][0].args[:2] == (256, 256)
    odd = _inputs(N_q=100, N_k=77)                   # new metadata: checked, V^T padded to 80
    odd["vt8"] = torch.randn(1, 2, 64, 77).to(E4M3)
    launch.attention_fp8_gluon(**odd, causal=True)
    assert len(checked) == 2
    vt_desc = launched[-1][1][2]
    assert vt_desc.base.shape[-1] == 80 and torch.equal(vt_desc.base[..., :77].float(),
                                                        odd["vt8"].float())
    assert not vt_desc.base[..., 77:].float().any()
    with pytest.raises(ValueError, match="out_dtype"):        # a bad call finds no plan
        launch.attention_fp8_gluon(**first, out_dtype=torch.float32)


def test_chapter_6_exports_the_launcher_on_first_use():
    assert ch6.attention_fp8_gluon is launch.attention_fp8_gluon
    assert "attention_fp8_gluon" in ch6.__all__


@pytest.mark.parametrize("block_n, tiles", [(256, (64, 256, 2)), (512, (64, 256, 2)),
                                            (128, (64, 128, 3)), (384, (64, 128, 3))])
def test_the_default_config_follows_the_scales_block(block_n, tiles):
    """With no config: 64 x 256 in two stages (the fastest measured) where 256 divides the K/V
    scales' block, else 64 x 128 in three; P staged in shared memory, within an H100's block at
    both head dims."""
    c = launch.default_config(block_n)
    assert (c.BLOCK_M, c.BLOCK_N, c.STAGES) == tiles and c.OVERLAP and c.CONSUMERS == 2
    for fn in (launch.attention_fp8_gluon, launch.compile_for_sm90):
        assert inspect.signature(fn).parameters["p_path"].default == "smem"
    for d in (64, 128):
        assert launch.shared_memory(c, d, "smem") <= H100.smem_per_block
    with pytest.raises(ValueError, match="CUDA GPU"):   # the default passes every other check
        launch.attention_fp8_gluon(**_inputs(N_k=1000, block_n=block_n), block_n=block_n)


@pytest.mark.parametrize("block_n", [64, 96, 200])
def test_no_default_config_for_a_scales_block_off_128(block_n):
    with pytest.raises(ValueError, match=f"multiple of 128 keys .* got block_n={block_n}\\."):
        launch.attention_fp8_gluon(**_inputs(block_n=block_n), block_n=block_n)


def test_a_config_that_fits_a_block_of_64_is_taken():
    with pytest.raises(ValueError, match="CUDA GPU"):
        launch.attention_fp8_gluon(**_inputs(block_n=64), block_n=64,
                                   config=Config(BLOCK_M=64, BLOCK_N=64, STAGES=2))


def test_shared_memory_counts_one_byte_an_element():
    c = Config(BLOCK_M=64, BLOCK_N=128, STAGES=3)
    assert launch.shared_memory(c, 128) == (2 * 64 + 6 * 128) * 128 + 16 * 8
    assert launch.shared_memory(c, 128, "smem") == launch.shared_memory(c, 128) + 2 * 64 * 128


def test_perm_32_gives_each_thread_of_a_quad_its_own_keys():
    """Thread q of a quad holds keys 8j + 2q + e of each 32 in S's accumulator (j < 4, e < 2)
    and columns 4q..4q+3, 16+4q..16+4q+3 in wgmma's fp8 A layout: PERM_32 maps the second set
    onto the first, a bijection of the 32."""
    perm = launch.PERM_32
    assert sorted(perm) == list(range(32))
    for q in range(4):
        cols = [4 * q + i for i in range(4)] + [16 + 4 * q + i for i in range(4)]
        assert sorted(perm[k] for k in cols) == sorted(8 * j + 2 * q + e for j in range(4)
                                                        for e in range(2))


def test_permuted_keys_leave_p_v_unchanged():
    """P's columns relabelled as the kernel does (column k <- key PERM_32[k]) times V^T with
    its keys permuted by ``permute_keys`` is P V; keys past N_k are zeros."""
    g = torch.Generator().manual_seed(0)
    N_k, d = 77, 16
    v = torch.randint(-8, 8, (1, 1, N_k, d), generator=g).float()
    vt8 = v.transpose(-1, -2).contiguous().to(E4M3)
    vtp = launch.permute_keys(vt8).vt
    assert vtp.shape == (1, 1, d, 96) and vtp.dtype == E4M3 and vtp.is_contiguous()
    p = torch.randint(0, 9, (5, 96), generator=g) / 8.0     # exact sums in any order
    p[:, N_k:] = 0.0                                  # masked keys
    idx = torch.tensor([32 * (k // 32) + launch.PERM_32[k % 32] for k in range(96)])
    got = p[:, idx] @ vtp[0, 0].float().T             # what wgmma sums over k
    want = p[:, :N_k] @ v[0, 0]
    assert torch.equal(got, want)
    assert not vtp[0, 0].float()[:, idx >= N_k].any()


AOT = r'''
import re
from flashbook.aot import cubin_resources, sass_loops
from flashbook import fa3_fp8_launch as launch
from flashbook.fa3_planner import Config
res = []
for d, causal, bm, bn, stages, path in ((128, False, 64, 256, 2, "default"),
                                        (128, False, 64, 128, 3, "regs"),
                                        (64, True, 64, 128, 2, "regs"),
                                        (128, False, 64, 128, 3, "smem"),
                                        (128, True, 64, 128, 3, "perm"),
                                        (128, False, 64, 128, 3, "perm4")):
    cfg = Config(BLOCK_M=bm, BLOCK_N=bn, STAGES=stages)
    if path == "default":      # attention_fp8_gluon's defaults for K/V scales in blocks of 256
        k, path = launch.compile_for_sm90(head_dim=d, causal=causal, block_n=256), "smem"
        default = k
    else:
        k = launch.compile_for_sm90(cfg, d, causal, p_path=path)
    ptx = k.asm["ptx"]
    mma = [l for l in ptx.splitlines() if "wgmma.mma_async" in l]
    usage, sass = cubin_resources(k.asm["cubin"], k.name)
    res.append(dict(cc=90, d=d, bn=bn, causal=causal, path=path, shared=k.metadata.shared,
                    planned=launch.shared_memory(cfg, d, path), mma=len(mma),
                    e4m3=sum("e4m3.e4m3" in l for l in mma),
                    a_in_registers=sum("}, {" in l for l in mma),
                    # shfl.idx with a lane in a register: data moving between threads
                    # (the one at entry broadcasts lane 0's warp id)
                    shfl_idx=len(re.findall(r"shfl\.sync\.idx\.b32\s+%r\d+, %r\d+, %r", ptx)),
                    st_shared_b16=len(re.findall(r"st\.shared\.b16", ptx)),
                    loops=sass_loops(sass), spills=usage["spill_stores"],
                    setmaxnreg=sorted({l.split()[-1] for l in ptx.splitlines()
                                       if "setmaxnreg" in l})))
# the default with half the exponentials on the FMA pipe: its main loop beside the default's
fma = launch.compile_for_sm90(head_dim=128, block_n=256, exp2_fma=True)
# P staged four keys a store, one exponential in eight on the FMA pipe
eighth = launch.compile_for_sm90(head_dim=128, block_n=256, p_path="sperm", exp2_fma=3)
res.append({label: sass_loops(cubin_resources(kk.asm["cubin"], kk.name)[1],
                              ("MUFU", "FFMA", "STSM", "STS.U16"))[0]
            for label, kk in (("default", default), ("exp2_fma", fma), ("sperm_fma8", eighth))})


def ptxas_log(path):
    """ptxas' report (``-v``) on the default tiles, 64 x 256 x 2, with P by ``path``."""
    import contextlib, io, triton
    out = io.StringIO()
    with triton.knobs.nvidia.scope(), contextlib.redirect_stdout(out):    # knobs restored after
        triton.knobs.nvidia.dump_ptxas_log = True
        launch.compile_for_sm90(launch.FASTEST, head_dim=128, block_n=256, p_path=path)
    return out.getvalue()


# P in registers at 256 keys a tile, beside P staged four keys a store
res.append({path: ptxas_log(path) for path in ("perm", "sperm")})
print("RESULT" + json.dumps(res))
'''


@pytest.mark.slow
def test_the_gluon_fp8_kernel_compiles_for_sm90_with_e4m3_wgmma(tmp_path):
    """PTX and SASS for the H100/H200: every wgmma is e4m3 x e4m3 and the tiles fit the 227 KB
    a block may use, no spills. What tells P's paths apart, in the two consumers' main loops
    (``aot.sass_loops``) and the PTX: "regs" takes P V's A from registers (4 per PV at
    K=BLOCK_N=128, k=32 each: two call sites in each of the two consumers) after warp
    shuffles (SHFL.IDX); "smem" stores P (16-bit stores) into two more tiles of shared memory
    and reads A from there; "perm" and "perm4" take A from registers with no shuffle, and
    "perm4" packs P with no byte permutes but the one merging each register's halves. The
    default config (the first) is 64 x 256 x 2 with P in shared memory. With ``exp2_fma`` its
    main loop has 64 MUFU fewer (half a thread's 128 keys) and three FFMA more for each; "sperm"
    stores P with 8 ``stmatrix`` (no 16-bit store) and with ``exp2_fma=3`` has 16 MUFU fewer.
    At the default's 64 x 256, ptxas serializes the wgmmas with P in registers and not with P
    staged (Chapter 6, Section 8)."""
    res = compile_script(AOT, tmp_path)
    logs = res.pop()
    loops = res.pop()
    assert len(res) == 6 and not too_big(res), res
    for r in res:
        assert r["mma"] > 0 and r["e4m3"] == r["mma"], r
        assert r["planned"] <= r["shared"] <= r["planned"] + 1024, r
        assert "240;" in r["setmaxnreg"] and "24;" in r["setmaxnreg"], r
        assert len(r["loops"]) == 2, r
        assert all(loop["mma"] == (r["d"] + r["bn"]) // 32 for loop in r["loops"]), r  # S, PV
        in_registers = 0 if r["path"] == "smem" else 2 * 2 * 4
        assert r["a_in_registers"] == in_registers, r
        shuffled = r["path"] == "regs"
        assert (r["shfl_idx"] > 0) == shuffled, r
        assert all((loop["SHFL.IDX"] > 0) == shuffled for loop in r["loops"]), r
        assert all((loop["STS"] >= 32) == (r["path"] == "smem") for loop in r["loops"]), r
        assert (r["st_shared_b16"] > 0) == (r["path"] == "smem"), r
    assert res[0]["planned"] == launch.shared_memory(launch.FASTEST, 128, "smem"), res[0]
    regs, perm4 = res[1]["loops"][0], res[5]["loops"][0]
    assert perm4["PRMT"] <= 16 < regs["PRMT"] and perm4["n"] < regs["n"], (regs, perm4)
    # exp2_fma: the odd keys' MUFU.EX2 (64 of a thread's 128) become FFMA work
    mufu, fma, eighth = loops["default"], loops["exp2_fma"], loops["sperm_fma8"]
    assert mufu["MUFU"] - fma["MUFU"] == 64 and fma["FFMA"] >= mufu["FFMA"] + 3 * 64, loops
    assert mufu["MUFU"] - eighth["MUFU"] == 16 and eighth["FFMA"] >= mufu["FFMA"] + 3 * 16, loops
    assert (eighth["STSM"], eighth["STS.U16"], mufu["STSM"], mufu["STS.U16"]) == (8, 0, 0, 64)
    # 64 x 256 with P in registers: while S_j's and PV_{j-1}'s wgmmas are both in flight a
    # consumer thread holds S (128 registers), O (64) and P_{j-1} (32) of its 240, and ptxas
    # runs the wgmmas one at a time (its note C7512), as Chapter 6 says; staged P leaves them
    # asynchronous
    serialized = "wgmma.mma_async instructions are serialized due to insufficient register"
    assert "C7512" in logs["perm"] and serialized in logs["perm"], logs["perm"]
    assert "C7512" not in logs["sperm"] and "Used 168 registers" in logs["sperm"], logs["sperm"]
