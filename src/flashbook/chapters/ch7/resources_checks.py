"""Chapter 7, Exercise 5's graded check: the resources of the chapter's Blackwell kernel (shared
memory byte-exact once placed as Triton places it, tensor-memory columns, threads, launch and
correction registers), against the kernel compiled ahead of time for sm_100a
(``planner.compiled_table``) and, for more configs, against ``planner``."""
from __future__ import annotations


from flashbook.check import CheckFailure, as_int, report, require_implemented

from .planner import (BARRIER_ALIGN, PER_SLOT_BARRIERS, PER_TILE_BARRIERS, REGISTERS_PER_SM,
                      SINGLE_WARP_REGS, SOFTMAX_REGS, TABLE_CONFIGS, TILE_ALIGN, Config,
                      compiled_entry, compiled_table, place, register_budget, shared_memory,
                      smem_buffers, threads, tile_bytes, tmem_columns, tmem_columns_used,
                      warp_specialize_buffers)

__all__ = ["resource_cases", "check_resources", "resources"]


def resource_cases(hidden: bool = False) -> list[Config]:
    """Visible: the compiled table's configs (the student's figures are compared with the
    compiled kernel's). Hidden: more configs, compared with this planner (byte-exact with the
    compiled kernel wherever both exist)."""
    stored = [Config(BLOCK_N=bn, STAGES=st, CAUSAL=ca).for_inputs(d, dt)
              for d, dt, bn, st, ca in TABLE_CONFIGS]
    if not hidden:
        return stored
    more = [Config(BLOCK_N=bn, STAGES=st, CAUSAL=ca).for_inputs(d, dt)
            for d in (64, 128) for dt in ("float16",) for bn in (64, 128) for st in (1, 2, 3, 4)
            for ca in (False, True)]
    return stored + [c for c in more if c not in stored]


def _truth(config: Config) -> tuple[dict, str]:
    """What the kernel really needs: the compiled table's entry where there is one, else this
    planner (checked byte-exact against every entry)."""
    e = compiled_entry(config)
    budget = register_budget(config)
    if e is not None:
        prov = compiled_table()["provenance"]
        return (dict(shared=e["shared"], tmem=e["tmem_size"], threads=e["reqntid"],
                     launch=e["maxnreg"], budgets=set(e["setmaxnreg"])),
                f"the compiled kernel (triton {prov['triton']}, sm_100a, data/ch7_compiled.json)")
    return (dict(shared=shared_memory(config), tmem=tmem_columns(config),
                 threads=threads(config), launch=budget["launch"],
                 budgets={budget["correction"], budget["softmax"], budget["single_warp"]}),
            "the planner (byte-exact with the compiled kernel)")


