"""Chapter 6's Gluon FlashAttention-3 kernel and its planner, on a machine without a GPU.

Gluon has no CPU interpreter, so the kernel is checked three ways here: its tile counts and
masks against brute force, its barrier protocol (producer, two consumers, the ping-pong token)
in a simulation that runs the kernel's sequence of mbarrier operations under random
interleavings, and the kernel itself compiled ahead of time for sm_90a (PTX with wgmma and TMA,
setmaxnreg, no spills, no serialised wgmma, and shared memory equal to the planner's figure,
byte for byte). The launcher's argument checks run on CPU tensors; the setup step that installs
JAX when it is missing runs with a fake pip. The numbers on a GPU are
``flashbook bench ch6``'s record (``data/bench/ch6/``)."""
import importlib.metadata
import importlib.util
import random
import subprocess
import types
from pathlib import Path

import pytest
import torch

from flashbook import sources
from flashbook.chapters.ch6 import planner
from flashbook.chapters.ch6.planner import Config, cta_tiles, kv_tiles

from aot_compile import compile_script

ROOT = Path(__file__).resolve().parents[1]


def cfg(d=128, dtype="float16", **kw):
    return Config(**kw).for_inputs(d, dtype)


# --------------------------------------------------------------------------------------------
# the planner
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("config, shared", [
    (cfg(128, BLOCK_M=64, BLOCK_N=128, STAGES=2), 164168),   # 160 KiB of tiles + 328 B
    (cfg(128, BLOCK_M=64, BLOCK_N=128, STAGES=3), 229768),   # 24-byte barrier arrays padded
    (cfg(128, BLOCK_M=64, BLOCK_N=64, STAGES=4), 164232),
    (cfg(64, BLOCK_M=64, BLOCK_N=128, STAGES=2), 82248),
    (cfg(64, BLOCK_M=128, BLOCK_N=64, STAGES=2), 65864),
])
def test_shared_memory_formula(config, shared):
    """Figures the compiled kernel reported (triton 3.6 and 3.9 agree); the slow test below
    recompiles some of them."""
    assert planner.shared_memory(config) == shared
    layout = planner.shared_memory_layout(config)
    spans = sorted((o, o + n) for _, o, n in layout)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "buffers overlap"


def test_register_budgets_are_setmaxnreg_values():
    b = planner.register_budget(cfg())
    assert (b["launch"], b["consumer"], b["producer"]) == (168, 240, 24)
    assert b["total"] == 2 * 128 * 240 + 128 * 24 <= 65536
    for n in (1, 2, 3):
        b = planner.register_budget(cfg(CONSUMERS=n))
        assert b["consumer"] % 8 == 0 and 24 <= b["consumer"] <= 256 and b["total"] <= 65536
    assert planner.register_budget(cfg(CONSUMERS=3))["consumer"] == 160


@pytest.mark.parametrize("change, reason", [
    (dict(BLOCK_N=256), "shared memory 295240 B > 232448"),        # and registers
    (dict(STAGES=4), "shared memory"),                              # 4 x 64 KiB of K/V
    (dict(BLOCK_M=128), "registers"),                               # 128-row consumers spill
    (dict(BLOCK_N=96), "power of two"),
    (dict(BLOCK_M=32), "64-row"),
    (dict(STAGES=1), "2 slots"),
    (dict(CONSUMERS=8), "threads"),
])
def test_planner_rejects_infeasible_configs(change, reason):
    verdict = planner.feasible(cfg(128, **change), planner.H200)
    assert not verdict and any(reason in r for r in verdict.reasons), verdict.reasons


def test_planner_rejects_unsupported_inputs_and_unresolved_configs():
    assert "head dim 96" in planner.feasible(cfg(96)).reasons[0]
    assert not planner.feasible(cfg(128, "float32"))
    with pytest.raises(ValueError, match="HEAD_DIM and DTYPE"):
        planner.shared_memory(Config())


