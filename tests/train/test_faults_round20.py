"""Round 20 of fault hunting (docs/reliability.md, "Round 20"): the Python API called as a library user calls it, and
the transformers hybrids (Granite 4.0-H, Nemotron-H, Falcon-H1, Zamba2, Bamba) through every verb."""

from __future__ import annotations

import pytest
import torch

from tests.train.fault_probes import one_line, saved_checkpoints


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Tiny float64 transformers hybrids saved with ``save_pretrained`` (vocabulary 97), by name."""
    from tests.models.hf.hybrid_models import build_hybrid

    return saved_checkpoints(tmp_path_factory, build_hybrid)


@pytest.mark.parametrize("name", ["granite_moe", "nemotron_h_moe"])
def test_a_float64_moe_checkpoint_loads_to_run_on_the_cpu(saved, name):
    """Before: ``load_causal_lm`` (and so ``generate --hf-path``) of a float64 Granite 4.0-H MoE or Nemotron-H MoE kept
    transformers' ``torch._grouped_mm`` experts, which take no float64: "Expected mat_a to be Float32, BFloat16 or
    Float16 matrix, got Double", a traceback at the first forward (the trainer alone switched to eager experts)."""
    from hybridpar.models.hf.causal_lm import load_causal_lm

    model = load_causal_lm(saved(name))
    assert model.dtype == torch.float64
    logits = model(torch.tensor([[1, 2, 3, 4]])).logits
    assert logits.shape == (1, 4, 97) and torch.isfinite(logits).all()


def _tiny_model(seed: int = 0):
    from hybridpar import HybridConfig, HybridLM

    torch.manual_seed(seed)
    return HybridLM(HybridConfig.from_preset("tiny"))


def test_a_refused_canonical_state_leaves_the_model_as_it_was():
    """Before: ``load_canonical_state_dict`` copied each tensor as it went, so a state refused for a missing key (strict)
    or a wrong shape left the model half loaded; a numpy array was "'numpy.ndarray' object has no attribute 'to'", and
    a state of another model listed every name (one line of thousands of characters)."""
    from hybridpar import canonical_state_dict, load_canonical_state_dict

    model, other = _tiny_model(0), canonical_state_dict(_tiny_model(1))
    before = {name: value.clone() for name, value in canonical_state_dict(model).items()}
    last = list(other)[-1]
    for state, said in [({**other, last: other[last][:1]}, "state tensor has shape"),
                        ({k: v for k, v in other.items() if k != last}, f"missing 1 ['{last}']"),
                        ({**other, "x": torch.zeros(1)}, "unexpected 1 ['x']"),
                        ({**other, last: other[last].numpy()}, "is a ndarray, not a torch.Tensor"),
                        ({f"other.{k}": v for k, v in other.items()}, "...")]:
        with pytest.raises(ValueError) as error:
            load_canonical_state_dict(model, state)
        assert said in one_line(error) and len(str(error.value)) < 400, str(error.value)
        assert all(torch.equal(before[k], v) for k, v in canonical_state_dict(model).items())
    load_canonical_state_dict(model, other)
    assert all(torch.equal(other[k], v) for k, v in canonical_state_dict(model).items())


def test_a_value_that_is_not_a_model_or_a_device_is_one_line():
    """Before: ``parallelize("ckpt/", dims)`` was "'str' object has no attribute 'named_modules'" and
    ``make_plan(run, device="h100")`` "'str' object has no attribute 'bf16_tflops'"."""
    import hybridpar as hp

    with pytest.raises(ValueError) as error:
        hp.parallelize("ckpt/", hp.ParallelDims())
    assert "parallelize takes the model (an nn.Module), got str" in one_line(error)
    run = hp.load_config(None, ["model.preset=tiny", "parallel.cp=1"])
    with pytest.raises(ValueError) as error:
        hp.make_plan(run, 1, device="h100")
    assert "device='h100' is not a DeviceFigures" in one_line(error)


