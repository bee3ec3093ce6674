"""The main job on real gloo ranks: it learns, resumes exactly, and fails clearly.

Every test starts one group of ranks through the harness and runs the trainer inside
it, the same code ``hybridpar train`` runs under torchrun.
"""

import contextlib
import io
import re
import shutil
from pathlib import Path

import torch

from hybridpar.config import load_config
from hybridpar.models.hf.checkpoint import load_hf
from tests.distributed.harness import run_each, run_ranks

DEFAULT = str(Path(__file__).resolve().parents[2] / "configs" / "tiny-hybrid.yaml")
QUIET = ["tensorboard=false", "plot=false"]


def _train(rank, world_size, overrides, stop_after=None):
    from hybridpar.train.trainer import Trainer

    history = Trainer(load_config(DEFAULT, overrides + QUIET), torch.device("cpu")).fit(stop_after=stop_after)
    return history if rank == 0 else None


def test_default_job_learns_mqar_on_its_two_ranks(tmp_path):
    """The default job (model, task, lr) and layout (cp=2 on 2 ranks), cut to its first tenth of
    steps: the loss falls from ln(256) past the ln(7) = 1.9 of guessing among the 7 values, and
    recall accuracy is at least twice chance (1/7) (`make demo` at step 50: loss 1.57, 0.36)."""
    tenth = ["train.steps=50", "train.eval_every=50", "checkpoint.every=-1"]
    history = run_ranks(2, _train, [f"output_dir={tmp_path}", *tenth], timeout_s=600)[0]
    first, last = history[0], history[-1]
    assert first["loss"] - last["loss"] > 3.0, (first, last)
    assert last["eval_accuracy"] > 2 / 7, last


TINY = ["model.preset=tiny", "data.pack_size=256"]  # the default job's demo widths and 1024-token rows cost minutes
RESUME = TINY + ["model.dtype=float64", "train.steps=3", "train.log_every=1", "train.eval_every=0",
                 "data.packs_per_step=2", "checkpoint.every=1", "checkpoint.keep=3"] + QUIET  # no padding option:
# a resumed run keeps the checkpoint's


def _losses(rank, world_size, directory, layout):
    """Train (or resume) in ``directory`` at ``layout``; rank 0 returns the step losses."""
    from hybridpar.train.trainer import Trainer

    history = Trainer(load_config(DEFAULT, RESUME + [f"output_dir={directory}"] + layout), torch.device("cpu")).fit()
    return [r["loss"] for r in history] if rank == 0 else None


CP2_TP2 = ["parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true"]
DP2_TP2 = ["parallel.cp=1", "parallel.dp_shard=2", "parallel.tp=2", "parallel.sequence_parallel=false"]
TP2 = ["parallel.cp=1", "parallel.tp=2", "parallel.sequence_parallel=true"]


def test_resume_gives_the_same_losses_at_the_same_and_at_another_layout_and_world_size(tmp_path):
    """3 uninterrupted steps at cp=2 x tp=2 (float64), a checkpoint after each; copies of the run
    directory holding only the step-1 checkpoint (as an interruption after step 1 leaves it) resume
    under the same layout, another layout (one launch of 4 ranks) and at tp=2 on 2 ranks instead of
    4: steps 2-3 (step 3 after an update by the restored optimizer) equal the uninterrupted run's.
    No padding option is given: at cp=1 the resumed runs keep the 2*cp=4 padding the checkpoint
    recorded, so they see the same batches."""
    reference = run_ranks(4, _losses, str(tmp_path / "straight"), CP2_TP2, timeout_s=600)[0]
    cases = [("same", 4, CP2_TP2), ("other layout", 4, DP2_TP2), ("2 ranks", 2, TP2)]
    for name, _, _ in cases:
        shutil.copytree(tmp_path / "straight", tmp_path / name.replace(" ", "_"),
                        ignore=shutil.ignore_patterns("step_00000002", "step_00000003"))
    resumed = {}
    for world_size in (4, 2):
        runs = [(name, str(tmp_path / name.replace(" ", "_")), layout) for name, n, layout in cases if n == world_size]
        losses = [ranks[0] for ranks in run_each(world_size, _losses, [run[1:] for run in runs], timeout_s=600)]
        resumed.update(zip([run[0] for run in runs], losses))
    assert len(reference) == 3 and all(len(losses) == 2 for losses in resumed.values())
    torch.testing.assert_close(torch.tensor(resumed["same"]), torch.tensor(reference[1:]), rtol=1e-12, atol=1e-12)
    for name in ("other layout", "2 ranks"):
        torch.testing.assert_close(torch.tensor(resumed[name]), torch.tensor(reference[1:]), rtol=1e-10, atol=1e-10,
                                   msg=name)


