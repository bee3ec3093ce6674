"""The transformers versions hybridpar accepts (models/hf/versions.py): mixers switched onto our
cores need >= 5.23, where transformers' own Mamba2 forward agrees with ours; older ones warn."""

from __future__ import annotations

import warnings

import pytest

from hybridpar.config_rules import Notice
from hybridpar.models.hf import versions
from hybridpar.models.hf.mixers.mamba2 import bridged_mixers, install_mamba_core
from tests.models.hf.hybrid_models import build_hybrid


@pytest.mark.parametrize("version, old", [("5.17.0", True), ("5.22.9", True), ("4.57.1", True), ("5.23.0", False),
                                          ("5.24.0.dev0", False), ("5.30.0rc1", False), ("6.0.0", False)])
def test_too_old_reads_the_release(version, old):
    assert versions.too_old(version) is old


def test_the_installed_transformers_is_new_enough():
    # the suite's pin (constraints.txt) must stay inside what pyproject.toml declares
    assert not versions.too_old(), versions.installed()


def test_an_old_transformers_refuses_switched_mixers_before_touching_them(monkeypatch):
    model = build_hybrid("bamba")
    monkeypatch.setattr(versions, "installed", lambda: "5.17.0")
    with pytest.raises(ValueError, match=r"runs on hybridpar's core only with transformers>=5\.23 \(found 5\.17\.0\).*"
                                         r"pip install 'transformers>=5\.23'\.$"):
        install_mamba_core(model)
    assert not bridged_mixers(model)  # nothing switched
    monkeypatch.setattr(versions, "installed", lambda: "5.24.0")
    assert install_mamba_core(model)


def test_an_old_transformers_warns_once():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        versions.warn_if_old("5.10.0")
        versions.warn_if_old("5.10.0")
        versions.warn_if_old("5.24.0")
    assert [(w.category, str(w.message).split(";")[0]) for w in seen] == [
        (Notice, "transformers 5.10.0 is older than 5.23, the oldest hybridpar is tested with")]
