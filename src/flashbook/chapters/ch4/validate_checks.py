"""Chapter 4's Exercise 3: ``validate_varlen``, the wrapper's argument checks. Each bad call
must raise a ValueError naming its argument (as a whole word); valid calls pass, one of them
while a CUDA graph is (as if) captured, reading no values on the host."""
from __future__ import annotations

import torch

from flashbook.cases import seeded
from flashbook.check import check_argument_errors, report, require_implemented
from flashbook.device import current


def _valid_call(dtype=torch.float16):
    dev = current().device
    lens_q, lens_k = (3, 0, 5), (4, 2, 5)
    q = seeded((sum(lens_q), 2, 16), 1, dtype)
    k = seeded((sum(lens_k), 2, 16), 2, dtype)
    v = seeded((sum(lens_k), 2, 16), 3, dtype)
    cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()],  # noqa: E731
                                   dtype=torch.int32, device=dev)
    return dict(q=q, k=k, v=v, cu_seqlens_q=cu(lens_q), cu_seqlens_k=cu(lens_k),
                max_seqlen_q=5, max_seqlen_k=5, window_size=(-1, -1))


def validate_cases(hidden: bool = False):
    """(what is wrong, changes to a valid call, the argument the message must name)."""
    base = _valid_call()
    dev = current().device
    i32 = dict(dtype=torch.int32, device=dev)
    cases = [
        ("cu_seqlens_q decreases", dict(cu_seqlens_q=torch.tensor([0, 5, 3, 8], **i32)),
         "cu_seqlens_q"),
        ("cu_seqlens_k ends before the keys do", dict(cu_seqlens_k=torch.tensor([0, 4, 6, 10],
                                                                                **i32)),
         "cu_seqlens_k"),
        ("cu_seqlens_q is int64", dict(cu_seqlens_q=base["cu_seqlens_q"].long()), "cu_seqlens_q"),
        ("cu_seqlens_q does not start at 0", dict(cu_seqlens_q=torch.tensor([1, 3, 3, 8], **i32)),
         "cu_seqlens_q"),
        ("max_seqlen_q shorter than the longest sequence", dict(max_seqlen_q=4), "max_seqlen_q"),
        ("window_size (-2, 0)", dict(window_size=(-2, 0)), "window_size"),
        ("k has another head dimension than q", dict(k=base["k"][..., :8].contiguous(),
                                                     v=base["v"][..., :8].contiguous()), "k"),
        ("k and v have another head count than q", dict(k=base["k"][:, :1].contiguous(),
                                                        v=base["v"][:, :1].contiguous()), "k"),
        ("q is 4-d", dict(q=base["q"][None]), "q"),
    ]
    if hidden:
        cases += [
            ("cu_seqlens_k describes another batch size", dict(
                cu_seqlens_k=torch.tensor([0, 4, 11], **i32)), "cu_seqlens_k"),
            ("cu_seqlens_q is a list", dict(cu_seqlens_q=[0, 3, 3, 8]), "cu_seqlens_q"),
            ("max_seqlen_k is a float", dict(max_seqlen_k=5.0), "max_seqlen_k"),
            ("window_size has three entries", dict(window_size=(1, 2, 3)), "window_size"),
            ("v is float32, q and k float16", dict(v=base["v"].float()), "v"),
            ("q's last dimension is strided", dict(q=base["q"].repeat(1, 1, 2)[..., ::2]), "q"),
            ("cu_seqlens_q has one entry", dict(cu_seqlens_q=torch.tensor([0], **i32),
                                                q=base["q"][:0]), "cu_seqlens_q"),
            ("v has one token fewer than k", dict(v=base["v"][:-1]), "v"),
            ("head dimension 24 (not a power of two)", {
                n: seeded((base[n].shape[0], 2, 24), 5 + i, base[n].dtype)
                for i, n in enumerate(("q", "k", "v"))}, "q"),
        ]
    return cases


def check_validate_varlen(validate, hidden: bool = False):
    """Exercise 3: every bad call raises a ValueError that names the argument; valid calls
    (lengths 0, N_q != N_k, windows, float32) pass, and one passes while a CUDA graph is
    (as if) captured without reading cu_seqlens on the host."""
    require_implemented(validate, "validate_varlen")
    valid = [("a valid call", {}), ("window (0, 0), float32", dict(
        window_size=(0, 0), **{n: t.float() for n, t in _valid_call().items()
                               if n in ("q", "k", "v")})),
             ("max_seqlen larger than needed, window (3, -1)", dict(max_seqlen_q=64,
                                                                    window_size=(3, -1)))]
    n = check_argument_errors(
        validate, [(name, {**_valid_call(), **change}) for name, change in valid],
        [(name, {**_valid_call(), **change}, arg) for name, change, arg in validate_cases(hidden)],
        title="validate_varlen", valid_hint="lengths 0 are allowed, and N_q may differ from N_k",
        consequence="The kernel would run on it and return wrong numbers or read out of bounds.",
        captured=_valid_call(),
        capture_hint="Read cu_seqlens with host_values(cu): it returns None while a graph is "
                     "captured; skip the value checks then.")
    report("validate_varlen", n, hidden=hidden)
