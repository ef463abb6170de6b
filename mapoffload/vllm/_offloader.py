"""The device path: the decoder layers vLLM is told to offload stay on the mapping.

vLLM offloads weights through its offloader (``vllm.model_executor.offloader``):
``make_layers`` hands every decoder layer to ``get_offloader().wrap_modules``
as it is built, and its UVA offloader (``--cpu-offload-gb``) copies the first
layers' weights into pinned host memory until the amount is reached. With the
``mapoffload`` load format, :class:`MapoffloadOffloader` is the offloader
while the loader builds the model: it takes the first layers the same way
(``offload_layers``, or vLLM's ``--cpu-offload-gb`` amount in whole layers)
and moves their (still empty) parameters to the host so they never take device memory.
The loader binds those parameters to the mapping, vLLM's own loader fills the
rest onto the device, and a :class:`~mapoffload.LayerwiseOffloadManager` per
stack streams the offloaded layers to the device each forward through the
copier (pinned staging ring, ``prefetch_layers`` ahead, released after use).
On vLLM's CPU backend the tests' switch ``MAPOFFLOAD_VLLM_CPU_TWIN=1`` runs that
very pipeline on the CPU. What to offload, and every refusal, is decided in
:mod:`._options` (:meth:`~._options.LoaderOptions.plan`).

vLLM's CUDA graphs would capture one forward's slot buffers (the manager
gives each layer buffers of its own per load), so the path needs
``enforce_eager``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from .._log import format_bytes, logger
from ..memory.regions import tensor_bytes
from ._errors import VllmLoadError
from ._options import OffloadRequest

if TYPE_CHECKING:
    from ..hf.offload import OffloadHandle

__all__ = ["LayerTaker", "OffloadRequest", "check_still_mapped", "installed", "make_offloader",
           "note_shortfall", "offloaded_names", "refuse_derived_weights", "start_managers"]


class LayerTaker:
    """What :class:`MapoffloadOffloader` does with the layers ``make_layers`` hands it (no vLLM here):
    takes the first ones, as vLLM's UVA offloader does (``request.layers`` of them, or layers until
    ``request.max_bytes`` is reached), and moves their (still empty) parameters to the host."""

    def __init__(self, request: OffloadRequest) -> None:
        self.request = request
        self.stacks: list[list[torch.nn.Module]] = []  # the layers taken, per make_layers call
        self.layers = 0
        self.bytes = 0

    def _wants(self) -> bool:
        if self.request.layers is not None:
            return self.layers < self.request.layers
        return self.bytes < (self.request.max_bytes or 0)

    def wrap(self, modules_generator) -> list[torch.nn.Module]:  # noqa: ANN001
        modules, taken = [], []
        for module in modules_generator:  # one at a time: a taken layer leaves the device before the next
            params = list(module.parameters())
            if params and self._wants():
                self.layers += 1
                self.bytes += sum(tensor_bytes(p) for p in params)
                for p in params:  # (untouched host pages: no memory until the loader binds them)
                    if p.device.type != "cpu":
                        p.data = torch.empty_like(p.data, device="cpu")
                taken.append(module)
            modules.append(module)
        if taken:
            self.stacks.append(taken)
        return modules


def make_offloader(request: OffloadRequest) -> Any:
    """A ``MapoffloadOffloader``: a vLLM ``BaseOffloader`` (the class is made here, over vLLM's) whose
    ``wrap_modules`` is a :class:`LayerTaker`'s; ``.taker`` says what it took."""
    from vllm.model_executor.offloader.base import BaseOffloader

    class MapoffloadOffloader(BaseOffloader):
        """Takes the first layers ``make_layers`` builds and moves them to the host (see the module)."""

        supports_tower_offload = False  # decoder stacks only: the manager sequences a stack

        def __init__(self) -> None:
            self.taker = LayerTaker(request)

        def wrap_modules(self, modules_generator, prefix: str = "") -> list[torch.nn.Module]:  # noqa: ANN001
            return self.taker.wrap(modules_generator)

    return MapoffloadOffloader()


@contextlib.contextmanager
def installed(offloader: Any) -> Iterator[None]:
    """``offloader`` is vLLM's offloader while the model is built; the one before is put back after."""
    from vllm.model_executor.offloader.base import get_offloader, set_offloader

    previous = get_offloader()
    set_offloader(offloader)
    try:
        yield
    finally:
        set_offloader(previous)


def note_shortfall(taker: LayerTaker, architecture: str) -> None:
    """Warn when ``offload_layers`` asks more layers than the model builds here (this pipeline stage's
    decoder layers): all of them are offloaded, as vLLM's UVA offloader takes all for a large amount."""
    asked = taker.request.layers
    if asked is not None and taker.layers and taker.layers < asked:
        logger.warning("mapoffload: offload_layers=%d in model_loader_extra_config, but vLLM %s builds %d decoder "
                       "layers here: all %d are offloaded (nothing of them stays on the device)", asked,
                       architecture, taker.layers, taker.layers)


# Submodules whose weights vLLM's post-processing turns into other tensors once, at load (vLLM 0.32's
# MLAAttention.process_weights_after_loading: W_UK/W_UV from kv_b_proj).
DERIVED_FROM = ("kv_b_proj",)


def refuse_derived_weights(model: torch.nn.Module, taker: LayerTaker) -> None:
    """Raise when an offloaded layer holds a module whose post-processing derives tensors from its
    weights: on a device it would derive them from the scratch its hidden weights point at (silently
    wrong), and the copies it keeps would not follow the weights streamed each forward."""
    taken = {id(m) for stack in taker.stacks for layer in stack for m in layer.modules()}
    found = [f"{name} ({attr})" for name, module in model.named_modules() if id(module) in taken
             for attr in DERIVED_FROM
             if isinstance(getattr(module, attr, None), torch.nn.Module)
             and callable(getattr(module, "process_weights_after_loading", None))]
    if found:
        raise VllmLoadError(f"{', '.join(found[:4])}: vLLM's post-processing derives tensors from these weights once "
                            f"(MLA attention's W_UK/W_UV), which offloaded layers streamed each forward cannot "
                            f"keep; the mapoffload device path does not serve this architecture: load without "
                            f"offload_layers/--cpu-offload-gb ({taker.request.why})")


def offloaded_names(model: torch.nn.Module, taker: LayerTaker) -> dict[str, torch.nn.Parameter]:
    """The offloaded layers' parameters, by their names in ``model``."""
    ids = {id(p) for stack in taker.stacks for layer in stack for p in layer.parameters()}
    return {n: p for n, p in model.named_parameters() if id(p) in ids}


def check_still_mapped(model: torch.nn.Module, params: dict[str, torch.nn.Parameter],
                       before: dict[str, int]) -> None:
    """Raise when an offloaded parameter, as ``model`` holds it now, is not on a file mapping (a loader
    gave it memory of its own), moved, or is gone.

    Looked up by name in ``model``, not through the objects in ``params``: vLLM's post-processing may
    register a *new* Parameter in a layer (``replace_parameter``: the unquantized MoE method does on
    its first load), over the data it saw, which under :func:`~._convert.hidden` is the scratch,
    while the old object gets its mapped data back and would look fine.
    """
    from ..memory.regions import MappedRegions

    current = dict(model.named_parameters(remove_duplicate=False))
    names = [n for n in params if n in current]
    in_files = MappedRegions().classify([current[n].data for n in names])
    changed = [n for n in params if n not in current]
    changed += [n for n, in_file in zip(names, in_files)
                if not in_file or current[n].device.type != "cpu" or current[n].data_ptr() != before[n]]
    if changed:
        raise VllmLoadError(f"vLLM's loaders or post-processing replaced offloaded weights, or put them in memory "
                            f"of their own ({', '.join(changed[:4])}): they cannot stay on the mapping; load "
                            f"without offload_layers/--cpu-offload-gb")


def start_managers(model: torch.nn.Module, taker: LayerTaker) -> OffloadHandle:
    """One device-path manager per offloaded stack, hooks registered, each handed the request's
    :class:`~mapoffload.OffloadOptions` whole, in the handle every entry point returns (its
    ``managers`` by stack path); logs what streams how. When one fails to start, those started before
    it are closed."""
    from ..hf.offload import OffloadHandle
    from ..offload.manager import start_stacks

    options = taker.request.options
    asked = options.prefetch_layers
    # A layer prefetches the ones after it in its stack: no deeper than the stack (a deeper depth
    # would only size uncached buffers for layers that are not there).
    depths = [min(asked, max(0, len(stack) - 1)) for stack in taker.stacks]
    managers = start_stacks(model, [(stack, options if depth == asked else options.replace(prefetch_layers=depth))
                                    for stack, depth in zip(taker.stacks, depths)])
    handle = OffloadHandle(model, options)
    handle.managers.update(zip(_stack_paths(model, taker.stacks), managers))
    for stack, depth, manager in zip(taker.stacks, depths, managers):
        copier = manager.copier
        bounded = f" (prefetch_layers={asked}: {len(stack)} layers offloaded)" if depth < asked else ""
        logger.info("mapoffload: vLLM offload (%s): %d layers (%s) stay on the mapping and stream to %s "
                    "through the copier%s: %d staging slots of %s, prefetch depth %d%s", taker.request.why,
                    len(stack), format_bytes(sum(manager.parts.layer_bytes(i) for i in range(len(stack)))),
                    options.device,
                    " (the device pipeline's CPU twin)" if options.cpu_twin else "", copier.slots,
                    format_bytes(copier.staging_bytes), depth, bounded)
    return handle


def _stack_paths(model: torch.nn.Module, stacks: list[list[torch.nn.Module]]) -> list[str]:
    """Each stack's name: the path of the module holding its layers (``model.layers``), as a summary
    names a stack; a stack whose layers are not found in ``model`` is named by its place."""
    names = {id(m): name for name, m in model.named_modules()}
    paths = []
    for k, stack in enumerate(stacks):
        first = names.get(id(stack[0])) if stack else None
        paths.append(first.rpartition(".")[0] if first else f"stack {k}")
    return paths
