"""The toolkit's check harness and case type: ``cases.AttnCase`` / ``make_inputs`` /
``validate_qkv`` and ``check.run_student`` / ``check.check_attention`` (tile configs, NaN padding,
canaries, masks, GQA, varlen), on implementations that are right and ones that are wrong."""
import dataclasses
import inspect
import os
import sys

import numpy as np
import pytest
import torch

from flashbook import case_sweeps, cases, check, launcher, reference
from flashbook.cases import AttnCase
from flashbook.check import CheckFailure

GOOD = [AttnCase("square", B=2, H_q=2, N_q=9, d=8),
        AttnCase("N_q != N_k, causal", H_q=1, N_q=5, N_k=9, d=8, causal=True),
        AttnCase("more queries than keys, causal", H_q=1, N_q=6, N_k=3, d=8, causal=True),
        AttnCase("window", H_q=2, N_q=7, N_k=11, d=8, window=(2, 1)),
        AttnCase("GQA", B=1, H_q=4, H_kv=2, N_q=5, N_k=6, d=8),
        AttnCase("strided", B=2, H_q=3, N_q=4, N_k=5, d=8, layout="bnhd"),
        AttnCase("float16, scale", H_q=1, N_q=4, d=16, dtype=torch.float16, scale=0.3)]


def reference_run(q, k, v, case, cfg):
    o, lse = reference.attention(q, k, v, scale=case.scale, causal=case.causal,
                                 window=case.window, return_lse=True, dtype=torch.float64)
    return o, lse


def test_reference_passes_every_case_with_padding_and_configs(capsys):
    n = check.check_attention(reference_run, GOOD, title="ref", configs=(None, "a"), pad=64)
    assert n == 2 * len(GOOD) and "PASSED ref: 14/14 cases" in capsys.readouterr().out


def test_reference_masks_match_the_definition():
    vis = reference.visible_mask(2, 5, causal=True)
    assert vis.tolist() == [[True] * 4 + [False], [True] * 5]        # bottom-right alignment
    win = reference.visible_mask(4, 4, window=(1, 0))
    assert win.int().sum().item() == 7 and not win[3, 1] and win[3, 2]


def test_a_top_left_causal_mask_fails_and_names_the_rows():
    def top_left(q, k, v, case, cfg):
        s = (q.double() @ k.double().transpose(-1, -2)) / q.shape[-1] ** 0.5
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
        return (reference.softmax(s) @ v.double()).to(q.dtype), torch.logsumexp(s, -1).float()
    with pytest.raises(CheckFailure, match="aligned bottom-right") as e:
        check.check_attention(top_left, GOOD[1:2], title="causal")
    assert "Wrong rows" in str(e.value)


def test_gqa_heads_must_share_the_right_kv_head():
    def wrong_group(q, k, v, case, cfg):      # head h reads K/V head h % H_kv, not h // G
        rep = q.shape[1] // k.shape[1]
        return reference_run(q, k.repeat(1, rep, 1, 1), v.repeat(1, rep, 1, 1), case, cfg)
    with pytest.raises(CheckFailure, match=r"Wrong \(b, h\)"):
        check.check_attention(wrong_group, GOOD[4:5], title="gqa")


def test_config_dependent_results_and_broken_canaries_fail():
    def depends(q, k, v, case, cfg):
        o, lse = reference_run(q, k, v, case, cfg)
        # within the float32 tolerance of the reference either way, but not of each other
        return (o * (1.0 + 5e-5 if cfg == "b" else 1.0)).to(q.dtype), lse
    with pytest.raises(CheckFailure, match="must not depend on the tile size"):
        check.check_attention(depends, GOOD[:1], title="tiles", configs=("a", "b"))

    def scribbles(q, k, v, case, cfg):
        q._flashbook_canary[0][-1] = 0.0          # a store one element past the tensor
        return reference_run(q, k, v, case, cfg)
    with pytest.raises(CheckFailure, match="memory around q was overwritten"):
        check.check_attention(scribbles, GOOD[:1], title="canary", pad=8)


