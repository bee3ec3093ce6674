"""Any transformers causal LM through the trainer and the CLI, with its own tokenizer, on chat data.

Tiny Llama, Qwen3 and Mistral checkpoints saved by transformers next to a BPE tokenizer trained
in the test (``tests/models/hf/test_causal_lm.py`` makes them). On real gloo ranks, for each model:
2 training steps on chat JSONL at tp=2 (sequence parallel), at cp=2 (the two share one launch of
2 ranks) and at tp=2 x dp_shard=2, through
the code ``hybridpar train`` runs (``Trainer.fit``); the export reloads in transformers with no
missing or unexpected keys, the tokenizer and chat template, and the logits of the trained
parallel model (float32, 1e-5; at tp=2 layouts); ``hybridpar check`` on the tp=2 x dp_shard=2 and
cp=2 configs in float64 is exact (1e-9). Then the preflight rules of the new keys, before any process starts.
"""

import contextlib
import io
import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from hybridpar.config import load_config
from tests.data.bpe import train_tiny_bpe
from tests.distributed.harness import run_each
from tests.train.fault_probes import cli
from tests.models.hf.test_causal_lm import CONFIGS, VOCAB, save_checkpoint

QUIET = ["tensorboard=false", "plot=false"]
TOPICS = ["the quick brown fox", "how are you today", "def add(a, b)", "be brief and kind", "hello there"]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """``(checkpoint directory per model, chat JSONL path)``."""
    root = tmp_path_factory.mktemp("hf_cli")
    bpe = train_tiny_bpe(root / "bpe")
    checkpoints = {name: str(save_checkpoint(name, root / name, bpe)) for name in sorted(CONFIGS)}
    chat = root / "chat.jsonl"
    with chat.open("w") as handle:
        for i in range(24):
            messages = [{"role": "user", "content": f"say {TOPICS[i % 5]}"},
                        {"role": "assistant", "content": TOPICS[(i + 1) % 5] + "." * (i % 3)}]
            handle.write(json.dumps({"messages": messages}) + "\n")
    return checkpoints, str(chat)


def job(source: str, chat: str, out: str, layout: list[str], dtype: str = "float32") -> list[str]:
    return [f"model.hf_path={source}", f"model.dtype={dtype}", "data.task=chat", f"data.path={chat}",
            "data.pack_size=64", "data.packs_per_step=2", "train.steps=2", "train.lr=0.01", "train.warmup_steps=0",
            "train.eval_every=0", "checkpoint.every=-1", f"output_dir={out}/run", *layout, *QUIET]


def _train_export_check(rank, world_size, checkpoints, chat, root, layout, check):
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hybridpar.train.trainer import Trainer

    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    results = {}
    for name, source in checkpoints.items():
        out = f"{root}/{name}-{world_size}"
        trainer = Trainer(load_config(None, job(source, chat, out, layout) + [f"model.export_hf={out}/export"]),
                          torch.device("cpu"))
        history = trainer.fit()
        trainer.model.eval()
        cp = any(option.startswith("parallel.cp=") for option in layout)
        with torch.no_grad():  # under CP the model takes sharded rows only: the check below covers it
            trained = None if cp else trainer.model(input_ids=ids, use_cache=False).logits  # gathered vocab shards
        result = {"type": next(c.__name__ for c in type(trainer.model).__mro__ if not c.__name__.startswith("FSDP")), "losses": [h["loss"] for h in history or []],
                  "attention": trainer.model.config._attn_implementation}
        if rank == 0:
            reloaded, info = AutoModelForCausalLM.from_pretrained(f"{out}/export", output_loading_info=True,
                                                                  local_files_only=True)
            original = AutoModelForCausalLM.from_pretrained(source, local_files_only=True).eval()
            with torch.no_grad():
                exported = reloaded.eval()(ids, use_cache=False).logits
                before = original(ids, use_cache=False).logits
            tokenizer = AutoTokenizer.from_pretrained(f"{out}/export", local_files_only=True)
            result.update(
                problems=sum(len(info[k]) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")),
                logits_error=0.0 if trained is None else float((exported - trained).abs().max()),
                changed=float((before - exported).abs().max()),
                template=tokenizer.chat_template == AutoTokenizer.from_pretrained(source).chat_template is not None,
                generation_config=os.path.isfile(f"{out}/export/generation_config.json"))
        if check:
            result["check"] = cli("check", *job(source, chat, f"{out}-check", layout, dtype="float64"))
        results[name] = result
        dist.barrier()
    return results


LAYOUTS = {"tp2-sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"], False),
           "tp2xdp_shard2": (4, ["parallel.tp=2", "parallel.dp_shard=2", "parallel.sequence_parallel=true"], True),
           "cp2": (2, ["parallel.cp=2", "parallel.cp_attention=ulysses"], True)}


