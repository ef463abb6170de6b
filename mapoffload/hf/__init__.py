"""Hugging Face integration: transformers models (and diffusers pipelines)
loaded on the file mapping and offloaded in one call.

``import mapoffload`` does not import this package; ``mapoffload.from_pretrained``,
``mapoffload.offload``, ``mapoffload.pipeline_from_pretrained`` and
``mapoffload.offload_pipeline`` do, lazily. transformers and diffusers are imported
only when a function that needs them is called (``pip install ".[hf]"`` from the source tree).
"""

from __future__ import annotations

from ..conversion import ConversionWriteError
from ._extras import INSTALL_HINT, MissingExtraError
from .blocks import find_block_lists
from .diffusers import load_pipeline, offload_pipeline, pipeline_from_pretrained
from .offload import OffloadHandle, OffloadRow, offload
from .transformers import KeyMismatchError, from_pretrained, load_pretrained

__all__ = [
    "ConversionWriteError",
    "INSTALL_HINT",
    "KeyMismatchError",
    "MissingExtraError",
    "OffloadHandle",
    "OffloadRow",
    "find_block_lists",
    "from_pretrained",
    "load_pipeline",
    "load_pretrained",
    "offload",
    "offload_pipeline",
    "pipeline_from_pretrained",
]