def test_varlen_cases_pack_sequences_and_mask_each():
    case = AttnCase("varlen", H_q=2, d=8, seqlens=(3, 0, 5), seqlens_k=(4, 2, 5), causal=True)
    q, k, v = cases.make_inputs(case, 0)
    assert q.shape == (8, 2, 8) and k.shape == (11, 2, 8)
    assert case.cu_seqlens().tolist() == [0, 3, 3, 8] and case.cu_seqlens(keys=True).dtype == torch.int32
    o, lse = cases.expected(case, q, k, v)
    assert lse.shape == (2, 8) and not torch.isnan(o).any()

    def per_sequence_ignored(q, k, v, case, cfg):   # attends across sequence boundaries
        full = AttnCase("dense", B=1, H_q=2, N_q=q.shape[0], N_k=k.shape[0], d=8, causal=True)
        o, lse = reference_run(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                               v.transpose(0, 1)[None], full, cfg)
        return o[0].transpose(0, 1), lse[0]
    with pytest.raises(CheckFailure):
        check.check_attention(per_sequence_ignored, [case], title="varlen")


@pytest.mark.parametrize("exc, text", [
    (NotImplementedError(), "not implemented yet"),
    (ValueError("q must be 4-d"), "rejected with ValueError: q must be 4-d"),
    (IndexError("index 9 is out of bounds"), "indexed past the end"),
])
def test_run_student_turns_failures_into_teaching_messages(exc, text):
    def fail():
        raise exc
    with pytest.raises(CheckFailure, match=text):
        check.run_student(fail, what="thing")
    with pytest.raises(type(exc)):
        check.run_student(fail, what="thing", passthrough=(type(exc),))


def test_stub_detection():
    def stub():
        raise NotImplementedError()

    def done():
        return 1
    assert check.is_stub(stub) and not check.is_stub(done)
    with pytest.raises(CheckFailure, match="not implemented"):
        check.require_implemented(stub, "stub")


def test_stub_detection_reads_a_functions_source_once(monkeypatch):
    """Launchers ask is_stub on every call; reading the source costs about 1 ms (Chapter 2's
    public fa2_tiled spent 1 ms of host time per call there), so it is read once per function,
    and a redefined function (a new object) is read again."""
    reads = []
    real = inspect.getsource
    monkeypatch.setattr(inspect, "getsource", lambda fn: reads.append(fn) or real(fn))

    def kernel():
        return 1
    for _ in range(5):
        assert not check.is_stub(kernel)
    assert reads == [kernel]

    def kernel():      # noqa: F811 - the student runs the cell again, with the stub
        raise NotImplementedError
    assert check.is_stub(kernel) and check.is_stub(kernel)
    assert len(reads) == 2 and reads[1] is kernel


@pytest.mark.parametrize("args, kw, text", [
    ((np.zeros((1, 1, 2, 4)),) * 3, {}, "must be a torch.Tensor"),
    ((torch.zeros(1, 2, 4),) * 3, {}, "must have 4 dimensions"),
    ((torch.zeros(1, 1, 2, 4, dtype=torch.bfloat16),) * 3, {}, "dtype"),
    ((torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4).half(), torch.zeros(1, 1, 2, 4)), {}, "share a dtype"),
    ((torch.zeros(1, 4, 2, 4), torch.zeros(1, 3, 2, 4), torch.zeros(1, 3, 2, 4)), {"gqa": True}, "multiple"),
    ((torch.zeros(1, 2, 2, 4), torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4)), {}, "shapes do not match"),
    ((torch.zeros(1, 1, 4, 2).transpose(-1, -2),) * 3, {}, "stride"),
    ((torch.zeros(1, 3, 2, 4).transpose(1, 2),) * 3, {"contiguous": "all"}, "not contiguous"),
    ((torch.zeros(1, 1, 2, 48),) * 3, {"head_dims": (16, 32)}, "head dimension d=48"),
    ((torch.zeros(1, 1, 0, 4),) * 3, {"allow_empty": False}, "empty input"),
])
def test_validate_qkv_says_what_is_wrong(args, kw, text):
    with pytest.raises(ValueError, match=text):
        cases.validate_qkv(*args, **kw)