def test_numpy_and_0d_tensor_numbers_are_the_numbers_they_stand_for():
    """Before: every public call held its integers to ``isinstance(value, int)``, so a size computed with numpy was
    refused as what it is: "hidden_size=np.int64(64) must be a positive integer", "ParallelDims.cp=np.int64(2) must be a
    positive integer", "pack_size must be an int", "peft.r=np.int64(4) ... must be an integer >= 1", "chunk_size=
    np.int64(8) must be a positive int", "world_size=np.int64(1) must be an integer >= 1", and ``top_p=np.float32(0.9)``
    "must be in (0, 1]"; a bool, a string and ``np.bool_`` are still refused."""
    np = pytest.importorskip("numpy")
    import hybridpar as hp

    config = hp.HybridConfig.from_preset("tiny", hidden_size=np.int64(64), norm_eps=np.float32(1e-5))
    assert type(config.hidden_size) is int and type(config.norm_eps) is float
    assert hp.ParallelDims(cp=np.int64(2), tp=torch.tensor(1)) == hp.ParallelDims(cp=2)
    assert hp.pack_documents([[1, 2, 3]], np.int32(8), cp_size=np.int64(2))[0]["input_ids"].numel() == 8
    torch.manual_seed(0)
    model = hp.HybridLM(config).eval()
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(model.generate(ids, np.int64(3), temperature=np.float32(1.0), top_p=np.float32(0.9), seed=np.int64(5)),
                       model.generate(ids, 3, temperature=1.0, top_p=0.9, seed=5))
    hidden, weight, labels = torch.randn(4, 8), torch.randn(10, 8), torch.tensor([1, 2, 3, -100])
    assert torch.equal(hp.lm_head_loss(hidden, weight, labels, chunk_size=np.int64(2), scale=np.float32(0.5))[0],
                       hp.lm_head_loss(hidden, weight, labels, chunk_size=2, scale=0.5)[0])
    assert len(hp.add_lora(hp.HybridLM(config), r=np.int64(4), alpha=np.float32(8))) > 0
    run = hp.load_config(None, ["model.preset=tiny", "parallel.cp=1"])
    assert hp.make_plan(run, np.int64(1), docs_per_pack=np.int64(2)).layout is not None
    for wrong in (True, "2", np.bool_(True), torch.tensor([2])):
        with pytest.raises(ValueError) as error:
            hp.ParallelDims(cp=wrong)
        assert "must be a positive integer" in one_line(error)


@pytest.mark.parametrize("eos, said", [("2", "(got '2')"), (-1, "(got -1)"), (256, "(got 256)"), ([2, 300], "(got 300)"),
                                       (True, "(got True)"), (2.0, "(got 2.0)")])
def test_an_end_token_that_is_not_a_token_id_is_one_line(eos, said):
    """Before: ``HybridLM.generate(..., eos_token_id="2")`` was a ``TypeError`` traceback from ``torch.full_like``, a
    numpy id or a 0-d tensor "not iterable", and an id outside the vocabulary (-1, 256) generated every token without a
    word, as it can never be drawn; a numpy id and a tensor of ids now stop the row as their ints do."""
    np = pytest.importorskip("numpy")
    import hybridpar as hp

    torch.manual_seed(0)
    model = hp.HybridLM(hp.HybridConfig.from_preset("tiny")).eval()
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError) as error:
        model.generate(ids, 3, eos_token_id=eos)
    assert said in one_line(error) and "vocab_size=256" in one_line(error), one_line(error)
    first = int(model.generate(ids, 1)[0, -1])
    for same in (first, np.int64(first), torch.tensor(first), torch.tensor([first, 7]), (first,)):
        assert model.generate(ids, 5, eos_token_id=same).shape == (1, 4)


