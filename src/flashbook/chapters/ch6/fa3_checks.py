"""Chapter 6, Exercise 4's check: the consumer warpgroups of the FA3-shaped Pallas kernel
(``fa3_pallas``), run in JAX's interpret mode (``interpret``), race detector on and told what
each wgmma reads up to its wait (``pallas_instruments``). Each case is one CTA (two 64-row
consumers, N_q = 128): O within fp16 tolerance of a float64 reference, ``lse2 * ln 2`` within
1e-3 of the natural-log LSE, no race, no barrier misuse, no hang. A wrong O is matched against
the classic online-softmax mistakes (``simulate``, ``BUGS``). Right values cannot show two
things, checked too: the proxy fence (``pallas_child.unfenced_reads``) and the ping-pong
(``_pingpong``, from the order log).
"""
from __future__ import annotations

import json
import math

import numpy as np
import torch

from flashbook.cases import AttnCase
from flashbook.check import CheckFailure, report, require_implemented
from flashbook.fa3_planner import Config

from . import fa3_pallas, interpret

TARGET = "flashbook.chapters.ch6.fa3_pallas:run_fa3_interpret"
TITLE = "FA3 consumer"
N_Q = fa3_pallas.CONSUMERS * fa3_pallas.BLOCK_Q        # one CTA: 128 query rows
O_TOL = (2e-3, 2e-3)         # (atol, rtol): fp16 O against float64
LSE_TOL = 1e-3               # absolute, natural log


def fa3_case(n_k: int, d: int = 64, causal: bool = False, block_kv: int = 64, stages: int = 2,
             why: str = "") -> tuple[AttnCase, Config]:
    """A case: the attention problem (one CTA's 128 query rows, fp16, named by what the case
    tests) and the kernel's tiles as the Gluon launcher takes them (BLOCK_N keys a K/V step,
    STAGES ring slots)."""
    return (AttnCase(why, H_q=1, N_q=N_Q, N_k=n_k, d=d, dtype=torch.float16, causal=causal),
            Config(BLOCK_M=fa3_pallas.BLOCK_Q, BLOCK_N=block_kv, STAGES=stages))


def describe(case: tuple[AttnCase, Config]) -> str:
    problem, tiles = case
    return (f"'N_q={N_Q}, N_k={problem.n_k}, d={problem.d}{', causal' if problem.causal else ''}, "
            f"block_kv={tiles.BLOCK_N}, {tiles.STAGES} stages"
            + (f": {problem.name}'" if problem.name else "'"))


def fa3_cases(hidden: bool = False) -> list[tuple[AttnCase, Config]]:
    if not hidden:
        return [fa3_case(384, why="6 K/V steps: each slot filled 3 times, its barrier phase wraps")]
    return [fa3_case(128, why="2 steps, each slot filled once"),
            fa3_case(256, causal=True, why="bottom-right causal mask"),
            fa3_case(320, d=128, stages=3, why="d = 128, a 3-slot ring"),
            fa3_case(512, causal=True, block_kv=128, why="causal, 128-key tiles"),
            fa3_case(192, stages=3, why="3 steps, 3 slots: nothing refilled")]


# ------------------------------------------------------------------------------------ inputs

def _inputs(case: tuple[AttnCase, Config], seed: int):
    """q (1,1,128,d), k, v (1,1,N_k,d) fp16; Q scaled up so the running max moves between tiles
    (a missing rescale shows)."""
    problem, _ = case
    rng = np.random.default_rng(seed)
    q = (1.5 * rng.standard_normal((1, 1, N_Q, problem.d))).astype(np.float16)
    k, v = (rng.standard_normal((1, 1, problem.n_k, problem.d)).astype(np.float16) for _ in "kv")
    return q, k, v


def _call(case: tuple[AttnCase, Config], seed: int) -> interpret.Call:
    (problem, tiles), (q, k, v) = case, _inputs(case, seed)
    kT = np.ascontiguousarray(np.swapaxes(k, -1, -2))
    return interpret.Call(describe(case), {"q": q, "kT": kT, "v": v},
                          dict(causal=problem.causal, stages=tiles.STAGES, block_kv=tiles.BLOCK_N),
                          thread_names=fa3_pallas.thread_names(),
                          barrier_names=fa3_pallas.barrier_names(tiles.STAGES),
                          smem_names=fa3_pallas.SMEM_NAMES)


# ------------------------------------------------------- the kernel's arithmetic, and its bugs

