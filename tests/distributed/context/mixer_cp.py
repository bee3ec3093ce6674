"""One context-parallel case of a transformers model whose token mixers run on a hybridpar core
(Mamba2 and Mamba1 mixers, gated DeltaNets, short convs), shared by ``test_hf_hybrids.py``,
``test_hf_gdn.py``, ``test_hf_short_conv.py`` and ``test_hf_mamba1.py``.

Two rows of packed documents (default 12 and 20 tokens): the one-process reference runs the model with
the mixers switched (``install``) and hybridpar's attention; the parallel model goes through
``parallelize(cp=2)``. Returns the loss error (summed over CP), the worst parameter gradient error
(``full_tensor``), the parameter counts and the class names of the installed mixer cores.
"""

from __future__ import annotations

import torch

from tests.distributed.tensor.hf_models import gradient_errors

DOCS = [0, 12, 32]


def cp_case(build, install, switched, vocab: int, name: str, attention: str, mesh, *, mamba: str = "a2a",
            docs=DOCS) -> dict:
    """``build(name)`` a tiny float64 model, ``install(model)`` its cores, ``switched(model)`` the
    ``(name, module)`` of its switched mixers; cp=2 with ``attention`` (and ``mamba``, the strategy of
    Mamba2 mixers and gated DeltaNets) on rows packed as ``docs``, against one process."""
    import torch.distributed as dist

    from hybridpar.data.thd import PackedSeqParams
    from hybridpar.parallel.context.hf import use_hybridpar_attention
    from hybridpar.parallel.context.inputs import shard_inputs
    from hybridpar.parallel.dims import ParallelDims
    from hybridpar.parallel.parallelize import parallelize
    from hybridpar.train.trainer import pack_loss_sum

    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (2, docs[-1]), generator=gen)
    labels = torch.randint(0, vocab, (2, docs[-1]), generator=gen)
    labels[:, ::5] = -100
    packed = PackedSeqParams.from_cu_seqlens(torch.tensor(docs, dtype=torch.int32))
    count = int((labels != -100).sum())

    reference = build(name)
    install(reference)
    use_hybridpar_attention(reference)
    ref_loss = pack_loss_sum(reference, shard_inputs(input_ids=ids, labels=labels, packed=packed))[0] / count
    ref_loss.backward()

    model = build(name)
    parallelize(model, ParallelDims(cp=2), mesh=mesh, cp_attention=attention, cp_mamba=mamba)
    cores = {type(m.core).__name__ for _, m in switched(model)}
    cp_group = ParallelDims.group(mesh, "cp")
    loss = pack_loss_sum(model, shard_inputs(input_ids=ids, labels=labels, packed=packed, cp_group=cp_group))[0] / count
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total, group=cp_group)
    errors = gradient_errors(model, reference)
    worst = max(errors, key=errors.get)
    return {"loss_error": abs(total.item() - ref_loss.item()), "grad_error": errors[worst], "worst": worst,
            "params": len(errors), "expected": len(dict(reference.named_parameters())), "cores": cores}
