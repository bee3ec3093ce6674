"""``benchmarks/ssd_ops.py`` counts the SSD core's aten ops: one chunk per slice dispatches more ops
than one slice for the whole row, and the module's slice budgets are restored afterwards."""

import json

from hybridpar.models.mamba import ssd_chunked

from tests.benchmarks import load_script


def test_smaller_slices_dispatch_more_ops(tmp_path):
    module = load_script("ssd_ops")
    before = ssd_chunked.DIAGONAL_SLICE_BYTES, ssd_chunked.HOST_DIAGONAL_SLICE_BYTES
    assert module.main(["--cases", "tiny:512", "--budgets-mib", "0", "256", "--out", str(tmp_path)]) == 0
    assert (ssd_chunked.DIAGONAL_SLICE_BYTES, ssd_chunked.HOST_DIAGONAL_SLICE_BYTES) == before
    one_chunk, whole = json.loads((tmp_path / "ssd_ops.json").read_text())["rows"]
    assert one_chunk["forward_ops"] > whole["forward_ops"] > 0 and one_chunk["backward_ops"] > whole["backward_ops"] > 0
    assert whole["current"] and not one_chunk["current"]