def test_ranking_picks_feasible_configs_fastest_first():
    for d in (64, 128):
        ranked = planner.rank(d, causal=False)
        assert ranked and all(planner.feasible(c) for c, _ in ranked)
        times = [p["ms"] for _, p in ranked]
        assert times == sorted(times)
        assert planner.best(d) == ranked[0][0]
        assert ranked[0][1]["tflops"] < planner.H100.peak_tflops
    top = planner.best(128)
    assert (top.BLOCK_M, top.BLOCK_N, top.STAGES, top.OVERLAP) == (64, 128, 2, True)
    small = planner.best(64)       # measured on an H200: 64x128 beats 128x64 at d=64
    assert (small.BLOCK_M, small.BLOCK_N) == (64, 128)
    # the model against the H200 (fp16, non-causal, triton 3.6): 591 and 502 TFLOP/s
    assert planner.predict(top, 1, 16, 16384)["tflops"] == pytest.approx(591, rel=0.05)
    assert planner.predict(cfg(128, BLOCK_N=64), 1, 16, 16384)["tflops"] == pytest.approx(
        502, rel=0.05)
    # a causal problem costs about half the time of the full one
    full = planner.predict(top, 1, 16, 16384)["ms"]
    half = planner.predict(top, 1, 16, 16384, causal=True)["ms"]
    assert 0.45 < half / full < 0.6


# --------------------------------------------------------------------------------------------
# tile counts and masks (the kernel's integer arithmetic, mirrored by planner.kv_tiles)
# --------------------------------------------------------------------------------------------
def visible(i, j, n_q, n_k, causal):
    return j < n_k and (not causal or j <= i + n_k - n_q)


@pytest.mark.parametrize("n_q, n_k", [(1, 1), (64, 64), (100, 100), (256, 256), (300, 300),
                                      (64, 200), (200, 64), (129, 383), (5, 1000), (1000, 5)])
