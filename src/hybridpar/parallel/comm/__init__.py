"""Communication: autograd-aware collectives on explicit groups, ``CommStats`` counting the
bytes of every collective (ours, DTensor's, FSDP2's), and the closed forms of a training step.

The lowest room of ``parallel/``: imports torch only.
"""
