"""Decoder layers streamed through the page cache inside a vLLM engine.

With the weights mapped and computed unpacked, a vLLM model is a plain
module over file pages: :class:`mapoffload.LayerwiseOffloadManager` with
``device="cpu"`` (in place: nothing moves, parameters stay the mapped tensors)
over each stack of decoder layers lets the process-wide page-cache
coordinator plan which layers stay cached under the host's budget (the
tightest cgroup cap) and read ahead and let go the rest around each forward.
Uncapped, the plan keeps every layer: the hooks only check.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .._log import logger
from ..hf.blocks import find_block_lists

if TYPE_CHECKING:
    from ..hf.offload import OffloadHandle
    from ..options import OffloadOptions


def stream_layers(model: torch.nn.Module, options: OffloadOptions) -> OffloadHandle:
    """One in-place manager per stack of ``model`` (each handed ``options`` whole: in place on the
    CPU, :meth:`~._options.LoaderOptions.stream_options`) with its forward hooks registered, in the
    handle every entry point returns (its ``managers`` by stack path). When one fails to start, those
    started before it are closed."""
    from ..hf.offload import OffloadHandle
    from ..offload.manager import start_stacks

    paths = [path for path, _ in find_block_lists(model)]
    handle = OffloadHandle(model, options)
    handle.managers.update(zip(paths, start_stacks(model, [(path, options) for path in paths])))
    for path, manager in handle.managers.items():
        logger.info("mapoffload: vLLM %s: %d layers streamed through the page cache (%s)", path,
                    len(manager.layers), manager)
    return handle
