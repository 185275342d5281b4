"""Known-wrong answers to Chapter 2's exercises; each must lose points.

Each variant replaces the source of one solution cell (named by its grade_id). The variants are
the solution's own cell with one realistic mistake edited in (so they follow the solution when
it changes); every edit is checked to apply exactly once.
"""
from pathlib import Path

from flashbook import notebooks

_ROOT = Path(__file__).resolve().parents[2]


def _cells() -> dict:
    nb = notebooks.read_source(notebooks.chapter("ch2", _ROOT).source)
    return {notebooks.grade_meta(c)["grade_id"]: c.source for c in nb.cells if notebooks.is_solution(c)}


_SOURCES = _cells()


def _edit(grade_id: str, *edits) -> dict:
    src = _SOURCES[grade_id]
    for old, new in edits:
        if src.count(old) != 1:
            raise AssertionError(f"known-wrong edit for {grade_id} does not apply once: {old!r}")
        src = src.replace(old, new)
    return {"grade_id": grade_id, "source": src}


_LIT, _BND, _CFG, _ROWS, _TILED = ("ch2_fa1_literal", "ch2_fa1_bounded", "ch2_launch_config",
                                   "ch2_fa2_rows", "ch2_fa2_tiled")

VARIANTS = {
    # ---------------------------------------------------------------- Exercise 1: the port
    "literal_missing_rescale_of_old_output": _edit(_LIT, (
        "O[o] = (row_l_prev * alpha * O[o] + beta * pv) / row_l_new",
        "O[o] = (alpha * O[o] + beta * pv) / row_l_new")),
    "literal_without_scale": _edit(_LIT, (
        "                acc *= scale\n", "")),
    "literal_only_one_syncthreads": _edit(_LIT, (
        "        cuda.syncthreads()                         # (2) nobody still reads K_j, V_j\n", "")),
    "literal_barrier_before_the_loads": _edit(_LIT, (
        "        for x in range(d):                         # thread tx loads row tx of K_j and V_j\n",
        "        cuda.syncthreads()\n        for x in range(d):\n"), (
        "        cuda.syncthreads()                         # (1) all rows of K_j, V_j are loaded\n", "")),
    "literal_m_l_not_written_back": _edit(_LIT, (
        "            m[lm_offset + Br * i + tx] = row_m_new\n"
        "            l[lm_offset + Br * i + tx] = row_l_new\n", "")),
    # ---------------------------------------------------------- Exercise 2: bounds
    "bounded_no_tail_guard": {"grade_id": _BND, "source": _SOURCES[_LIT].replace(
        "fa1_literal_kernel", "fa1_bounded_kernel")},
    "bounded_guards_loads_not_stores": _edit(_BND, (
        "            if valid:                              # no stores for phantom rows\n",
        "            if True:\n")),
    "bounded_zeros_but_no_minus_inf": _edit(_BND, (
        "                if j * Bc + y < N:\n", "                if True:\n")),
    "bounded_barrier_inside_the_guard": _edit(_BND, (
        "        cuda.syncthreads()                         # (1) every thread reaches it\n",
        "        if kv_row < N:\n            cuda.syncthreads()\n")),
    "bounded_first_tile_state_not_reset": _edit(_BND, (
        "            row_m_prev = float32(-math.inf)\n            row_l_prev = float32(0.0)\n"
        "            if valid:\n",
        "            row_m_prev = float32(0.0)\n            row_l_prev = float32(1.0)\n"
        "            if j > 0 and valid:\n")),
    # ------------------------------------------------------ Exercise 3: launch config
    "smem_miscounted_without_S": _edit(_CFG, (
        "    return 4 * (3 * Bc * d + Bc * Br)", "    return 4 * (3 * Bc * d)")),
    "smem_in_floats_not_bytes": _edit(_CFG, (
        "    return 4 * (3 * Bc * d + Bc * Br)", "    return 3 * Bc * d + Bc * Br")),
    "launch_config_prints_instead_of_raising": _edit(_CFG, (
        "        raise ValueError(f\"launch_config: the kernel needs",
        "        print(f\"launch_config: the kernel needs")),
    "launch_config_ignores_max_smem": _edit(_CFG, (
        "    limit = ch2.DEFAULT_SMEM_LIMIT if max_smem is None else max_smem",
        "    limit = ch2.DEFAULT_SMEM_LIMIT")),
    "launch_config_no_argument_checks": _edit(_CFG, (
        "        if not isinstance(value, int) or value < 1:", "        if False:"), (
        "    if Bc != Br:", "    if False:")),
    # ------------------------------------------------------------ Exercise 4: FA2 order
    "rows_m_l_in_global_memory": _edit(_ROWS, (
        "    def kernel(Q, K, V, N, scale, O):", "    def kernel(Q, K, V, N, scale, l, m, O):")),
    "rows_acc_not_rescaled": _edit(_ROWS, (
        "            for x in range(d):\n                acc[x] *= alpha\n", "")),
    "rows_not_normalised": _edit(_ROWS, (
        "            inv = float32(1.0) / l_i\n", "            inv = float32(1.0)\n")),
    "rows_no_tail_mask": _edit(_ROWS, (
        "sc = sc * scale if k0 + y < N else float32(-math.inf)", "sc = sc * scale")),
    "rows_missing_second_barrier": _edit(_ROWS, (
        "            cuda.syncthreads()                    # (2) done with the tile before it is reloaded\n",
        "")),
    # ------------------------------------------------------ Exercise 5: register tiling
    "tiled_row_max_not_reduced_across_threads": _edit(_TILED, (
        "                for t in range(1, NTX):\n                    mt = max(mt, Ms[row, t])\n",
        "                mt = Ms[row, tx]\n")),
    "tiled_no_tail_mask": _edit(_TILED, (
        "                    if k0 + tx + NTX * c < N:\n", "                    if True:\n")),
    "tiled_missing_barrier_before_pv": _edit(_TILED, (
        "            cuda.syncthreads()                    # (3) P tile complete\n", "")),
    "tiled_l_not_rescaled": _edit(_TILED, (
        "                l_i[r] *= alpha\n", "")),
}