@pytest.fixture(scope="module")
def trained(sources, tmp_path_factory):
    """Rank 0's results per layout name: one launch per world size (the 2-rank layouts share one)."""
    checkpoints, chat = sources
    root = tmp_path_factory.mktemp("trained")
    results = {}
    for world_size in (2, 4):
        names = [name for name, (n, _, _) in LAYOUTS.items() if n == world_size]
        layouts = [LAYOUTS[name][1:] for name in names]
        calls = [(checkpoints, chat, f"{root}/{index}", layout, check) for index, (layout, check) in enumerate(layouts)]
        runs = run_each(world_size, _train_export_check, calls, timeout_s=600)
        results.update(zip(names, (ranks[0] for ranks in runs)))
    return results


@pytest.mark.parametrize("layout_name", list(LAYOUTS))
def test_train_export_and_check_llama_qwen3_mistral(trained, layout_name):
    check = LAYOUTS[layout_name][2]
    for name, result in trained[layout_name].items():
        assert result["type"] == {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
                                  "mistral": "MistralForCausalLM"}[name]
        assert len(result["losses"]) == 2 and all(map(torch.isfinite, torch.tensor(result["losses"])))
        assert result["attention"] == "hybridpar", name  # blockwise at every cp: no [S, S] mask
        assert result["problems"] == 0, name
        assert result["logits_error"] < 1e-5, (name, result["logits_error"])
        assert result["changed"] > 1e-3, name  # it was trained
        assert result["template"] and result["generation_config"], name
        if check:
            code, report = result["check"]
            assert code == 0 and "check exact" in report, report
            differences = [float(line.split("max|diff|")[1].split()[0]) for line in report.splitlines()
                           if "max|diff|" in line]
            assert len(differences) > 20 and max(differences) < 1e-9, report


def test_new_keys_are_checked_before_any_process_starts(sources, tmp_path):
    from hybridpar.data.tokenizers import ByteTokenizer
    from hybridpar.train.batches import validate_data
    from hybridpar.train.preflight import validate_run

    checkpoints, chat = sources
    llama = checkpoints["llama"]

    def refused(*overrides):
        config = load_config(None, job(llama, chat, str(tmp_path), list(overrides)))
        with pytest.raises(ValueError) as error:
            validate_run(config, "train", None)
        return str(error.value)

    assert "backend 'hybrid' loads only" in refused("model.backend=hybrid")
    assert "has none" in refused("data.tokenizer=bytes")  # chat data needs a chat template
    assert "has no effect on data.task='mqar'" in refused("data.task=mqar", "data.tokenizer=bytes")
    # fine-tuning on text: the checkpoint's own tokenizer unless bytes are asked for by name
    text = tmp_path / "text.txt"
    text.write_text("hello there\n\nhow are you today\n")
    config = load_config(None, job(llama, str(text), str(tmp_path), ["data.task=text"]))
    assert validate_run(config, "train", None).vocab_size == VOCAB
    assert validate_data(config.data, VOCAB, llama).source_dir == Path(llama)
    config.data.tokenizer = "bytes"
    assert isinstance(validate_data(config.data, VOCAB, llama), ByteTokenizer)
    small = load_config(None, ["data.task=text", f"data.path={text}", f"data.tokenizer={llama}", f"output_dir={tmp_path}/s"])
    with pytest.raises(ValueError, match="produces ids up to 319, but the model's embedding has vocab_size=256"):
        validate_run(small, "train", None)  # the tiny HybridLM's embedding is smaller than the tokenizer
    assert "needs model.hf_path" in refused("model.hf_path=null", "model.backend=transformers")
    assert "applies to HybridLM models" in refused(f"model.export_hf={tmp_path}/x",
                                                   "model.export_architecture=Mamba2ForCausalLM")
    # the plan command shows a transformers model's size without crashing
    from hybridpar.plan import print_plan

    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        print_plan(load_config(None, job(llama, chat, str(tmp_path), ["parallel.tp=2"])))
    assert "LlamaForCausalLM" in stdout.getvalue()
