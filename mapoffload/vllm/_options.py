"""The mapoffload load format's options, read from vLLM's ``model_loader_extra_config``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .._checks import folder_problem, user_path
from ._errors import VllmLoadError

KEYS = {
    "keep_mapping": "true keeps every weight on the checkpoint's mapping, false copies as vLLM's loader "
                    "does, absent asks the host-copy gate",
    "pack": "true packs linear weights for the CPU's GEMM library (an owned copy, faster), false computes "
            "from the mapped weights; absent packs exactly when the weights are copies",
    "vnni": "true (with pack false or absent) packs each bf16 linear weight for vLLM's small-GEMM kernel into the "
            "mapped conversion folder and computes from there: about the speed of packed weights, sums that "
            "differ from oneDNN's in the last bit (needs AVX-512 BF16; elsewhere computed plain, logged); false or "
            "absent computes from the checkpoint's rows (oneDNN's sums, bit for bit)",
    "stream_layers": "true streams the decoder layers through the page cache under the host's budget (a "
                     "fixed set stays cached, the rest is read and let go each forward), false never; absent "
                     "streams whenever weights are mapped and computed unpacked",
    "cache_dir": "the folder conversions are written to, made if missing (default: beside the checkpoint, as for "
                 "from_pretrained; ~ is the home folder)",
    "offload_layers": "how many decoder layers (the first ones, as vLLM's --cpu-offload-gb takes them) stay on the "
                      "mapping and are streamed to the device by the copier each forward (absent: vLLM's "
                      "--cpu-offload-gb amount, else none)",
    "prefetch_layers": "how many offloaded layers ahead the copier streams (default 1)",
    "cpu_twin": "true on vLLM's CPU backend runs the offloaded layers through the device pipeline's CPU twin "
                "(copied through the copier into separate buffers each forward, as on a GPU)",
}


@dataclass(frozen=True)
class LoaderOptions:
    """What ``model_loader_extra_config`` asked for (each validated once, here)."""

    keep_mapping: bool | None = None
    pack: bool | None = None
    cache_dir: str | None = None
    stream_layers: bool | None = None
    offload_layers: int | None = None
    prefetch_layers: int = 1
    cpu_twin: bool = False
    prefetch_asked: bool = False  # prefetch_layers was given (not the default)
    vnni: bool = False  # linear weights computed from the mapping packed for vLLM's small-GEMM kernel

    @classmethod
    def parse(cls, extra: Any) -> LoaderOptions:
        """Options from vLLM's extra loader config (a dict; None or {} for the defaults).

        Raises
        ------
        VllmLoadError
            Not a dict, an unknown key (the known ones are listed), a value of the wrong type, or a
            ``cache_dir`` that is a file or lies under one (``~`` in it is expanded).
        """
        if extra is None:
            extra = {}
        if not isinstance(extra, dict):
            raise VllmLoadError(f"model_loader_extra_config must be a dict for load format 'mapoffload', "
                                f"got {type(extra).__name__}")
        unknown = sorted(set(extra) - set(KEYS))
        if unknown:
            known = "; ".join(f"{k}: {v}" for k, v in KEYS.items())
            raise VllmLoadError(f"model_loader_extra_config: unknown key(s) {unknown} for load format "
                                f"'mapoffload' (it takes {known})")
        for key in ("keep_mapping", "pack", "stream_layers", "cpu_twin", "vnni"):
            if extra.get(key) is not None and not isinstance(extra[key], bool):
                raise VllmLoadError(f"model_loader_extra_config[{key!r}] must be true, false or absent, "
                                    f"got {extra[key]!r}")
        cache_dir = extra.get("cache_dir")
        if cache_dir is not None:
            if not isinstance(cache_dir, str) or not cache_dir:
                raise VllmLoadError(f"model_loader_extra_config['cache_dir'] must be a folder path, got {cache_dir!r}")
            cache_dir = user_path(cache_dir, "cache_dir")  # "~/conv": no shell expanded it in the JSON
            # Checked here, before any weight is read: making it would fail with a bare FileExistsError or
            # NotADirectoryError out of vLLM's loader, after the model was built.
            problem = folder_problem(cache_dir)
            if problem is not None:
                raise VllmLoadError(f"model_loader_extra_config['cache_dir'] = {cache_dir!r} cannot hold the "
                                    f"conversion folders: {problem}; name a folder (it is made if missing)")
        for key, low in (("offload_layers", 1), ("prefetch_layers", 0)):
            value = extra.get(key)
            if value is not None and (type(value) is not int or value < low):
                raise VllmLoadError(f"model_loader_extra_config[{key!r}] must be a whole number >= {low} or absent, "
                                    f"got {value!r}")
        if extra.get("offload_layers") is not None and (extra.get("keep_mapping") is False or extra.get("pack")
                                                        or extra.get("stream_layers")):
            raise VllmLoadError("model_loader_extra_config: offload_layers keeps the offloaded layers mapped and "
                                "streams them through the copier; it cannot go with keep_mapping=false, pack=true "
                                "or stream_layers=true")
        if extra.get("keep_mapping") is False:  # vLLM's own loader and offloader: ours would be ignored
            for key, given in (("cpu_twin", extra.get("cpu_twin")), ("prefetch_layers",
                                                                     extra.get("prefetch_layers") is not None)):
                if given:
                    raise VllmLoadError(f"model_loader_extra_config[{key!r}] is for the layers the mapoffload load "
                                        f"format offloads; keep_mapping=false loads with vLLM's own loader and "
                                        f"offloader: leave {key} out (or keep_mapping unset)")
        if extra.get("vnni") and (extra.get("pack") or extra.get("offload_layers") is not None):
            raise VllmLoadError("model_loader_extra_config: vnni=true packs the linear weights computed from the "
                                "mapping for vLLM's small-GEMM kernel; it cannot go with pack=true (oneDNN's own "
                                "packing) or offload_layers (the device path computes plain)")
        if extra.get("stream_layers") and (extra.get("keep_mapping") is False or extra.get("pack")):
            raise VllmLoadError("model_loader_extra_config: stream_layers=true streams mapped weights computed "
                                "unpacked; it cannot go with keep_mapping=false or pack=true")
        prefetch = extra.get("prefetch_layers")
        return cls(extra.get("keep_mapping"), extra.get("pack"), cache_dir, extra.get("stream_layers"),
                   extra.get("offload_layers"), 1 if prefetch is None else prefetch, bool(extra.get("cpu_twin")),
                   prefetch is not None, bool(extra.get("vnni")))
