"""Chapter 6, Exercise 3's graded check (a config planner for the chapter's Gluon kernel) and
the compiled table it grades against.

For a resolved ``planner.Config`` the student writes ``smem_bytes(config)``,
``register_budget(consumers)`` (setmaxnreg's budget once the producer dropped to 24),
``consumer_register_need(config)``, ``fits(config, device)`` (``Device``: the fields of
``torch.cuda.get_device_properties`` it needs) and ``choose(d, dtype, candidates, device,
**problem)`` (the feasible candidate ``planner.predict`` expects fastest, or None), none of them
calling the planner's own answers. ``check_planner`` grades them against the compiled kernel:
``compiled_table()`` (``data/ch6_compiled.json``: per config ``metadata.shared``, registers,
stack, spills, with provenance), else ``planner.shared_memory`` (byte-exact with it). Shared
memory may be below it by Triton's alignment padding (``SMEM_SLACK``), never above; the register
estimate must predict exactly where ptxas spilled.

``TRITON_DEFAULT_FP_FUSION=1 python -m flashbook.chapters.ch6.planner_checks --out
src/flashbook/data/ch6_compiled.json`` (without ``TRITON_INTERPRET``) regenerates the table
(about 10 minutes on two cores); ``tests/test_ch6_planner.py`` recompiles two entries.
"""
from __future__ import annotations

import dataclasses

from flashbook.aot import FIELDS, compile_provenance, cubin_resources
from flashbook.check import CheckFailure, as_int, report, require_implemented
from flashbook import fa3_planner as planner
from flashbook.fa3_planner import Config
from flashbook.planning import (H100_PROPS, H200_PROPS, MBARRIER_BYTES,
                                CompiledTable, Device, as_bool, forbid_calls)

# gl.warp_specialize keeps, in shared memory, the arguments it hands the worker partitions
# (220 bytes for this kernel, planner.CAPTURE_BYTES) and 4 state bytes per consumer warpgroup
WARP_SPECIALIZE_BYTES = planner.CAPTURE_BYTES + 4 * 2
REGISTERS_PER_SM = planner.REGISTERS_PER_SM
PRODUCER_REGS = planner.PRODUCER_REGS
# Triton starts every barrier array at a multiple of 16 bytes (and the first after the 220-byte
# argument block): at most 4 + 6 * 8 = 52 bytes of padding that a sum of the buffers leaves out
SMEM_SLACK = 64


def _describe(c: Config) -> str:
    return (f"d={c.HEAD_DIM} {c.DTYPE}, BLOCK_M={c.BLOCK_M}, BLOCK_N={c.BLOCK_N}, "
            f"STAGES={c.STAGES}" + ("" if c.CONSUMERS == 2 else f", CONSUMERS={c.CONSUMERS}"))


# -------------------------------------------------- the compiled table (data/ch6_compiled.json)
TABLE = CompiledTable("ch6_compiled.json", ("d", "dtype", "BLOCK_M", "BLOCK_N", "STAGES"))
COMPILED_PATH = TABLE.path
TABLE_CONFIGS = [(d, "float16", bm, bn, st) for d in (128, 64) for bm in (64, 128)
                 for bn in (64, 128, 256) for st in (2, 3, 4)] + \
                [(128, "bfloat16", 64, 128, 2), (128, "bfloat16", 128, 64, 2),
                 (64, "bfloat16", 64, 128, 3), (64, "bfloat16", 128, 128, 2)]


def _config_key(c: Config) -> tuple:
    return (int(c.HEAD_DIM), str(c.DTYPE), int(c.BLOCK_M), int(c.BLOCK_N), int(c.STAGES))


def compiled_table(path=None) -> dict:
    """``{"provenance": {...}, "configs": [entry, ...]}``: per config shared, n_regs, stack,
    spill_stores, spill_loads (STL/LDL in the SASS) and spilled (any of them)."""
    return TABLE.read(path)


def compiled_entry(config: Config, path=None) -> dict | None:
    """The compiled table's entry for ``config`` (two consumers, FA3's order), or None."""
    if config.CONSUMERS != 2 or not config.OVERLAP:
        return None
    return TABLE.entry(_config_key(config), path)