def _smem_hint(config: Config, sizes: list[int]) -> str:
    from collections import Counter
    want = Counter(b for _, b, _ in smem_buffers(config))
    got = Counter(sizes)
    missing, extra = want - got, got - want
    q, k = tile_bytes(config, "q"), tile_bytes(config, "k")
    tiles = [b for b in want if b >= 1024]
    if extra and all(b // 2 in tiles or b // 2 in want for b in extra) and \
            any(b >= 2048 for b in extra):
        return " The tiles look counted in 4-byte elements: fp16 and bf16 are 2 bytes."
    if missing[2 * q] and extra[q]:
        return (f" You counted one Q tile ({q:,} B), but the CTA has two (Q0 and Q1, BLOCK_M "
                f"rows each), one per softmax warpgroup: 2 x BLOCK_M x d x 2 bytes.")
    if config.STAGES > 1 and missing[config.STAGES * k] and extra[k]:
        return (f" You counted one K (or V) tile, but each ring has STAGES={config.STAGES} "
                f"slots: STAGES x BLOCK_N x d x 2 bytes for K, the same for V.")
    barriers = sum(n for b, n in got.items() if b < 1024)
    want_b = sum(n for b, n in want.items() if b < 1024)
    if barriers != want_b:
        return (f" The kernel has {want_b} mbarrier arrays (8 bytes a barrier): "
                f"{', '.join(PER_TILE_BARRIERS)} (one per Q tile: 16 bytes each) and "
                f"{', '.join(PER_SLOT_BARRIERS)} (one per slot: 8 x STAGES bytes each); yours "
                f"lists {barriers} buffers under 1 KB.")
    return (" The kernel's buffers (bytes): "
            + ", ".join(f"{n} {b:,}" for n, b, _ in smem_buffers(config)) + ".")


def _check_case(resources, config: Config):
    what = f"kernel_resources, {config.describe()}"
    got = resources(config)
    if not isinstance(got, dict):
        raise CheckFailure(f"{what}: returned {type(got).__name__}; it should return a dict "
                           "with smem_buffers, tmem_columns, threads, launch_registers and "
                           "correction_registers.")
    missing = [k for k in ("smem_buffers", "tmem_columns", "threads", "launch_registers",
                           "correction_registers") if k not in got]
    if missing:
        raise CheckFailure(f"{what}: the dict has no {', '.join(missing)}.")
    truth, source = _truth(config)
    try:
        bufs = [(str(n), as_int(b, f"{what}: the size of smem buffer {n!r}"))
                for n, b in got["smem_buffers"]]
    except (TypeError, ValueError):
        raise CheckFailure(f"{what}: smem_buffers should be a list of (name, bytes) pairs, got "
                           f"{got['smem_buffers']!r:.200}.") from None
    align = [(n, b, TILE_ALIGN if b >= 1024 else BARRIER_ALIGN) for n, b in bufs]
    placed = place(align + warp_specialize_buffers(config))
    smem = max((o + b for _, o, b in placed), default=0)
    if smem != truth["shared"]:
        raise CheckFailure(
            f"{what}: your buffers, placed as Triton places them (planner.place, with "
            f"warp_specialize's own {sum(b for _, b, _ in warp_specialize_buffers(config))} "
            f"bytes), need {smem:,} bytes of shared memory, but the kernel needs "
            f"{truth['shared']:,} ({source}).{_smem_hint(config, [b for _, b in bufs])}")
    cols = as_int(got["tmem_columns"], f"{what}: tmem_columns")
    if cols != truth["tmem"]:
        used = tmem_columns_used(config)
        hint = (f" S0 and S1 take BLOCK_N = {config.BLOCK_N} fp32 columns each, O0 and O1 d = "
                f"{config.HEAD_DIM} each: {used} columns")
        if cols == used:
            hint += (f"; but tcgen05.alloc takes a power of two of at least 32 columns, so "
                     f"Triton allocates {truth['tmem']}.")
        elif cols > truth["tmem"]:
            hint += (". P, alpha and the row statistics take no columns of their own: they live "
                     "in S's columns (P in 16 bits, two values a column).")
        else:
            hint += ", rounded up to a power of two (at least 32)."
        raise CheckFailure(f"{what}: tmem_columns = {cols}, but the kernel allocates "
                           f"{truth['tmem']} ({source}).{hint}")
    n_threads = as_int(got["threads"], f"{what}: threads")
    if n_threads != truth["threads"]:
        raise CheckFailure(
            f"{what}: threads = {n_threads}, but the CTA has {truth['threads']} ({source}: "
            f".reqntid). The partitions have 4 + 4 + 4 + 1 + 1 + 1 = 15 warps; setmaxnreg "
            f"works per warpgroup, so Triton pads them to whole warpgroups (the example does the "
            f"same with its idle 16th warp).")
    launch = as_int(got["launch_registers"], f"{what}: launch_registers")
    if launch != truth["launch"]:
        raise CheckFailure(
            f"{what}: launch_registers = {launch}, but every thread starts with "
            f"{truth['launch']} ({source}: .maxnreg): the SM's {REGISTERS_PER_SM:,} registers "
            f"shared by the CTA's {truth['threads']} threads.")
    corr = as_int(got["correction_registers"], f"{what}: correction_registers")
    want = register_budget(config)["correction"]
    if corr != want or corr not in truth["budgets"]:
        total = 128 * (2 * SOFTMAX_REGS + corr + SINGLE_WARP_REGS)
        msg = (f"{what}: correction_registers = {corr}, but setmaxnreg gives the correction "
               f"warpgroup {want} ({source}: the setmaxnreg values are "
               f"{sorted(truth['budgets'])}): what the two softmax warpgroups (192 each) and the "
               f"warpgroup of the single-warp roles (24) leave of {REGISTERS_PER_SM:,}, per "
               f"thread of 128, rounded down to a multiple of 8.")
        if total > REGISTERS_PER_SM:
            msg += f" With {corr}: 128 x (2 x 192 + {corr} + 24) = {total:,}, too many."
        elif corr % 8:
            msg += f" setmaxnreg takes a multiple of 8, and {corr} is not."
        raise CheckFailure(msg)
    return smem, cols


def check_resources(kernel_resources, hidden: bool = False):
    """Exercise 5: the shared memory (byte-exact once placed by Triton's rule), tensor-memory
    columns, threads and register budgets of the chapter's kernel, against the kernel compiled
    ahead of time for sm_100a (the stored table) and, for more configs, the planner."""
    require_implemented(kernel_resources, "kernel_resources")
    cases = resource_cases(hidden)
    first = None
    for config in cases:
        smem, cols = _check_case(kernel_resources, config)
        first = first or (config, smem, cols)
    config, smem, cols = first
    report("kernel resources against the compiled kernel", len(cases), hidden=hidden,
           extra=f" ({config.describe()}: {smem:,} bytes of shared memory, {cols} TMEM columns)")


def resources(config: Config) -> dict:
    """The planner's answer to Exercise 5, in the exercise's form (for the demo's table)."""
    budget = register_budget(config)
    return dict(smem_buffers=[(n, b) for n, b, _ in smem_buffers(config)],
                tmem_columns=tmem_columns(config), threads=threads(config),
                launch_registers=budget["launch"], correction_registers=budget["correction"])


