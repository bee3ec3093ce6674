"""Communication: autograd-aware collectives on explicit groups, ``CommStats`` counting the
bytes of every collective (ours, DTensor's, FSDP2's), and the closed forms of a training step
(``step.py``, over the per-unit parameter shapes of ``units.py``; under LoRA, where a gradient reaches:
``grad_flow.py``).

Imports torch and ``dims``; the closed forms also read ``models/`` (shapes) and ``context/``'s byte counts.
"""
