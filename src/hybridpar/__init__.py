"""hybridpar: exact context, tensor and data parallelism for hybrid Mamba2/attention LMs.

The public names (``hybridpar.HybridLM``, ``hybridpar.parallelize``, ...) live in
``hybridpar.api`` and load on first use, so ``import hybridpar`` stays cheap and no module
below imports this package's namespace.

Packages, lowest floor first; a module imports only from its own floor or the ones below it
(``tests/test_layout.py`` holds this):

- ``yaml12``, ``config_rules``, ``strict_json``: YAML reading, the value rules of config keys, JSON
  read strictly (a key written twice is refused);
- ``models/`` and ``data/``: single-device model code and packed batches (no process group);
- ``parallel/``: TP/SP, CP, FSDP2, applied from outside the model;
- ``config``: the run configuration;
- ``train/``: the trainer, loss, checkpoints and the run directory;
- ``plan/``: the planner;
- ``api``, ``generate``, ``launch``, ``environment``, ``cli``, ``worker``: the public API and the command line
  (``worker``: one rank of a job; ``environment``: the variables it reads, checked first).
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"


def __getattr__(name: str):
    api = importlib.import_module("hybridpar.api")
    if name in api.__all__:
        return getattr(api, name)
    raise AttributeError(f"module 'hybridpar' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + importlib.import_module("hybridpar.api").__all__)
