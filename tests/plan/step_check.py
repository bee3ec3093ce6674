"""One measured training step against ``hybridpar plan`` of the same config, for the twins' tests."""

from __future__ import annotations

from hybridpar.plan.validate import measure_step, predict
from tests.distributed.harness import run_ranks


def assert_plan_matches_step(overrides: list[str], root: str, world: int = 2) -> None:
    """Parameters per rank and every collective's bytes exact, saved activations within 10% of the
    saved-tensor hooks' count (under ``selective`` the allocator's: the policy caches its kept outputs
    out of the hooks' sight) and the peak within 15% of the live tensors'."""
    got = run_ranks(world, measure_step, overrides, root, timeout_s=600)[0]
    plan = predict(overrides)
    assert plan["parameters_per_rank"] == got["parameters_per_rank"]
    assert plan["traffic_bytes_per_step_by_dim"] == got["traffic_by_dim"]
    saved = plan["saved_activation_bytes_per_pack"]["total"]
    kept = got["saved_bytes" if "parallel.activation_checkpointing=selective" in overrides else "saved_hook_bytes"]
    assert abs(saved / kept - 1) <= 0.10, (saved, kept)
    peak = plan["peak_memory_gib_per_rank"]
    assert abs(peak / got["tensor_peak_gib"] - 1) <= 0.15, (peak, got["tensor_peak_gib"], plan["peak_breakdown_gib"])