def test_validate_qkv_accepts_gqa_and_returns_the_sizes():
    q, k = torch.zeros(2, 4, 3, 8), torch.zeros(2, 2, 5, 8)
    assert cases.validate_qkv(q, k, k, gqa=True) == (2, 4, 2, 3, 5, 8)
    with pytest.raises(ValueError, match="scale"):
        cases.validate_scale(-1.0, 8)
    assert cases.validate_scale(None, 16) == 0.25


def test_cases_describe_and_grid():
    grid = cases.grid(GOOD[:2], dtype=(torch.float32, torch.float16), causal=(False, True))
    assert len(grid) == 8 and {c.dtype for c in grid} == {torch.float32, torch.float16}
    text = dataclasses.replace(GOOD[4], window=(2, 0), logit_boost=5.0).describe()
    assert "H_q=4, H_kv=2" in text and "window=(2, 0)" in text and "logits x5" in text
    with pytest.raises(ValueError, match="multiple"):
        AttnCase("bad", H_q=3, H_kv=2)


# -------------------------------------- index tensors read on the host (issue 27: CUDA graphs)

@pytest.fixture
def reads(monkeypatch):
    """Every Tensor.tolist() call, by the tensor's id."""
    seen, tolist = [], torch.Tensor.tolist

    def counting(t):
        seen.append(id(t))
        return tolist(t)
    monkeypatch.setattr(torch.Tensor, "tolist", counting)
    return seen


def test_host_values_reads_a_tensor_once_per_state(reads):
    cu = torch.tensor([0, 3, 3, 8], dtype=torch.int32)
    assert cases.host_values(cu) == (0, 3, 3, 8) and len(reads) == 1
    assert cases.host_values(cu) == (0, 3, 3, 8) and len(reads) == 1      # remembered
    cu[2] = 5                                                             # _version bumps
    assert cases.host_values(cu) == (0, 3, 5, 8) and len(reads) == 2
    same_values = cu.clone()                                              # another tensor
    assert cases.host_values(same_values) == (0, 3, 5, 8) and len(reads) == 3
    table = torch.tensor([[1, 2], [3, 4]], dtype=torch.int32)
    assert cases.host_values(table) == ((1, 2), (3, 4))
    key = id(table)
    del table                                  # a dead tensor's entry goes with it
    assert key not in launcher._READS


def test_host_values_reads_inference_tensors_every_time(reads):
    with torch.inference_mode():
        lens = torch.tensor([4, 5], dtype=torch.int32)
    assert cases.host_values(lens) == (4, 5) and cases.host_values(lens) == (4, 5)
    assert len(reads) == 2                     # no version counter: nothing to trust


@pytest.fixture
def gpu_runtime(monkeypatch):
    """cases as a GPU runtime sees it (the tensors stay on the CPU)."""
    import types
    monkeypatch.setattr(cases, "current", lambda: types.SimpleNamespace(gpu=True))
    monkeypatch.setattr(launcher, "current", lambda: types.SimpleNamespace(gpu=True))
    monkeypatch.delenv("FLASHBOOK_CHECK_VALUES", raising=False)


def test_on_a_gpu_the_hot_path_reads_no_values_and_the_graded_checks_do(gpu_runtime, reads):
    import flashbook
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    assert cases.host_values(cu) is None and not reads          # no host sync
    with flashbook.check_values():
        assert cases.host_values(cu) == (0, 3, 8) and len(reads) == 1

    def value_check(cu):
        values = cases.host_values(cu)
        if values is not None and min(values) < 0:
            raise ValueError("cu is negative")
    bad = dict(cu=torch.tensor([-1], dtype=torch.int32))
    value_check(**bad)                                          # skipped on the hot path
    assert check.check_argument_errors(value_check, [], [("negative", bad, "cu")],
                                       title="v") == 1          # graded: read and refused
    with pytest.raises(CheckFailure, match="rejected with ValueError: cu is negative"):
        check.run_student(value_check, **bad, what="wrapper")


def test_value_checks_on_request_by_environment_and_off_in_cpu_mode(gpu_runtime, monkeypatch):
    cu = torch.tensor([0, 2], dtype=torch.int32)
    monkeypatch.setenv("FLASHBOOK_CHECK_VALUES", "1")
    assert cases.host_values(cu) == (0, 2)
    monkeypatch.undo()
    assert cases.host_values(cu) == (0, 2)                      # CPU mode: read
    with cases.check_values(False):
        assert cases.host_values(cu) is None


