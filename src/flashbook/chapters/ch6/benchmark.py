"""Chapter 6 benchmark (``flashbook bench ch6``, an H100/H200): the Gluon FA3 kernel against the
students' Pallas kernel, JAX's FA3, Chapter 3/4's two-tile Triton kernel, cuDNN and FA2 (SDPA).

Cases: (B, H, N, d) in ``SHAPES``, N_q = N_k, causal and not, fp16; ``BF16_SHAPES`` in bf16.
Inputs ``torch.randn``, seeded, contiguous. Rows per case, in ``KERNELS`` order:

* ``ch6_gluon_fa3`` (reference): ``attention_fa3`` with the planner's config passed explicitly
  (the timed call does not re-plan), and a ``public`` row: the call as a reader makes it.
* ``ch6_pallas_fa3`` (variant): ``fa3_pallas.fa3_kernel`` around the ch6 solution's Exercise 4
  consumer at full size, compiled, ``default_config`` (``benchmark_jax``).
* ``jax_pallas_fa3`` (baseline): JAX's ``attention_mgpu.attention`` on (B, N, H, d) copies,
  tuned as its own benchmark (block_q 64, 2 steps, the first block_kv of (256, 128, 64) that
  fits), q pre-scaled (it applies no softmax scale).
* ``ch3_two_tiles`` (non-causal) / ``ch4_two_tiles`` (causal: Chapter 4's ``attention_varlen``
  on the packed batch, without its host checks): the same two-tile kernel; fp16 only.
* ``sdpa_cudnn``, ``sdpa_flash`` (baselines): ``bench_setups.sdpa_setup``.

Each note gives ``max|O-sdpa_cudnn|`` (``sdpa_flash``'s where cuDNN refuses), WRONG past
``TOLERANCE``; a row that fails has no ``ms`` and a note saying why. Torch rows are replayed
from CUDA graphs; JAX's, launched through XLA on its own stream (no torch graph captures it),
are timed by CUPTI (``benchmark_jax``). Every case's torch rows run before any JAX row, so no
graph is captured while JAX's runtime is live. FLOPs ``reference.attention_flops``, GB/s
``bench.attention_bytes``.
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from flashbook import bench_setups
from flashbook.bench import free_cuda_cache, join_notes, public_row, why_failed
from flashbook.bench_setups import cu_seqlens, expect, ours, refused_setup, sdpa_setup
from flashbook.cases import AttnCase
from flashbook.results import Row

GRAPH_TIMER = True
SHAPES = [(1, 16, 16384, 128), (4, 16, 4096, 128), (4, 16, 4096, 64)]
BF16_SHAPES = [(1, 16, 16384, 128)]
CAUSAL = (False, True)
REFERENCES = ("sdpa_cudnn", "sdpa_flash")
TOLERANCE = 2e-2                  # max|O - cuDNN| above this: the row's O is flagged WRONG

OURS, PALLAS, JAX_FA3 = "ch6_gluon_fa3", "ch6_pallas_fa3", "jax_pallas_fa3"
CH3, CH4 = "ch3_two_tiles", "ch4_two_tiles"
# (kernel, role, phase): phase 1 torch-timed, phase 2 JAX. Rows come out in this order per case.
KERNELS = [(OURS, "reference", 1), (PALLAS, "variant", 2), (JAX_FA3, "baseline", 2),
           (CH3, "variant", 1), (CH4, "variant", 1),
           ("sdpa_cudnn", "baseline", 1), ("sdpa_flash", "baseline", 1)]
ORDER = {name: i for i, (name, _, _) in enumerate(KERNELS)}


def shape(case: AttnCase) -> tuple:
    """(B, H, N, d) of a case: N_q = N_k = N."""
    return (case.B, case.H_q, case.N_q, case.d)


@dataclasses.dataclass
class Inputs:
    """One shape and dtype's tensors, shared by its causal and non-causal cases."""
    q: torch.Tensor            # (B, H, N, d) contiguous
    k: torch.Tensor
    v: torch.Tensor
    q_bnhd: torch.Tensor       # (B, N, H, d) contiguous copies: JAX's layout, and viewed as
    k_bnhd: torch.Tensor       # (B*N, H, d) Chapter 4's packed one
    v_bnhd: torch.Tensor
    want: dict = dataclasses.field(default_factory=dict)   # causal -> (name, O (B, H, N, d))
    extra: dict = dataclasses.field(default_factory=dict)  # e.g. the pre-scaled q for JAX

    def check(self, causal: bool):
        """``max|O-<reference>|`` of an O (B, H, N, d), flagged WRONG past ``TOLERANCE``."""
        name, want = self.want.get(causal, ("", None))
        return bench_setups.err_note(name, want, TOLERANCE)


