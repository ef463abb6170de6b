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
