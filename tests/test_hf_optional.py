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
