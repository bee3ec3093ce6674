"""Make ``import hybridpar`` work from a plain checkout (src layout, no install needed)."""

import sys
from pathlib import Path

_SRC = str(Path(__file__).resolve().parents[1] / "src")
if _SRC not in sys.path:
    sys.path.insert(0, _SRC)
