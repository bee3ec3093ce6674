"""``benchmarks/norm_traffic.py`` counts the bytes the pure norms move against the fused kernels: per
norm and per step of the preset, both norm kinds, and the pure norms' traffic is their ops' tensors."""

import json

import torch

from tests.benchmarks import load_script


def test_the_pure_norms_move_more_bytes_than_the_fused_kernels(tmp_path):
    assert load_script("norm_traffic").main(["--cases", "tiny:256", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "norm_traffic.json").read_text())["rows"]
    assert [(r["norm"], r["per_step"]) for r in rows] == [("RMSNorm", 6), ("GatedRMSNorm", 2)]  # tiny: M*-M-, and the final norm
    for row in rows:
        assert row["pure_ops"] > row["fused_ops"] > 0 and row["pure_bytes"] > 2 * row["fused_bytes"] > 0
        assert row["step_pure_gb"] == row["per_step"] * row["pure_bytes"] / 1e9 and row["step_saved_ms"] > 0
    assert "| tiny | 256 | GatedRMSNorm | 2 |" in (tmp_path / "norm_traffic.md").read_text()


def test_traffic_counts_every_op_once_and_views_not_at_all():
    traffic = load_script("norm_traffic").Traffic
    x = torch.ones(4, 8)
    with traffic() as seen:
        y = x.view(8, 4).t()  # views: nothing moves
        z = x * 2  # reads 128 bytes, writes 128
    assert (seen.ops, seen.bytes) == (1, 256) and y.shape == (4, 8) and z.sum() == 64
