"""mapoffload inside vLLM: the ``mapoffload`` load format.

Installed beside vLLM, the package's ``vllm.general_plugins`` entry point
calls :func:`register` in every vLLM process, which registers the load
format; ``import mapoffload`` itself never imports vLLM. Then::

    vllm serve FOLDER --load-format mapoffload
    LLM(model=FOLDER, load_format="mapoffload",
        model_loader_extra_config={"keep_mapping": True})

See :mod:`mapoffload.vllm.loader` for what it does and
:mod:`mapoffload.vllm._options` for the options.
"""

from __future__ import annotations

from ._errors import VllmLoadError, VllmVersionError
from ._logging import share_vllm_handlers

LOAD_FORMAT = "mapoffload"

__all__ = ["LOAD_FORMAT", "VllmLoadError", "VllmVersionError", "register"]


def register() -> None:
    """Register the ``mapoffload`` load format with vLLM (idempotent). A vLLM outside the tested
    range still gets the format: choosing it raises :class:`VllmVersionError` naming both versions,
    so a mapoffload install never stops a vLLM that does not use it."""
    from vllm.model_executor.model_loader import register_model_loader

    from .loader import make_loader_class

    share_vllm_handlers()
    register_model_loader(LOAD_FORMAT)(make_loader_class())
