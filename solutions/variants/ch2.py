"""Known-wrong answers to Chapter 2's exercises: the solution cell with one realistic mistake
edited in. Each must lose points to its bug (``expect``: a phrase of the failure message)."""
from __future__ import annotations

from flashbook.contract import Variant

_COPY, _LIT, _BND, _CFG, _ROWS, _TILED = ("ch2_tile_copy", "ch2_fa1_literal", "ch2_fa1_bounded",
                                          "ch2_launch_config", "ch2_fa2_rows", "ch2_fa2_tiled")

VARIANTS = (
    # -------------------------------------------------- warm-up: a tile through shared memory
    Variant("copy_without_barrier", _COPY, (
        ("    cuda.syncthreads()                  # every element of the tile is loaded\n", ""),),
        expect="race"),
    Variant("copy_without_bounds_guard", _COPY, (
        ("        if start + e < N * d:\n", "        if True:\n"),
        ("    if row < N:\n", "    if True:\n")), expect="past the end"),
    Variant("copy_barrier_inside_the_guard", _COPY, (
        ("    cuda.syncthreads()                  # every element of the tile is loaded\n"
         "    row = cuda.blockIdx.x * T + tx\n    if row < N:\n",
         "    row = cuda.blockIdx.x * T + tx\n    if row < N:\n        cuda.syncthreads()\n"),),
        expect="syncthreads"),
    Variant("copy_stores_the_first_row_of_the_tile", _COPY, (
        ("            Y[row * d + x] = tile[tx * d + x]", "            Y[row * d + x] = tile[x]"),),
        expect="values are wrong"),
    # ---------------------------------------------------------------- Exercise 1: the port
    Variant("literal_missing_rescale_of_old_output", _LIT, (
        ("O[o] = (row_l_prev * alpha * O[o] + beta * pv) / row_l_new",
         "O[o] = (alpha * O[o] + beta * pv) / row_l_new"),), expect="values are wrong"),
    Variant("literal_without_scale", _LIT, (
        ("                acc *= scale\n", ""),), expect="values are wrong"),
    Variant("literal_only_one_syncthreads", _LIT, (
        ("        cuda.syncthreads()                         # (2) nobody still reads K_j, V_j\n", ""),),
        expect="race"),
    Variant("literal_barrier_before_the_loads", _LIT, (
        ("        for x in range(d):                         # thread tx loads row tx of K_j and V_j\n",
         "        cuda.syncthreads()\n        for x in range(d):\n"),
        ("        cuda.syncthreads()                         # (1) all rows of K_j, V_j are loaded\n", "")),
        expect="race"),
    Variant("literal_m_l_not_written_back", _LIT, (
        ("            m[lm_offset + Br * i + tx] = row_m_new\n"
         "            l[lm_offset + Br * i + tx] = row_l_new\n", ""),), expect="values are wrong"),
    # ---------------------------------------------------------- Exercise 2: bounds
    # the literal port as the answer: no guard at all (was: the literal cell, renamed)
    Variant("bounded_no_tail_guard", _BND, (
        ("            if kv_row < N:\n", "            if True:\n"),
        ("            valid = row < N\n", "            valid = True\n"),
        ("                if j * Bc + y < N:\n", "                if True:\n")),
        expect="past the end"),
    Variant("bounded_guards_loads_not_stores", _BND, (
        ("            if valid:                              # no stores for phantom rows\n",
         "            if True:\n"),), expect="past the end"),
    Variant("bounded_zeros_but_no_minus_inf", _BND, (
        ("                if j * Bc + y < N:\n", "                if True:\n"),),
        expect="values are wrong"),
    Variant("bounded_barrier_inside_the_guard", _BND, (
        ("        cuda.syncthreads()                         # (1) every thread reaches it\n",
         "        if kv_row < N:\n            cuda.syncthreads()\n"),), expect="syncthreads"),
    Variant("bounded_first_tile_state_not_reset", _BND, (
        ("            row_m_prev = float32(-math.inf)\n            row_l_prev = float32(0.0)\n"
         "            if valid:\n",
         "            row_m_prev = float32(0.0)\n            row_l_prev = float32(1.0)\n"
         "            if j > 0 and valid:\n"),), expect="values are wrong"),
    # ------------------------------------------------------ Exercise 3: launch config
    Variant("smem_miscounted_without_S", _CFG, (
        ("    return 4 * (3 * Bc * d + Bc * Br)", "    return 4 * (3 * Bc * d)"),),
        expect="S is Br x Bc"),
    Variant("smem_in_floats_not_bytes", _CFG, (
        ("    return 4 * (3 * Bc * d + Bc * Br)", "    return 3 * Bc * d + Bc * Br"),),
        expect="a float is 4 bytes"),
    Variant("launch_config_prints_instead_of_raising", _CFG, (
        ("        raise ValueError(f\"launch_config: the kernel needs",
         "        print(f\"launch_config: the kernel needs"),), expect="did not raise"),
    Variant("launch_config_ignores_max_smem", _CFG, (
        ("    limit = ch2.DEFAULT_SMEM_LIMIT if max_smem is None else max_smem",
         "    limit = ch2.DEFAULT_SMEM_LIMIT"),), expect="must be able to use it"),
    Variant("launch_config_no_argument_checks", _CFG, (
        ("        if not isinstance(value, int) or value < 1:", "        if False:"),
        ("    if Bc != Br:", "    if False:")), expect="did not raise ValueError"),
    Variant("launch_config_allows_bc_not_br", _CFG, (
        ("    if Bc != Br:", "    if False:"),), expect="Bc=16, Br=8) did not raise ValueError"),
    Variant("launch_config_allows_over_1024_threads", _CFG, (
        ("    if Bc > 1024:", "    if False:"),), expect="Bc=2048, Br=2048"),
    # ------------------------------------------------------------ Exercise 4: FA2 order
    Variant("rows_m_l_in_global_memory", _ROWS, (
        ("    def kernel(Q, K, V, N, scale, O):", "    def kernel(Q, K, V, N, scale, l, m, O):"),),
        expect="no l, m arrays"),
    Variant("rows_acc_not_rescaled", _ROWS, (
        ("            for x in range(d):\n                acc[x] *= alpha\n", ""),),
        expect="values are wrong"),
    Variant("rows_not_normalised", _ROWS, (
        ("            inv = float32(1.0) / l_i\n", "            inv = float32(1.0)\n"),),
        expect="values are wrong"),
    Variant("rows_no_tail_mask", _ROWS, (
        ("sc = sc * scale if k0 + y < N else float32(-math.inf)", "sc = sc * scale"),),
        expect="values are wrong"),
    Variant("rows_missing_second_barrier", _ROWS, (
        ("            cuda.syncthreads()                    # (2) done with the tile before it is reloaded\n",
         ""),), expect="race"),
    # ------------------------------------------------------ Exercise 5: register tiling
    Variant("tiled_row_max_not_reduced_across_threads", _TILED, (
        ("                for t in range(1, NTX):\n                    mt = max(mt, Ms[row, t])\n",
         "                mt = Ms[row, tx]\n"),), expect="values are wrong"),
    Variant("tiled_no_tail_mask", _TILED, (
        ("                    if k0 + tx + NTX * c < N:\n", "                    if True:\n"),),
        expect="values are wrong"),
    Variant("tiled_missing_barrier_before_pv", _TILED, (
        ("            cuda.syncthreads()                    # (3) P tile complete\n", ""),),
        expect="race"),
    Variant("tiled_l_not_rescaled", _TILED, (
        ("                l_i[r] *= alpha\n", ""),), expect="values are wrong"),
)
