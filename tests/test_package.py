"""Unit tests of the helper package: device, reference, check harness, bench, data."""
import math
import subprocess
import sys

import pytest
import torch

import flashbook
from flashbook import bench, reference


def test_setup_on_cpu_selects_simulators_and_small_sizes(capsys):
    backend = flashbook.setup()
    assert not backend.gpu and backend.device == "cpu"
    assert backend.sizes == flashbook.device.CPU_SIZES
    assert "backend: Triton interpreter + Numba CUDA simulator" in capsys.readouterr().out
    import os
    assert os.environ["TRITON_INTERPRET"] == "1" and os.environ["NUMBA_ENABLE_CUDASIM"] == "1"


def test_setup_warns_when_triton_was_imported_first():
    import os
    code = "import triton, flashbook; b = flashbook.setup(); print('restart', b.restart_needed)"
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "NUMBA_ENABLE_CUDASIM")}
    env["FLASHBOOK_FORCE_CPU"] = "1"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=300)
    assert "Restart the runtime" in proc.stdout and "restart True" in proc.stdout, proc.stderr


def test_a_second_setup_on_cpu_needs_no_restart(capsys, monkeypatch):
    """setup() compared the variables' values ("1") with "1" by looking up a variable named
    "1": once triton was imported, every later setup() warned "restart needed"."""
    import os
    import triton  # noqa: F401 - imported, as in a notebook after its first cell
    monkeypatch.setattr(flashbook.device, "_current", None)
    for var in ("TRITON_INTERPRET", "NUMBA_ENABLE_CUDASIM"):
        monkeypatch.setenv(var, "1")             # what the first setup() (here: conftest) set
    first, second = flashbook.setup(), flashbook.setup()
    assert not first.restart_needed and not second.restart_needed
    assert "Restart the runtime" not in capsys.readouterr().out
    monkeypatch.delenv("TRITON_INTERPRET")       # triton imported before CPU mode was on
    assert flashbook.setup(verbose=False).restart_needed
    assert os.environ["TRITON_INTERPRET"] == "1"


def test_setup_prints_the_versions_the_chapter_needs(capsys):
    from flashbook import versions
    flashbook.setup(needs=("torch", "numba-cuda"))
    out = capsys.readouterr().out
    assert f"torch {versions.installed('torch')}" in out
    assert "this chapter needs torch >= 2.11, numba-cuda >= 0.30.4" in out and "triton" not in out
    old = {"torch": "2.8.0+cu126", "triton": "3.4.0"}
    line, warnings = versions.report(("torch", "triton", "numba"), version=old.get)
    assert line == ("flashbook | torch 2.8.0+cu126, triton 3.4.0, numba missing | this chapter "
                    "needs torch >= 2.11, triton >= 3.6, numba >= 0.68")
    assert len(warnings) == 3 and "torch 2.8.0+cu126 is older" in warnings[0]
    assert "Gluon's warp_specialize" in warnings[1] and "numba is not installed" in warnings[2]
    assert versions.report(("torch",), version={"torch": "2.11.0+cu130"}.get)[1] == []
    with pytest.raises(ValueError, match="no minimum version known"):
        versions.report(("jax",))


def test_banner_names_the_gpu_and_its_compute_capability():
    b = flashbook.Backend(True, "Tesla T4", (7, 5), flashbook.device.GPU_SIZES)
    assert "Tesla T4 (sm_75)" in b.banner() and "CUDA" in b.banner()


def _sdpa64(q, k, v, causal, scale=None):
    # torch's math path in float64 is an independent implementation of the same definition.
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        mask = reference.causal_mask(q.shape[-2], k.shape[-2]) if causal else None
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                                scale=scale)


@pytest.mark.parametrize("nq,nk,causal", [(7, 7, False), (7, 7, True), (4, 9, True), (5, 13, False)])
def test_reference_attention_matches_torch_sdpa(nq, nk, causal):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, nq, 16, generator=g, dtype=torch.float64)
    k = torch.randn(2, 3, nk, 16, generator=g, dtype=torch.float64)
    v = torch.randn(2, 3, nk, 16, generator=g, dtype=torch.float64)
    torch.testing.assert_close(reference.attention(q, k, v, causal=causal), _sdpa64(q, k, v, causal))


