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
