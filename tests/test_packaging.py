"""Packaging: installing never writes into the source tree."""

from __future__ import annotations

import os
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


def test_the_readme_installs_cpu_torch_first_and_links_the_options_fields():
    """The CPU-only torch line said "first" after `pip install .` (which had already installed torch), and
    "documented on the class ([docs/usage.md])" linked a page that never named OffloadOptions."""
    import dataclasses
    import re

    from mapoffload import OffloadOptions

    readme = (SOURCE_ROOT / "README.md").read_text()
    block = readme.split("```bash", 1)[1].split("```", 1)[0]
    lines = block.splitlines()
    cpu = next(i for i, line in enumerate(lines) if "download.pytorch.org/whl/cpu" in line)
    install = next(i for i, line in enumerate(lines) if line.startswith("pip install . "))
    assert cpu < install, block
    link = re.search(r"Its fields are documented on the class \(\[docs/usage\.md[^\]]*\]\(docs/usage\.md#([a-z-]+)\)",
                     readme)
    assert link, "the README links the options' fields to a section of docs/usage.md"
    usage = (SOURCE_ROOT / "docs" / "usage.md").read_text()
    heading = next(h for h in re.findall(r"^#+ (.+)$", usage, re.M)
                   if re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-") == link.group(1))
    section = usage.split(heading, 1)[1].split("\n## ", 1)[0]
    assert "OffloadOptions" in heading
    for f in dataclasses.fields(OffloadOptions):
        assert f"`{f.name}`" in section, f.name


def test_the_missing_extension_message_says_where_python_was_started():
    """'Run from the repository root, the current directory comes first' read as an instruction to run
    from the repository root, the opposite of what it meant."""
    from mapoffload._native import _missing_core_message

    source = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "mapoffload")
    text = _missing_core_message(source)  # the source folder, whichever mapoffload this test imported
    assert "Run from the repository root" not in text
    assert "Python was started in the repository root" in text and "Run it from another directory" in text
    assert "reinstall with `pip install .`" in _missing_core_message("/usr/lib/python3/site-packages/mapoffload")
