"""Chapter 7's resource planner for the Gluon Blackwell kernel (``gluon_fa4``); Exercise 5's
check (``resources_checks``) grades the student's figures against it and the compiled table.

What a configuration of the kernel costs in shared memory, tensor memory and registers, and
whether one CTA fits on an sm_100 SM (B200). Pure Python: no GPU, no Triton. Every figure is
compared with the kernel compiled ahead of time for sm_100a on a CPU machine: the stored table
``data/ch7_compiled.json`` (``compiled_table``; regenerate it with ``python -m
flashbook.chapters.ch7.planner --out src/flashbook/data/ch7_compiled.json``, about a minute) and,
in a slow test, a fresh compile.

A config fixes the head dim d (64 or 128), the 16-bit dtype, ``BLOCK_M = 128`` query rows per Q
tile (two tiles a CTA), ``BLOCK_N`` keys per K/V tile, ``STAGES`` slots of the K ring and of the V
ring, and whether the kernel masks causally (it changes what the worker warps capture).

**Shared memory** (``shared_memory``, byte-exact against ``metadata.shared``). Triton places
every buffer once (all are live together), sorted by size, largest first (ties in program
order), each at the next multiple of its alignment:

* the tiles, 128-byte swizzled (alignment 1024): Q ``2 * BLOCK_M * d * 2`` (reused for O at
  the end), K and V ``STAGES * BLOCK_N * d * 2`` each;
* the mbarriers, 8 bytes each, one array per name (alignment 16): eight per-tile arrays of 2
  (``q_full``, ``s_ready``, ``p_ready``, ``stats``, ``o_done``, ``o_ready``, ``l_ready``,
  ``epi_ready``) and four per-slot arrays of ``STAGES`` (``k_full``, ``k_free``, ``v_full``,
  ``v_free``);
* what ``gl.warp_specialize`` keeps for the worker partitions (``warp_specialize_buffers``):
  their captured arguments, packed (8 bytes a tensor-memory or tensor descriptor, ``8 + 4 *
  rank`` a shared-memory view, 4 an i32 or f32; 320 bytes for this kernel, 324 when it is causal
  and the workers also need N_Q), and one state byte per worker warp (12).

So d = 128, 2 stages: 196,608 bytes of tiles + 320 + 12 x 16 + 12 = 197,132 bytes, of the
232,448 a block may use.

**Tensor memory** (``tmem_columns``): 512 columns of 128 lanes x 32 bits per SM. The kernel
allocates S0 and S1 (``BLOCK_N`` fp32 columns each) and O0 and O1 (d each); P (16-bit, two to a
column), alpha and the final row max and sum live inside S's columns (``tmem_map``). Triton
allocates the sum rounded up to a power of two (at least 32): ``metadata.tmem_size``, the
operand of the PTX ``tcgen05.alloc``. d = 128: 2 x 128 + 2 x 128 = 512; d = 64: 384 -> 512.

**Registers** (``register_budget``): the partitions have ``CORRECTION_WARPS`` (4: the
correction, the default partition), 4, 4 (the softmax warpgroups), 1, 1 and 1 warps (MMA, load,
epilogue): 15, padded to whole warpgroups, 16 warps = 512 threads (``.reqntid 512``). The launch
gives each thread 65,536 / 512 = 128 registers, rounded down to a multiple of 8 (``.maxnreg
128``, what cuobjdump reports as REG); then ``setmaxnreg`` moves them: the softmax warpgroups
ask for ``SOFTMAX_REGS`` (192), the single-warp roles for ``SINGLE_WARP_REGS`` (24; their
warpgroup shares one budget), and the correction gets the rest, ``(65,536 - 128 x (2 x 192 +
24)) / 128`` rounded down to a multiple of 8 = 104. A softmax thread holds a whole row of S
(``BLOCK_N`` fp32 registers) — the reason for its 192; the correction moves O through registers
in 32-column chunks, so 104 are enough. The two requests are constexprs of the kernel
(``gluon_fa4.kernel_args``), and Triton's split follows the same rule for other values (192 and
32 give the correction 96, 184 and 24 give it 120). ``CORRECTION_WARPS = 8`` (a correction
warpgroup per Q tile) is a what-if this planner answers and the kernel does not build: 20 warps,
640 threads, 96 registers at launch, 48 for a correction thread.

The model's code is ``planner_model`` (which the kernel and Exercise 5's check import); this
module re-exports it and adds compiling the kernel for the table (``compile_entry``, ``main``).
"""
from __future__ import annotations

from flashbook.aot import compile_provenance, cubin_resources, write_compiled_table

from .planner_model import (B200, BARRIER_ALIGN, CAPTURE_ALIGN, COMPILED_PATH, CORRECTION_CHUNK,
                            GPU, MBARRIER_BYTES, PARTITION_WARPS, PER_SLOT_BARRIERS,
                            PER_TILE_BARRIERS, REGISTERS_PER_SM, SETMAXNREG_MAX, SETMAXNREG_MIN,
                            SINGLE_WARP_REGS, SOFTMAX_REGS, STATE_ALIGN, SUPPORTED_DTYPES,
                            SUPPORTED_HEAD_DIMS, TABLE_CONFIGS, TILE_ALIGN, TMEM_COLUMNS,
                            TMEM_MIN_ALLOC, Config, Verdict, best, candidates, compiled_entry,
                            compiled_table, feasible, partition_warps, place, register_budget,
                            shared_memory, shared_memory_layout, smem_buffers, threads,
                            tile_bytes, tmem_columns, tmem_columns_used, tmem_map,
                            warp_specialize_buffers, warps)
