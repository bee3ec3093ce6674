"""``parameter_layouts`` follows Megatron's rule order (``_detect_parallelism_type``) for
Transformer Engine classes, in one process on small stand-in modules named like the TE /
Megatron classes (Transformer Engine itself is not installable here).

The stand-ins carry the parameters and attributes the real classes do: a
``TELayerNormColumnParallelLinear`` has ``weight``/``bias`` plus the fused LayerNorm's
``layer_norm_weight``/``layer_norm_bias``; a ``TELinear`` has ``parallel_mode``; Megatron
modules and parameters carry ``tensor_model_parallel``/``partition_dim``. DTensor placements
(rule 1) are checked on real process groups in ``test_fsdp`` and ``test_tp_hf``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from hybridpar.parallel.data import param_layouts as layouts_module
from hybridpar.parallel.data.fsdp import parameter_layouts as reexported
from hybridpar.parallel.data.param_layouts import Layout, parameter_layouts

COLUMN0 = Layout(True, 0, "module_type")


def _linear_params(module: nn.Module, out_features: int = 8, in_features: int = 4, bias: bool = True) -> None:
    module.weight = nn.Parameter(torch.randn(out_features, in_features))
    module.bias = nn.Parameter(torch.randn(out_features)) if bias else None


def _named(name: str, **attrs) -> nn.Module:
    """An ``nn.Module`` subclass called ``name`` with linear-shaped parameters and ``attrs``."""
    module = type(name, (nn.Module,), {})()
    _linear_params(module)
    for key, value in attrs.items():
        setattr(module, key, value)
    return module


def _one(module: nn.Module) -> dict[str, Layout]:
    return parameter_layouts(nn.ModuleDict({"m": module}))


def test_fused_layernorm_of_te_layernorm_column_linear_is_replicated():
    module = _named("TELayerNormColumnParallelLinear")
    module.layer_norm_weight = nn.Parameter(torch.ones(4))
    module.layer_norm_bias = nn.Parameter(torch.zeros(4))
    got = _one(module)
    assert got["m.weight"] == got["m.bias"] == COLUMN0
    assert got["m.layer_norm_weight"] == got["m.layer_norm_bias"] == Layout(False, None, "fused_norm")


@pytest.mark.parametrize("mode,weight,bias", [
    ("column", Layout(True, 0, "parallel_mode"), Layout(True, 0, "parallel_mode")),
    ("row", Layout(True, 1, "parallel_mode"), Layout(False, None, "parallel_mode")),  # row bias: added once
    ("duplicated", Layout(False, None, "parallel_mode"), Layout(False, None, "parallel_mode")),
    (None, Layout(False, None, "parallel_mode"), Layout(False, None, "parallel_mode")),
])
def test_te_linear_parallel_mode_is_honoured(mode, weight, bias):
    got = _one(_named("TELinear", parallel_mode=mode))
    assert got["m.weight"] == weight and got["m.bias"] == bias


def test_module_marked_parallel_without_partition_dim_falls_through():
    # no partition_dim on the module: the parameter's own attributes decide ...
    proj = _named("SomeProjection", tensor_model_parallel=True)
    proj.weight.tensor_model_parallel, proj.weight.partition_dim = True, 1
    assert _one(proj)["m.weight"] == Layout(True, 1, "param_attr")
    # ... or the norm-name rule, or the default
    assert _one(_named("GroupedNorm", tensor_model_parallel=True))["m.weight"] == Layout(False, None, "norm_name")
    assert _one(_named("Plain", tensor_model_parallel=True))["m.weight"] == Layout(False, None, "default")
    # a module-level partition_dim outside {0, 1} does not decide either
    assert _one(_named("Plain", tensor_model_parallel=True, partition_dim=-1))["m.weight"].source == "default"


def test_module_attributes_decide_column_row_and_replicated():
    got = _one(_named("Proj", tensor_model_parallel=True, partition_dim=1))
    assert got["m.weight"] == Layout(True, 1, "module_attr") and got["m.bias"] == Layout(False, None, "module_attr")
    assert _one(_named("Proj", tensor_model_parallel=False))["m.weight"] == Layout(False, None, "module_attr")


def test_rule_order_type_then_module_attr_then_param_attr_then_norm_name():
    # a known class name beats module attributes
    row = _named("RowParallelLinear", tensor_model_parallel=True, partition_dim=0)
    assert _one(row)["m.weight"] == Layout(True, 1, "module_type")
    assert _one(row)["m.bias"] == Layout(False, None, "module_type")
    # module attributes beat parameter attributes
    both = _named("Proj", tensor_model_parallel=True, partition_dim=1)
    both.weight.tensor_model_parallel, both.weight.partition_dim = True, 0
    assert _one(both)["m.weight"] == Layout(True, 1, "module_attr")
    # parameter attributes beat the norm name (Megatron's Mamba ExtendedRMSNorm, seed 002) ...
    norm = _named("ExtendedRMSNorm")
    norm.weight.tensor_model_parallel, norm.weight.partition_dim = True, 0
    assert _one(norm)["m.weight"] == Layout(True, 0, "param_attr")
    assert _one(_named("ExtendedRMSNorm"))["m.weight"] == Layout(False, None, "norm_name")
    # ... but not a replicated class of the registry (TopKRouter, LayerNorm)
    router = _named("TopKRouter")
    router.weight.tensor_model_parallel, router.weight.partition_dim = True, 0
    assert _one(router)["m.weight"] == Layout(False, None, "module_type")
    # a parameter marked sharded without a partition dim does not decide
    loose = _named("Plain")
    loose.weight.tensor_model_parallel = True
    assert _one(loose)["m.weight"] == Layout(False, None, "default")


def test_grouped_and_column_classes():
    assert _one(_named("TEColumnParallelGroupedLinear"))["m.weight"] == COLUMN0
    grouped_row = _named("TERowParallelGroupedLinear")
    assert _one(grouped_row)["m.weight"] == Layout(True, 1, "module_type")
    assert _one(grouped_row)["m.bias"] == Layout(False, None, "module_type")


def test_docstring_lists_every_source_in_rule_order():
    doc = layouts_module.__doc__
    order = ["dtensor", "fused_norm", "module_type", "module_attr", "param_attr", "norm_name", "parallel_mode",
             "default"]
    positions = [doc.index(f"``{source}``") for source in order]
    assert positions == sorted(positions)


def test_fsdp_reexports_parameter_layouts():
    assert reexported is parameter_layouts
