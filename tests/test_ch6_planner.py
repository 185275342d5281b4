"""Chapter 6, Exercise 3: the config planner's check (``planner_checks``) and its data.

The check must pass a right planner (visible and hidden cases), fail each classic mistake with a
message that names it, and compare with what the compiled kernel really needs: the table in
``src/flashbook/data/ch6_compiled.json``. The table must agree with the planner, cover every
config the visible check uses, carry its provenance, and (slow test) still be what compiling the
kernel ahead of time gives."""
import dataclasses
import json

import pytest

from flashbook import fa3_planner as planner
from flashbook.chapters.ch6 import planner_checks as pc
from flashbook.check import CheckFailure
from flashbook.fa3_planner import Config

from ch6_aot import REGENERATE, SHARES_THE_COMPILE, compiled


# ------------------------------------------------------------------------------ a right planner
def smem_bytes(config):
    d, size = config.HEAD_DIM, 2
    q = config.CONSUMERS * config.BLOCK_M * d * size
    kv = 2 * config.STAGES * config.BLOCK_N * d * size
    barriers = (2 * config.CONSUMERS + 4 * config.STAGES) * pc.MBARRIER_BYTES
    return q + kv + barriers + pc.WARP_SPECIALIZE_BYTES


def register_budget(consumers):
    per_thread = (pc.REGISTERS_PER_SM - 128 * pc.PRODUCER_REGS) // (128 * consumers)
    return min(256, per_thread // 8 * 8)


def consumer_register_need(config):
    o = config.BLOCK_M * config.HEAD_DIM // 128
    s = config.BLOCK_M * config.BLOCK_N // 128
    p = config.BLOCK_M * config.BLOCK_N // 256
    return o + s + p + 32


def make_fits(smem=smem_bytes, need=consumer_register_need, budget=register_budget,
              limit=lambda dev: dev.shared_memory_per_block_optin, inclusive=True):
    def fits(config, device=pc.H100_PROPS):
        s = smem(config)
        ok = s <= limit(device) if inclusive else s < limit(device)
        return ok and need(config) <= budget(config.CONSUMERS)
    return fits


def make_choose(fits, check_fits=True):
    def choose(d, dtype, candidates, device=pc.H100_PROPS, **problem):
        configs = [c.for_inputs(d, dtype) for c in candidates]
        ok = [c for c in configs if fits(c, device)] if check_fits else configs
        return min(ok, key=lambda c: planner.predict(c, **problem)["ms"], default=None)
    return choose


def planner_fns(**override):
    fns = dict(smem_bytes=smem_bytes, register_budget=register_budget,
               consumer_register_need=consumer_register_need)
    fns.update({k: v for k, v in override.items() if k in fns})
    fits = override.get("fits") or make_fits(fns["smem_bytes"], fns["consumer_register_need"],
                                             fns["register_budget"])
    choose = override.get("choose") or make_choose(fits)
    return (fns["smem_bytes"], fns["register_budget"], fns["consumer_register_need"], fits,
            choose)


# ------------------------------------------------------------------------------ the check
@pytest.mark.parametrize("hidden", [False, True])
def test_a_right_planner_passes(hidden, capsys):
    pc.check_planner(*planner_fns(), hidden=hidden)
    out = capsys.readouterr().out
    if hidden:
        assert out == ""
    else:
        assert out.startswith("PASSED config planner:") and "18 configs against the compiled" \
            in out and "choice for d=128: 64x128, 2 stages" in out, out


def test_the_solution_is_the_planner_within_the_padding():
    """The allowance is only Triton's alignment padding: every config of the planner's grid and
    other consumer counts land within it, and the largest gap is well below the smallest term a
    student can forget (the 96 bytes of mbarriers of a 2-stage ring)."""
    configs = [c for d in (64, 128) for c in planner.candidates(d) if c.OVERLAP]
    gaps = [planner.shared_memory(c) - smem_bytes(c)
            for n in (1, 2, 3) for c in (dataclasses.replace(c, CONSUMERS=n) for c in configs)]
    assert 0 <= min(gaps) and max(gaps) <= 52 < pc.SMEM_SLACK < 96


def test_a_stub_fails_as_not_implemented():
    def stub(*args, **kwargs):
        raise NotImplementedError()
    fns = list(planner_fns())
    for i in range(5):
        broken = fns[:i] + [stub] + fns[i + 1:]
        with pytest.raises(CheckFailure, match="not implemented"):
            pc.check_planner(*broken)


def budget_unrounded(consumers):
    return min(256, (pc.REGISTERS_PER_SM - 128 * pc.PRODUCER_REGS) // (128 * consumers))


def budget_uncapped(consumers):
    return (pc.REGISTERS_PER_SM - 128 * pc.PRODUCER_REGS) // (128 * consumers) // 8 * 8


WRONG = {
    "one slot of K and V": (dict(smem_bytes=lambda c: smem_bytes(c) - 2 * (c.STAGES - 1)
                                 * c.BLOCK_N * c.HEAD_DIM * 2), "one slot of K and one of V"),
    "one Q tile": (dict(smem_bytes=lambda c: smem_bytes(c) - c.BLOCK_M * c.HEAD_DIM * 2),
                   "counted one Q tile"),
    "STAGES tiles for K and V together": (
        dict(smem_bytes=lambda c: smem_bytes(c) - c.STAGES * c.BLOCK_N * c.HEAD_DIM * 2),
        "STAGES=2 slots of K and STAGES of V"),      # at 2 stages: one slot each, the same sum
    "no barriers": (dict(smem_bytes=lambda c: smem_bytes(c) - (4 + 4 * c.STAGES) * 8),
                    "mbarriers are missing"),
    "no warp_specialize bytes": (dict(smem_bytes=lambda c: smem_bytes(c) - 228),
                                 "228 bytes gl.warp_specialize"),
    "4-byte elements": (dict(smem_bytes=lambda c: 2 * smem_bytes(c) - (4 + 4 * c.STAGES) * 8
                             - 228), "4-byte elements"),
    "a figure above the compiled one": (dict(smem_bytes=lambda c: smem_bytes(c) + 40),
                                        "36 bytes more"),
    "a float": (dict(smem_bytes=lambda c: smem_bytes(c) + 0.5), "whole number"),
    "budget not a multiple of 8": (dict(register_budget=budget_unrounded), "multiple of 8"),
    "budget over 256": (dict(register_budget=budget_uncapped), "at most 256 registers"),
    "budget ignores the producer": (
        dict(register_budget=lambda n: min(256, 65536 // (128 * n) // 8 * 8)),
        "what the producer warpgroup leaves"),
    "need forgets P": (dict(consumer_register_need=lambda c: consumer_register_need(c)
                            - c.BLOCK_M * c.BLOCK_N // 256), "P in 16 bits"),
    "the SM's 228 KB": (
        dict(fits=make_fits(limit=lambda dev: dev.shared_memory_per_multiprocessor)),
        "not 228 KB"),
    "48 KB without opt-in": (dict(fits=make_fits(limit=lambda dev: dev.shared_memory_per_block)),
                             "compare with shared_memory_per_block?"),
    "exclusive limit": (dict(fits=make_fits(inclusive=False)), "the limit is inclusive"),
    "fits ignores registers": (
        dict(fits=lambda c, device=pc.H100_PROPS:
             smem_bytes(c) <= device.shared_memory_per_block_optin),
        "needs ~256 registers > its 240"),
    "fits returns a number": (dict(fits=lambda c, device=pc.H100_PROPS: 1), "True or False"),
    "smem_bytes is the planner's": (dict(smem_bytes=lambda c: planner.shared_memory(c)),
                                    "calls planner.shared_memory"),
    "fits is the planner's": (dict(fits=lambda c, device=pc.H100_PROPS: bool(planner.feasible(c))),
                              "calls planner.feasible"),
    "choose ignores feasibility": (dict(choose=make_choose(make_fits(), check_fits=False)),
                                   "which does not fit"),
    "choose picks the smallest fitting tiles": (
        dict(choose=lambda d, dtype, cands, device=pc.H100_PROPS, **p: min(
            (c.for_inputs(d, dtype) for c in cands if make_fits()(c.for_inputs(d, dtype), device)),
            key=lambda c: smem_bytes(c), default=None)), "choose the least"),
    "choose raises when nothing fits": (
        dict(choose=lambda d, dtype, cands, device=pc.H100_PROPS, **p:
             make_choose(make_fits())(d, dtype, cands, device, **p) or Config()),
        "no candidate fits"),
}


@pytest.mark.parametrize("name", WRONG)
def test_each_classic_mistake_fails_for_its_reason(name):
    override, text = WRONG[name]
    with pytest.raises(CheckFailure) as e:
        pc.check_planner(*planner_fns(**override))
        pc.check_planner(*planner_fns(**override), hidden=True)
    assert text in str(e.value), str(e.value)


def test_choose_must_pass_the_device_on():
    """Only the hidden GPUs with less shared memory catch a choose that checks an H100."""
    fits = make_fits()
    choose = make_choose(lambda c, device: fits(c))          # ignores the device
    fns = planner_fns(choose=choose)
    pc.check_planner(*fns)
    with pytest.raises(CheckFailure, match="100 KB"):
        pc.check_planner(*fns, hidden=True)


# ------------------------------------------------------------------------------ the data
def test_the_compiled_table_agrees_with_the_planner_and_covers_the_visible_configs():
    table = pc.compiled_table()
    entries = table["configs"]
    keys = [(e["d"], e["dtype"], e["BLOCK_M"], e["BLOCK_N"], e["STAGES"]) for e in entries]
    assert len(set(keys)) == len(keys), "duplicate entries"
    for e in entries:
        c = Config(BLOCK_M=e["BLOCK_M"], BLOCK_N=e["BLOCK_N"], STAGES=e["STAGES"]).for_inputs(
            e["d"], e["dtype"])
        assert e["shared"] == planner.shared_memory(c), e
        budget = planner.register_budget(c)
        assert e["n_regs"] == budget["launch"], e
        # the planner's register estimate says "spills" exactly where ptxas spilled
        assert e["spilled"] == (planner.consumer_registers(c) > budget["consumer"]), e
        assert e["spilled"] == bool(e["spill_stores"] or e["spill_loads"] or e["stack"]), e
    assert all(pc.compiled_entry(c) for c in pc.planner_configs())
    assert any(e["spilled"] for e in entries) and not all(e["spilled"] for e in entries)
    prov = table["provenance"]
    for field in ("triton", "target", "date", "command", "ptxas", "kernel_source_sha256"):
        assert prov.get(field), field
    assert "sm_90a" in prov["target"] and "planner_checks" in prov["command"]


def test_the_device_limits_are_hoppers():
    for dev in (pc.H100_PROPS, pc.H200_PROPS):
        assert dev.shared_memory_per_block_optin == 232448 == planner.H100.smem_per_block
        assert dev.shared_memory_per_multiprocessor == 233472
        assert dev.shared_memory_per_block == 49152
        assert dev.regs_per_multiprocessor == 65536


def test_the_choice_table_marks_the_choice():
    text = pc.choice_table(*planner_fns(), 128)
    rows = [r for r in text.splitlines() if "**chosen**" in r]
    assert len(rows) == 1 and rows[0].startswith("| 64 x 128 | 2 | 164,164 | 164,168 |"), text


# ------------------------------------------------------------------------------ slow: recompile
@pytest.mark.slow
@SHARES_THE_COMPILE
def test_the_compiled_table_is_what_compiling_gives():
    """Recompile two entries (``ch6_aot.REGENERATE``) ahead of time for sm_90a, in the
    subprocess that compiles test_ch6.py's kernels: the stored figures must be what the compiler
    reports now, or the table is stale (regenerate it with the command in its provenance)."""
    fresh = compiled()["entries"]
    assert len(fresh) == len(REGENERATE)
    prov = pc.compiled_table()["provenance"]
    for new in fresh:
        c = Config(BLOCK_M=new["BLOCK_M"], BLOCK_N=new["BLOCK_N"], STAGES=new["STAGES"]
                   ).for_inputs(new["d"], new["dtype"])
        old = pc.compiled_entry(c)
        stale = (f"data/ch6_compiled.json is stale for {new}: stored {old}; regenerate with "
                 f"`{prov['command']}`")
        for field in ("shared", "n_regs", "spilled"):
            assert new[field] == old[field], stale
        import triton
        if triton.__version__ == prov["triton"]:
            assert new == old, stale
    assert json.dumps(fresh)
