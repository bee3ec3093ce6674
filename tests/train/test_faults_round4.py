"""Faults, round 4: cases found by probing bad inputs after round 3, one test per class."""

import json

import pytest

from hybridpar.config import load_config
from hybridpar.train.run.checkpoint import CheckpointError
from hybridpar.train.run.directory import plan_resume
from tests.train.test_faults_round3 import DEFAULT, TINY


@pytest.mark.parametrize("damage", ["shard_missing", "manifest_not_json", "manifest_a_list"])
def test_an_earlier_run_whose_every_checkpoint_is_damaged_says_so(tmp_path, damage):
    """checkpoint.resume=auto skips a damaged checkpoint; when none is left, the refusal to overwrite
    the earlier run said "resume it with checkpoint.resume=auto" (what the user had done) and
    dropped the reason. It now names the newest checkpoint and what is wrong with it."""
    step = tmp_path / "checkpoints" / "step_00000002"
    step.mkdir(parents=True)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    manifest = {"shard_missing": json.dumps({"format": 2, "files": {"__0_0.distcp": 10}, "sha256": {"__0_0.distcp": "0"}}),
                "manifest_not_json": "{oops", "manifest_a_list": "[1, 2]"}[damage]
    (step / "manifest.json").write_text(manifest)
    config = load_config(DEFAULT, [*TINY, f"output_dir={tmp_path}", "checkpoint.resume=auto"])
    with pytest.raises(CheckpointError) as error:
        plan_resume(config)
    message = str(error.value)
    assert message.startswith(f"output_dir '{tmp_path}' holds an earlier run, but none of its 1 checkpoint(s) can be "
                              f"resumed (newest: {step}: "), message
    assert "checkpoint.if_exists=overwrite" in message and "\n" not in message and len(message) < 800
    assert "resume it with checkpoint.resume=auto" not in message
    fresh = plan_resume(load_config(DEFAULT, [*TINY, f"output_dir={tmp_path}", "checkpoint.if_exists=overwrite"]))
    assert fresh.checkpoint is None and str(step) in " ".join(fresh.remove)