from .resources_checks import check_resources, resource_cases, resources

__all__ = ["Config", "GPU", "B200", "Verdict", "SUPPORTED_HEAD_DIMS", "SUPPORTED_DTYPES",
           "TMEM_COLUMNS", "REGISTERS_PER_SM", "SOFTMAX_REGS", "SINGLE_WARP_REGS",
           "PARTITION_WARPS", "tile_bytes", "smem_buffers", "warp_specialize_buffers", "place",
           "shared_memory_layout", "shared_memory", "tmem_map", "tmem_columns_used",
           "tmem_columns", "partition_warps", "warps", "threads", "register_budget", "feasible",
           "candidates", "best", "COMPILED_PATH", "compiled_table", "compiled_entry", "compile_entry",
           "check_resources", "resource_cases", "resources"]


def compile_entry(d: int, dtype: str, block_n: int, stages: int, causal: bool,
                  **split) -> dict:
    """Compile the chapter's kernel (``gluon_fa4.compile_for_sm100``) for one config and read
    what it needs: ``metadata.shared``, ``metadata.tmem_size`` and ``metadata.num_warps``; from
    the PTX the ``tcgen05.alloc`` operand, ``.reqntid``, ``.maxnreg``, the ``setmaxnreg``
    values and the MMAs (SS: both operands in shared memory; TS: A in tensor memory); from the
    cubin (``cuobjdump``, bundled with Triton) the registers, the stack and the spill
    instructions. ``split``: other register requests (``SOFTMAX_REGS``, ``SINGLE_WARP_REGS``).
    Needs Triton with Gluon; no GPU."""
    import re
    from . import gluon_fa4
    c = Config(BLOCK_N=block_n, STAGES=stages, CAUSAL=causal, **split).for_inputs(d, dtype)
    k = gluon_fa4.compile_for_sm100(c)
    ptx = k.asm["ptx"]
    md = k.metadata
    mma = re.findall(r"tcgen05\.mma\.cta_group::1\.kind::f16\s+\[[^\]]*\],\s*(\[?)", ptx)
    entry = dict(d=d, dtype=dtype, BLOCK_M=c.BLOCK_M, BLOCK_N=block_n, STAGES=stages,
                 causal=causal, shared=md.shared, tmem_size=md.tmem_size,
                 num_warps=md.num_warps,
                 tmem_alloc=[int(x) for x in re.findall(r"tcgen05\.alloc\S*\s+\[[^\]]*\],\s*(\d+);",
                                                         ptx)],
                 reqntid=int(re.search(r"\.reqntid (\d+)", ptx).group(1)),
                 maxnreg=int(re.search(r"\.maxnreg (\d+)", ptx).group(1)),
                 setmaxnreg=sorted({int(x) for x in
                                    re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+);",
                                               ptx)}),
                 mma_ss=sum(1 for a in mma if not a), mma_ts=sum(1 for a in mma if a),
                 tma_loads=len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.shared::\w+\.global",
                                          ptx)),
                 tma_stores=len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared::\w+",
                                           ptx)))
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
            shared="metadata.shared: bytes of dynamic shared memory a block needs",
            tmem_size="metadata.tmem_size: tensor-memory columns the CTA allocates",
            tmem_alloc="the operand of each tcgen05.alloc in the PTX (columns)",
            num_warps="metadata.num_warps: the partitions' warps, padded to warpgroups",
            reqntid="PTX .reqntid: threads per CTA",
            maxnreg="PTX .maxnreg: registers a thread at launch",
            setmaxnreg="the values of every setmaxnreg in the PTX (the roles' budgets and "
                       "Triton's own: 256 while the CTA sets up, 80 for idle worker warps)",
            mma_ss="tcgen05.mma instructions with A and B in shared memory (S = Q K^T)",
            mma_ts="tcgen05.mma instructions with A in tensor memory (O += P V)",
            tma_loads="TMA loads (cp.async.bulk.tensor global -> shared) in the PTX",
            tma_stores="TMA stores (cp.async.bulk.tensor shared -> global) in the PTX",
            n_regs="cuobjdump -res-usage REG: registers a thread at launch (= maxnreg)",
            stack="cuobjdump -res-usage STACK: bytes of local memory per thread",
            spill_stores="STL instructions in the SASS (cuobjdump -sass)",
            spill_loads="LDL instructions in the SASS",
            utcmma="UTC*MMA instructions (tcgen05.mma) in the SASS"),
    )


# ------------------------------------------------------------------------------ regenerate
def main(argv=None):
    import argparse
    p = argparse.ArgumentParser(description="Compile Chapter 7's Gluon kernel for sm_100a and store what it needs (no GPU needed).")
    p.add_argument("--out", default=str(COMPILED_PATH))
    args = p.parse_args(argv)
    write_compiled_table(args.out, "flashbook.chapters.ch7.planner", argv, TABLE_CONFIGS, compile_entry, _provenance)


if __name__ == "__main__":
    main()