def test_reference_lse_and_empty_rows():
    q = torch.randn(1, 1, 6, 8, dtype=torch.float64)
    k = torch.randn(1, 1, 3, 8, dtype=torch.float64)
    v = torch.randn(1, 1, 3, 8, dtype=torch.float64)
    o, lse = reference.attention(q, k, v, causal=True, return_lse=True)
    # bottom-right: with N_q=6 > N_k=3 the first 3 queries see no key
    assert torch.all(o[..., :3, :] == 0) and torch.all(torch.isneginf(lse[..., :3]))
    assert not torch.isnan(o).any()
    s = (q @ k.transpose(-1, -2)) / math.sqrt(8)
    expected = torch.logsumexp(s[..., 3:, :].masked_fill(
        ~reference.causal_mask(6, 3)[3:], float("-inf")), dim=-1)
    torch.testing.assert_close(lse[..., 3:].double(), expected, rtol=1e-6, atol=1e-6)


def test_causal_mask_is_bottom_right():
    m = reference.causal_mask(2, 4)
    assert m.tolist() == [[True, True, True, False], [True, True, True, True]]


def test_flops():
    assert reference.attention_flops(1, 1, 2, 3, 4) == 4 * 2 * 3 * 4
    assert reference.attention_flops(2, 2, 8, 8, 8, causal=True) == 4 * 2 * 2 * 32 * 8


def test_gpu_peak_table():
    assert bench.gpu_peak("Tesla T4").tensor_tflops == 65.0
    assert bench.gpu_peak("NVIDIA H200").hbm_gbps == 4800.0
    assert bench.gpu_peak("NVIDIA A100-SXM4-80GB").name == "A100"
    assert bench.gpu_peak("NVIDIA A10G").name == "A10G"
    assert bench.gpu_peak("Some Future GPU") is None


def test_needs_gpu_explains_on_cpu(capsys):
    assert bench.needs_gpu("this benchmark") is False
    assert "needs a CUDA GPU" in capsys.readouterr().out


def test_measure_attention_on_cpu():
    q = torch.randn(1, 2, 64, 16)
    r = bench.measure_attention("sdpa", "baseline", lambda: bench.sdpa()(q, q, q), B=1, H=2,
                                N_q=64, N_k=64, d=16, dtype=torch.float32, memory=True)
    assert r.ms > 0 and r.tflops > 0 and r.pct_peak is None and r.peak_mib >= 0


@pytest.mark.slow
def test_execute_passes_env_to_the_kernel_and_leaves_os_environ_alone(monkeypatch):
    import os
    import threading
    import time

    import nbformat

    from flashbook import notebooks
    monkeypatch.setenv("FLASHBOOK_TEST_INHERITED", "parent")
    monkeypatch.setenv("FLASHBOOK_TEST_OVERRIDDEN", "parent")
    monkeypatch.delenv("FLASHBOOK_TEST_KERNEL_ONLY", raising=False)
    before = dict(os.environ)
    leaked, done = [], threading.Event()

    def watch():   # the old implementation set os.environ for the whole execution
        while not done.is_set():
            if os.environ.get("FLASHBOOK_TEST_OVERRIDDEN") != "parent" or \
                    "FLASHBOOK_TEST_KERNEL_ONLY" in os.environ:
                leaked.append(True)
            time.sleep(0.005)

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "import os, time\n"
        "print(*(os.environ.get(f'FLASHBOOK_TEST_{k}') for k in "
        "('INHERITED', 'OVERRIDDEN', 'KERNEL_ONLY')))\n"
        "time.sleep(0.3)")])
    nb.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python", "name": "python3"}
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        nb = notebooks.execute(nb, timeout=120, env={"FLASHBOOK_TEST_OVERRIDDEN": "kernel",
                                                     "FLASHBOOK_TEST_KERNEL_ONLY": "kernel"})
    finally:
        done.set()
        watcher.join()
    assert nb.cells[0].outputs[0]["text"].split() == ["parent", "kernel", "kernel"]
    assert not leaked, "execute() changed os.environ while the notebook ran"
    assert dict(os.environ) == before


def test_the_grading_commands_start_without_torch():
    """``flashbook collect/autograde/export`` parse their arguments without importing torch or
    matplotlib (about 1.5 s each start: an instructor's every command, a class's every shard);
    the kernels that run the notebooks import what the chapter needs."""
    code = "import sys, flashbook.cli; print(sorted({'torch', 'matplotlib'} & set(sys.modules)))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout
