"""Round 25 of fault hunting (docs/reliability.md, "Round 25"): mixed precision everywhere.

``parallel.mixed_precision=bf16``, ``model.dtype`` and ``parallel.tf32`` swept over every layout, model family,
LoRA, checkpoints, export, ``check`` and ``plan``: what was silently different from what the config said."""

from __future__ import annotations

import pytest

from hybridpar.config import load_config

TINY = ["model.preset=tiny", "data.pack_size=64", "parallel.cp=1"]


def test_the_plans_step_time_follows_the_precision_its_matmuls_run_in():
    """``hybridpar plan`` priced every run's matmuls at the bf16 tensor-core peak: a float32 run (TF32, half of it)
    or one with ``parallel.tf32=false`` or in float64 (about 1/15) was estimated as fast as bf16 mixed precision.
    The rate now follows what the matmuls run in, and the time line names it."""
    from types import SimpleNamespace

    from hybridpar.models.hybrid import HybridConfig
    from hybridpar.plan.estimate import H100, estimate_time
    from hybridpar.plan.layout import Layout
    from hybridpar.plan.report import _time_line

    layouts = {name: Layout.from_run(load_config(None, TINY + extra), HybridConfig.from_preset("tiny")) for name, extra in {
        "bf16": ["parallel.mixed_precision=bf16"], "bfloat16": ["model.dtype=bfloat16"], "tf32": [],
        "float32": ["parallel.tf32=false"], "float64": ["model.dtype=float64"]}.items()}
    assert [layout.matmul_precision for layout in layouts.values()] == ["bf16", "bf16", "tf32", "float32", "float64"]
    times = {name: estimate_time(layout, 0, {}) for name, layout in layouts.items()}
    assert len({t.flops for t in times.values()}) == 1  # the same matmuls: only their rate differs
    bf16 = times["bf16"].compute_s
    assert times["bfloat16"].compute_s == pytest.approx(bf16)
    assert times["tf32"].compute_s == pytest.approx(2 * bf16)
    assert times["float32"].compute_s == pytest.approx(989 / 67 * bf16)
    assert times["float64"].compute_s == pytest.approx(989 / 67 * bf16)
    for name, layout in layouts.items():  # the line hybridpar plan prints
        line = _time_line(SimpleNamespace(time=times[name], device=H100, layout=layout))
        assert line.endswith(f"per rank, matmuls in {layout.matmul_precision})"), line


def _check_outputs(rank, world_size, overrides):
    """stdout of ``hybridpar check`` and ``check --packing`` on one process (their exit codes too)."""
    import contextlib
    import io

    import torch

    from hybridpar.train.proof.layout import run_check
    from hybridpar.train.proof.packing import run_packing_check

    outputs = []
    for run in (run_check, run_packing_check):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = run(load_config(None, TINY + list(overrides)), torch.device("cpu"))
        outputs.append((code, out.getvalue()))
    return outputs


def test_check_under_bf16_says_what_it_compared_and_how_to_prove_exactly(tmp_path):
    """``check`` of a ``parallel.mixed_precision=bf16`` run compares the layout in bf16 mixed precision with one
    float32 process; it said "within tolerance 5e-02 in float32" and advised ``model.dtype=float64``, which that config
    refuses (float64 masters under bf16). ``check --packing`` runs no autocast (both sides float32) but held them to
    bf16's 5e-2 (a leak 500x float32's tolerance passed). Now each says what ran, the advice names both keys, and
    ``--packing`` is held to its dtype's tolerance with one line that mixed precision is not used."""
    from tests.distributed.harness import run_each

    [[[(code, layout), (packing_code, packing)]]] = run_each(
        1, _check_outputs, [(["parallel.mixed_precision=bf16", f"output_dir={tmp_path}"],)], timeout_s=300)
    assert code == 0 and packing_code == 0, (layout, packing)
    verdict = layout.strip().splitlines()[-1]
    assert "in bf16 mixed precision against one float32 process" in verdict, verdict
    assert "run with model.dtype=float64 parallel.mixed_precision=null for the exact check" in verdict, verdict
    header = next(line for line in layout.splitlines() if line.startswith("check: "))
    assert "dtype=float32 mixed_precision=bf16 (the reference: one float32 process)" in header, header
    assert "tolerance=1e-04" in packing and "tolerance 1e-04 in float32" in packing, packing
    assert "parallel.mixed_precision=bf16 not used here: both runs compute in float32" in packing, packing


