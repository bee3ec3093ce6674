"""hybridpar as a library: one packed row of a hybrid model split over 2 processes (cp=2),
loss and gradients equal to one process.

    python examples/quickstart.py            # starts 2 gloo processes on this machine (CPU)

What it shows, with the public API only (``import hybridpar as hp``):

    documents -> hp.pack_documents -> hp.collate_thd -> hp.PackedSeqParams.from_batch
      -> hp.shard_inputs (this rank's zigzag half of every document, no communication)
      -> hp.parallelize(model, hp.ParallelDims(cp=2))  (Mamba2 "state", attention "allgather")
      -> model(input_ids, packed=..., labels=...) = (loss_sum, valid_count) on this rank's tokens
      -> divide by the row's valid-token count; FSDP adds the ranks' gradients: one process's
"""

from __future__ import annotations

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import hybridpar as hp

# "M*-M-": Mamba2, attention, MLP, Mamba2, MLP blocks
CONFIG = dict(vocab_size=64, hidden_size=32, pattern="M*-M-", mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=8,
              chunk_size=8, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64)


def one_row():
    """Three documents packed into one 48-token row (each padded to a multiple of 2*cp)."""
    gen = torch.Generator().manual_seed(0)
    docs = [torch.randint(1, 64, (n,), generator=gen).tolist() for n in (17, 9, 14)]
    batch = hp.collate_thd(hp.pack_documents(docs, pack_size=48, cp_size=2))
    return batch["input_ids"], batch["labels"], hp.PackedSeqParams.from_batch(batch)


def loss_and_grads(model, input_ids, labels, packed, group=None):
    """Loss = (this rank's summed token losses) / (valid tokens of the whole row); FSDP, which
    ``parallelize`` applies over the cp ranks, adds the ranks' gradients in backward."""
    loss_sum, count = model(input_ids, packed=packed, labels=labels)
    total_sum, total_count = loss_sum.detach().clone(), count.clone()
    if group is not None:
        dist.all_reduce(total_sum, group=group)
        dist.all_reduce(total_count, group=group)
    (loss_sum / total_count).backward()
    return total_sum / total_count


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_main(rank: int, world_size: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    model = hp.HybridLM(hp.HybridConfig(**CONFIG)).double()
    dims = hp.ParallelDims(cp=world_size)
    mesh = dims.build_mesh("cpu")
    model = hp.parallelize(model, dims, mesh=mesh, cp_mamba="state", cp_attention="allgather")
    input_ids, labels, packed = one_row()
    cp_group = hp.ParallelDims.group(mesh, "cp")
    local = hp.shard_inputs(input_ids=input_ids, labels=labels, packed=packed, cp_group=cp_group)
    loss = loss_and_grads(model, local.input_ids, local.labels, local.packed, group=cp_group)
    grads = hp.canonical_state_dict(model, grads=True)  # full gradients, gathered over the layout
    if rank == 0:
        queue.put((loss.item(), {n: g.tolist() for n, g in grads.items()}))
    dist.destroy_process_group()


def main() -> int:
    torch.manual_seed(0)
    reference = hp.HybridLM(hp.HybridConfig(**CONFIG)).double()
    input_ids, labels, packed = one_row()
    ref_loss = loss_and_grads(reference, input_ids, labels, packed)
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}

    queue = mp.get_context("spawn").SimpleQueue()
    ranks = mp.start_processes(rank_main, args=(2, free_port(), queue), nprocs=2, start_method="spawn", join=False)
    loss, grads = queue.get()  # before joining: rank 0 cannot exit until its result is read
    while not ranks.join():
        pass
    worst = max((torch.tensor(grads[n], dtype=torch.float64) - g).abs().max().item() for n, g in ref_grads.items())
    print(f"one process: loss {ref_loss.item():.12f}\ncp=2:        loss {loss:.12f}\n"
          f"largest gradient difference over {len(ref_grads)} parameters: {worst:.1e}")
    return 0 if abs(loss - ref_loss.item()) < 1e-9 and worst < 1e-9 else 1


if __name__ == "__main__":
    sys.exit(main())