def compile_entry(d: int, dtype: str, bm: int, bn: int, stages: int) -> dict:
    """Compile the kernel for one config (``fa3_launch.compile_for_sm90``, non-causal, FA3's
    order; no GPU) and read ``metadata.shared`` and, with ``cuobjdump``, the cubin's registers,
    stack and spill instructions."""
    from flashbook import fa3_launch as gluon_fa3
    c = Config(BLOCK_M=bm, BLOCK_N=bn, STAGES=stages).for_inputs(d, dtype)
    k = gluon_fa3.compile_for_sm90(c, causal=False)
    entry = dict(d=d, dtype=dtype, BLOCK_M=bm, BLOCK_N=bn, STAGES=stages,
                 shared=k.metadata.shared)
    entry.update(cubin_resources(k.asm["cubin"], "fa3_kernel")[0])
    entry["spilled"] = bool(entry["spill_stores"] or entry["spill_loads"] or entry["stack"])
    return entry


def _provenance(command: str) -> dict:
    from flashbook import fa3_kernel
    return dict(
        what="Chapter 6's Gluon FA3 kernel (flashbook.fa3_launch.fa3_kernel) "
             "compiled ahead of time, non-causal, OVERLAP=True, two consumer warpgroups, with "
             "the launch options and setmaxnreg budgets of fa3_launch.kernel_args",
        target="GPUTarget('cuda', 90, 32): sm_90a (H100/H200)",
        **compile_provenance(command, fa3_kernel.__file__),     # the device code's source
        fields=dict(
            {f: FIELDS[f] for f in ("shared", "stack", "spill_stores", "spill_loads")},
            n_regs="registers a thread at launch (cuobjdump -res-usage REG; what the driver "
                   "reports as the kernel's n_regs): the maxnreg of 168, before setmaxnreg "
                   "moves registers from the producer to the consumers",
            spilled="any of stack, spill_stores, spill_loads"),
        machine="no GPU: compiled on a CPU-only machine",
    )


def main(argv=None):
    """Regenerate the compiled table."""
    TABLE.main(argv, "flashbook.chapters.ch6.planner_checks",
               "Compile Chapter 6's Gluon kernel for sm_90a and store what it needs (no GPU "
               "needed).", TABLE_CONFIGS, compile_entry, _provenance)


# -------------------------------------------------------------------------------------- the cases
def planner_configs(hidden: bool = False) -> list[Config]:
    """Visible: d=128 fp16, every tile config (18, all compiled); hidden: also d=64 and bf16."""
    dims, dtypes = ((128, 64), ("float16", "bfloat16")) if hidden else ((128,), ("float16",))
    return [c for d in dims for dt in dtypes for c in planner.candidates(d, dt) if c.OVERLAP]


def _tiles(stages_list=(2, 3, 4), bms=(64, 128), bns=(64, 128, 256)) -> list[Config]:
    """Unresolved candidates (the tunables only), both orders of FA3's overlap."""
    return [Config(BLOCK_M=bm, BLOCK_N=bn, STAGES=st, OVERLAP=ov)
            for bm in bms for bn in bns for st in stages_list for ov in (True, False)]


def _small_device(kib: int) -> Device:
    return Device(f"a GPU whose blocks may use {kib} KB", 48 * 1024, kib * 1024,
                  (kib + 1) * 1024)


def choice_problems(hidden: bool = False) -> list[tuple[str, int, str, list, Device, dict]]:
    """(what, d, dtype, candidates, device, ``planner.predict``'s keywords)."""
    long = dict(B=1, H=16, N_q=16384, causal=False)
    cases = [
        ("d=128 fp16, every tile config, (1, 16, 16384) non-causal", 128, "float16", _tiles(),
         H100_PROPS, long),
        ("d=128, only 128-row consumers (none fits)", 128, "float16", _tiles(bms=(128,)),
         H100_PROPS, long),
    ]
    if hidden:
        cases += [
            ("d=64 fp16, every tile config, (1, 16, 16384) non-causal", 64, "float16", _tiles(),
             H100_PROPS, long),
            ("d=128 bf16, every tile config, (2, 32, 4096) causal on an H200", 128, "bfloat16",
             _tiles(), H200_PROPS, dict(B=2, H=32, N_q=4096, causal=True)),
            ("d=64, only 128-row consumers", 64, "float16", _tiles(bms=(128,)), H100_PROPS,
             long),
            ("d=128, no 128-key tiles", 128, "float16", _tiles(bns=(64, 256)), H100_PROPS,
             dict(B=4, H=8, N_q=8192, causal=True)),
            ("d=128 on a GPU whose blocks may use 100 KB", 128, "float16", _tiles(),
             _small_device(100), long),
            ("d=64 on a GPU whose blocks may use 64 KB", 64, "bfloat16", _tiles(),
             _small_device(64), dict(B=1, H=16, N_q=2048, causal=False)),
        ]
    return cases


