"""The HBM traffic model of the two loop orders (Section 8 counts the bytes with it), and what
it predicts for the recorded H200 runs (Section 11 sets that against the measured times)."""
from __future__ import annotations

import math
from typing import NamedTuple

from flashbook import bench

from . import benchmark
from .launch import tiled_config


def hbm_traffic(N: int, d: int, Bc: int, Br: int, order: str, *, B: int = 1, H: int = 1,
                itemsize: int = 4) -> dict:
    """Bytes each loop order moves between global memory (HBM) and the chip, with no cache.

    ``order='fa1'`` (flash.cu): per head, K and V are read once; for each of the Tc K/V tiles,
    every Q tile is read, the running (m, l) and O rows are read and written back; O, l, m are
    initialised in HBM first. ``order='fa2'``: Q is read once, each of the Tr query tiles reads
    all of K and V, O is written once, (m, l) never leave the chip.
    Returns reads, writes and total in bytes, and the per-tensor breakdown in elements.
    """
    Tc, Tr = math.ceil(N / Bc), math.ceil(N / Br)
    Nd = N * d
    if order == "fa1":
        parts = {"Q read": Tc * Nd, "K,V read": 2 * Nd, "O read": Tc * Nd, "O write": Tc * Nd,
                 "m,l read": Tc * 2 * N, "m,l write": Tc * 2 * N, "init O,m,l": Nd + 2 * N}
    elif order == "fa2":
        parts = {"Q read": Nd, "K,V read": Tr * 2 * Nd, "O read": 0, "O write": Nd,
                 "m,l read": 0, "m,l write": 0, "init O,m,l": 0}
    else:
        raise ValueError(f"order must be 'fa1' or 'fa2', got {order!r}")
    heads = B * H
    reads = sum(v for k, v in parts.items() if "read" in k) * heads * itemsize
    writes = sum(v for k, v in parts.items() if "read" not in k) * heads * itemsize
    return {"reads": reads, "writes": writes, "total": reads + writes,
            "parts": {k: v * heads for k, v in parts.items()}, "Tc": Tc, "Tr": Tr}


def traffic_table(N: int, d: int, Bc: int, Br: int, B: int = 1, H: int = 1) -> str:
    """A text table comparing the two orders (MB = 1e6 bytes)."""
    a = hbm_traffic(N, d, Bc, Br, "fa1", B=B, H=H)
    b = hbm_traffic(N, d, Bc, Br, "fa2", B=B, H=H)
    lines = [f"B={B}, H={H}, N={N}, d={d}, Bc={Bc}, Br={Br} (Tc={a['Tc']}, Tr={a['Tr']}), float32",
             f"{'':12}{'FA1 (flash.cu)':>16}{'FA2 order':>14}"]
    for key in a["parts"]:
        lines.append(f"{key:12}{a['parts'][key] * 4 / 1e6:13.1f} MB{b['parts'][key] * 4 / 1e6:11.1f} MB")
    for key in ("reads", "writes", "total"):
        lines.append(f"{key.upper():12}{a[key] / 1e6:13.1f} MB{b[key] / 1e6:11.1f} MB")
    lines.append(f"compulsory (read Q, K, V, write O once): {4 * 4 * N * d * B * H / 1e6:.1f} MB")
    return "\n".join(lines)


class Prediction(NamedTuple):
    """One recorded row against the traffic model: bytes / datasheet bandwidth vs measured."""
    kernel: str
    N: int
    model: str              # which count: "fa1 Bc=Br=32", "fa2 Bc=32 Br=64", "compulsory"
    bytes: int
    predicted_ms: float     # bytes / bandwidth: the time if HBM bandwidth were the only limit
    ms: float               # measured

    @property
    def ratio(self) -> float:
        return self.ms / self.predicted_ms


def predicted_vs_measured(rows, gpu: str = "NVIDIA H200") -> list[Prediction]:
    """For each recorded row of the ladder (and sdpa_efficient), the time its HBM traffic takes
    at the GPU's datasheet bandwidth (``bench.gpu_peak``), next to the measured time.

    The four rungs are counted with ``hbm_traffic`` for the tiles ``flashbook bench ch2`` ran
    them with (``benchmark``); PyTorch's kernel with the compulsory traffic only (read Q, K, V,
    write O once), a lower bound. Rows not measured, or of other kernels, are left out.
    """
    peak = bench.gpu_peak(gpu)
    if peak is None:
        raise ValueError(f"no datasheet bandwidth for {gpu!r} in bench.PEAKS")
    out = []
    for r in rows:
        if r.ms is None or r.role == "public":
            continue
        N, d, shape = r.N_q, r.d, dict(B=r.B, H=r.H_q)
        if r.kernel in ("fa1_literal", "fa1_bounded"):
            bc = benchmark.FA1_BC
            model, nbytes = f"fa1 Bc=Br={bc}", hbm_traffic(N, d, bc, bc, "fa1", **shape)["total"]
        elif r.kernel == "fa2_rows":
            bc, br = benchmark.ROWS_BC, benchmark.ROWS_BR
            model, nbytes = f"fa2 Bc={bc} Br={br}", hbm_traffic(N, d, bc, br, "fa2", **shape)["total"]
        elif r.kernel == "fa2_tiled":
            cfg = tiled_config(d, gpu=True)
            model = f"fa2 Bc={cfg.BN} Br={cfg.BM}"
            nbytes = hbm_traffic(N, d, cfg.BN, cfg.BM, "fa2", **shape)["total"]
        elif r.kernel == "sdpa_efficient":
            model, nbytes = "compulsory", 4 * 4 * N * d * r.B * r.H_q
        else:
            continue
        out.append(Prediction(r.kernel, N, model, nbytes, nbytes / (peak.hbm_gbps * 1e9) * 1e3, r.ms))
    return out


def prediction_table(rows, gpu: str = "NVIDIA H200") -> str:
    """``predicted_vs_measured`` as a text table (MB = 1e6 bytes)."""
    peak = bench.gpu_peak(gpu)
    lines = [f"HBM traffic at the {peak.name} datasheet bandwidth ({peak.hbm_gbps / 1000:g} TB/s) "
             "against the measured time",
             f"{'kernel':15}{'N':>6}  {'traffic model':17}{'MB':>9}{'predicted ms':>14}"
             f"{'measured ms':>13}{'measured/pred.':>16}"]
    for p in predicted_vs_measured(rows, gpu):
        lines.append(f"{p.kernel:15}{p.N:6d}  {p.model:17}{p.bytes / 1e6:9.1f}{p.predicted_ms:14.3f}"
                     f"{p.ms:13.3f}{p.ratio:15.0f}x")
    return "\n".join(lines)
