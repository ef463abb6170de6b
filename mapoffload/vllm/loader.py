"""The ``mapoffload`` load format: vLLM serves straight from the checkpoint's mapping.

``LLM(model=FOLDER, load_format="mapoffload")`` or ``vllm serve FOLDER
--load-format mapoffload``. vLLM builds its model as always; then, instead of
copying every weight into memory of its own, each parameter becomes a view of
the checkpoint file (where vLLM keeps a tensor unchanged) or of a mapped
conversion folder (what vLLM builds: see :mod:`._convert`). Options go through
``model_loader_extra_config``, read, checked and refused in one place, :mod:`._options`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

import torch

from ..loading.decide import decide
from ..conversion.code_key import class_code
from ..loading.files import NotLocalError, files_bytes, looks_remote, vllm_files
from .._log import format_bytes, logger
from ..loading.checkpoint import keep_checkpoint_mapped
from ..memory.regions import tensor_bytes
from ._compute import PLAIN, VNNI, mapped_layout, mapped_linear, packed_layers
from ._convert import Bound, bind_mapped, conversion_key, hidden
from ._errors import VllmLoadError, VllmVersionError
from ._offloader import check_still_mapped, installed, make_offloader, offloaded_names, note_shortfall, \
    refuse_derived_weights, start_managers
from ._options import EngineFacts, EnginePlan, LoaderOptions
from ._postprocess import PostProcessed
from ._stream import stream_layers

TESTED = ((0, 32), (0, 33))  # vLLM versions from the first (inclusive) to the second (exclusive)


def check_version(version: str) -> None:
    """Raise :class:`VllmVersionError` when ``version`` is outside :data:`TESTED`."""
    parts = []
    for piece in version.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    low, high = TESTED
    if not low <= tuple(parts) < high:
        raise VllmVersionError(
            f"the mapoffload load format is tested with vLLM >={low[0]}.{low[1]},<{high[0]}.{high[1]}; "
            f"this is vLLM {version}: install a tested vLLM, or load with load_format='auto'")


def _local_folder(model: str) -> str:
    if not os.path.isdir(model):
        if looks_remote(model):
            raise NotLocalError(model, what="the mapoffload load format", kind="folder")
        raise VllmLoadError(f"{model}: the mapoffload load format maps a local folder; download the model "
                            f"first (e.g. `hf download {model} --local-dir DIR`) and serve DIR")
    return model


def _safetensors_files(folder: str) -> list[str]:
    """The files vLLM's safetensors loading reads in ``folder`` (:func:`vllm_files`); a folder of PyTorch
    files only is refused naming one."""
    if os.path.isdir(folder) and not any(e.endswith(".safetensors") for e in os.listdir(folder)):
        others = sorted(e for e in os.listdir(folder) if e.endswith((".bin", ".pt", ".pth")))
        if others:
            raise VllmLoadError(f"{os.path.join(folder, others[0])}: the mapoffload load format maps safetensors "
                                "checkpoints only (convert the folder, or load with load_format='auto')")
    return vllm_files(folder)  # a missing shard, a malformed index: said as they are


def _cpu_kernels() -> list:
    """What decides the layouts vLLM's CPU kernels prepack weights in after loading (its MoE experts: one
    for AMX, another without): a conversion holds those bytes, so a folder shared by hosts of two kinds
    (NFS, a shared cache_dir) gives each its own. torch's CPU capability and its AMX answer."""
    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return [torch.backends.cpu.get_cpu_capability(), bool(amx()) if callable(amx) else None]


