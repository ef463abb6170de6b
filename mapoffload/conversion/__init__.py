"""The conversion cache: tensors a loader *makes* (transformers' fused experts, a cast, fp8
dequantized; what vLLM stacks, pads and shards) written once into mapped safetensors folders that
later loads of the same checkpoint reuse.

:mod:`.cache` holds one folder (:class:`ConversionCache`), :mod:`.naming` names it and
chooses its root, :mod:`.writer` lays out its files, :mod:`.marks` removes what dead conversions
left. ``mapoffload.hf`` and ``mapoffload.vllm`` use it through the names below.
"""

from __future__ import annotations

from .cache import MANIFEST, PART_BYTES, ConversionCache, ConversionWriteError
from .naming import FORMAT, concrete_class, default_root, fingerprint
from .marks import sweep
from .writer import reserve_safetensors, write_safetensors

__all__ = [
    "FORMAT",
    "MANIFEST",
    "PART_BYTES",
    "ConversionCache",
    "ConversionWriteError",
    "concrete_class",
    "default_root",
    "fingerprint",
    "reserve_safetensors",
    "sweep",
    "write_safetensors",
]
