"""Chapter 8's own tests (the contract tests in test_chapters.py run its exercises, stubs and
known-wrong variants): the merge references, the split count, the wrapper's argument checks,
the mesh simulator, the ring harness's teardown (a hang and a raise in the student's code), the
traffic formulas of the ring, all-gather and Ulysses and the Ulysses check, the figures, and the
split-KV kernels compiling ahead of time for sm_75 and sm_90."""
import math
from pathlib import Path

import pytest
import torch

from flashbook import sources
from flashbook.chapters import ch8
from flashbook.chapters.ch8 import mesh, ring
from flashbook.check import CheckFailure, simulated_capture

from aot_compile import compile_script, too_big

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def solution():
    return sources.solution_namespace("ch8", ROOT)


# ------------------------------------------------------------------------------ the merge

def test_merge_lse_matches_the_whole_row_and_handles_empty_sides():
    s = torch.randn(3, 10, dtype=torch.float64) * 4
    v = torch.randn(10, 2, dtype=torch.float64)
    a = ch8.state_of(s[:, :4], v[:4])
    b = ch8.state_of(s[:, 4:], v[4:])
    m, l, o = ch8.merge_states(a, b)
    torch.testing.assert_close(o, torch.softmax(s, -1) @ v)
    torch.testing.assert_close(m + torch.log(l), torch.logsumexp(s, -1))
    o2, lse2 = ch8.merge_lse(a[2], a[0] + torch.log(a[1]), b[2], b[0] + torch.log(b[1]))
    torch.testing.assert_close(o2, o)
    empty = ch8.identity((3,), 2)
    m, l, o = ch8.merge_states(empty, empty)
    assert torch.all(m == -math.inf) and torch.all(l == 0) and torch.all(o == 0)


def test_wire_fp16_state_loses_accuracy_that_fp32_lse_keeps():
    err = ch8.wire_roundtrip_error(boost=12.0)
    assert err["fp32 m, l, O"] < 1e-5
    assert err["fp16 m, l, O (the mesh kernel)"] > 3 * err["fp32 LSE, fp16 O"]


# ---------------------------------------------------------------------- split-KV launch

@pytest.mark.parametrize("batch, context, want", [
    (1, 131072, 16),        # 8 programs: 16 splits give 128 of the 132 SMs one program
    (32, 8192, 1),          # 256 programs keep the GPU busy; short context: no split
    (32, 131072, 8),        # no range longer than 16384 keys
    (4, 131072, 8),         # 32 programs: 4 to fill, 8 for the length
    (8, 1024, 1),           # 64 programs: more than a third of 132 SMs
    (1, 1000, 8)])          # never more splits than the 8 key tiles