@pytest.mark.parametrize("name", ["granite", "bamba"])
def test_a_plain_export_of_a_model_with_lora_adapters_is_refused(saved, tmp_path, name):
    """Before: ``export_causal_lm`` (and ``save_hf``) of a model after ``add_lora`` wrote its ``lora_A``/``lora_B``
    tensors beside the base weights; transformers loads that folder dropping them as unexpected keys, so the exported
    model is the base model without a word (Granite 4.0-H as a transformers model; Bamba as a HybridLM). A canonical
    state with adapters said "pass full tensors under single-device names". Now one line naming ``export_lora``."""
    import hybridpar as hp

    model = hp.load_causal_lm(saved(name))
    hp.add_lora(model, r=2)
    calls = [lambda: hp.export_causal_lm(model, tmp_path / "a"),
             lambda: hp.export_causal_lm(model, tmp_path / "b", state_dict=hp.canonical_state_dict(model))]
    if isinstance(model, hp.HybridLM):
        calls.append(lambda: hp.save_hf(model, tmp_path / "c"))
    for call in calls:
        with pytest.raises(ValueError) as error:
            call()
        assert "LoRA adapters" in one_line(error) and "export_lora(" in one_line(error), one_line(error)
    assert not any(tmp_path.iterdir())
    hp.export_lora(model, tmp_path / "merged", hp.canonical_state_dict(model), merge=True)
    assert (tmp_path / "merged" / "config.json").is_file()


def test_packed_params_unlike_the_input_rows_are_one_line():
    """Before: ``PackedSeqParams.from_batch`` of a collated batch of two packs describes them as one row of 2 x 48
    tokens, and ``model(batch["input_ids"], packed=...)`` with the [2, 48] ids was "The size of tensor a (48) must match
    the size of tensor b (96)" from inside a layer; ``shard_inputs`` said "build the params from the same packed row"
    (they were); ``packed=batch`` (the dict) was "'dict' object has no attribute 'cache'" and ``collate_thd(pack)``
    of one pack "KeyError: 0". The reshaped row runs as the message says."""
    import hybridpar as hp

    batch = hp.collate_thd(hp.pack_documents([list(range(1, 30)), list(range(3, 40)), list(range(2, 9))], 48))
    packed, model = hp.PackedSeqParams.from_batch(batch), _tiny_model()
    calls = [(lambda: model(batch["input_ids"], packed=packed), "input has shape [2, 48]; the params of a collated batch"),
             (lambda: hp.shard_inputs(input_ids=batch["input_ids"], packed=packed), "input_ids.reshape(1, -1)"),
             (lambda: model(batch["input_ids"][:1], packed=batch), "packed is a dict, not a PackedSeqParams"),
             (lambda: model(batch["input_ids"].reshape(1, -1)[:, :40], packed=packed), "build packed from this batch"),
             (lambda: hp.collate_thd(hp.pack_documents([[1, 2, 3]], 8)[0]), "got one pack (a dict); pass [pack]")]
    for call, said in calls:
        with pytest.raises(ValueError) as error:
            call()
        assert said in one_line(error), one_line(error)
    local = hp.shard_inputs(input_ids=batch["input_ids"].reshape(1, -1), labels=batch["labels"].reshape(1, -1),
                            packed=packed)
    assert int(model(local.input_ids, packed=local.packed, labels=local.labels)[1]) == 70


def test_parallelizing_a_model_twice_is_refused():
    """Before: a second ``parallelize`` of the same model stacked a second set of context-parallel cores on the first
    and then stopped in FSDP's multi-line AssertionError ("fully_shard has already been applied"; cp=2 and dp_shard=2),
    and at one process wrapped every block in a second activation checkpoint (each recomputed twice), silently."""
    import hybridpar as hp

    model = hp.parallelize(_tiny_model(), hp.ParallelDims(), activation_checkpointing="full")
    with pytest.raises(ValueError) as error:
        hp.parallelize(model, hp.ParallelDims(), activation_checkpointing="full")
    assert "HybridLM is already parallelized (ParallelDims(" in one_line(error) and "runs once" in one_line(error)
    assert all(name.count("_checkpoint_wrapped_module") <= 1 for name, _ in model.named_parameters())


