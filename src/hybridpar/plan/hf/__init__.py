"""The planner's transformers twins: a transformers checkpoint priced as the ``HybridLM`` shape it computes.

``twin.py`` maps a transformers config to its twin (``TwinConfig``: Llama-family decoders, Bamba,
NemotronH, GraniteMoeHybrid, Falcon-H1's parallel layers ``P``), or says why there is none;
``moe.py`` prices what a twin's MoE blocks (pattern ``E``: router, routed experts, shared experts)
hold, keep for backward and send. Imported by
``plan/planner.py`` (the twin), ``plan/activations.py``, ``plan/transients.py``, ``plan/traffic.py`` and
``plan/estimate.py`` (the MoE terms); imports ``models/`` (config mapping) and ``parallel.comm.step``
(parameter shapes) only.
"""