class _Loader:
    """Mixin body of :class:`MapoffloadModelLoader` (kept apart so the module imports without vLLM)."""

    def _setup(self, load_config) -> None:  # noqa: ANN001
        import vllm

        check_version(vllm.__version__)
        self.options = LoaderOptions.parse(load_config.model_loader_extra_config)

    def download_model(self, model_config) -> None:  # noqa: ANN001
        _safetensors_files(_local_folder(model_config.model))

    def _plan(self, vllm_config, model_config) -> EnginePlan:  # noqa: ANN001
        """The load device and what it offloads, as the options decide for this engine (every refusal is there)."""
        return self.options.plan(EngineFacts.of(vllm_config, model_config, self.load_config))

    def _keep(self, folder: str, architecture: str) -> tuple[bool, str]:
        keep = self.options.keep_mapping
        if keep is None and self.options.stream_layers:
            return True, "stream_layers=true in model_loader_extra_config"
        decision = decide(keep, weight_bytes=lambda: files_bytes(_safetensors_files(folder)),
                          component=f"vLLM {architecture}", gate=keep_checkpoint_mapped)
        if decision.decided_by == "caller":
            return decision.keep_mapping, f"keep_mapping={str(keep).lower()} in model_loader_extra_config"
        return decision.keep_mapping, ("host copies would not fit (the gate)" if decision.keep_mapping
                                       else "host copies fit (the gate)")

    def _copy(self, vllm_config, model_config, prefix: str, pack: bool, layout: str):  # noqa: ANN001
        from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

        config = dataclasses.replace(self.load_config, load_format="safetensors", model_loader_extra_config={})
        with mapped_linear(not pack, layout=layout):  # vLLM's loader computing as ours would
            return DefaultModelLoader(config).load_model(vllm_config=vllm_config, model_config=model_config,
                                                          prefix=prefix)

    @staticmethod
    def _layout(linear: str, architecture: str) -> str:
        """How linear layers computed from the weights' rows run (``_compute.py``): VNNI only when
        ``linear="vnni"`` asks and the CPU runs vLLM's small-GEMM kernel (else plain, logged)."""
        if linear != "vnni":
            return PLAIN
        layout = mapped_layout()
        if layout != VNNI:
            logger.warning("mapoffload: vLLM %s: linear='vnni', but vLLM's small-GEMM kernel does not run on this "
                           "CPU (needs AVX-512 BF16 and vLLM's weight_packed_linear): computed from the plain weights",
                           architecture)
        return layout

    def _key(self, files: list[str], model: torch.nn.Module, model_config, vllm_config, architecture: str,
             pack: bool, only: set[str] | None = None, gemm: str = PLAIN) -> str:  # noqa: ANN001
        import vllm

        parallel = vllm_config.parallel_config
        try:
            from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank

            ranks = {"tp": [get_tensor_model_parallel_rank(), parallel.tensor_parallel_size],
                     "pp": [get_pp_group().rank_in_group, parallel.pipeline_parallel_size]}
        except (AssertionError, RuntimeError, AttributeError):
            ranks = {"tp": [0, parallel.tensor_parallel_size], "pp": [0, parallel.pipeline_parallel_size]}
        shapes = [[n, list(p.shape), str(p.dtype)] for n, p in model.named_parameters()]
        return conversion_key(files, architecture=architecture, dtype=model_config.dtype,
                              hf_config=model_config.hf_config,
                              extra={"vllm": vllm.__version__, **ranks, "cpu": _cpu_kernels(),
                                     # an out-of-tree model (vLLM's ModelRegistry): its code, as a user's class's
                                     "code": class_code(type(model), None, []),
                                     "quantization": model_config.quantization,
                                     "pack": pack, "gemm_layout": gemm, "parameters": shapes,
                                     **({} if only is None else {"offloaded": sorted(only)})})

    def get_all_weights(self, model_config, model):  # noqa: ANN001
        """The checkpoint's tensors, as views of its mapping, for vLLM's ``reload_weights()`` from disk (the
        folder the engine serves, or ``weights_path``): vLLM loads them into the bound weights as its own
        reload does (copy-on-write: the files are never written). Everything is resolved and mapped here,
        before vLLM moves the layers' weights aside: a refusal (a folder of PyTorch files, a hub id, a
        missing shard) leaves the engine serving what it served."""
        from ..loading.read import read_files

        return iter(read_files(_safetensors_files(_local_folder(model_config.model))).items())

    def load_weights(self, model: torch.nn.Module, model_config) -> Bound:  # noqa: ANN001
        """Bind an already built ``model``'s parameters to the mapping (vLLM's in-place load API)."""
        from vllm.config import get_current_vllm_config

        handle = getattr(model, "mapoffload_handle", None)
        managers = list(handle.managers.values()) if handle is not None else []
        if managers:
            raise VllmLoadError(f"reloading weights in place: {len(managers)} layer stack(s) of this model are "
                                f"streamed by mapoffload ({managers[0]!r}), whose stores are the weights bound now; "
                                f"start a new engine to load other weights")
        packed = packed_layers(model)
        if packed:
            raise VllmLoadError(f"reloading weights in place: {len(packed)} linear layers ({packed[0]}, ...) compute "
                                f"from weights packed for vLLM's small-GEMM kernel (VNNI), which a checkpoint's plain "
                                f"rows cannot refill; start a new engine (or load without linear='vnni')")

        bound, cache = self._bind(model, model_config, get_current_vllm_config(), model.__class__.__name__,
                                  pack=False)
        _finish(bound, cache)
        return bound

    def _bind(self, model, model_config, vllm_config, architecture: str, pack: bool,
              only: set[str] | None = None, gemm: str = PLAIN):  # noqa: ANN001
        from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

        folder = _local_folder(model_config.model)
        files = _safetensors_files(folder)

        def check_loaded(m: torch.nn.Module, loaded: set[str] | None) -> None:
            if loaded is not None:  # vLLM's own check: every parameter came from the checkpoint
                DefaultModelLoader.track_weights_loading(self, m, loaded, quantized=False)  # type: ignore[arg-type]

        key = self._key(files, model, model_config, vllm_config, architecture, pack, only, gemm)
        return bind_mapped(model, files, key=key, cache_dir=self.options.cache_dir, folder=folder,
                           check_loaded=check_loaded, only=only)

    def load_model(self, vllm_config, model_config, prefix: str = "") -> torch.nn.Module:  # noqa: ANN001
        """Build vLLM's model, bind its weights to the mapping (or copy them, as asked or as the gate
        says), then let vLLM process them: packed for the CPU's GEMM library, or computed mapped."""
        from vllm.model_executor.model_loader.utils import process_weights_after_loading
        from vllm.utils.torch_utils import set_default_torch_dtype

        from ._logging import share_vllm_handlers

        share_vllm_handlers()  # vLLM configures its logging after the plugins load
        plan = self._plan(vllm_config, model_config)
        device, request = plan.device, plan.request
        folder = _local_folder(model_config.model)
        _safetensors_files(folder)  # safetensors only, or one line naming the others
        architecture = (model_config.architectures or ["model"])[0]
        if request is not None:
            return self._load_offloaded(vllm_config, model_config, prefix, device, request, architecture)
        keep, why = self._keep(folder, architecture)
        linear = self.options.linear_for(keep)
        pack = linear == "packed"
        layout = self._layout(linear, architecture)
        vnni = "packed for vLLM's small-GEMM kernel (VNNI)"
        compute = ("packed for the CPU GEMM library (owned copies)" if pack else
                   "computed from the mapped weights" + (f", {vnni} in the conversion folder" if layout == VNNI else ""))
        if not keep:
            model = self._copy(vllm_config, model_config, prefix, pack, layout)
            copied = ("packed for the CPU GEMM library" if pack else
                      f"{vnni}, in memory" if layout == VNNI else "computed from the plain rows")
            logger.info("mapoffload: vLLM %s copied into memory as vLLM's loader does (%s); linear layers %s",
                        architecture, why, copied)
            return model
        with set_default_torch_dtype(model_config.dtype), device:
            model = self.create_model(vllm_config=vllm_config, model_config=model_config, prefix=prefix)
        bound, cache = self._bind(model, model_config, vllm_config, architecture, pack, gemm=layout)
        before = {name: tensor_bytes(p) for name, p in model.named_parameters()}
        post = PostProcessed(cache)
        # VNNI packs weights in place of the checkpoint's: kept only where they are mapped (in the folder).
        layout = layout if not bound.copied_names else PLAIN
        try:
            with post.watching(model) if not bound.copied_names else contextlib.nullcontext(), \
                    mapped_linear(not pack, layout=layout, stored=post.stored):
                process_weights_after_loading(model, model_config, device)
        except BaseException:
            cache.abandon()
            raise
        _finish(bound, cache)
        bound.recount(model)
        after = {name: p.numel() for name, p in model.named_parameters()}
        bound.packed = sum(n for name, n in before.items() if not after.get(name))  # handed to the GEMM library
        stream = self.options.streams(linear)
        model.mapoffload_handle = stream_layers(model, self.options.stream_options()) if stream else None
        where = (f"{'reused' if bound.reused else 'written to'} {bound.folder}" if bound.folder
                 else "no conversion needed")
        packed = f", {format_bytes(bound.packed)} packed into the GEMM library's own copies" if bound.packed else ""
        logger.info("mapoffload: vLLM %s kept on the mapping (%s): %s mapped from the checkpoint, %s converted "
                    "(mapped; %s), %s copied%s; linear layers %s", architecture, why, format_bytes(bound.mapped),
                    format_bytes(bound.converted), where, format_bytes(bound.copied), packed, compute)
        model.mapoffload_bound = bound
        return model.eval()

    def _load_offloaded(self, vllm_config, model_config, prefix: str, device: torch.device, request,
                        architecture: str) -> torch.nn.Module:  # noqa: ANN001
        """The device path (see :mod:`._offloader`): the offloaded layers mapped and streamed by the
        copier, everything else loaded onto the device by vLLM's own loader."""
        from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

        from vllm.model_executor.model_loader.utils import process_weights_after_loading
        from vllm.utils.torch_utils import set_default_torch_dtype

        offloader = make_offloader(request)
        with installed(offloader), set_default_torch_dtype(model_config.dtype), device:
            model = self.create_model(vllm_config=vllm_config, model_config=model_config, prefix=prefix)
        offloaded = offloaded_names(model, offloader.taker)
        refuse_derived_weights(model, offloader.taker)
        note_shortfall(offloader.taker, architecture)
        if not offloaded:
            raise VllmLoadError(f"vLLM {architecture} builds no decoder layers through make_layers ({request.why}): "
                                f"nothing to offload; load without it")
        bound, cache = self._bind(model, model_config, vllm_config, architecture, False, set(offloaded))
        try:
            if bound.reused:  # the binding ran no loader: vLLM's fills the rest, as it does (onto the device)
                config = dataclasses.replace(self.load_config, load_format="safetensors",
                                             model_loader_extra_config={})
                with hidden(offloaded.values(), torch.device("cpu")):
                    DefaultModelLoader(config).load_weights(model, model_config)
            before = {n: p.data_ptr() for n, p in offloaded.items()}
            # On a device, vLLM's post-processing would copy host weights there and back (owned copies):
            # the offloaded ones are hidden from it. On the CPU they stay in place, computed unpacked.
            with hidden(offloaded.values(), device) if device.type != "cpu" else contextlib.nullcontext(), \
                    mapped_linear(device.type == "cpu"):
                process_weights_after_loading(model, model_config, device)
            check_still_mapped(model, offloaded, before)
        except BaseException:
            cache.abandon()
            raise
        _finish(bound, cache)
        bound.recount(model)
        model.mapoffload_handle = start_managers(model, offloader.taker)
        model.mapoffload_bound = bound
        logger.info("mapoffload: vLLM %s: %d offloaded layers kept on the mapping (%s): %s mapped from the "
                    "checkpoint, %s converted (%s); the rest, %s, loaded onto %s by vLLM's loader", architecture,
                    offloader.taker.layers, request.why, format_bytes(bound.mapped), format_bytes(bound.converted),
                    bound.folder or "no conversion needed", format_bytes(bound.copied), device)
        return model.eval()


def _finish(bound: Bound, cache) -> None:  # noqa: ANN001
    """Commit a conversion written by this start (a reused one is already whole)."""
    if not cache.reused and not bound.copied_names:
        cache.commit()
    if cache.reused or (not bound.copied_names and cache.tensors):
        bound.folder = cache.path


def make_loader_class() -> type:
    """The loader class, built over vLLM's ``BaseModelLoader`` (imported only here)."""
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    class MapoffloadModelLoader(_Loader, BaseModelLoader):
        """vLLM model loader for ``load_format="mapoffload"`` (see :mod:`mapoffload.vllm.loader`)."""

        def __init__(self, load_config) -> None:  # noqa: ANN001
            BaseModelLoader.__init__(self, load_config)
            self._setup(load_config)

    return MapoffloadModelLoader
