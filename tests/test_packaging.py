"""Packaging: installing never writes into the source tree."""

from __future__ import annotations

import pathlib

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

SOURCE_ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_build_folder_is_not_in_the_source_tree():
    # scikit-build-core's build-dir is relative to the source: a read-only
    # checkout could not be installed and two installs of one checkout would
    # share (and corrupt) it. Without it, each build uses a temporary folder.
    with open(SOURCE_ROOT / "pyproject.toml", "rb") as f:
        skbuild = tomllib.load(f)["tool"]["scikit-build"]
    assert "build-dir" not in skbuild, skbuild.get("build-dir")


def test_import_mapoffload_does_not_import_torch():
    from child import run_python

    proc = run_python("import sys, mapoffload; print('torch' in sys.modules)")
    assert proc.returncode == 0 and proc.stdout.strip() == "False", proc.stderr


def test_no_test_helper_module_shadows_an_installed_module():
    """pytest puts tests/ first on sys.path, so a helper module named like an installed package replaces it
    for everything the tests import: tests/kernels.py did so for the ``kernels`` package that transformers
    5.20+ imports (164 failures on the README's install, none where an older transformers was pinned)."""
    import importlib.machinery
    import sys

    tests = pathlib.Path(__file__).resolve().parent
    others = [p for p in sys.path if p and pathlib.Path(p).resolve() != tests]
    helpers = sorted(p.stem for p in tests.glob("*.py") if not p.stem.startswith("test_") and p.stem != "conftest")
    assert helpers, "no helper modules found: the test looks in the wrong place"
    shadowing = [name for name in helpers
                 if name in sys.stdlib_module_names or importlib.machinery.PathFinder.find_spec(name, others)]
    assert not shadowing, f"tests/ modules named like installed or standard modules: {shadowing}"