def _fresh_copy(module):
    """A second copy of ``module``, as the grader's fresh load of the checks makes one."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(module.__name__ + "_fresh", module.__file__)
    copy = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = copy                  # dataclasses look their module up
    try:
        spec.loader.exec_module(copy)
    finally:
        del sys.modules[spec.name]
    return copy


def test_a_graded_check_from_a_fresh_copy_turns_on_the_notebooks_value_checks_and_poison(
        gpu_runtime):
    """On a GPU the grader's check (a fresh copy of flashbook's modules) enters check_values() and
    poisoned_outputs() while the student's wrapper runs the notebook's copy: the switches must
    reach it (on an H200 Chapters 4 and 5 lost Exercise 3's and 4's points without this)."""
    fresh = _fresh_copy(launcher)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    assert cases.host_values(cu) is None
    with fresh.check_values():
        assert cases.host_values(cu) == (0, 3, 8)
    assert cases.host_values(cu) is None and "FLASHBOOK_CHECK_VALUES" not in os.environ
    with fresh.poisoned_outputs():
        assert cases.output((2,), dtype=torch.float32, device="cpu").isnan().all()
    assert "FLASHBOOK_POISON_OUTPUTS" not in os.environ
    with fresh.check_values(False):
        assert cases.host_values(cu) is None


def test_simulated_capture_refuses_host_reads_and_restores_torch():
    before = {n: vars(torch.Tensor).get(n) for n in check.HOST_READS}
    cu = torch.tensor([0, 3], dtype=torch.int32)
    with check.simulated_capture():
        assert cases.capturing() and cases.host_values(cu) is None
        for read in (lambda: cu.tolist(), lambda: cu[1].item(), lambda: cu.cpu(),
                     lambda: bool(cu[0]), lambda: int(cu[1]), lambda: cu.numpy()):
            with pytest.raises(check.HostReadDuringCapture):
                read()
    assert not cases.capturing() and cases.host_values(cu) == (0, 3)
    assert {n: vars(torch.Tensor).get(n) for n in check.HOST_READS} == before


def test_argument_check_fails_a_validator_that_reads_while_captured():
    def reads_on_the_host(cu):
        if min(cu.tolist()) < 0:
            raise ValueError("cu is negative")

    def reads_with_host_values(cu):
        values = cases.host_values(cu)
        if values is not None and min(values) < 0:
            raise ValueError("cu is negative")
    good, bad = dict(cu=torch.tensor([0, 1])), dict(cu=torch.tensor([-1]))
    args = dict(valid=[("ok", good)], invalid=[("negative", bad, "cu")], title="v",
                captured=good, capture_hint="Use host_values.")
    assert check.check_argument_errors(reads_with_host_values, **args) == 3
    with pytest.raises(CheckFailure, match=r"captured: it read a tensor on the host "
                                           r"\(Tensor.tolist\(\).*Use host_values"):
        check.check_argument_errors(reads_on_the_host, **args)


# ------------------------------------------------------------------ the random-shape sweep

def _sweep(seed, **kw):
    kw = {"block_m": 128, "block_n": 64, "tiles": 2, **kw}
    return case_sweeps.sweep("s", seed=seed, n=40, **kw)


def test_sweep_is_seeded_and_every_case_is_valid_and_has_work():
    assert _sweep(3) == _sweep(3) and _sweep(3) != _sweep(4)
    for case in _sweep(3, fold=True):
        q, k, v = cases.make_inputs(case, 0)
        o, lse = cases.expected(case, q, k, v)         # the reference accepts it
        assert o.shape == q.shape and case.H_q % case.h_kv == 0
        assert any(a and b for a, b in zip(case.seqlens, case.seqlens_k))


def test_sweep_reaches_the_tile_edges_groups_and_masks_it_is_for():
    many = [c for seed in range(5) for c in _sweep(seed)]
    lens_k = {n for c in many for n in c.seqlens_k}
    assert {0, 1, 63, 64, 65, 127, 128, 129} <= lens_k, sorted(lens_k)
    assert {c.H_q // c.h_kv for c in many} == set(range(1, 9))
    kinds = {("causal" if c.causal else "window" if c.window else "none") for c in many}
    assert kinds == {"causal", "window", "none"}
    # a few queries against more keys than one tile holds: where a tall tile's padding rows
    # hide a left band of keys (Chapter 5's two-tile bug)
    assert any(max(c.seqlens) <= 32 and max(c.seqlens_k) > 128 for c in many)
    assert not any(c.causal or c.window for seed in range(5) for c in _sweep(seed, masks=False))


def test_sweep_with_the_m_fold_puts_query_edges_at_a_tiles_positions():
    """With the M-fold a 128-row tile holds 128 / G positions: the query lengths sit at its edges."""
    edges = [n for seed in range(5) for c in _sweep(seed, fold=True, groups=(4,))
             for n in c.seqlens]
    assert {31, 32, 33, 64} & set(edges) and not {127, 129} & set(edges)


@pytest.mark.parametrize("guard", [False, True])
def test_a_stub_the_gpu_compiler_refuses_is_reported_as_not_implemented(guard):
    """On a GPU, Triton refuses a @triton.jit helper's `raise NotImplementedError()` with
    'unsupported AST node type: Raise': the check says the exercise is unfinished, and where."""
    from flashbook.check import run_student

    class CompilationError(Exception):
        pass

    def launch():
        raise CompilationError("at 3:4:\ndef visible_pairs(rows, cols, seqlen_q):\n"
                               "    # YOUR CODE HERE\n    ^\nunsupported AST node type: Raise")
    with pytest.raises(CheckFailure, match=r"not implemented yet.*Unfinished: `visible_pairs`"):
        run_student(launch, what="masked kernel", guard=guard)


def test_other_errors_of_student_code_propagate_unchanged():
    from flashbook.check import run_student
    with pytest.raises(TypeError, match="unsupported operand"):
        run_student(lambda: 1 + "a", what="x")


def test_validate_qkv_remembers_only_inputs_that_passed_and_keys_them_by_metadata():
    from flashbook.device import current
    dev = current().device
    q, k, v = (torch.randn(1, 2, 8, 16, device=dev) for _ in range(3))
    cases._QKV_PASSED.clear()
    assert cases.validate_qkv(q, k, v) == (1, 2, 2, 8, 8, 16)
    assert len(cases._QKV_PASSED) == 1
    assert cases.validate_qkv(q, k, v) == (1, 2, 2, 8, 8, 16)      # from memory
    assert len(cases._QKV_PASSED) == 1
    strided = torch.randn(1, 2, 8, 32, device=dev)[..., ::2]      # same shape, stride(-1) 2
    for _ in range(2):                                           # refused every time
        with pytest.raises(ValueError, match="contiguous in its last dimension"):
            cases.validate_qkv(strided, k, v)
    with pytest.raises(ValueError, match="must be a torch.Tensor"):
        cases.validate_qkv(q.numpy() if dev == "cpu" else [1], k, v)
    assert len(cases._QKV_PASSED) == 1



def test_a_tensor_past_32_bit_offsets_is_refused_before_any_kernel_sees_it(monkeypatch):
    """A (32, 131072, 8, 128) cache spans 2**32 elements: a kernel's int32 offsets wrap (an
    illegal memory access on an H200). Measured on a meta tensor (no memory), refused with a
    real one under a lowered limit."""
    from flashbook.device import current
    assert cases.element_span(torch.empty(32, 131072, 8, 128, device="meta")) == 2**32
    assert cases.element_span(torch.empty(4, 6)[:, ::2]) == 1 + 3 * 6 + 2 * 2
    assert cases.element_span(torch.empty(0, 5)) == 0
    t = torch.zeros(2, 3, 4, 8, device=current().device)
    cases.validate_tensor("k_cache", t, dims=4, dtypes=(torch.float32,), name="decode")
    monkeypatch.setattr(cases, "MAX_ELEMENTS", 191)
    with pytest.raises(ValueError, match="k_cache spans 192 elements .* at most 191"):
        cases.validate_tensor("k_cache", t, dims=4, dtypes=(torch.float32,), name="decode")
