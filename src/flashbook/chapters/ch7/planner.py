"""Chapter 7's resource planner (``planner_model``, re-exported), Exercise 5's check and the
compiled table's regeneration (``python -m flashbook.chapters.ch7.planner --out
src/flashbook/data/ch7_compiled.json``: about a minute, no GPU). ``WHAT_IFS`` change the split
of warps and registers: without them a hard-coded answer would pass every config."""
from __future__ import annotations

from collections import Counter

from flashbook.aot import FIELDS, compile_provenance, cubin_resources, ptx_resources
from flashbook.check import CheckFailure, as_int, report, require_implemented

from . import planner_model
from .planner_model import *  # noqa: F403: the model is this module's public surface

__all__ = planner_model.__all__ + ["compile_entry", "main", "check_resources", "resource_cases",
                                   "resources", "WHAT_IFS"]


# ------------------------------------------------------------------------------ the compiled table
def compile_entry(d: int, dtype: str, block_n: int, stages: int, causal: bool,
                  **split) -> dict:
    """Compile the kernel for one config (``split``: other register requests) and read what it
    needs: the metadata, the PTX's figures (``aot.ptx_resources``), the cubin's registers,
    stack, spills and UTC*MMA instructions. Needs Triton with Gluon; no GPU."""
    import re
    from . import gluon_fa4
    c = Config(BLOCK_N=block_n, STAGES=stages, CAUSAL=causal, **split).for_inputs(d, dtype)
    k = gluon_fa4.compile_for_sm100(c)
    md = k.metadata
    entry = dict(d=d, dtype=dtype, BLOCK_M=c.BLOCK_M, BLOCK_N=block_n, STAGES=stages,
                 causal=causal, shared=md.shared, tmem_size=md.tmem_size,
                 num_warps=md.num_warps, **ptx_resources(k.asm["ptx"]))
    resources, sass = cubin_resources(k.asm["cubin"], "fa4_kernel")
    entry.update(resources, utcmma=len(re.findall(r"\bUTC\w*MMA\w*\b", sass)))
    return entry


def _provenance(command: str) -> dict:
    from . import fa4_kernel
    return dict(
        what="Chapter 7's Gluon Blackwell kernel (flashbook.chapters.ch7.gluon_fa4.fa4_kernel) "
             "compiled ahead of time with the launch options and setmaxnreg requests of "
             "gluon_fa4.kernel_args",
        target="GPUTarget('cuda', 100, 32): sm_100a (B200)",
        # the SHA-256 of the device code's source
        **compile_provenance(command, fa4_kernel.__file__, ("ptxas-blackwell", "ptxas")),
        machine="no GPU: compiled on a CPU-only machine (the kernel needs an sm_100 GPU to run)",
        fields=dict(
            FIELDS,
            tmem_size="metadata.tmem_size: tensor-memory columns the CTA allocates",
            num_warps="metadata.num_warps: the partitions' warps, padded to warpgroups",
            n_regs="cuobjdump -res-usage REG: registers a thread at launch (= maxnreg)",
            utcmma="UTC*MMA instructions (tcgen05.mma) in the SASS"),
    )


def main(argv=None):
    TABLE.main(argv, "flashbook.chapters.ch7.planner", "Compile Chapter 7's Gluon kernel for "
               "sm_100a and store what it needs (no GPU needed).", TABLE_CONFIGS, compile_entry,
               _provenance)


# ------------------------------------------------------------------------------ Exercise 5
# Splits other than the kernel's (192 / 104 / 24, 4 correction warps): the CuTe example's (its
# correction gets 96), a softmax asking 184 (120), a correction warpgroup per Q tile (640 threads)
WHAT_IFS = (dict(SINGLE_WARP_REGS=32), dict(CORRECTION_WARPS=8), dict(SOFTMAX_REGS=184),
            dict(CORRECTION_WARPS=8, SOFTMAX_REGS=160, SINGLE_WARP_REGS=32))