def simulate(q, k, v, *, block_kv: int, causal: bool = False, scale: float | None = None,
             rescale: bool = True, exp2: bool = True, log2e: bool = True,
             normalise: bool = True):
    """The consumer's arithmetic in float64, tile by tile (``q`` (N_q, d), ``k``, ``v`` (N_k, d)):
    ``(o, lse)``, LSE in natural log; each flag switches a classic mistake on (``BUGS``)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    n_q, d = q.shape
    n_k = k.shape[0]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    s_all = (q @ k.T) * (scale * (fa3_pallas.LOG2E if log2e else 1.0))
    if causal:
        keep = np.arange(n_k)[None, :] <= np.arange(n_q)[:, None] + (n_k - n_q)
        s_all = np.where(keep, s_all, -np.inf)
    m = np.full(n_q, -np.inf)
    l = np.zeros(n_q)
    acc = np.zeros((n_q, v.shape[1]))
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        for j in range(n_k // block_kv):
            s = s_all[:, j * block_kv:(j + 1) * block_kv]
            m_new = np.maximum(m, s.max(1))
            alpha = np.exp2(m - m_new)
            p = np.exp2(s - m_new[:, None]) if exp2 else np.exp(s - m_new[:, None])
            l = l * alpha + p.sum(1)
            acc = (acc * alpha[:, None] if rescale else acc) + p @ v[j * block_kv:
                                                                   (j + 1) * block_kv]
            m = m_new
        o = acc / l[:, None] if normalise else acc
        lse = (m + np.log2(l)) * fa3_pallas.LN2
    return o, lse


# (name, flags for ``simulate``, what the output matches, expect-able phrase first)
BUGS = (
    ("no_rescale", dict(rescale=False),
     "O is what you get when the accumulator is not rescaled: when the running max grows from m "
     "to m_new, multiply acc (like l) by alpha = exp2(m - m_new) before adding P V."),
    ("natural_exp", dict(exp2=False),
     "O is what you get with P = exp(s - m) where s and m are in log2 units: in the log2 domain "
     "P is exp2(s - m) (and alpha exp2(m - m_new)); mixing bases weighs the keys wrongly."),
    ("no_log2e", dict(log2e=False),
     "O is what you get when S is not multiplied by log2(e) before exp2: exp2(x) = e^(x ln 2), "
     "so that computes softmax(S ln 2). Fold log2(e) into the scale: s * (scale * log2(e))."),
    ("no_normalise", dict(normalise=False),
     "O is not divided by l: the accumulator holds sum_j exp2(s_j - m) v_j, and the softmax "
     "needs one division by l = sum_j exp2(s_j - m) at the end, after the loop."),
)


def _diagnose(case: tuple[AttnCase, Config], call: interpret.Call, got: np.ndarray) -> str:
    (problem, tiles), (q, kT, v) = case, (call.arrays[n][0, 0] for n in ("q", "kT", "v"))
    for _, flags, text in BUGS:
        want, _ = simulate(q, kT.T, v, block_kv=tiles.BLOCK_N, causal=problem.causal, **flags)
        if np.isfinite(want).all() and np.allclose(got, want, atol=5e-3, rtol=5e-3):
            return " " + text
    return ""


_HINT_VALUES = ("per step: s = (Q K^T) * (scale * log2(e)) (the mask applied), m_new = max(m, "
                "rowmax(s)), alpha = exp2(m - m_new), p = exp2(s - m_new), l = l * alpha + "
                "rowsum(p), acc = acc * alpha + p V; at the end O = acc / l and lse2 = m + "
                "log2(l). Rows 0-63 are consumer warpgroup 0's, rows 64-127 warpgroup 1's.")


def _compare(case: tuple[AttnCase, Config], call: interpret.Call, out: dict | None):
    from flashbook.compare import assert_close

    what = f"{TITLE}, case {describe(case)}"
    (problem, _), (q, kT, v) = case, (call.arrays[n][0, 0] for n in ("q", "kT", "v"))
    want_o, want_lse = fa3_pallas.reference(q, kT.T, v, causal=problem.causal)
    got_o, got_lse = (out or {}).get("o"), (out or {}).get("lse2")
    if got_o is None or got_lse is None:
        raise CheckFailure(f"{what}: the kernel returned no output.")
    got_o, got_lse = got_o[0, 0].astype(np.float64), got_lse[0, 0].astype(np.float64)
    ok = np.isfinite(got_o) & (np.abs(got_o - want_o) <= O_TOL[0] + O_TOL[1] * np.abs(want_o))
    hint = (_diagnose(case, call, got_o) if not ok.all() else "").strip()
    assert_close(torch.from_numpy(got_o), torch.from_numpy(want_o), what=f"{what}: O",
                 dims=("row", "col"), atol=O_TOL[0], rtol=O_TOL[1],
                 hint=(hint + " " if hint else "") + "The consumer's arithmetic, " + _HINT_VALUES)
    assert_close(torch.from_numpy(got_lse * fa3_pallas.LN2), torch.from_numpy(want_lse),
                 what=f"{what}: LSE (your lse2 times ln 2)", dims=("row",), atol=LSE_TOL,
                 rtol=0.0,
                 hint="return lse2 = m + log2(l) in base 2, with m the running max of the "
                      "scaled scores in log2 units (s = Q K^T * scale * log2(e)); the check "
                      "multiplies it by ln 2 to compare with the natural-log LSE.")


# ------------------------------------------------------------------------ protocol failures

_RULES = ("The consumer's rules, for each K/V step (slot = step % stages): (1) "
          "`plgpu.barrier_wait(k_full.at[slot])` before the QK^T wgmma reads `kT_ring.at[slot]`, "
          "and `plgpu.barrier_wait(v_full.at[slot])` before the PV wgmma reads "
          "`v_ring.at[slot]`; (2) arrive on `k_consumed.at[slot]` once S has been read out of "
          "its accumulator, and on `v_consumed.at[slot]` once the PV result has: a wgmma reads "
          "its SMEM operands until the warpgroup waits for it (reading `acc_ref[...]`), so a "
          "release before that lets the producer overwrite a tile still being multiplied; (3) "
          "the schedule barrier: the two consumers must arrive on it equally often. Per step "
          "each does a rendezvous (arrive, wait) between issuing the QK^T wgmma and reading S, "
          "arrives when its softmax is done and waits before the PV wgmma; warpgroup 1 adds one "
          "rendezvous before its loop and warpgroup 0 one after its loop.")


def _hint(result: interpret.Run) -> str:
    races = [r for c in result.calls for r in c["races"] if r.get("first")]
    buffers = {r.get("buffer") or "" for r in races}
    pending = {w.get("barrier") or "" for w in result.pending}
    kinds = {p["kind"] for p in result.problems}
    if any(b.startswith("kT_ring") for b in buffers):
        lead = ("The QK^T wgmma read a K^T slot that no wait on its k_full barrier covered, or "
                "the slot was refilled while it was read: rules (1) and (2). ")
    elif any(b.startswith("v_ring") for b in buffers):
        lead = ("The PV wgmma's read of a V slot is not ordered with the copy into it: the wait "
                "on v_full is missing, or v_consumed was arrived on before the PV result was "
                "read (the producer then refills V under the wgmma): rules (1) and (2). ")
    elif "schedule" in pending:
        lead = ("A warpgroup waits on the schedule barrier for an arrival that never comes: "
                "the two consumers' arrivals are unbalanced, rule (3). ")
    elif any(p.startswith(("k_consumed", "v_consumed")) for p in pending):
        lead = ("The producer waits for a release that never comes: every step must arrive "
                "once on k_consumed[slot] and once on v_consumed[slot], rule (2). ")
    elif kinds & {"completed-again", "phase-passed", "unobserved-phases"}:
        lead = "Each step waits exactly once on k_full[slot] and once on v_full[slot]. "
    else:
        lead = ""
    return lead + _RULES


def check_fa3_consumer(consumer, hidden: bool = False, *, timeout: float | None = None,
                       stall: float | None = interpret.STALL_S):
    """Exercise 4 (module docstring); hidden cases add causal masks, d = 128, 3-slot rings and
    128-key tiles."""
    require_implemented(consumer, "fa3_consumer")
    cases = fa3_cases(hidden)
    seed = 400 if hidden else 40
    calls = [_call(c, seed + i) for i, c in enumerate(cases)]
    outs = interpret.run_checked(TARGET, {"consumer": consumer}, calls, title=TITLE,
                                 hint=_hint, timeout=timeout or interpret.TIMEOUT_S,
                                 stall=stall)
    for case, call, out in zip(cases, calls, outs):
        _compare(case, call, out)
        _fence(case, out)
        _pingpong(case, out)
    tracked = all(bool(o.get("wgmma_reads_checked", False)) for o in outs if o)
    report(f"{TITLE} (Pallas Mosaic GPU, interpret mode, race detector on)", len(cases),
           ("" if tracked else " (with this JAX the race detector does not see what a wgmma "
            f"reads: tested with JAX {interpret.JAX_VERSION})")
           + interpret.unordered(outs, "the ping-pong"), hidden=hidden)


# ----------------------------------------------------------- what right values cannot show

def _fence(case: tuple[AttnCase, Config], out: dict):
    """A register store to SMEM that a wgmma (or the TMA) then reads needs ``commit_smem``
    between (``pallas_child.unfenced_reads``)."""
    unfenced = json.loads(str(out.get("unfenced", "[]")))
    if not unfenced:
        return
    u, shipped = unfenced[0], out.get("shipped", [])
    reader = "the wgmma" if u["what"] == "wgmma_ref" else "the TMA store"
    raise CheckFailure(
        f"{TITLE}, case {describe(case)}: the proxy fence is missing. Registers wrote SMEM at "
        f"{interpret.where(u['store'], shipped)}, and {reader} at "
        f"{interpret.where(u['read'], shipped)} reads it with no `plgpu.commit_smem()` between. "
        f"Register stores go to SMEM through the generic proxy, while wgmma and the TMA read "
        f"it through the async proxy; without the fence (fence.proxy.async) the tensor cores "
        f"may read P before the stores are visible to them, and multiply stale or half-written "
        f"values: a wrong O, only sometimes, on a GPU (the interpreter has one proxy and cannot "
        f"show it). Call `plgpu.commit_smem()` after `p_smem[...] = ...`, before the PV wgmma.")


def _blocks(n: int) -> list[list[int]]:
    """GEMM block j of a consumer, as indices into its wgmma issues (QK0, PV0, QK1, PV1, ...):
    the PV GEMM of step j - 1, then the QK^T GEMM of step j."""
    return [[i for i in (2 * j - 1, 2 * j) if 0 <= i < 2 * n] for j in range(n + 1)]


def _block_name(j: int, n: int) -> str:
    if j == 0:
        return "its first GEMM block (the QK^T of step 0)"
    if j == n:
        return f"its last GEMM block (the PV of step {n - 1})"
    return f"GEMM block {j} (the PV of step {j - 1} and the QK^T of step {j})"


def _pingpong(case: tuple[AttnCase, Config], out: dict):
    """The consumers' GEMM blocks take turns: warpgroup 1's block j follows warpgroup 0's, and
    0's block j + 1 follows 1's block j. From the order log: X's issue follows Y's when, before
    it, X waited on the schedule barrier for a completion an arrival of Y after its issue counts
    towards. Skipped without a log."""
    order = out.get("order")
    if order is None:
        return
    logs = {wg: [e for e in order if e.get("thread") == wg and
                 (e["op"] == "mma" or e.get("barrier") == "schedule")] for wg in (0, 1)}
    mmas = {wg: [i for i, e in enumerate(log) if e["op"] == "mma"] for wg, log in logs.items()}
    if len(mmas[0]) != len(mmas[1]) or len(mmas[0]) % 2:
        return                       # not one QK^T and one PV per step: the values show it

    def waited(wg, pos):             # the latest schedule completion wg waited for before pos
        return max([e["phase"] for e in logs[wg][:pos] if e["op"] == "wait"], default=0)

    def follows(x, ex, y, ey):       # x's wgmma number ex follows y's wgmma number ey
        after = [e["phase"] for e in logs[y][mmas[y][ey] + 1:] if e["op"] == "arrive"]
        return bool(after) and after[0] <= waited(x, mmas[x][ex])

    n = len(mmas[0]) // 2
    blocks = _blocks(n)
    for j in range(n + 1):          # wg1's block j after wg0's; wg0's block j after wg1's j - 1
        for x, y, jy in ((1, 0, j), (0, 1, j - 1)) if j else ((1, 0, 0),):
            if not follows(x, blocks[j][0], y, blocks[jy][-1]):
                raise CheckFailure(
                    f"{TITLE}, case {describe(case)}: the consumers' GEMMs do not take turns. "
                    f"Consumer warpgroup {x} issued {_block_name(j, n)} without waiting, on "
                    f"the schedule barrier, for warpgroup {y} to issue {_block_name(jy, n)}. "
                    f"Without the turns the two warpgroups issue their GEMMs together, share "
                    f"the tensor cores at half speed each, and then both run their softmax "
                    f"while the tensor cores idle (Exercise 2b's lockstep); with them, one "
                    f"warpgroup's softmax hides the other's GEMMs. {_RULES}")
