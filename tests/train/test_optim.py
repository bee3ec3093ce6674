"""AdamW's implementation: fused on CUDA, torch's choice on CPU (the per-parameter loop), and the
loop where DTensor and plain parameters mix, where DTensor's foreach and fused ops refuse the list."""

from hybridpar.config import TrainConfig
from tests.distributed.harness import run_ranks


def foreach_choices(rank: int, world_size: int) -> tuple:
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    from hybridpar.train.optim import build_optimizer

    plain = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    mixed = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    mesh = init_device_mesh("cpu", (world_size,))
    mixed[0].weight = nn.Parameter(distribute_tensor(mixed[0].weight.detach(), mesh, [Replicate()]))
    optimizer = build_optimizer(mixed, TrainConfig())
    loss = sum(p.full_tensor().sum() if hasattr(p, "full_tensor") else p.sum() for p in mixed.parameters())
    loss.backward()
    optimizer.step()  # the per-parameter loop takes the mixed list
    return build_optimizer(plain, TrainConfig()).defaults["foreach"], optimizer.defaults["foreach"]


def test_foreach_is_left_to_torch_unless_dtensor_and_plain_parameters_mix():
    assert run_ranks(2, foreach_choices) == [(None, False)] * 2


def test_cuda_parameters_take_the_fused_update_and_cpu_ones_keep_torchs_choice():
    from types import SimpleNamespace

    import torch

    from hybridpar.train.optim import adamw_implementation

    def on(device: str, floating: bool = True):  # no CUDA here: the rule reads the device type and dtype alone
        return SimpleNamespace(device=torch.device(device), is_floating_point=lambda: floating)

    assert adamw_implementation([on("cuda"), on("cuda")]) == {"fused": True}
    assert adamw_implementation([on("cuda"), on("cuda", floating=False)]) == {"foreach": None}
    assert adamw_implementation([torch.zeros(2, 2), torch.zeros(2)]) == {"foreach": None}
    assert adamw_implementation([]) == {"foreach": None}
