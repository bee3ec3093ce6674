"""``hybridpar check --packing``: packed rows against the same documents one per row, float64.

Through the CLI in one gloo rank (in-process, as the other check tests): a ``HybridLM`` and a tiny
Granite 4.0-H MoE saved by transformers (its Mamba2 mixers on hybridpar's core, attention on
hybridpar's blockwise core) are exact (exit 0, every gradient listed); the same Granite with
transformers' own Mamba forward (``install_mamba_core`` switched off: state flows from one document
into the next) fails with exit 1, and the first line says training packs it one document per row.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
import torch

from tests.distributed.harness import run_ranks

DEFAULT = str(Path(__file__).resolve().parents[2] / "configs" / "tiny-hybrid.yaml")
HYBRID = ["--config", DEFAULT, "model.preset=tiny", "parallel.cp=1", "parallel.tp=1", "parallel.sequence_parallel=false",
          "data.pack_size=64", "data.task_options={min_len: 16, max_len: 32, num_kv_pairs: 2, vocab_size: 32}"]
DATA = ["data.pack_size=128", "data.packs_per_step=1", "data.task_options={min_len: 24, max_len: 48, num_kv_pairs: [2, 4]}",
        "parallel.cp=1"]


@pytest.fixture(scope="module")
def granite(tmp_path_factory):
    import transformers as hf

    path = tmp_path_factory.mktemp("packing_check") / "granite_moe"
    torch.manual_seed(0)
    hf.GraniteMoeHybridForCausalLM(hf.GraniteMoeHybridConfig(
        num_hidden_layers=2, layer_types=["mamba", "attention"], mamba_n_heads=4, mamba_d_head=16, mamba_expand=1,
        num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=64, mamba_d_state=8, mamba_n_groups=1,
        mamba_chunk_size=8, hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=256, use_cache=False)).save_pretrained(path)
    return str(path)


def _checks(rank, world_size, granite, out_dir):
    import hybridpar.train.hf_model as hf_model
    from hybridpar.cli import main

    def check(*argv) -> tuple[int, str]:
        out = io.StringIO()
        with contextlib.redirect_stderr(out), contextlib.redirect_stdout(out):
            code = main(["check", "--packing", *argv])
        return code, out.getvalue()

    hf_args = [f"model.hf_path={granite}", "model.dtype=float64", *DATA]
    results = {"hybrid": check(*HYBRID, "model.dtype=float64", f"output_dir={out_dir}/hybrid"),
               "granite": check(*hf_args, f"output_dir={out_dir}/granite")}
    hf_model.install_mamba_core = lambda model: []  # transformers' own Mamba forward: no document resets
    results["leaking"] = check(*hf_args, f"output_dir={out_dir}/leaking")
    return results


def test_packed_rows_equal_one_document_per_row_and_a_leak_fails(granite, tmp_path):
    results = run_ranks(1, _checks, granite, str(tmp_path), timeout_s=300)[0]
    for name in ("hybrid", "granite"):
        code, report = results[name]
        assert code == 0 and "check --packing exact" in report, report
        assert "training: packing: several documents per row" in report, report
        documents, rows = report.split("check --packing: ")[1].split(" documents in ")
        assert int(documents) > int(rows.split()[0]), report  # rows really hold several documents
        differences = [float(line.split("max|diff|")[1].split()[0]) for line in report.splitlines() if "max|diff|" in line]
        assert len(differences) > 10 and max(differences) < 1e-9, report
    code, report = results["leaking"]
    assert code == 1 and "check --packing FAILED" in report and "packed documents see each other" in report, report
    assert "training: packing: one document per row" in report and "training is not affected" in report, report