def _interrupted_save(rank, world_size, directory):
    """A save that dies half-way leaves the previous checkpoint as the one to load."""
    import torch.distributed.checkpoint as dcp

    from hybridpar.train.run import checkpoint as ckpt
    from hybridpar.train.trainer import Trainer

    overrides = TINY + [f"output_dir={directory}", "parallel.cp=2", "parallel.tp=1", "parallel.sequence_parallel=false",
                        "train.steps=4", "train.eval_every=0", "checkpoint.every=2"] + QUIET
    trainer = Trainer(load_config(DEFAULT, overrides), torch.device("cpu"))
    trainer.fit(stop_after=2)
    original_save = dcp.save

    def dying_save(state, checkpoint_id):
        original_save(state, checkpoint_id=checkpoint_id)  # shards written, but the rename never happens
        raise KeyboardInterrupt("killed while writing")

    ckpt.dcp.save = dying_save
    try:
        trainer.fit(stop_after=4)
    except KeyboardInterrupt:
        pass
    finally:
        ckpt.dcp.save = original_save
    latest = ckpt.latest_checkpoint(f"{directory}/checkpoints")
    left = sorted(p.name for p in Path(f"{directory}/checkpoints").iterdir())
    resumed = Trainer(load_config(DEFAULT, overrides), torch.device("cpu"))
    resumed.resume()
    return latest.name, resumed.start_step, left, sorted(p.name for p in Path(f"{directory}/checkpoints").iterdir())


def test_interrupted_checkpoint_leaves_the_previous_one_loadable(tmp_path):
    """The unfinished save is never loaded, and the resume removes it (rank 0, holding the lock)."""
    results = run_ranks(2, _interrupted_save, str(tmp_path), timeout_s=300)
    assert "step_00000004.tmp" in results[0][2] and "step_00000004" not in results[0][2]  # rank 0 lists before removing
    for latest, start_step, _, entries in results:
        assert latest == "step_00000002" and start_step == 2
        assert entries == ["step_00000002"]


def _cli(rank, world_size, argv):
    from hybridpar.cli import main

    stderr, stdout = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(stdout):
        code = main(argv)
    return code, stderr.getvalue(), stdout.getvalue()


