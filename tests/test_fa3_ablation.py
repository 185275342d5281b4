"""Chapter 6's forward ablation (``flashbook.fa3_ablation``): each variant changes one design
choice of the planner's config; the figures the prose quotes follow the record; the command
refuses to run without an sm_90 GPU."""
import dataclasses
import json

import pytest

from flashbook import fa3_ablation
from flashbook.fa3_launch import pick_config
from flashbook.fa3_planner import prefers_persistent

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("shape,causal", [((1, 16, 16384, 128), False),
                                          ((1, 16, 16384, 128), True),
                                          ((2, 16, 4096, 128), True)])
def test_each_variant_changes_one_choice_of_the_planners_config(shape, causal):
    B, H, N, d = shape
    pick = pick_config(d, torch.float16, causal, B, H, N, N)
    cfg = fa3_ablation.configs(B, H, N, d, causal)
    assert cfg["default"] is None                      # as a reader calls it: no config
    assert not cfg["grid"].PERSISTENT and cfg["persistent"].PERSISTENT
    assert cfg["persistent"].GROUP == 1 and not cfg["no_overlap"].OVERLAP
    for name in ("grid", "persistent", "no_overlap"):
        changed = {f.name for f in dataclasses.fields(pick)
                   if getattr(pick, f.name) != getattr(cfg[name], f.name)}
        assert changed <= {"PERSISTENT", "GROUP", "OVERLAP"} and len(changed - {"GROUP"}) <= 1
    # the planner's choice is one of the two launches: persistent where its rule holds
    assert pick == (cfg["persistent"] if prefers_persistent(N, causal, d) else cfg["grid"])


def _record(gpu="NVIDIA H100 80GB HBM3"):
    rows = [dict(shape=list(s), causal=c, tflops={v: 100.0 + 10 * i + j for j, v in
                                                  enumerate(fa3_ablation.variants(s[3]))},
                 rounds_ms={v: [1.0, 1.0 + j / 100, 1.0]
                            for j, v in enumerate(fa3_ablation.variants(s[3]))})
            for i, (s, c) in enumerate((s, c) for s in fa3_ablation.SHAPES for c in (False, True))]
    return dict(provenance=dict(gpu=gpu), rows=rows)


def test_the_quoted_figures_follow_the_record(tmp_path, monkeypatch):
    """None without a record; with one, every variant's TFLOP/s and ratio to cuDNN per case, and
    every figure moves when its timing does; two GPUs' records are refused."""
    monkeypatch.setattr(fa3_ablation, "DATA_DIR", tmp_path)
    assert fa3_ablation.record() is None
    rec = _record()
    (tmp_path / "h100.json").write_text(json.dumps(rec))
    before = fa3_ablation.values(fa3_ablation.record())
    assert before["ch6_abl_gpu"] == "H100 80GB HBM3"
    first = rec["rows"][0]["tflops"]
    assert before["ch6_abl_grid_1_16384_128_noncausal"] == first["grid"]
    assert before["ch6_abl_grid_vs_cudnn_1_16384_128_noncausal"] == first["grid"] / first["cudnn"]
    assert "ch6_abl_cudnn_vs_cudnn_2_4096_128_causal" not in before
    assert "ch6_abl_two_consumers_2_4096_128_causal" not in before
    assert "ch6_abl_two_consumers_vs_cudnn_4_4096_64_causal" in before
    # the noise: the widest spread of one variant's rounds, the last variant's 1.0 .. 1.04
    assert before["ch6_abl_spread_pct"] == pytest.approx(100 * (len(fa3_ablation.VARIANTS) - 1) / 100)
    for i, row in enumerate(rec["rows"]):
        for j, variant in enumerate(row["tflops"]):
            row["tflops"][variant] *= 1 + (10 * i + j + 1) / 256
    rec["rows"][2]["rounds_ms"]["grid"] = [1.0, 1.0, 1.06]
    (tmp_path / "h100.json").write_text(json.dumps(rec))
    after = fa3_ablation.values(fa3_ablation.record())
    assert set(after) == set(before)
    assert [k for k in before if k != "ch6_abl_gpu" and after[k] == before[k]] == []
    (tmp_path / "h200.json").write_text(json.dumps(rec))
    with pytest.raises(ValueError, match="several GPUs"):
        fa3_ablation.record()


def test_every_quoted_key_of_a_full_record_is_pasted_in_the_chapter():
    """The prose's ablation table pastes every figure a complete record gives (and no other
    ch6_abl_* key), so a record with all variants fills the whole table."""
    import re
    from pathlib import Path
    text = (Path(__file__).resolve().parents[1] / "solutions" / "ch6_hopper.py").read_text()
    pasted = set(re.findall(r"`(ch6_abl_\w+?)(?::[^`]*)?`", text))
    assert pasted == set(fa3_ablation.values(_record()))


def test_the_command_refuses_without_an_sm90_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs an sm_90 GPU"):
        fa3_ablation.main(["--out", "unused"])