# -------------------------------------------------------------------------------------- the check
def _terms(c: Config) -> dict:
    d, e = c.HEAD_DIM, 2
    return dict(q_tile=c.BLOCK_M * d * e, kv_tile=c.BLOCK_N * d * e,
                q=c.CONSUMERS * c.BLOCK_M * d * e, kv=2 * c.STAGES * c.BLOCK_N * d * e,
                barriers=(2 * c.CONSUMERS + 4 * c.STAGES) * MBARRIER_BYTES,
                scratch=WARP_SPECIALIZE_BYTES)


def _smem_diagnosis(c: Config, got: int, want: int) -> str:
    t = _terms(c)
    model = t["q"] + t["kv"] + t["barriers"] + t["scratch"]
    known = [
        (-(c.CONSUMERS - 1) * t["q_tile"],
         f"you counted one Q tile, but each of the {c.CONSUMERS} consumer warpgroups has its "
         f"own BLOCK_M x d Q tile ({t['q_tile']:,} B each): a CTA computes "
         f"{c.CONSUMERS} x BLOCK_M query rows."),
        (-2 * (c.STAGES - 1) * t["kv_tile"],
         f"you counted one slot of K and one of V, but the ring has STAGES={c.STAGES} slots of "
         f"K and STAGES of V ({t['kv_tile']:,} B a tile): 2 x STAGES x BLOCK_N x d x 2 bytes."),
        (-c.STAGES * t["kv_tile"],
         f"you counted STAGES={c.STAGES} tiles for K and V together, but K and V each need "
         f"their own STAGES slots ({t['kv_tile']:,} B a tile): 2 x STAGES x BLOCK_N x d x 2 "
         f"bytes."),
        (-t["barriers"],
         f"the mbarriers are missing: 8 bytes each, 2 x CONSUMERS (Q landed, ping-pong) + "
         f"4 x STAGES (K full/empty, V full/empty) = {t['barriers'] // MBARRIER_BYTES} of them."),
        (-t["scratch"],
         f"the {WARP_SPECIALIZE_BYTES} bytes gl.warp_specialize keeps for its worker warps "
         "(WARP_SPECIALIZE_BYTES) are missing."),
        (t["q"] + t["kv"], "the tiles look counted in 4-byte elements: fp16 and bf16 are 2 bytes."),
    ]
    for delta, hint in known:
        if delta and got - model == delta:
            return " " + hint[0].upper() + hint[1:]
    return (f" The kernel's buffers: Q {t['q']:,} B (CONSUMERS x BLOCK_M x d x 2), K and V "
            f"{t['kv']:,} B (2 x STAGES x BLOCK_N x d x 2), mbarriers {t['barriers']} B, "
            f"warp_specialize {t['scratch']} B; planner.shared_memory_layout(config) lists where "
            f"Triton puts each.")


def _smem_reference(c: Config) -> tuple[int, str]:
    e = compiled_entry(c)
    if e is not None:
        prov = compiled_table()["provenance"]
        return e["shared"], (f"the compiled kernel's metadata.shared: triton {prov['triton']}, "
                             f"sm_90a, data/ch6_compiled.json")
    return planner.shared_memory(c), "planner.shared_memory, byte-exact with the compiled kernel"


