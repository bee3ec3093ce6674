"""The planner's transformers twins: a transformers checkpoint priced as the ``HybridLM`` shape it computes.

``twin.py`` maps a transformers config to its twin (``TwinConfig``: Llama-family decoders, Bamba,
NemotronH, GraniteMoeHybrid, Falcon-H1's parallel layers ``P``), or says why there is none;
``moe.py`` prices what a twin's MoE blocks (pattern ``E``: router, routed experts, shared experts)
hold, keep for backward and send; ``zamba2.py`` a Zamba2's shared blocks (pattern ``Z``: one use of a
shared attention block and its layer's linear; the weights once, the adapters per use), ``zamba2_lora.py`` a
use under LoRA (the linears it may adapt, what it keeps with the base frozen). Imported by
``plan/planner.py`` (the twin), ``plan/params.py``, ``plan/activations.py``, ``plan/transients.py``,
``plan/memory.py``, ``plan/traffic.py``, ``plan/search.py`` and ``plan/estimate.py``; imports ``models/``
(config mapping), ``parallel.comm`` (parameter shapes, closed forms) and ``plan/layout.py`` only
(``moe.py`` also ``plan/params.grad_flow``).
"""
