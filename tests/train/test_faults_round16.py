"""Round 16 of fault hunting (docs/reliability.md, "Round 16"): the CLI and the Python API as a user
would hit them. Real runs go through a harness child (``cli_in_child``); dry runs and the API run in
this process."""

from __future__ import annotations

import pytest

from tests.train.fault_probes import cli, cli_in_child, one_line  # noqa: F401

TINY = ["model.preset=tiny", "parallel.cp=1", "parallel.tp=1", "data.pack_size=64", "train.warmup_steps=0",
        "plot=false", "tensorboard=false"]


def test_too_few_held_out_documents_are_refused_before_step_1(tmp_path):
    """Before: a file of one paragraph trained every step (and saved checkpoints) and was refused only at the
    first evaluation, at the end of the run; the dry run refused it at once."""
    (tmp_path / "t.txt").write_text("one paragraph of text, with no blank line in it.\n" * 50)
    code, output = cli("train", *TINY, "data.task=text", f"data.path={tmp_path / 't.txt'}", "train.steps=3",
                       "train.eval_every=3", "checkpoint.every=1", f"output_dir={tmp_path / 'run'}")
    assert code == 2 and "evaluation holds out the last 10% and needs at least 2" in output, output
    assert "step     1" not in output and not (tmp_path / "run" / "checkpoints").exists(), output
