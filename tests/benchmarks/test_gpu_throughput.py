"""``benchmarks/gpu_throughput.py`` runs on CPU in its dry-run mode (every variant's code path,
tiny shapes) with the issue's JSON schema, refuses cleanly without CUDA otherwise, and its
MFU arithmetic follows the formula in its docstring. The dry runs call its ``main(argv)`` in this
process (the process boundary is not the claim; two interpreter starts were most of the cost),
with the float32 precision flags it sets put back afterwards."""

import json

import pytest
import torch

from tests.benchmarks import load_script

KEYS = ["model", "tokens", "variant", "step_s", "tokens_per_s", "mfu", "peak_gib", "graph_breaks", "note"]


@pytest.fixture
def precision_kept():
    """``measure`` sets TF32 per row (``set_tf32``): later tests get this process's flags back."""
    kept = torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision
    yield
    torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision = kept


def test_dry_run_writes_every_variant_in_the_issue_schema(tmp_path, precision_kept):
    module = load_script("gpu_throughput")
    assert module.main(["--dry-run", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "gpu_throughput.json").read_text())
    assert list(data) == ["device", "torch", "date", "command", "rows"]
    assert [(r["model"], r["variant"]) for r in data["rows"]] == [
        ("tiny", "fp32-eager"), ("tiny", "bf16-fused"), ("tiny", "bf16-fused-compiled"),
        ("llama-tiny", "transformers-sdpa"), ("llama-tiny", "bf16-fused")]
    for row in data["rows"]:
        assert list(row) == KEYS
        assert row["step_s"] > 0 and row["tokens_per_s"] == pytest.approx(row["tokens"] / row["step_s"])
        assert row["graph_breaks"] == 0
    assert "| tiny | 128 | bf16-fused-compiled |" in (tmp_path / "gpu_throughput.md").read_text()
    assert module.main(["--dry-run", "--out", str(tmp_path), "--append", "--rows", "tiny:128:fp32-eager"]) == 0
    appended = json.loads((tmp_path / "gpu_throughput.json").read_text())
    assert [(r["model"], r["variant"]) for r in appended["rows"]] == [  # the row measured again goes last
        ("tiny", "bf16-fused"), ("tiny", "bf16-fused-compiled"), ("llama-tiny", "transformers-sdpa"),
        ("llama-tiny", "bf16-fused"), ("tiny", "fp32-eager")]
    assert appended["command"].count("gpu_throughput.py") == 2


def test_rows_are_model_tokens_variant():
    module = load_script("gpu_throughput")
    assert module.parse_rows("1b:8192:bf16-fused,small:131072:fp32-eager") == [
        ("1b", 8192, "bf16-fused"), ("small", 131072, "fp32-eager")]
    with pytest.raises(SystemExit, match="not model:tokens:variant"):
        module.parse_rows("1b:8k:bf16-fused")
    assert len(module.FULL_PLAN) == 17 and module.FULL_PLAN[:2] == [("small", 131072, "fp32-eager"),
                                                                   ("small", 131072, "bf16-fused")]


def test_without_cuda_it_refuses_in_one_line(tmp_path, monkeypatch, capsys):
    module = load_script("gpu_throughput")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # no GPU, even on a machine that has one
    assert module.main(["--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == ("gpu_throughput: no CUDA device here; run it on a GPU machine "
                                               "(or pass --dry-run on CPU).")
    assert not any(tmp_path.iterdir())


def test_model_flops_per_token_follow_the_docstring_formula():
    module = load_script("gpu_throughput")
    from hybridpar.models.hybrid import HybridConfig, HybridLM

    with torch.device("meta"):
        model = HybridLM(HybridConfig.from_preset("1b"))
    lengths = module.doc_lengths(8192)
    assert sum(lengths) == 8192 and len(lengths) == 8 and all(n % 8 == 0 for n in lengths)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    keys = sum(n * (n + 1) / 2 for n in lengths) / 8192
    ssd = 3 * (2 * 128 * (8 * 128 + 64 * 64) + 4 * 64 * 64 * 128)
    expected = 6 * linear + 2 * 12 * 16 * 128 * keys + 12 * ssd
    assert module.hybrid_flops_per_token(model, lengths) == pytest.approx(expected)
    assert 6 * linear > 6e9  # ~1.17B parameters, most of them in matmuls
    assert module.peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert module.peak_flops("NVIDIA H100 PCIe") == 756e12
    assert module.peak_flops("NVIDIA H200") == 989e12
    assert module.peak_flops("cpu") is None
