"""The Hugging Face integration stays optional: importing mapoffload never
imports transformers, diffusers or torch; a missing extra is a clear error."""

from __future__ import annotations

import sys

import pytest

from child import run_python


def test_import_mapoffload_imports_no_hf_library():
    proc = run_python(
        "import sys, mapoffload; print(sorted(m for m in ('torch', 'transformers', 'diffusers') if m in sys.modules))"
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stderr


def test_lazy_names_resolve():
    import mapoffload

    assert callable(mapoffload.from_pretrained) and callable(mapoffload.offload)
    assert {"from_pretrained", "offload"} <= set(mapoffload.__all__)
    from mapoffload.offload import LayerwiseOffloadManager  # the submodule still imports

    assert LayerwiseOffloadManager is mapoffload.LayerwiseOffloadManager


def test_missing_transformers_names_the_extra(monkeypatch, tmp_path):
    pytest.importorskip("torch")
    import mapoffload
    from mapoffload.hf import MissingExtraError

    # A None entry in sys.modules makes `import transformers` fail as if it
    # were not installed.
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(MissingExtraError, match=r'pip install "\.\[hf\]" in the mapoffload source tree'):
        mapoffload.from_pretrained(object, tmp_path, device="cpu")


@pytest.mark.parametrize("found, refused", [
    ("5.10.0", True), ("5.18.2", True), ("5.19.0", False), ("5.25.0", False), ("5.99.1.dev0", False),
    ("6.0.0", True), ("6.0.0rc1", True),
])
def test_a_transformers_outside_the_supported_range_is_refused_by_name(monkeypatch, tmp_path, found, refused):
    """The load drives transformers' own loader, whose internals move between minor versions: outside the
    range CI runs (pyproject.toml's), a load is refused, naming the range, never possibly wrong."""
    pytest.importorskip("transformers")
    import importlib.metadata

    from mapoffload.hf import MissingExtraError
    from mapoffload.hf._extras import require

    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda n: found if n == "transformers" else real(n))
    if refused:
        with pytest.raises(MissingExtraError, match=rf"supports transformers>=5\.19,<6; transformers {found} is"):
            require("transformers", "mapoffload.from_pretrained")
    else:
        assert require("transformers", "mapoffload.from_pretrained").__name__ == "transformers"


def test_the_supported_transformers_range_is_the_one_pyproject_states():
    tomllib = pytest.importorskip("tomllib")
    from conftest import SOURCE_ROOT
    from mapoffload.hf._extras import TRANSFORMERS_SPEC

    with open(SOURCE_ROOT / "pyproject.toml", "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    for name in ("hf", "diffusers", "test"):
        assert TRANSFORMERS_SPEC in extras[name], (name, extras[name])


@pytest.mark.parametrize("first", [
    "import mapoffload.offload",
    "from mapoffload.offload import LayerwiseOffloadManager",
    "import mapoffload; mapoffload.offload",
    "import mapoffload.hf.offload",
])
def test_mapoffload_offload_stays_the_function_whatever_is_imported_first(first):
    import subprocess
    import sys

    code = (f"{first}\nimport mapoffload, mapoffload.offload\nfrom mapoffload import offload\n"
            "import mapoffload.hf\n"
            "assert callable(mapoffload.offload) and mapoffload.offload is offload is mapoffload.hf.offload, "
            "mapoffload.offload\n"
            "assert mapoffload.LayerwiseOffloadManager.__module__ == 'mapoffload.offload'\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/")


def test_diffusers_without_accelerate_names_it(monkeypatch):
    # diffusers imports set_module_tensor_to_device from accelerate only when it is
    # installed; the hooks used to fail with an AttributeError from diffusers' module.
    pytest.importorskip("diffusers")
    from diffusers.models import model_loading_utils as mlu

    from mapoffload.hf._drive_diffusers import diffusers_hooks

    monkeypatch.delattr(mlu, "set_module_tensor_to_device", raising=False)
    with pytest.raises(ImportError, match=r"accelerate.*mapoffload\[diffusers\]"):
        diffusers_hooks()