@pytest.mark.parametrize("bm, bn", [(64, 128), (64, 64), (128, 64)])
@pytest.mark.parametrize("causal", [False, True])
def test_tile_counts_cover_every_visible_key_and_mask_only_partial_tiles(n_q, n_k, bm, bn,
                                                                        causal):
    for row0 in range(0, n_q, bm):
        tiles, full = kv_tiles(row0, n_q, n_k, bm, bn, causal)
        assert 0 <= full <= tiles
        rows = range(row0, min(row0 + bm, n_q))
        for t in range(-(-max(n_k, 1) // bn) + 1):
            keys = range(t * bn, (t + 1) * bn)
            seen = [visible(i, j, n_q, n_k, causal) for i in rows for j in keys]
            if t < full:        # the unmasked fast path: every pair visible (all rows of the box)
                assert all(visible(i, j, n_q, n_k, causal)
                           for i in range(row0, row0 + bm) for j in keys)
            if t >= tiles:      # never loaded: nothing visible there
                assert not any(seen), (row0, t)


# --------------------------------------------------------------------------------------------
# the barrier protocol, simulated: the kernel's mbarrier operations in its order
# --------------------------------------------------------------------------------------------
class Barrier:
    """An mbarrier: ``count`` arrivals (plus any expected TMA bytes) complete a phase; a wait on
    parity P returns once the current phase's parity is not P."""

    def __init__(self, count):
        self.count, self.pending, self.tx, self.phase = count, count, 0, 0

    def arrive(self, tx=0):
        self.pending -= 1
        self.tx += tx
        self._maybe_complete()

    def complete_tx(self, nbytes):
        self.tx -= nbytes
        assert self.tx >= 0, "more bytes landed than expected"
        self._maybe_complete()

    def _maybe_complete(self):
        assert self.pending >= 0, "arrived again before the phase completed"
        if self.pending == 0 and self.tx == 0:
            self.phase += 1
            self.pending = self.count

    def passed(self, parity):
        return (self.phase & 1) != parity


def simulate(n_q, n_k, bm, bn, stages, causal, seed, broken=None):
    """Run one CTA of every m-block with a random interleaving; fail on a deadlock, on a slot
    refilled while a consumer reads it, or on a consumer reading the wrong tile. ``broken``
    plants a bug the simulation must catch: "one_arrival" (empty barriers count one consumer),
    "no_empty_wait" (the producer refills without waiting)."""
    empty_count = 1 if broken == "one_arrival" else 2
    rows = 2 * bm
    for mb in range(-(-n_q // rows)):
        rng = random.Random(seed * 1000 + mb)
        q_bars = [Barrier(1) for _ in range(2)]
        sched = [Barrier(1) for _ in range(2)]
        k_full, v_full = [Barrier(1) for _ in range(stages)], [Barrier(1) for _ in range(stages)]
        k_empty = [Barrier(empty_count) for _ in range(stages)]
        v_empty = [Barrier(empty_count) for _ in range(stages)]
        slot_tile = {(kind, s): None for kind in "kv" for s in range(stages)}
        readers = {key: set() for key in slot_tile}
        inflight = []                                  # TMA copies not landed yet
        n_cta = cta_tiles(mb, n_q, n_k, bm, bn, causal)

        def load(kind, s, j, bar):
            assert not readers[(kind, s)], f"{kind} slot {s} refilled while read"
            slot_tile[(kind, s)] = None
            bar.arrive(tx=1)                           # expect-tx by the producer
            inflight.append((kind, s, j, bar))

        def producer():
            for w in range(2):
                q_bars[w].arrive(tx=1)
                inflight.append(("q", w, w, q_bars[w]))
            for j in range(n_cta):
                s, ph = j % stages, (j // stages) & 1
                if broken != "no_empty_wait":
                    yield k_empty[s], ph ^ 1
                load("k", s, j, k_full[s])
                if broken != "no_empty_wait":
                    yield v_empty[s], ph ^ 1
                load("v", s, j, v_full[s])

        def acquire(t, wg):
            return (sched[0], (t & 1) ^ 1) if wg == 0 else (sched[1], t & 1)

        def take(kind, s, j, wg):
            assert slot_tile[(kind, s)] == j, f"wg{wg} read {kind} tile {slot_tile[(kind, s)]}, " \
                                              f"wanted {j}"
            readers[(kind, s)].add(wg)

        def release(kind, s, wg, bar):
            readers[(kind, s)].discard(wg)
            bar.arrive()

        def consumer(wg):
            row0 = mb * rows + wg * bm
            n, _ = kv_tiles(row0, n_q, n_k, bm, bn, causal)
            yield q_bars[wg], 0
            for j in range(n):                         # _tile(j)
                s, ph = j % stages, (j // stages) & 1
                yield k_full[s], ph
                take("k", s, j, wg)
                if j:
                    sp, php = (j - 1) % stages, ((j - 1) // stages) & 1
                    yield v_full[sp], php
                    take("v", sp, j - 1, wg)
                yield acquire(j, wg)
                sched[1 - wg].arrive()                 # release the token after issuing
                if j:
                    release("v", sp, wg, v_empty[sp])  # (overlap: after the softmax; same order)
                release("k", s, wg, k_empty[s])
            if n:                                      # the last PV, turn n
                sl, phl = (n - 1) % stages, ((n - 1) // stages) & 1
                yield v_full[sl], phl
                take("v", sl, n - 1, wg)
            yield acquire(n, wg)
            sched[1 - wg].arrive()
            if n:
                release("v", sl, wg, v_empty[sl])
            for j in range(n, n_cta):                  # flush
                s, ph = j % stages, (j // stages) & 1
                yield k_full[s], ph
                yield v_full[s], ph
                k_empty[s].arrive()
                v_empty[s].arrive()
                yield acquire(j + 1, wg)
                sched[1 - wg].arrive()

        agents = {"p": producer(), 0: consumer(0), 1: consumer(1)}
        waiting = {}
        for name, gen in list(agents.items()):
            waiting[name] = next(gen, None)
        while any(w is not None for w in waiting.values()) or inflight:
            ready = [n for n, w in waiting.items() if w is not None and w[0].passed(w[1])]
            if inflight and (not ready or rng.random() < 0.3):
                kind, s, j, bar = inflight.pop(rng.randrange(len(inflight)))
                if kind != "q":
                    slot_tile[(kind, s)] = j
                bar.complete_tx(1)
                continue
            assert ready, f"deadlock: m-block {mb}, waiting {waiting}"
            name = rng.choice(ready)
            waiting[name] = next(agents[name], None)
        assert all(b.phase == n_cta // stages + (s < n_cta % stages)
                   for s, b in enumerate(k_empty)), "a tile was not released by both consumers"


@pytest.mark.parametrize("n_q, n_k", [(128, 128), (300, 300), (1000, 1000), (64, 700),
                                      (700, 64), (1, 513)])
@pytest.mark.parametrize("bm, bn, stages", [(64, 128, 2), (64, 64, 3), (128, 64, 2), (64, 64, 4)])
@pytest.mark.parametrize("causal", [False, True])
def test_barrier_protocol_never_deadlocks_or_overwrites(n_q, n_k, bm, bn, stages, causal):
    for seed in range(3):
        simulate(n_q, n_k, bm, bn, stages, causal, seed)


@pytest.mark.parametrize("broken", ["one_arrival", "no_empty_wait"])
def test_the_simulation_catches_a_broken_ring(broken):
    """Empty barriers that wait for one consumer instead of two, or a producer that does not wait
    for them at all: a slot is refilled under a reader, a barrier is over-arrived, a consumer
    reads the wrong tile, or the CTA deadlocks (what the kernel's count=2 and waits prevent)."""
    with pytest.raises(AssertionError, match="refilled|arrived again|read|deadlock|released"):
        for seed in range(20):
            simulate(1024, 1024, 64, 64, 2, False, seed, broken)


# --------------------------------------------------------------------------------------------
# the launcher's checks (everything before the GPU itself runs on CPU tensors)
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fa3():
    from flashbook.chapters.ch6 import gluon_fa3
    return gluon_fa3


def qkv(B=1, H=2, N=128, d=64, dtype=torch.float16, n_k=None):
    n_k = N if n_k is None else n_k
    return (torch.randn(B, H, N, d, dtype=dtype), torch.randn(B, H, n_k, d, dtype=dtype),
            torch.randn(B, H, n_k, d, dtype=dtype))


@pytest.mark.parametrize("make, kwargs, text", [
    (lambda: qkv(), {}, "runs only on a CUDA GPU"),
    (lambda: qkv(dtype=torch.float32), {}, "torch.float16 or torch.bfloat16"),
    (lambda: tuple(t[0] for t in qkv()), {}, "must be 4-D"),
    (lambda: qkv(d=96), {}, "d=96 is not supported"),
    (lambda: (qkv()[0], qkv(N=64)[1], qkv()[2]), {}, "k and v must be"),
    (lambda: (qkv()[0].transpose(1, 2).contiguous().transpose(1, 2), *qkv()[1:]), {},
     "must be contiguous"),
    (lambda: qkv(), dict(softmax_scale=-1.0), "softmax_scale"),
    (lambda: qkv(), dict(config=Config(BLOCK_N=96)), "power of two"),
    (lambda: qkv(), dict(config=Config(STAGES=9)), "shared memory"),
    (lambda: qkv(), dict(config=cfg(128)), "config is for d=128"),
    (lambda: qkv(), dict(config=Config(CONSUMERS=3)), "two consumer warpgroups"),
    (lambda: qkv(), dict(config={"BLOCK_N": 64}), "must be a"),
    (lambda: ([1], *qkv()[1:]), {}, "must be a torch.Tensor"),
])
def test_launcher_names_the_problem(fa3, make, kwargs, text):
    q, k, v = make()
    with pytest.raises(ValueError, match=text):
        fa3.attention_fa3(q, k, v, **kwargs)


def test_launcher_defaults_come_from_the_planner(fa3):
    c = fa3.pick_config(128, torch.float16)
    assert c == planner.best(128) and planner.feasible(c)
    args = fa3.kernel_args(c)
    assert args["constexprs"]["CONSUMER_REGS"] == 240 and args["options"]["maxnreg"] == 168


# --------------------------------------------------------------------------------------------
# ahead of time for sm_90a (slow: a subprocess compiles, ~30 s on two cores)
# --------------------------------------------------------------------------------------------
AOT = r'''
import os, subprocess, tempfile
from flashbook.chapters.ch6 import gluon_fa3, planner
bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
res = []
for d, dtype, bm, bn, stages, overlap, causal in CASES:
    c = planner.Config(BLOCK_M=bm, BLOCK_N=bn, STAGES=stages, OVERLAP=overlap).for_inputs(d, dtype)
    k = gluon_fa3.compile_for_sm90(c, causal)
    ptx = k.asm["ptx"]
    sass = ""
    tool = os.path.join(bin_dir, "cuobjdump")
    if os.path.exists(tool):
        with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
            f.write(k.asm["cubin"])
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
        os.unlink(f.name)
    res.append(dict(case=[d, dtype, bm, bn, stages, overlap, causal], shared=k.metadata.shared,
                    planned=planner.shared_memory(c), target=ptx.split(".target", 1)[1].split()[0],
                    wgmma=ptx.count("wgmma.mma_async"), tma_load=ptx.count("cp.async.bulk.tensor") -
                    ptx.count("cp.async.bulk.tensor.3d.global.shared"),
                    tma_store=ptx.count("cp.async.bulk.tensor.3d.global.shared"),
                    setmaxnreg=sorted(set(int(x.split()[-1].rstrip(";")) for x in ptx.splitlines()
                                          if "setmaxnreg" in x)),
                    maxnreg=".maxnreg 168" in ptx, sass=bool(sass), hgmma=sass.count("HGMMA"),
                    depbar=sass.count("WARPGROUP.DEPBAR"),
                    local=sass.count("STL") + sass.count("LDL")))
print("RESULT" + json.dumps(res))
'''

CASES = [(128, "float16", 64, 128, 2, True, False),     # the planner's pick for d=128
         (128, "bfloat16", 64, 128, 3, False, True),    # the largest ring that fits
         (64, "float16", 64, 128, 2, True, True)]       # the planner's pick for d=64


@pytest.mark.slow
def test_kernel_compiles_for_sm90a_with_the_planned_shared_memory(tmp_path):
    res = compile_script(f"CASES = {CASES!r}\n" + AOT, tmp_path)
    assert len(res) == len(CASES)
    for r in res:
        assert r["target"].startswith("sm_90a"), r
        assert r["shared"] == r["planned"], f"planner off for {r['case']}: {r}"
        assert r["wgmma"] > 0 and r["tma_load"] > 0 and r["tma_store"] > 0, r
        assert 24 in r["setmaxnreg"] and 240 in r["setmaxnreg"], r   # producer down, consumers up
        assert r["maxnreg"], r
        if r["sass"]:
            assert r["local"] == 0, f"register spills in {r['case']}"
            assert r["depbar"] < r["hgmma"] / 4, f"ptxas serialised the wgmmas in {r['case']}"


# ------------------------------------------------------------------- JAX for Exercises 1 and 4

def _versions(present):
    def version(name):
        if name not in present:
            raise importlib.metadata.PackageNotFoundError(name)
        return present[name]
    return version


def test_setup_installs_jax_cpu_wheels_only_when_missing(capsys):
    from flashbook.chapters.ch6 import interpret, jax_setup
    calls = []

    def pip(cmd, check=False, **kw):
        calls.append(cmd)
        return types.SimpleNamespace(returncode=0)
    colab = {"torch": "2.8.0", "triton": "3.4.0", "jax": "0.7.2", "jaxlib": "0.7.2",
             "absl-py": "1.4.0"}
    assert jax_setup.ensure_jax(pip, _versions(colab), environ={}) == "present"
    assert calls == []                                     # Colab's JAX is never replaced
    assert jax_setup.ensure_jax(pip, _versions({"torch": "2.13.0"}), environ={}) == "installed"
    (cmd,) = calls
    assert cmd[cmd.index("-q") + 1:cmd.index("-c")] == list(interpret.JAX_REQUIREMENTS)
    assert f"jax=={interpret.JAX_VERSION}" in cmd
    out = capsys.readouterr().out
    assert "installed jax==" in out and interpret.JAX_VERSIONS in out
    assert jax_setup.ensure_jax(pip, _versions({}), environ={"NBGRADER_EXECUTION": "autograde"}) \
        == "not installed while grading" and len(calls) == 1

    def offline(cmd, check=False, **kw):
        raise subprocess.CalledProcessError(1, cmd)
    assert jax_setup.ensure_jax(offline, _versions({}), environ={}) == "install failed"
    assert interpret.INSTALL in capsys.readouterr().out


def test_one_wording_of_the_jax_versions(monkeypatch):
    """The setup cell's printout and the checks' errors quote interpret.JAX_VERSIONS; the
    chapter's opening text names no JAX version or install command of its own."""
    from flashbook.chapters.ch6 import interpret
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "jax" else find_spec(name, *a))
    problem = interpret.jax_problem()
    assert interpret.INSTALL in problem and interpret.JAX_VERSIONS in problem
    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.4.30")
    assert interpret.JAX_VERSIONS in interpret.jax_problem()            # too old
    opening = sources.source("ch6", ROOT).path.read_text().split("# %%", 2)[1]
    assert "pip install" not in opening and "jax>=" not in opening


def test_the_launcher_plans_once_per_problem(fa3, monkeypatch):
    """attention_fa3 without a config asks the planner (milliseconds of Python) once per
    problem shape, not on every call; another shape is planned anew."""
    calls = []
    real = fa3.planner.best
    monkeypatch.setattr(fa3.planner, "best", lambda *a, **kw: calls.append(a) or real(*a, **kw))
    fa3.pick_config.cache_clear()
    first = fa3.pick_config(64, torch.float16, True, 2, 8, 4096, 4096)
    assert fa3.pick_config(64, torch.float16, True, 2, 8, 4096, 4096) is first
    fa3.pick_config(128, torch.float16, True, 2, 8, 4096, 4096)
    assert len(calls) == 2
    args = fa3.kernel_args(first.for_inputs(64, "float16"))
    assert fa3.kernel_args(first.for_inputs(64, "float16")) is args
    fa3.pick_config.cache_clear()