def test_bad_input_exits_nonzero_with_one_message_on_every_rank(tmp_path):
    """In a process group the caller made (no launcher to print once), every rank says it once."""
    corrupt = tmp_path / "corrupt"
    good = TINY + [f"output_dir={tmp_path / 'good'}", "parallel.cp=2", "parallel.tp=1",
                   "parallel.sequence_parallel=false", "train.steps=1", "train.eval_every=0", "checkpoint.every=1"] + QUIET
    run_ranks(2, _cli, ["train", "--config", DEFAULT, *good], timeout_s=300)
    shutil.copytree(tmp_path / "good" / "checkpoints" / "step_00000001", corrupt)
    for shard in corrupt.glob("*.distcp"):
        shard.write_bytes(b"not a checkpoint")
    cases = [
        (["train.nonsense=1"], "unknown config key"),
        (["parallel.cp=3"], "but the world size is 2"),
        (["parallel.cp=1", "parallel.tp=2", "model.overrides={mamba_num_heads: 6, mamba_n_groups: 3}"],
         "n_groups.*3.*tp"),
        (["parallel.cp_mamba=ring"], "parallel.cp_mamba='ring' is invalid: it must be one of 'a2a', 'state'"),
        (["data.task=jsonl", "data.task_options={}"], "data.path=null names no file"),
        (["train.steps=0"], "train.steps=0 is invalid: it must be an integer >= 1"),
        ([f"checkpoint.resume={corrupt}"], r"checkpoint.resume=.*corrupt' cannot be loaded: .*__0_0.distcp has 16 bytes but the manifest"),
    ]
    base = TINY + ["parallel.cp=2", "parallel.tp=1", "parallel.sequence_parallel=false", "train.steps=2",
                   f"output_dir={tmp_path / 'bad'}"] + QUIET
    for overrides, message in cases:
        changed = {o.partition("=")[0] for o in overrides}  # each key once: a repeated one is said (one more line)
        kept = [o for o in base if o.partition("=")[0] not in changed]
        for code, stderr, _ in run_ranks(2, _cli, ["train", "--config", DEFAULT, *kept, *overrides], timeout_s=300):
            assert code == 2, (overrides, stderr)
            assert len(stderr.strip().splitlines()) == 1, stderr
            assert re.search(message, stderr), (overrides, stderr)


def test_check_reports_exact_layout_and_fails_beyond_tolerance(tmp_path):
    overrides = TINY + ["model.dtype=float64", f"output_dir={tmp_path}", *CP2_TP2] + QUIET
    results = run_ranks(4, _cli, ["check", "--config", DEFAULT, *overrides], timeout_s=300)
    code, _, report = results[0]
    assert all(r[0] == 0 for r in results), report
    assert "check exact" in report and report.count(" ok") >= 30
    differences = [float(line.split("max|diff|")[1].split()[0]) for line in report.splitlines() if "max|diff|" in line]
    assert max(differences) < 1e-9
    strict = ["check", "--config", DEFAULT, "--tolerance", "1e-30", "model.dtype=float32", f"output_dir={tmp_path}",
              *TINY, *CP2_TP2] + QUIET
    results = run_ranks(4, _cli, strict, timeout_s=300)
    assert all(r[0] == 1 for r in results) and "FAILED" in results[0][2]


def test_fine_tune_a_hugging_face_checkpoint_and_export_it(tmp_path):
    """NemotronH from a local directory -> 3 steps at tp=2 x cp=2 -> HF export that
    transformers loads with the logits of our model."""
    from transformers import AutoModelForCausalLM, NemotronHConfig, NemotronHForCausalLM

    torch.manual_seed(0)
    config = NemotronHConfig(
        vocab_size=256, hidden_size=32, hybrid_override_pattern="M*-M-", num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, intermediate_size=48, mamba_num_heads=8, mamba_head_dim=8, n_groups=2,
        ssm_state_size=8, chunk_size=8,
    )
    NemotronHForCausalLM(config).save_pretrained(tmp_path / "original")
    overrides = [f"model.hf_path={tmp_path / 'original'}", f"model.export_hf={tmp_path / 'tuned'}",
                 f"output_dir={tmp_path / 'run'}", "train.steps=3", "train.eval_every=0", "checkpoint.every=-1", *CP2_TP2]
    run_ranks(4, _train, overrides, timeout_s=300)

    ours = load_hf(tmp_path / "tuned")
    before = load_hf(tmp_path / "original")
    assert not torch.equal(ours.lm_head.weight, before.lm_head.weight)  # it was trained
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "tuned", attn_implementation="eager").eval()
    ids = torch.randint(0, 256, (2, 19))
    with torch.no_grad():
        expected = theirs(ids, use_cache=False).logits
        actual = ours(ids)
    assert ((actual - expected).abs().max() / expected.abs().max()) < 1e-5