def _check_smem(smem_bytes, configs) -> int:
    compiled = 0
    for c in configs:
        what = f"smem_bytes, {_describe(c)}"
        got = as_int(smem_bytes(c), what)
        want, source = _smem_reference(c)
        compiled += source.startswith("the compiled")
        if not 0 <= want - got <= SMEM_SLACK:
            side = "more" if got > want else "less"
            raise CheckFailure(
                f"{what}: {got:,} bytes, but the kernel needs {want:,} ({source}). Yours is "
                f"{abs(want - got):,} bytes {side} (up to {SMEM_SLACK} bytes less is Triton's "
                f"alignment padding, allowed).{_smem_diagnosis(c, got, want)}")
    return compiled


def _check_budget(register_budget, hidden: bool) -> int:
    counts = (1, 2, 3, 4) if hidden else (1, 2, 3)
    for n in counts:
        what = f"register_budget({n})"
        got = as_int(register_budget(n), what)
        want = planner.register_budget(Config(CONSUMERS=n))["consumer"]
        if got == want:
            continue
        free = REGISTERS_PER_SM - 128 * PRODUCER_REGS
        msg = (f"{what}: {got} registers a consumer thread, expected {want}: what the producer "
               f"warpgroup leaves ({REGISTERS_PER_SM:,} - 128 x {PRODUCER_REGS} = {free:,}) shared "
               f"by {n} x 128 consumer threads, rounded down to a multiple of 8, at most 256.")
        if got % 8:
            msg += (f" setmaxnreg takes a multiple of 8 ({got} is not): round "
                    f"{free / (128 * n):.2f} down to {free // (128 * n) // 8 * 8}.")
        elif got > planner.SETMAXNREG_MAX:
            msg += (f" setmaxnreg can give a thread at most {planner.SETMAXNREG_MAX} registers, "
                    f"not {got}: with one consumer there is more than it may take.")
        elif 128 * (n * got + PRODUCER_REGS) > REGISTERS_PER_SM:
            msg += (f" {n} x 128 x {got} + 128 x {PRODUCER_REGS} = "
                    f"{128 * (n * got + PRODUCER_REGS):,} registers: more than the SM's "
                    f"{REGISTERS_PER_SM:,}.")
        raise CheckFailure(msg)
    return len(counts)


def _check_need(consumer_register_need, register_budget, configs) -> int:
    spills = 0
    for c in configs:
        what = f"consumer_register_need, {_describe(c)}"
        got = as_int(consumer_register_need(c), what)
        want = planner.consumer_registers(c)
        if got != want:
            d = c.HEAD_DIM
            raise CheckFailure(
                f"{what}: {got}, expected {want}: the fp32 O accumulator BLOCK_M x d / 128 = "
                f"{c.BLOCK_M * d // 128}, the fp32 scores BLOCK_M x BLOCK_N / 128 = "
                f"{c.BLOCK_M * c.BLOCK_N // 128}, P in 16 bits (two to a register) BLOCK_M x "
                f"BLOCK_N / 256 = {c.BLOCK_M * c.BLOCK_N // 256}, plus 32 for addresses, "
                f"counters and the row statistics (a warpgroup's 128 threads share each tile).")
        e = compiled_entry(c)
        if e is not None:
            budget = as_int(register_budget(c.CONSUMERS), f"register_budget({c.CONSUMERS})")
            if (got > budget) != e["spilled"]:
                raise CheckFailure(
                    f"{what}: {got} registers against a budget of {budget}, but ptxas "
                    + (f"spilled ({e['spill_stores']} stores to local memory)" if e["spilled"]
                       else "did not spill") + " when it compiled this config "
                    "(data/ch6_compiled.json).")
            spills += e["spilled"]
    return spills