def resource_cases(hidden: bool = False) -> list[Config]:
    """Visible: the compiled table's configs and two what-ifs of the split. Hidden: more configs
    and every what-if on several shapes."""
    stored = [Config(BLOCK_N=bn, STAGES=st, CAUSAL=ca).for_inputs(d, dt)
              for d, dt, bn, st, ca in TABLE_CONFIGS]
    visible = stored + [Config(**WHAT_IFS[0]).for_inputs(128, "float16"),
                        Config(CAUSAL=True, **WHAT_IFS[1]).for_inputs(64, "bfloat16")]
    if not hidden:
        return visible
    more = [Config(BLOCK_N=bn, STAGES=st, CAUSAL=ca).for_inputs(d, dt)
            for d in (64, 128) for dt in ("float16",) for bn in (64, 128) for st in (1, 2, 3, 4)
            for ca in (False, True)]
    more += [Config(BLOCK_N=bn, STAGES=st, **split).for_inputs(d, "bfloat16")
             for split in WHAT_IFS for d, bn, st in ((64, 64, 3), (128, 128, 1))]
    return visible + [c for c in more if c not in visible]


def _truth(config: Config) -> tuple[dict, str]:
    """What the kernel needs, and from where: the compiled entry if any, else this planner."""
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
            "the planner (byte-exact with the compiled kernel)" if config.is_the_kernels_split()
            else "the planner, for this split of warps and registers")


def _smem_hint(config: Config, sizes: list[int]) -> str:
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
    _check_registers(got, config, what, truth, source)
    return smem, cols


def _check_registers(got: dict, config: Config, what: str, truth: dict, source: str):
    """threads, launch_registers and correction_registers, each named when it is wrong."""
    parts = partition_warps(config)
    n_warps = sum(w for _, w in parts)

    def where(field: str) -> str:                  # the PTX field, for the compiled kernel
        return f"{source}: {field}" if source.startswith("the compiled") else source
    n_threads = as_int(got["threads"], f"{what}: threads")
    if n_threads != truth["threads"]:
        raise CheckFailure(
            f"{what}: threads = {n_threads}, but the CTA has {truth['threads']} "
            f"({where('.reqntid')}). The partitions have " + " + ".join(str(w) for _, w in parts)
            + f" = {n_warps} warps (CORRECTION_WARPS = {config.CORRECTION_WARPS} for the "
            f"correction, 4 for each softmax warpgroup, 1 each for the MMA, load and epilogue "
            f"warps); setmaxnreg works per warpgroup, so Triton pads them to whole warpgroups "
            f"(the example does the same with its idle 16th warp): {truth['threads'] // 32} "
            f"warps of 32 threads.")
    launch = as_int(got["launch_registers"], f"{what}: launch_registers")
    if launch != truth["launch"]:
        hint = (f" Registers are allocated 8 at a time, and {launch} is not a multiple of 8."
                if launch == REGISTERS_PER_SM // n_threads and launch % 8 else "")
        raise CheckFailure(
            f"{what}: launch_registers = {launch}, but every thread starts with "
            f"{truth['launch']} ({where('.maxnreg')}): the SM's {REGISTERS_PER_SM:,} registers "
            f"shared by the CTA's {truth['threads']} threads, rounded down to a multiple of 8."
            + hint)
    corr = as_int(got["correction_registers"], f"{what}: correction_registers")
    budget = register_budget(config)
    want = budget["correction"]
    if corr != want or corr not in truth["budgets"]:
        sm, one = config.SOFTMAX_REGS, config.SINGLE_WARP_REGS
        n_corr = 32 * config.CORRECTION_WARPS
        msg = (f"{what}: correction_registers = {corr}, but setmaxnreg gives the correction "
               f"{want} ({source}: the setmaxnreg values are {sorted(truth['budgets'])}): what "
               f"the two softmax warpgroups (SOFTMAX_REGS = {sm} a thread) and the warpgroup of "
               f"the single-warp roles (SINGLE_WARP_REGS = {one}) leave of "
               f"{REGISTERS_PER_SM:,}, shared by the correction's {n_corr} threads "
               f"(CORRECTION_WARPS = {config.CORRECTION_WARPS}), rounded down to a multiple "
               f"of 8.")
        total = 128 * (2 * sm + one) + n_corr * corr
        if total > REGISTERS_PER_SM:
            msg += (f" With {corr}: 128 x (2 x {sm} + {one}) + {n_corr} x {corr} = "
                    f"{total:,}, too many.")
        elif corr % 8:
            msg += f" setmaxnreg takes a multiple of 8, and {corr} is not."
        raise CheckFailure(msg)


def check_resources(kernel_resources, hidden: bool = False):
    """Exercise 5: shared memory (byte-exact once placed), TMEM columns, threads, launch and
    correction registers, against the sm_100a compile (``compiled_table``) or the model."""
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


if __name__ == "__main__":
    main()
