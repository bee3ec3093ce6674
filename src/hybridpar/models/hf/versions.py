"""The transformers versions hybridpar's transformers paths are proven on.

``pyproject.toml`` asks for ``transformers>=5.23`` and the suite pins 5.24 (``constraints.txt``).
An older transformers still arrives where pip does not resolve dependencies (``pip install
--no-deps`` over a GPU machine's packages, which carry 5.17). Measured there (the suite's
tests/models/hf on 5.17, 5.20, 5.22 and 5.23 over torch 2.13):

- transformers before 5.23 computes a different Mamba2 and Bamba forward on the same weights
  (relative difference 0.15-0.52 of the logits against hybridpar's exact core and against 5.23+);
- its LFM2 short conv takes other arguments before 5.21, and its RoPE in float64 mixes dtypes
  that ``hybridpar check`` then refuses to multiply.

So token mixers that hybridpar switches onto its cores (Mamba2 hybrids, gated DeltaNet, short
convolutions: their transformers forward stays for generation and is their reference) are refused
on such a version, and any other transformers model runs with one warning (its attention models
and Llama's throughput path ran there).
"""

from __future__ import annotations

import warnings

from hybridpar.config_rules import Notice

__all__ = ["OLDEST", "installed", "too_old", "require_for_mixers", "warn_if_old"]

OLDEST = (5, 23)
_WARNED: set[str] = set()


def installed() -> str:
    """The installed transformers version (``transformers.__version__``)."""
    import transformers

    return transformers.__version__


def _release(version: str) -> tuple[int, ...]:
    from packaging.version import Version  # a dependency of transformers

    return Version(version).release[:2]


def too_old(version: str | None = None) -> bool:
    """Whether ``version`` (default: the installed one) is older than ``OLDEST``."""
    return _release(version or installed()) < OLDEST


def _oldest() -> str:
    return ".".join(map(str, OLDEST))


def require_for_mixers(what: str, version: str | None = None) -> None:
    """``ValueError`` when transformers is older than ``OLDEST`` and ``what`` (e.g. "Mamba2 mixer
    'model.layers.0.mamba'") would be switched onto hybridpar's core (module docstring)."""
    version = version or installed()
    if too_old(version):
        raise ValueError(f"{what} runs on hybridpar's core only with transformers>={_oldest()} (found {version}): older "
                         "versions compute these mixers differently and take other arguments; pip install "
                         f"'transformers>={_oldest()}'.")


def warn_if_old(version: str | None = None) -> None:
    """One warning per process when transformers is older than ``OLDEST`` (module docstring)."""
    version = version or installed()
    if too_old(version) and version not in _WARNED:
        _WARNED.add(version)
        warnings.warn(f"transformers {version} is older than {_oldest()}, the oldest hybridpar is tested with; attention "
                      f"models run, hybrid token mixers are refused; pip install 'transformers>={_oldest()}'.", Notice,
                      stacklevel=2)