def _check_fits(fits, smem_bytes, configs, hidden: bool) -> int:
    for c in configs:
        verdict = planner.feasible(c, planner.H100)
        got = as_bool(fits(c, H100_PROPS), f"fits({_describe(c)}, H100_PROPS)")
        if got != bool(verdict):
            if got:
                msg = (f"fits: says {_describe(c)} fits an H100, but it does not: "
                       + "; ".join(verdict.reasons) + ".")
            else:
                need = planner.shared_memory(c)
                msg = (f"fits: says {_describe(c)} does not fit an H100, but it does "
                       f"({need:,} B of shared memory, at most "
                       f"{H100_PROPS.shared_memory_per_block_optin:,} B a block; "
                       f"{planner.consumer_registers(c)} registers a consumer thread, at most "
                       f"{planner.register_budget(c)['consumer']}).")
                if need > H100_PROPS.shared_memory_per_block:
                    msg += (" Did you compare with shared_memory_per_block? That is the 48 KB a "
                            "block gets unless the kernel opts in; the kernel opts in (Triton "
                            "does it at launch) and may use shared_memory_per_block_optin.")
            raise CheckFailure(msg)
    # at the limit: a device whose blocks may use exactly what the config needs, or a byte less
    edge = [c for c in configs if planner.consumer_registers(c) <= planner.register_budget(c)[
        "consumer"]]
    edge = edge if hidden else edge[:2]
    for c in edge:
        need = as_int(smem_bytes(c), f"smem_bytes, {_describe(c)}")
        exact = dataclasses.replace(H100_PROPS, name=f"a GPU whose blocks may use {need:,} B",
                                    shared_memory_per_block_optin=need,
                                    shared_memory_per_multiprocessor=need + 1024)
        if not as_bool(fits(c, exact), f"fits({_describe(c)}, {exact.name})"):
            raise CheckFailure(
                f"fits: {_describe(c)} needs {need:,} B (your smem_bytes) and {exact.name} "
                f"(shared_memory_per_block_optin = {need:,}): it fits, the limit is inclusive "
                "(<=), and the registers fit too.")
        short = dataclasses.replace(H100_PROPS, name=f"a GPU whose blocks may use {need - 1:,} B",
                                    shared_memory_per_block_optin=need - 1,
                                    shared_memory_per_multiprocessor=need - 1 + 1024)
        if as_bool(fits(c, short), f"fits({_describe(c)}, {short.name})"):
            raise CheckFailure(
                f"fits: says {_describe(c)}, which needs {need:,} B (your smem_bytes), fits "
                f"{short.name} (shared_memory_per_block_optin = {need - 1:,}, "
                f"shared_memory_per_multiprocessor = {need - 1 + 1024:,}). A block may use at "
                "most shared_memory_per_block_optin: the SM's total "
                "(shared_memory_per_multiprocessor, 228 KB on an H100) less the 1 KB the system "
                "reserves for every block, so 227 KB = 232,448 B on an H100/H200, not 228 KB.")
    return len(configs) + 2 * len(edge)


def _predicted(c: Config, problem: dict) -> float:
    return planner.predict(c, **problem)["ms"]


def _check_choose(choose, hidden: bool) -> tuple[int, str]:
    first = ""
    for what, d, dtype, cands, device, problem in choice_problems(hidden):
        resolved = [c.for_inputs(d, dtype) for c in cands]
        ok = [c for c in resolved if planner.feasible(c, planner.H100)
              and planner.shared_memory(c) <= device.shared_memory_per_block_optin]
        best = min(ok, key=lambda c: _predicted(c, problem), default=None)
        got = choose(d, dtype, list(cands), device, **problem)
        label = f"choose, {what}"
        if best is None:
            if got is not None:
                raise CheckFailure(f"{label}: returned {got}, but no candidate fits "
                                   f"{device.name} (128-row consumers need more registers than "
                                   "the 240 a consumer thread gets); return None then.")
            continue
        if not isinstance(got, Config):
            raise CheckFailure(f"{label}: returned {got!r}; expected a planner.Config (one of the "
                               "candidates, resolved with .for_inputs(d, dtype)).")
        got = got if got.HEAD_DIM is not None else got.for_inputs(d, dtype)
        if (got.HEAD_DIM, got.DTYPE) != (d, dtype):
            raise CheckFailure(f"{label}: returned a config for d={got.HEAD_DIM}, {got.DTYPE}; "
                               f"expected one for d={d}, {dtype}.")
        if _config_key(got) not in {_config_key(c) for c in resolved}:
            raise CheckFailure(f"{label}: returned {_describe(got)}, which is not a candidate.")
        verdict = planner.feasible(got, planner.H100)
        smem = planner.shared_memory(got)
        if not verdict or smem > device.shared_memory_per_block_optin:
            reasons = list(verdict.reasons)
            if smem > device.shared_memory_per_block_optin:
                reasons = [r for r in reasons if not r.startswith("shared memory")] + [
                    f"shared memory {smem:,} B > {device.shared_memory_per_block_optin:,} B a "
                    f"block may use on {device.name}"]
            raise CheckFailure(
                f"{label}: chose {_describe(got)} (predicted {_predicted(got, problem):.3f} ms), "
                f"which does not fit: {'; '.join(reasons)}. The model does not know the limits: "
                f"choose the fastest among the configs that fit (the answer: {_describe(best)}, "
                f"{_predicted(best, problem):.3f} ms).")
        t_got, t_best = _predicted(got, problem), _predicted(best, problem)
        if t_got > t_best * (1 + 1e-9):
            raise CheckFailure(
                f"{label}: chose {_describe(got)}, predicted {t_got:.3f} ms, but "
                f"{_describe(best)} fits too and is predicted {t_best:.3f} ms: choose the least "
                "planner.predict(config, **problem)['ms'] among the configs that fit.")
        if not first:
            first = f"{got.BLOCK_M}x{got.BLOCK_N}, {got.STAGES} stages"
    return len(choice_problems(hidden)), first


