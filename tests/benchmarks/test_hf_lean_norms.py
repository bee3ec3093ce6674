"""``benchmarks/hf_lean_norms.py`` counts the bytes kept for backward with transformers' norms and with
hybridpar's lean norms in their place: fewer with ours, for a Mamba2 hybrid and for a Llama."""

import json

from tests.benchmarks import load_script


def test_lean_norms_keep_less_for_a_hybrid_and_a_llama(tmp_path):
    module = load_script("hf_lean_norms")
    assert module.main(["--tokens", "64", "--archs", "bamba", "llama", "--out", str(tmp_path)]) == 0
    bamba, llama = json.loads((tmp_path / "hf_lean_norms.json").read_text())["rows"]
    assert (bamba["lean_rms_norms"], bamba["lean_gated_norms"], llama["lean_rms_norms"], llama["lean_gated_norms"]) \
        == (5, 1, 5, 0)
    for row in (bamba, llama):
        assert 0 < row["lean_norms_mib"] < row["transformers_norms_mib"]
    assert "| llama | 64 | 5 | 0 |" in (tmp_path / "hf_lean_norms.md").read_text()
