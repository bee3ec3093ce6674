"""The Mamba2 mixer: same numbers as transformers' Mamba2Mixer, and exact on packed rows."""

import pytest
import torch

from hybridpar.data.thd import PackedSeqParams
from hybridpar.models.mamba.mixer import Mamba2Mixer


def tiny_mixer(dtype=torch.float64, **overrides) -> Mamba2Mixer:
    kwargs = dict(hidden_size=32, num_heads=8, head_dim=8, n_groups=2, state_size=16, conv_kernel=4, chunk_size=8)
    kwargs.update(overrides)
    torch.manual_seed(0)
    mixer = Mamba2Mixer(**kwargs).to(dtype)
    with torch.no_grad():  # random, non-trivial SSM parameters and norm weights
        mixer.D.uniform_(0.5, 1.5)
        mixer.norm.weight.uniform_(0.5, 1.5)
        mixer.conv1d.bias.uniform_(-0.5, 0.5)
    return mixer


def test_matches_transformers_mamba2_mixer():
    from transformers import Mamba2Config
    from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer as HFMamba2Mixer

    config = Mamba2Config(
        hidden_size=32, num_heads=8, head_dim=8, expand=2, n_groups=2, state_size=16, conv_kernel=4,
        chunk_size=8, use_conv_bias=True, use_bias=False, layer_norm_epsilon=1e-5, num_hidden_layers=1,
    )
    reference = HFMamba2Mixer(config, layer_idx=0).eval()
    ours = tiny_mixer(torch.float32)
    ours.load_state_dict(reference.state_dict())
    hidden = torch.randn(2, 45, 32)  # 45 is not a multiple of the chunk
    with torch.no_grad():
        expected = reference(hidden)
        actual = ours(hidden)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def test_parameter_names_and_shapes_match_transformers():
    from transformers import Mamba2Config
    from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer as HFMamba2Mixer

    config = Mamba2Config(hidden_size=32, num_heads=8, head_dim=8, expand=2, n_groups=2, state_size=16, num_hidden_layers=1)
    reference = {k: v.shape for k, v in HFMamba2Mixer(config, layer_idx=0).state_dict().items()}
    ours = {k: v.shape for k, v in tiny_mixer(torch.float32).state_dict().items()}
    assert ours == reference


@pytest.mark.parametrize("lengths", [[13, 8, 1, 22], [8, 16, 20]])  # boundaries inside chunks and on chunk edges
def test_packed_row_equals_each_document_alone(lengths):
    mixer = tiny_mixer()
    hidden = torch.randn(1, sum(lengths), 32, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0] + lengths).cumsum(0)
    packed_out = mixer(hidden, PackedSeqParams.from_cu_seqlens(cu))
    upstream = torch.randn_like(packed_out)
    packed_grads = torch.autograd.grad((packed_out * upstream).sum(), [hidden, *mixer.parameters()])

    alone_out = torch.cat([mixer(hidden[:, s:e]) for s, e in zip(cu[:-1], cu[1:])], dim=1)
    alone_grads = torch.autograd.grad((alone_out * upstream).sum(), [hidden, *mixer.parameters()])
    torch.testing.assert_close(packed_out, alone_out, rtol=1e-10, atol=1e-10)
    for packed_grad, alone_grad in zip(packed_grads, alone_grads):
        torch.testing.assert_close(packed_grad, alone_grad, rtol=1e-10, atol=1e-10)


def test_heads_not_divisible_by_groups_is_rejected():
    with pytest.raises(ValueError, match="not divisible by n_groups"):
        Mamba2Mixer(hidden_size=32, num_heads=6, head_dim=8, n_groups=4)


def test_projection_width_that_is_not_a_shard_is_rejected():
    mixer = tiny_mixer()
    with pytest.raises(ValueError, match="not the mixer's or one TP rank's share"):
        mixer.split_sizes(mixer.in_proj.out_features - 1)


def test_split_sizes_of_a_tp_shard_with_split_or_replicated_groups():
    """A TP rank holds H/tp heads and G/tp groups, or the single group whole (tp_groups)."""
    from hybridpar.models.mamba.mixer import tp_groups

    assert (tp_groups(4, 2), tp_groups(1, 4), tp_groups(3, 2)) == (2, 1, 0)
    for groups in (2, 1):
        mixer = Mamba2Mixer(hidden_size=32, num_heads=8, head_dim=8, n_groups=groups, state_size=16)
        d_half, state = mixer.intermediate_size // 2, mixer.ssm_state_size
        local_groups = tp_groups(groups, 2)
        width = 2 * d_half + 2 * local_groups * state + 4
        assert mixer.split_sizes(width) == (d_half, d_half + 2 * local_groups * state, 4), groups