@pytest.mark.parametrize("recorded, now", [("auto", "transformers"), ("transformers", "auto")])
def test_a_resume_under_another_model_backend_names_model_backend(tmp_path, recorded, now):
    """Before: a Bamba run trained as a HybridLM (``model.backend=auto``) resumed with ``model.backend=transformers``
    (or the reverse) was told "Use the model.preset/model.overrides/model.hf_path it was trained with", all three
    unchanged; the key that changed, ``model.backend``, was not named."""
    from hybridpar.config import load_config
    from hybridpar.train.run.resume import _check_compatible

    hybrid = {"hidden_size": 64, "pattern": "M-*-", "vocab_size": 97, "dtype": "float32"}
    bamba = {"architectures": ["BambaForCausalLM"], "model_type": "bamba", "hidden_size": 64, "dtype": "float32"}
    shapes = {"auto": hybrid, "transformers": bamba}
    config = load_config(None, [f"model.hf_path={tmp_path}", f"model.backend={now}"])
    info = {"model": shapes[recorded], "config": {"model": {"hf_path": str(tmp_path), "backend": recorded}}}
    with pytest.raises(ValueError) as error:
        _check_compatible(tmp_path, info, config, shapes[now], 1)
    assert f"resume with model.backend={recorded}" in one_line(error) and "model.preset" not in one_line(error)
    info["config"]["model"]["hf_path"] = str(tmp_path / "other")  # another checkpoint too: the shape message
    with pytest.raises(ValueError) as error:
        _check_compatible(tmp_path, info, config, shapes[now], 1)
    assert "model.hf_path it was trained with" in one_line(error)


def test_generate_causal_lm_holds_a_transformers_models_prompt_and_end_token_to_its_vocabulary(saved):
    """Before: ``generate_causal_lm`` of a transformers model (Granite 4.0-H) passed its arguments to transformers
    unchecked: a list of ids was "'list' object has no attribute 'is_cuda'", a [S] row "tuple index out of range", an id
    past the vocabulary "index out of range in self", ``eos_token_id="2"`` "'<' not supported between instances of
    'str' and 'int'", a numpy id "invalid index to scalar variable", ``eos_token_id=-1`` never stopped a row, and
    ``max_new_tokens=np.int64(3)`` was refused; the HybridLM path already checked the ids."""
    np = pytest.importorskip("numpy")
    from hybridpar.models.hf.causal_lm import generate_causal_lm, load_causal_lm

    model = load_causal_lm(saved("granite")).eval()
    ids = torch.tensor([[1, 2, 3]])
    for call, said in [(lambda: generate_causal_lm(model, [[1, 2, 3]], 2), "input_ids is a list, not a torch.Tensor"),
                       (lambda: generate_causal_lm(model, ids[0], 2), "use ids[None] for one prompt"),
                       (lambda: generate_causal_lm(model, torch.tensor([[1, 2, 97]]), 2), "vocabulary [0, 97)"),
                       (lambda: generate_causal_lm(model, ids, 2, eos_token_id="2"), "(got '2')"),
                       (lambda: generate_causal_lm(model, ids, 2, eos_token_id=-1), "[0, vocab_size=97)")]:
        with pytest.raises(ValueError) as error:
            call()
        assert said in one_line(error), one_line(error)
    first = int(generate_causal_lm(model, ids, 1)[0, -1])
    assert generate_causal_lm(model, ids, np.int64(4), eos_token_id=np.int64(first)).shape == (1, 4)


def test_export_lora_of_a_state_without_the_adapters_is_refused(saved, tmp_path):
    """Before: ``export_lora(model, dir, state)`` with a state that holds no adapter tensors (saved before ``add_lora``,
    or the base weights alone) wrote an empty ``adapter_model.safetensors`` (``merge=False``) or the base weights as the
    merged model (``merge=True``), without a word; a state that is not a dict was "'str' object has no attribute
    'items'"."""
    import hybridpar as hp

    model = hp.load_causal_lm(saved("granite"))
    base = hp.canonical_state_dict(model)
    hp.add_lora(model, r=2, targets=["q_proj", "v_proj"])
    for merge in (False, True):
        with pytest.raises(ValueError) as error:
            hp.export_lora(model, tmp_path / f"m{merge}", base, merge=merge)
        assert "state holds none of the model's 4 adapter tensors" in one_line(error), one_line(error)
    with pytest.raises(ValueError) as error:
        hp.export_lora(model, tmp_path / "s", "state")
    assert "got str; pass canonical_state_dict(model)" in one_line(error)
    assert not any(tmp_path.iterdir())
    hp.export_lora(model, tmp_path / "adapter", hp.canonical_state_dict(model))
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize("field, value, said", [("pattern", "M*X", "unknown characters ['X']"),
                                                 ("num_key_value_heads", 3, "divisible by num_key_value_heads=3"),
                                                 ("vocab_size", 0, "vocab_size=0 must be a positive integer")])
