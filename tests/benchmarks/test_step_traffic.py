"""``benchmarks/step_traffic.py`` counts the bytes one eager bf16 step moves, by part of the model:
every part is there (blocks multiplied by their count in the preset), the fused kernels count their
inputs and outputs once, views move nothing, our custom ops are opened and matmuls are not computed."""

import json

import torch

from tests.benchmarks import load_script


def test_every_part_of_a_step_is_counted_once_per_block_of_the_preset(tmp_path):
    script = load_script("step_traffic")
    assert script.main(["--cases", "tiny:256", "--out", str(tmp_path)]) == 0
    (record,) = json.loads((tmp_path / "step_traffic.json").read_text())["cases"]
    assert record["blocks"] == {"Mamba2Mixer": 2, "Attention": 1, "MLP": 2}  # tiny: M*-M-
    parts = {e["part"]: e for e in record["parts"]}
    for part in ("Mamba2Mixer block: mixer", "Mamba2Mixer block: mixer.in_proj", "Mamba2Mixer block: mixer.norm",
                 "Mamba2Mixer block: norm", "Attention block: mixer", "MLP block: mixer", "LM head + loss", "embeddings",
                 "AdamW (fused)"):
        assert parts[part]["memory_bound_gb"] > 0, part
    for part in ("Mamba2Mixer block: mixer", "MLP block: mixer", "LM head + loss"):
        assert parts[part]["forward_gb"] > 0 and parts[part]["backward_gb"] > 0, part
    rows = record["rows"]
    kernels = {(r["phase"], r["part"]) for r in rows if r["kind"] == "fused kernels"}
    for phase in ("forward", "backward"):  # FLA's scan and conv, the gated norm, flash attention, torch's RMSNorm
        for part in ("Mamba2Mixer block: mixer", "Mamba2Mixer block: mixer.norm", "Attention block: mixer",
                     "MLP block: norm"):
            assert (phase, part) in kernels, (phase, part)
    mamba = [r for r in rows if r["part"] == "Mamba2Mixer block: mixer" and r["kind"] == "fused kernels"]
    assert all(r["per_step"] == 2 and r["ops"] % 2 == 0 for r in mamba)
    head = record["summary"]
    assert head["gb"] == sum(e["memory_bound_gb"] for e in record["parts"]) and head["other_ops"] > head["kernel_ops"] > 0
    text = (tmp_path / "step_traffic.md").read_text()
    assert "## tiny at 256 tokens (2 x Mamba2Mixer, 1 x Attention, 2 x MLP)" in text
    assert "| Mamba2Mixer block: mixer |" in text


def test_views_and_allocations_move_nothing_factories_only_write_and_matmuls_are_not_computed():
    script = load_script("step_traffic")
    traffic = script.Traffic(lambda: ("forward", "here"))
    x = torch.ones(4, 8)
    with traffic:
        x.view(8, 4).t()  # views: nothing moves
        x * 2  # reads 128 bytes, writes 128
        x.new_zeros(4, 8)  # writes 128
        torch.empty_like(x)  # allocates: nothing moves
        torch.add(x, 1, out=torch.empty(4, 8, dtype=torch.bfloat16))  # reads 128, writes 64
        product = x @ x.t()  # shapes only: zeros, not 8s
    rows = {(kind, op): value for (_, _, kind, op), value in traffic.rows.items()}
    assert rows == {("other ops", "mul"): [1, 256], ("other ops", "new_zeros"): [1, 128], ("other ops", "add"): [1, 192],
                    ("matmul", "mm"): [1, 320]}
    assert product.shape == (4, 4) and not product.any()


def test_our_custom_ops_are_opened_and_counted_by_their_inner_ops():
    from hybridpar.models import lm_head_loss

    assert lm_head_loss.chunked_lm_head_loss  # importing the module registers the op
    script = load_script("step_traffic")
    traffic = script.Traffic(lambda: ("forward", "loss"))
    hidden, weight, labels = torch.randn(16, 8), torch.randn(32, 8), torch.randint(0, 32, (16,))
    with traffic:
        torch.ops.hybridpar.lm_head_loss(hidden, weight, labels, 8)
    ops = {op for (_, _, _, op) in traffic.rows}
    assert "lm_head_loss" not in ops and {"exp_", "sum", "max"} <= ops, ops