# ------------------------------------------------------------------ helpers (CPU-testable)

def cases(shapes=SHAPES, bf16_shapes=BF16_SHAPES, causal=CAUSAL) -> list[AttnCase]:
    """fp16 at every shape, then bf16 at ``bf16_shapes``; each non-causal then causal."""
    return [AttnCase("x".join(map(str, s)), B=s[0], H_q=s[1], N_q=s[2], d=s[3], dtype=dtype,
                     causal=c)
            for dtype, group in ((torch.float16, shapes), (torch.bfloat16, bf16_shapes))
            for s in group for c in causal]


def measure(kernel: str, role: str, case: AttnCase, setup, **kw) -> Row:
    """``bench_setups.measure`` of one row of ``case``."""
    return bench_setups.measure(kernel, role, setup, **bench_setups.case_columns(case), **kw)


def sort_rows(rows: list[Row], order: list[AttnCase]) -> list[Row]:
    """Rows in case order (``order``), then in ``KERNELS`` order within a case."""
    index = {(*shape(c), str(c.dtype).replace("torch.", ""), c.causal): i
             for i, c in enumerate(order)}

    def key(r):
        return (index.get((r.B, r.H_q, r.N_q, r.d, r.dtype, r.causal), len(index)),
                ORDER.get(r.kernel, len(ORDER)))
    return sorted(rows, key=key)


def namespace(namespaces: dict, chapter: str) -> dict:
    """A chapter's solution namespace, loaded once into ``namespaces`` (RuntimeError: why not)."""
    if chapter not in namespaces:
        try:
            from flashbook import sources
            namespaces[chapter] = sources.solution_namespace(chapter)
        except Exception as e:  # noqa: BLE001 - its rows say why
            namespaces[chapter] = f"the {chapter} solution did not load: {why_failed(e)}"
    if isinstance(namespaces[chapter], str):
        raise RuntimeError(namespaces[chapter])
    return namespaces[chapter]


def make_inputs(B, H, N, d, dtype, device="cuda", seed=0) -> Inputs:
    g = torch.Generator(device=device).manual_seed(seed)
    q, k, v = (torch.randn(B, H, N, d, device=device, dtype=dtype, generator=g)
               for _ in range(3))
    return Inputs(q, k, v, *(t.transpose(1, 2).contiguous() for t in (q, k, v)))


# ------------------------------------------------------------------ phase 1: torch-timed setups

def gluon_setup(case: AttnCase, x: Inputs):
    """``attention_fa3`` with the planner's config for this problem, checked once."""
    def setup():
        from flashbook.bench import compiled, registers
        from flashbook.fa3_launch import attention_fa3, fa3_kernel, pick_config
        B, H, N, d = shape(case)
        cfg = pick_config(d, case.dtype, case.causal, B, H, N, N)
        before = compiled(fa3_kernel)
        o, _ = attention_fa3(x.q, x.k, x.v, case.causal, config=cfg)
        new = {key: c for key, c in compiled(fa3_kernel).items() if key not in before}
        note = join_notes(f"BLOCK_M={cfg.BLOCK_M} BLOCK_N={cfg.BLOCK_N} STAGES={cfg.STAGES} "
                          f"OVERLAP={cfg.OVERLAP}"
                          + (f" PERSISTENT GROUP={cfg.GROUP}" if cfg.PERSISTENT else ""),
                          registers(new) if new else "", x.check(case.causal)(o))
        return (lambda: attention_fa3(x.q, x.k, x.v, case.causal, config=cfg)), note
    return setup


def ch3_setup(case: AttnCase, x: Inputs, namespaces: dict):
    """Chapter 3's two-tile kernel (non-causal only), as ``ch3.benchmark`` calls it."""
    def setup():
        from flashbook.device import current
        from flashbook.tiles import pick_config
        attention = namespace(namespaces, "ch3")["attention_two_tiles"]
        o, _ = attention(x.q, x.k, x.v)
        cfg = pick_config(case.d, case.dtype, current().capability, two_tiles=True)
        note = join_notes(f"BLOCK_M={cfg.BLOCK_M} BLOCK_N={cfg.BLOCK_N} warps={cfg.num_warps} "
                          f"stages={cfg.num_stages}", x.check(case.causal)(o))
        return (lambda: attention(x.q, x.k, x.v)), note
    return setup