# the planner's answers: the exercise is to compute them (planner.predict and Config are given)
_ANSWERS = ("shared_memory", "shared_memory_layout", "consumer_registers", "register_budget",
            "feasible", "rank", "best")


def check_planner(smem_bytes, register_budget, consumer_register_need, fits, choose,
                  hidden: bool = False):
    """Exercise 3 (module docstring); ``fits`` also at a device's exact limit."""
    for fn, name in ((smem_bytes, "smem_bytes"), (register_budget, "register_budget"),
                     (consumer_register_need, "consumer_register_need"), (fits, "fits"),
                     (choose, "choose")):
        require_implemented(fn, name)
        forbid_calls(fn, name, planner, _ANSWERS,      # the notebook's name for fa3_planner
                     "planner.predict and planner.Config are yours to use", name="planner")
    configs = planner_configs(hidden)
    compiled = _check_smem(smem_bytes, configs)
    budgets = _check_budget(register_budget, hidden)
    spilled = _check_need(consumer_register_need, register_budget, configs)
    n_fits = _check_fits(fits, smem_bytes, configs, hidden)
    n_choose, first = _check_choose(choose, hidden)
    n = 2 * len(configs) + budgets + n_fits + n_choose
    report("config planner", n, extra=(
        f" (shared memory of {compiled} configs against the compiled kernel's, registers against "
        f"the {spilled} that spilled, choice for d=128: {first})"), hidden=hidden)


# ------------------------------------------------------------------------------- the demo's table
def choice_table(smem_bytes, register_budget, consumer_register_need, fits, choose, d: int,
                 dtype: str = "float16", device: Device = H100_PROPS, **problem) -> str:
    """A markdown table of the candidates (FA3's order): the student's figures, the compiled
    kernel's, the model's speed, the student's choice marked."""
    problem = problem or dict(B=1, H=16, N_q=16384, causal=False)
    cands = [c for c in _tiles() if c.OVERLAP]
    chosen = choose(d, dtype, cands, device, **problem)
    chosen = chosen and _config_key(chosen.for_inputs(d, dtype) if chosen.HEAD_DIM is None
                                    else chosen)
    budget = register_budget(2)
    lines = ["| tiles (Q x K/V) | stages | smem_bytes | compiled | registers / budget | "
             "spilled | fits | model TFLOP/s |", "|---|---|---|---|---|---|---|---|"]
    for c in cands:
        c = c.for_inputs(d, dtype)
        e = compiled_entry(c)
        compiled = f"{e['shared']:,}" if e else "-"
        spilled = ("yes" if e["spilled"] else "no") if e else "-"
        mark = " **chosen**" if _config_key(c) == chosen else ""
        lines.append(f"| {c.BLOCK_M} x {c.BLOCK_N} | {c.STAGES} | {smem_bytes(c):,} | "
                     f"{compiled} | {consumer_register_need(c)} / {budget} | {spilled} | "
                     f"{'yes' if fits(c, device) else 'no'} | "
                     f"{planner.predict(c, **problem)['tflops']:.0f}{mark} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
