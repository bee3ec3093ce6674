"""FLA's ``chunk_gated_delta_rule`` contract written out token by token (any dtype, float64 in the tests).

From its docstring and ``fla.ops.gated_delta_rule.naive.naive_recurrent_gated_delta_rule``: per
``cu_seqlens`` sequence ``n`` and value head ``h`` (key head ``h // (Hv/Hk)``), state ``S [dk, dv]``
starting at ``initial_state[n]`` (zeros without one)::

    S <- exp(g_t) S;   S <- S + k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T (scale q_t)

``o`` in v's dtype, final states ``[N, Hv, dk, dv]`` in float32 or wider. ``fla_gdn_on_cpu.py``
holds it to FLA's own naive reference; ``test_gdn_fused.py`` registers it as a stand-in rule for ``fused_rules.py``.
"""

from __future__ import annotations

import torch


def gated_delta_contract(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None):
    assert q.shape[0] == 1 and cu_seqlens is not None
    k_heads, dk, v_heads, dv = q.shape[2], q.shape[3], v.shape[2], v.shape[3]
    scale = dk ** -0.5 if scale is None else scale
    acc = torch.promote_types(v.dtype, torch.float32)
    q, k = (t.to(acc).repeat_interleave(v_heads // k_heads, dim=2) for t in (q, k))  # [1, T, Hv, dk]
    v, g, beta = (t.to(acc) for t in (v, g, beta))
    outputs, finals = [], []
    for n in range(cu_seqlens.shape[0] - 1):
        state = initial_state[n].to(acc) if initial_state is not None else q.new_zeros(v_heads, dk, dv)
        for t in range(int(cu_seqlens[n]), int(cu_seqlens[n + 1])):
            state = state * g[0, t].exp()[:, None, None]
            u = beta[0, t][:, None] * (v[0, t] - (state * k[0, t][:, :, None]).sum(1))  # [Hv, dv]
            state = state + k[0, t][:, :, None] * u[:, None, :]
            outputs.append((state * (scale * q[0, t])[:, :, None]).sum(1))  # [Hv, dv]
        finals.append(state)
    o = torch.stack(outputs)[None] if outputs else v.new_zeros(v.shape)
    return o.to(v.dtype), (torch.stack(finals) if output_final_state else None)