MQAR = ["data.task=mqar", "data.task_options={vocab_size: 16, num_kv_pairs: [1, 2], min_len: 8, max_len: 24}",
        "data.pack_size=64", "data.packs_per_step=2", "train.warmup_steps=1", "train.log_every=1",
        "checkpoint.every=-1", "tensorboard=false", "plot=false", "parallel.cp=1"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny float32 Llama checkpoint (transformers' own config class)."""
    import torch
    import transformers as hf

    path = tmp_path_factory.mktemp("llama") / "f32"
    torch.manual_seed(0)
    hf.LlamaForCausalLM(hf.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, use_cache=False)).save_pretrained(path)
    return path


def _fit_and_export(rank, world_size, overrides, directory):
    """``Trainer.fit`` of ``MQAR + overrides``; rank 0 returns the export's dtypes by tensor and its config's dtype."""
    import contextlib
    import io
    import json
    from pathlib import Path

    import torch
    from safetensors import safe_open

    from hybridpar.train.trainer import Trainer

    with contextlib.redirect_stdout(io.StringIO()):
        Trainer(load_config(None, [*MQAR, *overrides, f"output_dir={directory}/run",
                                   f"model.export_hf={directory}/export"]), torch.device("cpu")).fit()
    if rank:
        return None
    dtypes = {}
    for file in Path(directory, "export").glob("*.safetensors"):
        with safe_open(file, "pt") as handle:
            dtypes |= {key: str(handle.get_slice(key).get_dtype()) for key in handle.keys()}
    config = json.loads(Path(directory, "export", "config.json").read_text())
    return dtypes, config.get("dtype", config.get("torch_dtype"))


def test_an_export_after_an_evaluation_under_fsdp_bf16_is_the_float32_master_weights(llama, tmp_path):
    """An evaluation (a forward without backward) leaves FSDP's root gathered: its parameters were the bf16 compute
    copies. An export after an evaluation at the last step of a ``dp_shard=2`` mixed-precision run wrote the embedding,
    final norm and LM head rounded to bf16 beside float32 weights, and labelled the checkpoint ``bfloat16`` (at
    ``tp=2`` the same run exported float32). ``canonical_state_dict`` (export, ``check``) and its inverse now reshard
    gathered FSDP modules first."""
    from tests.distributed.harness import run_each

    [[(dtypes, label), _]] = run_each(2, _fit_and_export, [(
        [f"model.hf_path={llama}", "parallel.mixed_precision=bf16", "parallel.dp_shard=2", "train.steps=2",
         "train.eval_every=2", "train.eval_packs=2"], str(tmp_path))], timeout_s=300)
    assert set(dtypes.values()) == {"F32"}, {k: v for k, v in dtypes.items() if v != "F32"}
    assert label == "float32"


def test_mixed_precision_on_float64_weights_names_the_key_to_drop_it_as_the_config_spells_it():
    """``model.dtype=float64 parallel.mixed_precision=bf16`` is refused (mixed precision keeps float32 masters); the
    line told a CLI user to "set mixed_precision=None", a key and value no config takes."""
    import torch

    from hybridpar.models.hybrid import HybridConfig, HybridLM
    from hybridpar.parallel.dims import ParallelDims
    from hybridpar.parallel.parallelize import parallelize

    model = HybridLM(HybridConfig.from_preset("tiny", dtype=torch.float64))
    with pytest.raises(ValueError, match=r"model\.dtype=float32\) or train without mixed precision "
                                         r"\(parallel\.mixed_precision=null; None in Python\)"):
        parallelize(model, ParallelDims(), mixed_precision="bf16")


def test_a_merged_lora_export_on_a_bfloat16_base_is_bfloat16_throughout():
    """LoRA on ``model.dtype=bfloat16`` trains float32 adapters; its merged export (``peft.merge=true``) wrote every
    adapted weight as float32 (bf16 + float32 promotes) beside the bf16 rest, in a checkpoint labelled ``bfloat16``
    (14 of a tiny Llama's 21 tensors). Each merged weight now keeps its base's dtype, rounded once from the float64
    sum, as ``merge_adapter_checkpoint`` merges a PEFT adapter."""
    import torch

    from hybridpar.models.hf.lora_export import merged_state

    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(8, 6, generator=generator).to(torch.bfloat16)
    a, b = torch.randn(2, 6, generator=generator), torch.randn(8, 2, generator=generator)
    state = {"q_proj.weight": weight, "q_proj.lora_A.weight": a, "q_proj.lora_B.weight": b,
             "norm.weight": torch.ones(6, dtype=torch.bfloat16)}
    merged = merged_state(state, 0.5)
    assert {k: v.dtype for k, v in merged.items()} == {"q_proj.weight": torch.bfloat16, "norm.weight": torch.bfloat16}
    assert torch.equal(merged["q_proj.weight"], (weight.double() + 0.5 * (b.double() @ a.double())).to(torch.bfloat16))
    float32 = merged_state({**state, "q_proj.weight": weight.float()}, 0.5)["q_proj.weight"]
    assert float32.dtype == torch.float32  # a float32 base stays float32


def test_the_ssm_decays_are_float32_when_fsdps_bf16_policy_gathers_a_log_in_bf16():
    """FSDP's bf16 policy gathers every parameter in bf16, ``A_log`` too; the Mamba2 core (HybridLM and the transformers
    Mamba2 hybrids) and the Mamba1 core (Jamba, FalconMamba) computed ``A = -exp(A_log)`` in bf16 there (about 3
    significant digits, every decay of every token), where one process under autocast keeps it float32 and
    docs/gpu.md promises float32 decays at every layout. Given the same (bf16-representable) values, a bf16 ``A_log``
    now gives what a float32 one gives, in both cores."""
    import torch
    from torch import nn

    from hybridpar.models.hf.mixers.mamba1 import local_selective_core
    from hybridpar.models.mamba.core import mamba_conv_scan

    generator = torch.Generator().manual_seed(0)
    heads, head_dim, groups, state, length = 2, 4, 1, 4, 16
    width = heads * head_dim + 2 * groups * state
    xBC, dt = torch.randn(1, length, width, generator=generator), torch.randn(1, length, heads, generator=generator)
    conv, bias = torch.randn(width, 4, generator=generator) * 0.3, torch.zeros(width)
    a_log = torch.tensor([0.7, 2.9]).to(torch.bfloat16)  # exp() of these is not bf16-representable
    scan = [mamba_conv_scan(xBC, dt, conv, bias, torch.zeros(heads), a, torch.ones(heads), head_dim=head_dim,
                            state_size=state, chunk_size=8) for a in (a_log, a_log.float())]
    torch.testing.assert_close(scan[0], scan[1], rtol=0, atol=0)

    class Mamba1(nn.Module):  # transformers' Mamba1 mixer's parts, as local_selective_core reads them
        def __init__(self, a_log_dtype):
            super().__init__()
            torch.manual_seed(0)
            self.conv1d, self.act = nn.Conv1d(6, 6, 4, groups=6, padding=3), nn.SiLU()
            self.x_proj, self.dt_proj = nn.Linear(6, 2 + 2 * 3, bias=False), nn.Linear(2, 6)
            self.A_log = nn.Parameter(torch.log(torch.arange(1.0, 4.0).repeat(6, 1) * 1.7).to(a_log_dtype))
            self.D = nn.Parameter(torch.ones(6))

    x = torch.randn(1, 12, 6, generator=generator)
    bf16, f32 = Mamba1(torch.bfloat16), Mamba1(torch.float32)
    with torch.no_grad():
        f32.A_log.copy_(bf16.A_log.float())
    torch.testing.assert_close(local_selective_core(bf16, x), local_selective_core(f32, x), rtol=0, atol=0)
