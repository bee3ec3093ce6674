"""The LM head loss's blocks compiled (``models/lm_head_blocks.py`` through ``models/cuda_compile.py``),
checked on CPU.

On CUDA the blocks run under inductor; here they compile with ``aot_eager`` (dynamo's trace and AOT
autograd's functional graph, run by eager kernels), which checks what the GPU path depends on: the
functional form traces whole (``fullgraph``) through every block shape, and it computes the eager
form's math. Inductor's kernels themselves are checked on a GPU (``benchmarks/run_on_gpu.sh``).
"""

from __future__ import annotations

import logging

import pytest
import torch

from hybridpar.models import cuda_compile
from hybridpar.models.cuda_compile import compile_steps, compiled_backend
from hybridpar.models.lm_head_loss import local_gradients, local_statistics
from hybridpar.train.loss import lm_head_loss
from tests.train.test_lm_head_loss import make_case, reference


pytestmark = pytest.mark.usefixtures("fresh_compiled_steps")  # tests/conftest.py


def statistics_and_gradients(h, w, labels, chunk_size, **options):
    row_max, sum_exp, target, argmax = local_statistics(h, w, labels, chunk_size, **options)
    lse = row_max + sum_exp.log()
    grads = local_gradients(torch.tensor(0.75, dtype=lse.dtype), h, w, labels, lse, chunk_size, **options)
    return [row_max, sum_exp, target, argmax, *grads]


def test_eager_on_cpu_inductor_on_cuda():
    assert compiled_backend(torch.device("cpu")) is None
    assert compiled_backend(torch.device("cuda")) == "inductor"
    with compile_steps("aot_eager"):
        assert compiled_backend(torch.device("cpu")) == "aot_eager"
    with compile_steps(None):
        assert compiled_backend(torch.device("cuda")) is None


@pytest.mark.parametrize("scale, softcap", [(1.0, None), (0.5, None), (2.0, 3.0)])
@pytest.mark.parametrize("dtype, matmul_dtype", [(torch.float64, None), (torch.float32, torch.bfloat16)])
def test_compiled_blocks_give_the_eager_bits(dtype, matmul_dtype, scale, softcap):
    """Every statistic and gradient of the compiled (functional) form equals the eager (in-place) form
    bit for bit under ``aot_eager`` (the same kernels), over blocks of four shapes (37 tokens, 61 ids at
    ``chunk_size=4``: 16-token and 5-token blocks by 4 and 1 ids), in float64 and under bf16 matmuls."""
    h, w, labels = make_case(dtype=dtype)
    options = dict(matmul_dtype=matmul_dtype, scale=scale, softcap=softcap)
    eager = statistics_and_gradients(h, w, labels, 4, **options)
    with compile_steps("aot_eager"):
        compiled = statistics_and_gradients(h, w, labels, 4, **options)
    assert cuda_compile._COMPILED and not cuda_compile._FAILED  # it did compile, and fullgraph held
    for got, want in zip(compiled, eager):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_compiled_loss_equals_cross_entropy_in_float64():
    h, w, labels = make_case()
    want = reference(h, w, labels, scale=0.5, softcap=2.0)
    h, w = h.requires_grad_(), w.requires_grad_()
    with compile_steps("aot_eager"):
        loss, _ = lm_head_loss(h, w, labels, chunk_size=5, scale=0.5, softcap=2.0)
        loss.backward()
    for got, ref in zip((loss.detach(), h.grad, w.grad), want):
        assert (got - ref).abs().max() <= 1e-10 * ref.abs().max()


def test_a_failed_compile_runs_the_eager_blocks_and_says_so(caplog):
    def broken_backend(graph, example_inputs):
        raise RuntimeError("no kernels today")

    h, w, labels = make_case(dtype=torch.float32)
    eager = statistics_and_gradients(h, w, labels, 8)
    with caplog.at_level(logging.WARNING, logger="hybridpar.models.cuda_compile"), compile_steps(broken_backend):
        got = statistics_and_gradients(h, w, labels, 8)
        again = statistics_and_gradients(h, w, labels, 8)
    for a, b, want in zip(got, again, eager):
        assert torch.equal(a, want) and torch.equal(b, want)
    warnings = [r.getMessage() for r in caplog.records if r.name == "hybridpar.models.cuda_compile"]
    assert len(warnings) == 2 and all("no kernels today" in m and "eagerly" in m for m in warnings)
    assert cuda_compile._FAILED == {"LM head loss statistics", "LM head loss gradient"}