def test_split_count_fills_the_sms_with_whole_tiles(batch, context, want):
    s = ch8.choose_num_splits(batch, 8, context, 132, 128)
    assert s == want
    tiles = -(-context // 128)
    per = -(-tiles // s)
    assert -(-tiles // per) == s                           # every split but the last: per tiles


def test_split_count_on_cpu_gives_several_splits():
    assert ch8.choose_num_splits(1, 2, 64, None, 16) == 1
    assert ch8.choose_num_splits(1, 2, 256, None, 16) == 4


@pytest.mark.parametrize("change, arg", [
    (dict(q=torch.randn(1, 2, 4, 16)), "q"),
    (dict(cache_seqlens=torch.tensor([70], dtype=torch.int32)), "cache_seqlens"),
    (dict(cache_seqlens=torch.tensor([5])), "cache_seqlens"),
    (dict(k_cache=torch.randn(1, 64, 3, 16)), "k_cache"),
    (dict(num_splits=0), "num_splits"),
])
def test_wrapper_rejects_bad_arguments(solution, change, arg):
    call = dict(q=torch.randn(1, 1, 4, 16), k_cache=torch.randn(1, 64, 2, 16),
                v_cache=torch.randn(1, 64, 2, 16),
                cache_seqlens=torch.tensor([50], dtype=torch.int32))
    call.update(change)
    if "k_cache" in change:
        call["v_cache"] = change["k_cache"]
    with pytest.raises(ValueError, match=arg):
        solution["decode_split_kv"](**call)


def test_wrapper_checks_read_nothing_on_the_host_while_a_graph_is_captured(monkeypatch):
    """Issue 27: cache_seqlens is read once per tensor, and not at all during a capture."""
    call = dict(q=torch.randn(1, 1, 4, 16), k_cache=torch.randn(1, 64, 2, 16),
                v_cache=torch.randn(1, 64, 2, 16),
                cache_seqlens=torch.tensor([50], dtype=torch.int32))
    with simulated_capture():
        ch8.validate_split_decode(**call)
        with pytest.raises(ValueError, match="cache_seqlens"):
            ch8.validate_split_decode(**{**call, "cache_seqlens": call["cache_seqlens"].long()})
    reads, tolist = [], torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t) or tolist(t))
    for _ in range(3):
        ch8.validate_split_decode(**call)
    assert len(reads) == 1
    with pytest.raises(ValueError, match="cache_seqlens"):
        ch8.validate_split_decode(**{**call, "cache_seqlens": torch.tensor([70],
                                                                           dtype=torch.int32)})


def test_split_kv_matches_chapter5_decode(solution):
    from flashbook.chapters import ch5
    ns5 = sources.solution_namespace("ch5", ROOT)
    q = torch.randn(2, 1, 8, 16)
    k, v = torch.randn(2, 80, 2, 16), torch.randn(2, 80, 2, 16)
    lens = torch.tensor([80, 33], dtype=torch.int32)
    o, lse = solution["decode_split_kv"](q, k, v, lens, num_splits=3)
    o5, lse5 = ns5["decode"](q, k, v, lens)
    torch.testing.assert_close(o, o5, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, lse5, atol=1e-5, rtol=1e-5)
    assert ch5 is not None


def test_one_split_writes_the_answer_without_a_combine(solution):
    from flashbook import plans
    q = torch.randn(2, 1, 8, 16)
    k, v = torch.randn(2, 80, 2, 16), torch.randn(2, 80, 2, 16)
    lens = torch.tensor([80, 33], dtype=torch.int32)
    want = solution["decode_split_kv"](q, k, v, lens, num_splits=3)
    with plans.recorded_launches() as launches:
        got = solution["decode_split_kv"](q, k, v, lens, num_splits=1)
    assert [launch.kernel for launch, _ in launches] == [solution["split_kv_kernel"]]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert got[0].dtype == q.dtype and got[1].shape == (2, 8, 1)


def test_sequences_per_launch_keeps_each_slice_within_32_bit_offsets():
    # meta tensors: the shapes of an H200 sweep point, no memory
    cache = torch.empty(32, 131072, 8, 128, dtype=torch.float16, device="meta")
    per_sequence = 131072 * 8 * 128
    n = ch8.sequences_per_launch(cache, cache)
    assert n * per_sequence <= 2**31 - 1 < (n + 1) * per_sequence
    with pytest.raises(ValueError, match="one sequence"):
        ch8.sequences_per_launch(torch.empty(1, 2**22, 8, 128, device="meta"))


def test_a_cache_past_32_bit_offsets_is_launched_in_slices(solution, monkeypatch):
    from flashbook import plans
    from flashbook.chapters.ch8 import launch
    q = torch.randn(5, 1, 4, 16)
    k, v = torch.randn(5, 48, 2, 16), torch.randn(5, 48, 2, 16)
    lens = torch.tensor([48, 1, 17, 33, 48], dtype=torch.int32)
    want = solution["decode_split_kv"](q, k, v, lens, num_splits=2)
    monkeypatch.setattr(launch, "MAX_ELEMENTS", 2 * 48 * 2 * 16)     # two sequences a launch
    monkeypatch.setattr(launch, "_SPLIT_PLANS", plans.Plans())       # planned afresh
    with plans.recorded_launches() as launches:
        got = solution["decode_split_kv"](q.clone(), k.clone(), v.clone(), lens.clone(),
                                          num_splits=2)
    splits = [t for launch_, t in launches if launch_.kernel is solution["split_kv_kernel"]]
    assert [t[0].shape[0] for t in splits] == [2, 2, 1]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------- the mesh

def test_seed_chain_deadlocks_on_a_partial_row_and_reports_who_waits():
    states = [ch8.identity((1,), 1) for _ in range(6)]
    with pytest.raises(mesh.Deadlock, match="PE 5 .* waits on PE 6, not in the group"):
        mesh.simulate(mesh.seed_chain_reduce, states, 4, merge=ch8.merge_states)
    r = mesh.simulate(mesh.seed_chain_reduce, states[:4] * 2, 4, merge=ch8.merge_states)
    assert (r.messages, r.steps, r.hops) == (7, 4, 7)


def test_simulator_rejects_a_plain_function_and_counts_unreceived_messages():
    def not_a_generator(pe, n, cols, state):
        return state

    with pytest.raises(TypeError, match="generator"):
        mesh.simulate(not_a_generator, [1, 2], 2)

    def sends_twice(pe, n, cols, state):
        if pe == 1:
            yield mesh.send(0, state)
            yield mesh.send(0, state)
        else:
            state += yield mesh.recv(1)
        return state
    r = mesh.simulate(sends_twice, [1, 2], 2)
    assert r.result == 3 and r.unreceived == [(1, 0)]


def test_reduction_costs_table_and_figure(solution):
    costs = ch8.reduction_costs({"chain": solution["chain_reduce"],
                                 "tree": solution["tree_reduce"]}, (4, 16, 64), cols=8)
    assert [c[2] for c in costs["chain"]] == [3, 8, 14]
    assert [c[2] for c in costs["tree"]] == [2, 4, 6]
    assert all(c[1] == c[0] - 1 for rows in costs.values() for c in rows)
    ch8.plot_reduction_costs(costs)


# -------------------------------------------------------------------- the ring harness

def test_zigzag_positions_cover_the_sequence_and_balance_causal_work():
    for P in (2, 3, 4):
        pos = [ring.zigzag_positions(8 * P, P, r) for r in range(P)]
        assert sorted(torch.cat(pos).tolist()) == list(range(8 * P))
        assert len({ring.causal_work(p) for p in pos}) == 1
    contiguous = [ring.causal_work(ring.contiguous_positions(16, 4, r)) for r in range(4)]
    assert contiguous == sorted(contiguous) and contiguous[0] < contiguous[-1]


def _hangs(q, k, v, q_pos, k_pos, causal=False):
    import torch.distributed as dist
    dist.recv(torch.empty_like(k), (dist.get_rank() + 1) % dist.get_world_size())
    return q, q[..., 0]


def _raises_on_rank_1(q, k, v, q_pos, k_pos, causal=False):
    import torch.distributed as dist
    if dist.get_rank() == 1:
        raise RuntimeError("student bug on rank 1")
    dist.recv(torch.empty_like(k), 1)
    return q, q[..., 0]


@pytest.fixture
def workers(monkeypatch):
    """The pids of the processes the check starts (its ring workers), recorded as they start:
    other tests running at the same time start rings of their own."""
    import subprocess
    started = []

    class Recording(subprocess.Popen):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            started.append(self.pid)

    monkeypatch.setattr(subprocess, "Popen", Recording)
    return started


def _alive(pids):
    """The pids still running (a reaped worker has no /proc entry; a zombie is not running)."""
    def running(pid):
        try:
            return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
        except (OSError, IndexError):
            return False
    return [p for p in pids if running(p)]


@pytest.mark.timeout(60)         # a hang that the check's own limit misses fails here
def test_a_hanging_ring_fails_within_its_limit_and_leaves_no_process(workers):
    with pytest.raises(CheckFailure, match="no result within 4 s: a deadlock"):
        ch8.check_ring_attention(_hangs, timeout=4)
    assert workers and not _alive(workers)


def test_a_raising_rank_is_named_and_the_others_are_killed(workers):
    with pytest.raises(CheckFailure, match="(?s)rank 1 failed .*student bug on rank 1"):
        ch8.check_ring_attention(_raises_on_rank_1, timeout=30)
    assert workers and not _alive(workers)


# ------------------------------------------------- Ulysses, all-gather and their traffic

def test_cp_traffic_formulas_for_llama_3_70b():
    """Ring and all-gather send every K/V element to every other rank; Ulysses sends (P - 1)/P
    of q, k, v, O and LSE: (G + 1)/P of the ring's bytes (plus the LSE), and needs P | h_kv."""
    t = ch8.cp_traffic(131072, 8, h_q=64, h_kv=8, d=128, itemsize=2)
    assert t["ring"]["bytes"] == t["all-gather"]["bytes"] == 2 * 16384 * 8 * 128 * 7 * 2
    assert (t["ring"]["steps"], t["all-gather"]["steps"], t["Ulysses"]["steps"]) == (7, 1, 2)
    lse = 16384 * 64 * 7 // 8
    assert t["Ulysses"]["elements"] - lse == pytest.approx(t["ring"]["elements"] * (8 + 1) / 8)
    mha = ch8.cp_traffic(131072, 8, h_q=16, h_kv=16, d=128)        # G = 1: a quarter at P = 8
    assert (mha["Ulysses"]["elements"] - 16384 * 16 * 7 // 8) * 4 == mha["ring"]["elements"]
    assert ch8.cp_traffic(4096, 16, h_q=64, h_kv=8, d=128)["Ulysses"] is None
    assert ch8.cp_traffic(4096, 3, h_q=64, h_kv=8, d=128)["Ulysses"] is None
    rows = ch8.traffic_rows()
    assert [(r["N"], r["P"]) for r in rows] == [(N, P) for N in (32768, 131072, 262144)
                                                for P in (2, 8)]
    assert rows[3]["ring MiB"] == 448 and rows[2]["Ulysses MiB"] == pytest.approx(1156)


def test_collective_bytes_are_what_a_rank_sends_to_the_others():
    class Dist:
        @staticmethod
        def get_world_size():
            return 4

        @staticmethod
        def get_rank():
            return 1
    x = torch.zeros(8, 3, dtype=torch.float64)                       # 24 bytes a row
    assert ring._bytes_to_others(Dist, "all_to_all_single", (x.clone(), x), {}) == 6 * 24
    assert ring._bytes_to_others(Dist, "all_to_all_single", (x.clone(), x, None, [1, 4, 2, 1]),
                                 {}) == 4 * 24
    assert ring._bytes_to_others(Dist, "all_gather", ([x] * 4, x), {}) == 3 * 192
    assert ring._bytes_to_others(Dist, "all_to_all", ([x] * 4, [x, x[:1], x, x]), {}) == 3 * 192
    assert ring._bytes_to_others(Dist, "all_reduce", (x,), {}) == 0


def test_counted_traffic_matches_the_formulas_plus_the_positions(solution):
    case = ch8.ShardedCase("traffic", 32, H_q=4, H_kv=2, d=8, causal=True, layout="zigzag")
    methods = {m: solution[f] for m, f in (("ring", "ring_attention"),
                                           ("all-gather", "allgather_attention"),
                                           ("Ulysses", "ulysses_attention"))}
    counted = ch8.counted_traffic(methods, case, world_size=2)
    formula = ch8.cp_traffic(32, 2, 4, 2, 8, itemsize=8)
    positions = 16 * 8                                               # one shard's int64 positions
    assert counted["ring"]["bytes"] == formula["ring"]["bytes"] + positions
    assert counted["all-gather"]["bytes"] == formula["all-gather"]["bytes"] + positions
    assert counted["Ulysses"]["bytes"] == formula["Ulysses"]["bytes"] + 2 * positions
    assert counted["ring"]["calls"] == {"isend": 3}
    assert counted["Ulysses"]["calls"] == {"all_to_all_single": 5, "all_gather": 2}


def test_ulysses_check_passes_the_solution_and_names_each_wrong_method(solution, capsys):
    ch8.check_ulysses(solution["ulysses_attention"])
    assert "PASSED Ulysses attention over gloo, 2 processes" in capsys.readouterr().out
    for wrong, message in ((solution["allgather_attention"], "all-gather context parallelism"),
                           (solution["ring_attention"], "point-to-point")):
        with pytest.raises(CheckFailure, match=message):
            ch8.check_ulysses(wrong)


def _always_raises(q, k, v, q_pos, k_pos, causal=False):
    raise ValueError("P must divide h_kv")


def test_ulysses_check_wants_a_value_error_only_where_p_does_not_divide_h_kv():
    """Where P divides h_kv a raise fails the check like any other, with its traceback."""
    with pytest.raises(CheckFailure, match="(?s)rank [01] failed .*ValueError: P must divide"):
        ch8.check_ulysses(_always_raises)


# ------------------------------------------------------------------------------ figures

def test_figures_draw():
    ch8.plot_zigzag_work(4, 64)
    ch8.plot_mesh_chain(6, 4)
    ch8.plot_mesh_chain(8, 4)
    ch8.plot_cp_costs(P=8, peak_tflops=989.0, link_gbps=450.0)
    c = ch8.cp_costs(131072, 2)
    assert c["sent_per_step_mib"] == pytest.approx(2 * 65536 * 16 * 128 * 2 / 2**20)


# ------------------------------------------------------------------ ahead-of-time compile

AOT = r'''
ns = sources.solution_namespace("ch8")
out = []
for cc, (BN, warps, stages) in ((75, (64, 4, 3)), (90, (128, 4, 2))):
    target = GPUTarget("cuda", cc, 32)
    k = ns["split_kv_kernel"]
    sig = signature(k, {n: "*fp16" for n in ("Q", "K", "V")} | {"O_PART": "*fp32",
                    "LSE_PART": "*fp32", "CACHE_SEQLENS": "*i32", "qk_scale": "fp32"},
                    ("GROUP", "HEAD_DIM", "BLOCK_M", "BLOCK_N", "DOT_PRECISION"))
    c = triton.compile(ASTSource(fn=k, signature=sig, constexprs=dict(
        GROUP=4, HEAD_DIM=128, BLOCK_M=16, BLOCK_N=BN, DOT_PRECISION="tf32")), target=target,
        options={"num_warps": warps, "num_stages": stages})
    out.append(dict(name="split", cc=cc, shared=c.metadata.shared))
    k = ns["combine_kernel"]
    sig = signature(k, {"O_PART": "*fp32", "LSE_PART": "*fp32", "O": "*fp16", "LSE": "*fp32"},
                    ("HEAD_DIM", "BLOCK_S"))
    c = triton.compile(ASTSource(fn=k, signature=sig, constexprs=dict(HEAD_DIM=128, BLOCK_S=64)),
                       target=target, options={"num_warps": 4, "num_stages": 1})
    out.append(dict(name="combine", cc=cc, shared=c.metadata.shared))
from flashbook.chapters.ch8.ring_bench import _merge_kernel
k = _merge_kernel()
sig = signature(k, {"O_ACC": "*fp32", "LSE_ACC": "*fp32", "O_NEW": "*fp16", "LSE_NEW": "*fp32"},
                ("H", "HEAD_DIM", "BLOCK_R"))
c = triton.compile(ASTSource(fn=k, signature=sig, constexprs=dict(H=16, HEAD_DIM=128,
                   BLOCK_R=64)), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": 4, "num_stages": 1})
out.append(dict(name="ring merge", cc=90, shared=c.metadata.shared))
print("RESULT" + json.dumps(out))
'''


@pytest.mark.slow
def test_split_kv_and_ring_merge_kernels_compile_for_t4_and_h200(tmp_path):
    """A cubin for the T4; PTX for the H200, whose shared memory is known once LLVM lowers the
    kernel (ptxas is skipped there)."""
    got = compile_script(AOT, tmp_path, ptx_only_for=(90,))
    assert len(got) == 5
    assert not too_big(got), got


# ------------------------------------------------------------- the multi-GPU ring's logic

def test_ring_bench_ring_is_exact_on_cpu_with_torchrun_and_gloo(tmp_path):
    """ring_bench's Ring (zig-zag steps, its Triton merge in the interpreter, the hops) run by
    torchrun as 2 gloo processes with reference attention, against one process; then its
    measuring code end to end (on CPU every time is 0), the profiler trace included."""
    import os
    import socket
    import subprocess
    import sys
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), FLASHBOOK_FORCE_CPU="1",
               TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                           f"--master-port={port}", "-m", "flashbook.chapters.ch8.ring_bench",
                           "--cpu-check", "--out", str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "CPU CHECK max error" in proc.stdout
    assert (tmp_path / "ring_trace_rank0.json").stat().st_size > 1000     # the profiler trace


def test_ring_bench_rows_and_benchmark_summary():
    from flashbook.chapters.ch8 import benchmark, ring_bench
    case = dict(N=131072, causal=True, world_size=2, ring_ms=40.0, one_gpu_ms=70.0,
                efficiency=70 / 80, max_err_o=1e-3, max_err_lse=1e-4, hop_ms=2.0,
                hop_bytes=2**29, steps_rank0=[dict(step=0, compute_ms=20, wait_ms=0.1)],
                flops=4 * 16 * 131072 ** 2 * 128 / 2)
    rows = ring_bench.rows_of([case], 989.0)   # made-up numbers: a unit test of the arithmetic
    assert [r.kernel for r in rows] == ["ch8_ring", "ch5_two_tiles"]
    assert rows[0].tflops == pytest.approx(case["flops"] / 40e-3 / 1e12)
    assert rows[0].pct_peak == pytest.approx(100 * rows[0].tflops / (2 * 989.0))
    assert "scaling efficiency 87.5 %" in rows[0].note
    assert "split-KV" not in benchmark.summary(rows)
    both = dict(case, ulysses_ms=50.0, allgather_ms=45.0, max_err_ulysses=2e-3,
                max_err_allgather=0.5)
    rows = ring_bench.rows_of([both], 989.0)
    assert [r.kernel for r in rows] == ["ch8_ulysses", "ch8_allgather", "ch8_ring",
                                        "ch5_two_tiles"]
    assert rows[0].tflops == pytest.approx(case["flops"] / 50e-3 / 1e12)
    assert "all-to-all" in rows[0].note and "WRONG" not in rows[0].note
    assert "zig-zag" in rows[1].note and "WRONG" in rows[1].note      # 0.5 > TOLERANCE


SANDBOXED_RING = r'''
import os, socket, sys, tempfile
import flashbook as fb
fb.setup(verbose=False)
from flashbook import sources
from flashbook.grade import sandbox
from flashbook.chapters import ch8
ns = sources.solution_namespace("ch8")
work = tempfile.mkdtemp()                 # as the sandbox's launcher: HOME and TMPDIR in it
os.makedirs(os.path.join(work, "tmp"))
os.environ.update(HOME=work, TMPDIR=os.path.join(work, "tmp"))
tempfile.tempdir = None
abi = sandbox.landlock(rw=[work, "/dev", f"/proc/{os.getpid()}"],
                       ro=sandbox.read_only_paths(), tcp_bind_ports=[],
                       local_ports=True)       # what the chapter's notebook metadata asks
if abi >= 4:
    for port in (22, 80, 443):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            print("NOT BLOCKED", port)
        except PermissionError:
            print("blocked", port)
        except OSError:
            print("NOT BLOCKED", port)          # allowed, nobody listening
ch8.check_ring_attention(ns["ring_attention"], timeout=60)
print("ABI", abi)
'''


def test_ring_check_runs_inside_the_autograders_sandbox(tmp_path):
    """For Chapter 8 the autograder's Landlock sandbox leaves the ephemeral ports open for gloo
    (the ring's processes talk over loopback TCP) and keeps well-known ports closed."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), FLASHBOOK_FORCE_CPU="1",
               TRITON_INTERPRET="1", TMPDIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", SANDBOXED_RING], env=env, capture_output=True,
                          text=True, timeout=180, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "PASSED ring attention over gloo" in proc.stdout
    assert "NOT BLOCKED" not in proc.stdout
    abi = int(proc.stdout.split("ABI ")[1].split()[0])
    assert proc.stdout.count("blocked") == (3 if abi >= 4 else 0)


def test_benchmark_runs_end_to_end_at_a_tiny_size_on_cpu():
    """The GPU benchmark's code path (every row, the checks in the notes, the summary) in the
    interpreter at a tiny size. CPU timings: a test of the code, never recorded."""
    from flashbook.chapters.ch8 import benchmark
    rows = benchmark.run(shape=(1, 8, 2, 256, 16), sweep=(2,), read_bytes=2**20,
                         copy_bytes=2**20, device="cpu", compile_flex=False,
                         tile_sweep=benchmark.TILE_SWEEP[:1])
    kernels = [r.kernel for r in rows]
    assert kernels[0] == "ch8_split_kv" and rows[0].role == "reference"
    assert {"ch5_decode", "sdpa_flash", "flex_attention", "hbm_read", "d2d_copy"} <= set(kernels)
    for r in rows:
        if r.kernel in ("ch8_split_kv", "ch5_decode") and r.role != "public":
            err = float(r.note.split("max|O-")[1].split("=")[1].split(";")[0])
            assert err < 1e-2, r
    assert [r.role for r in rows if r.kernel == "ch8_split_kv"] == ["reference", "public",
                                                                    "variant", "variant"]
    public = rows[1]          # the call as the chapter shows it, checks on, timed launched
    assert public.ms and public.note == "decode_split_kv(q, k_cache, v_cache, cache_seqlens)"


def test_the_benchmark_command_records_what_flashbook_bench_records(monkeypatch):
    """``python -m flashbook.chapters.ch8.benchmark`` records the chapter contract's benchmark
    and timer, as ``flashbook bench ch8`` (``results.record(CHAPTER, ...)``) does."""
    from flashbook import results
    from flashbook.chapters.ch8 import benchmark
    seen = []

    class Recorded(Exception):
        """Stops the command before it reads the record back."""

    def record_benchmark(chapter_id, run, out_root, command, graph_timer=False):
        seen.append((chapter_id, run, graph_timer, str(out_root), command))
        raise Recorded

    monkeypatch.setattr(results, "record_benchmark", record_benchmark)
    with pytest.raises(Recorded):
        benchmark.main(["--out", "/nonexistent"])
    assert seen == [(ch8.CHAPTER.id, ch8.CHAPTER.benchmark, ch8.CHAPTER.graph_timer,
                     "/nonexistent",
                     "python -m flashbook.chapters.ch8.benchmark --out /nonexistent")]


def test_gpu_runs_full_size_checks_pass_at_a_tiny_size_on_cpu(capsys):
    from flashbook.chapters.ch8 import gpu_run
    gpu_run.checks(cases=((1, 96, 96), (2, 64, 40)), h_q=8, h_kv=2, d=16, device="cpu",
                   dtype=torch.float32, tol=1e-4)
    assert capsys.readouterr().out.count("check split-KV") == 2


CLOSED_EPHEMERAL = r'''
import os, socket, tempfile
from flashbook.grade import sandbox
listener = socket.socket()
listener.bind(("127.0.0.1", 0))            # before the sandbox: a port in the ephemeral range
listener.listen()
port = listener.getsockname()[1]
work = tempfile.mkdtemp()
abi = sandbox.landlock(rw=[work], ro=sandbox.read_only_paths(), tcp_bind_ports=[])
try:
    socket.create_connection(("127.0.0.1", port), timeout=1).close()
    print("CONNECTED", abi)
except PermissionError:
    print("BLOCKED", abi)
'''


def test_other_chapters_keep_the_ephemeral_ports_closed(tmp_path):
    """Only a chapter whose notebook asks for them (``{"flashbook": {"local_ports": true}}``
    in its metadata, read by the autograder from the course's source copy) gets the ephemeral
    ports: every other chapter's kernel cannot connect to a port of that range."""
    import json
    import os
    import subprocess
    import sys
    from flashbook.grade import autograde

    class Course:                      # the one method needs_local_ports uses
        def source_dir(self, a):
            return ROOT / "notebooks"
    asking = [s.id for s in sources.sources(ROOT)
              if autograde.needs_local_ports(Course(), s.id, [s.name])]
    assert asking == ["ch8"]
    meta = json.loads((ROOT / "notebooks" / "ch8_distributed.ipynb").read_text())["metadata"]
    assert meta["flashbook"] == {"local_ports": True}
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), TMPDIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", CLOSED_EPHEMERAL], env=env, capture_output=True,
                          text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    verdict, abi = proc.stdout.split()
    assert verdict == ("BLOCKED" if int(abi) >= 4 else "CONNECTED")