def test_a_hybrid_config_changed_after_it_was_built_is_checked_again(field, value, said):
    """Before: ``HybridConfig`` checked its fields when built only, so ``config.pattern = "M*X"`` then ``HybridLM(config)``
    was "KeyError: 'X'", and ``num_key_value_heads=3`` (of 4 heads) or ``vocab_size=0`` built a model that fails at its
    first forward (as round 16 found for a RunConfig changed by hand before ``make_plan``)."""
    from hybridpar import HybridConfig, HybridLM

    config = HybridConfig.from_preset("tiny")
    setattr(config, field, value)
    with pytest.raises(ValueError) as error:
        HybridLM(config)
    assert said in one_line(error), one_line(error)


def test_the_hybrid_backends_refusal_closes_its_reason_once(saved):
    """Before: ``load_causal_lm(granite, backend="hybrid")`` (``model.backend=hybrid``) ended its nested reason with
    ".);", a sentence's stop inside the parentheses and another clause after them."""
    from hybridpar.models.hf.causal_lm import load_causal_lm

    with pytest.raises(ValueError) as error:
        load_causal_lm(saved("granite"), backend="hybrid")
    message = one_line(error)
    assert ".)" not in message and "'NemotronHForCausalLM']); use backend 'transformers'" in message, message


@pytest.mark.parametrize("pad, cp, fix", [(2, 2, "Resume at parallel.cp=1, or"), (4, 4, "Resume at parallel.cp=1 or 2, or"),
                                          (12, 4, "Resume at parallel.cp=1, 2, 3 or 6, or")])
def test_a_resume_at_a_cp_the_recorded_padding_does_not_take_names_the_cps_that_do(tmp_path, pad, cp, fix):
    """Before: a LoRA run of Zamba2 written at ``tp=2`` (documents padded to 2) resumed at ``cp=2`` was told "Resume at a
    cp whose 2*cp divides 2", a riddle whose answer is ``parallel.cp=1``."""
    from hybridpar.config import load_config
    from hybridpar.train.run.resume import _check_compatible

    config = load_config(None, ["model.preset=tiny", f"parallel.cp={cp}"])
    with pytest.raises(ValueError) as error:
        _check_compatible(tmp_path, {"data": {"pad_to_multiple_of": pad}}, config, None, cp)
    assert fix in one_line(error) and "whose 2*cp" not in one_line(error), one_line(error)


def test_check_packing_says_the_layout_it_does_not_use(capsys):
    """Before: ``hybridpar check --packing --nproc-per-node 2 parallel.cp=2`` ran the same one-process comparison on both
    processes and printed "check --packing passed" without a word that cp=2 played no part, so a pass read as packing
    proven under context parallelism."""
    from hybridpar.config import load_config
    from hybridpar.train.proof.packing import _layout_note, run_packing_check

    overrides = ["model.preset=tiny", "data.pack_size=64", "data.packs_per_step=1", "train.seed=1",
                 "data.task_options={num_kv_pairs: 4, min_len: 24, max_len: 40}"]
    assert run_packing_check(load_config(None, overrides + ["parallel.cp=2", "parallel.tp=2"]), torch.device("cpu")) == 0
    out = capsys.readouterr().out
    assert "layout: parallel.cp=2, parallel.tp=2 not used here" in out and "without --packing proves the layout" in out
    assert _layout_note(load_config(None, overrides + ["parallel.cp=1"])) == ""