def ch4_setup(case: AttnCase, x: Inputs, namespaces: dict):
    """Chapter 4's two-tile ``attention_varlen`` (causal) on the packed batch, timed without
    its argument checks (``bench_setups.ours``)."""
    B, H, N, d = shape(case)
    packed = [t.view(B * N, H, d) for t in (x.q_bnhd, x.k_bnhd, x.v_bnhd)]
    check = x.check(case.causal)

    def setup():
        cu = cu_seqlens([N] * B, x.q.device)
        return ours(namespace(namespaces, "ch4"), "attention_varlen", (*packed, cu, cu, N, N),
                    lambda o: check(o.view(B, N, H, d).transpose(1, 2)), causal=case.causal)()
    return setup


def torch_rows(case: AttnCase, x: Inputs, namespaces: dict, kernels) -> list[Row]:
    rows = []
    for kernel, role, phase in KERNELS:
        # the two-tile kernel once a case: Chapter 3's non-causal, Chapter 4's causal
        if phase != 1 or kernel not in kernels or kernel == (CH3 if case.causal else CH4):
            continue
        if kernel == OURS:
            setup = gluon_setup(case, x)
        elif kernel == CH3:
            setup = ch3_setup(case, x, namespaces)
        elif kernel == CH4:
            setup = ch4_setup(case, x, namespaces)
        else:                                  # SDPA: its own reference's row has no check
            name = x.want.get(case.causal, ("", None))[0]
            setup = sdpa_setup(kernel, x.q, x.k, x.v, case.causal, gqa=False,
                               check=x.check(case.causal) if name != kernel else None)
        rows.append(measure(kernel, role, case, setup))
        if kernel == OURS:              # the call as a reader makes it: no config, launched
            from flashbook.fa3_launch import attention_fa3
            rows.append(public_row(rows[-1], functools.partial(
                attention_fa3, x.q, x.k, x.v, case.causal), "attention_fa3(q, k, v, causal)"))
        free_cuda_cache()
    return rows


def jax_rows(case: AttnCase, x: Inputs, namespaces: dict, kernels) -> list[Row]:
    """Phase 2: the rows JAX times (``benchmark_jax``, loaded when it runs)."""
    from . import benchmark_jax as bj
    rows = []
    for kernel, role, phase in KERNELS:
        if phase != 2 or kernel not in kernels:
            continue
        setup = bj.pallas_setup(case, x, lambda: namespace(namespaces, "ch6")) \
            if kernel == PALLAS else bj.jax_fa3_setup(case, x)
        rows.append(measure(kernel, role, case, setup, timer=bj.jax_time))
        free_cuda_cache()
    return rows


# ------------------------------------------------------------------------------ the run

def run(shapes=SHAPES, bf16_shapes=BF16_SHAPES, causal=CAUSAL, kernels=None,
        device="cuda") -> list[Row]:
    """Every row (module docstring) of ``kernels`` (default: all); a case's inputs stay on the
    GPU from phase 1 to phase 2 (about 0.4 GiB a shape)."""
    kernels = set(kernels or ORDER)
    order = cases(shapes, bf16_shapes, causal)
    namespaces: dict = {}                                 # solutions, loaded once
    inputs: dict = {}
    rows: list[Row] = []
    for case in order:                                    # phase 1: torch, CUDA graphs
        key = (shape(case), case.dtype)
        if key not in inputs:
            try:
                inputs[key] = make_inputs(*shape(case), case.dtype, device=device, seed=len(inputs))
            except Exception as e:  # noqa: BLE001 - e.g. out of memory: every row says so
                free_cuda_cache()
                inputs[key] = e
        x = inputs[key]
        if isinstance(x, Exception):
            rows += [measure(k, role, case, refused_setup(x), note="inputs")
                     for k, role, _ in KERNELS if k in kernels]
            continue
        x.want[case.causal] = expect(x.q, x.k, x.v, case.causal, REFERENCES, gqa=False)
        rows += torch_rows(case, x, namespaces, kernels)
    if any(phase == 2 and k in kernels for k, _, phase in KERNELS):
        for case in order:                                # phase 2: JAX
            x = inputs[(shape(case), case.dtype)]
            if not isinstance(x, Exception):
                rows += jax_rows(case, x, namespaces, kernels)
    inputs.clear()
    free_cuda_cache()
    return sort_rows(rows, order)
