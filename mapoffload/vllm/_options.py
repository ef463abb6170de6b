"""The mapoffload load format's options: read from vLLM's ``model_loader_extra_config``, checked
and refused here, and only here.

:meth:`LoaderOptions.parse` reads the extra config (every key's value, the keys that cannot go
together); :meth:`LoaderOptions.plan` adds what the engine's configuration
says (:class:`EngineFacts`: the device, ``--cpu-offload-gb``, ``--enforce-eager``, ...) and
returns what to load, with the :class:`~mapoffload.OffloadOptions` the device path hands its
managers whole. Each refuses everything it finds at once: one :class:`VllmLoadError` naming
every key (and engine setting) that takes part, also in ``.keys``.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from typing import Any

import torch

from .._checks import check_cache_dir
from .._env import EnvSettingError
from .._log import logger
from ..options import OffloadOptions
from ._errors import VllmLoadError

__all__ = ["ENV_CPU_TWIN", "EngineFacts", "EnginePlan", "KEYS", "LINEAR", "LoaderOptions",
           "OffloadRequest"]

KEYS = {
    "keep_mapping": "true keeps every weight on the checkpoint's mapping, false copies as vLLM's loader "
                    "does, absent asks the host-copy gate",
    "linear": "how linear layers compute: 'packed' (packed for the CPU's GEMM library, oneDNN: an owned copy, "
              "faster), 'mapped' (computed from the mapped weights: oneDNN's sums, bit for bit), 'vnni' (each bf16 "
              "linear weight packed for vLLM's small-GEMM kernel into the mapped conversion folder and computed "
              "from there: about the speed of packed weights, sums that differ from oneDNN's in the last bit; needs "
              "AVX-512 BF16, elsewhere computed plain, logged); absent packs exactly when the weights are copies",
    "stream_layers": "true streams the decoder layers through the page cache under the host's budget (a "
                     "fixed set stays cached, the rest is read and let go each forward), false never; absent "
                     "streams whenever weights are mapped and computed unpacked",
    "cache_dir": "the folder conversions are written to, made if missing (default: beside the checkpoint, as for "
                 "from_pretrained; ~ is the home folder)",
    "offload_layers": "how many decoder layers (the first ones, as vLLM's --cpu-offload-gb takes them) stay on the "
                      "mapping and are streamed to the device by the copier each forward (absent: vLLM's "
                      "--cpu-offload-gb amount, else none)",
    "prefetch_layers": "how many offloaded layers ahead the copier streams (default 1)",
}
LINEAR = ("packed", "mapped", "vnni")
# The tests' switch: on vLLM's CPU backend, the offloaded layers run through the device pipeline's CPU twin
# (copied through the copier into separate buffers each forward, as on a GPU). Read by LoaderOptions.parse.
ENV_CPU_TWIN = "MAPOFFLOAD_VLLM_CPU_TWIN"
_FLAGS = ("keep_mapping", "stream_layers")


@dataclass(frozen=True)
class OffloadRequest:
    """Which layers the device path offloads: the first ``layers``, or the first layers holding
    ``max_bytes``; ``options`` are the managers' (``why``: the setting that asked, for the logs)."""

    layers: int | None
    max_bytes: int | None
    options: OffloadOptions
    why: str

    @property
    def prefetch(self) -> int:
        """How many offloaded layers ahead the copier streams (as asked: a stack bounds it)."""
        return self.options.prefetch_layers


@dataclass(frozen=True)
class EngineFacts:
    """What the engine's configuration says that the options depend on (:meth:`of` reads vLLM's)."""

    device: torch.device
    enforce_eager: bool = True
    cpu_offload_gb: float = 0.0
    cpu_offload_params: tuple[str, ...] = ()
    offload_group_size: int = 0
    offload_backend: str = "auto"
    quantization: str | None = None
    speculative: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "device", torch.device(self.device))

    @classmethod
    def of(cls, vllm_config: Any, model_config: Any, load_config: Any = None) -> EngineFacts:
        """The facts of vLLM's ``VllmConfig`` / ``ModelConfig`` / ``LoadConfig`` (the load config's
        device first, as vLLM's loaders take it)."""
        offload = getattr(vllm_config, "offload_config", None)
        uva = getattr(offload, "uva", None)
        return cls(device=getattr(load_config, "device", None) or vllm_config.device_config.device,
                   enforce_eager=bool(getattr(model_config, "enforce_eager", False)),
                   cpu_offload_gb=float(getattr(uva, "cpu_offload_gb", 0) or 0),
                   cpu_offload_params=tuple(sorted(getattr(uva, "cpu_offload_params", None) or ())),
                   offload_group_size=int(getattr(getattr(offload, "prefetch", None), "offload_group_size", 0) or 0),
                   offload_backend=getattr(offload, "offload_backend", "auto") or "auto",
                   quantization=getattr(model_config, "quantization", None),
                   speculative=getattr(vllm_config, "speculative_config", None) is not None)


@dataclass(frozen=True)
class EnginePlan:
    """What :meth:`LoaderOptions.plan` decided: the load device, and what the device path offloads
    (None: nothing, the model loads on the mapping or as vLLM's loader does)."""

    device: torch.device
    request: OffloadRequest | None


class _Refusals:
    """Every refusal found, raised together: one error naming each key that takes part."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.found: list[tuple[tuple[str, ...], str]] = []

    def add(self, keys: list[str], why: str) -> None:
        self.found.append((tuple(keys), why))

    def raise_any(self) -> None:
        if not self.found:
            return
        keys = tuple(dict.fromkeys(k for ks, _ in self.found for k in ks))
        if len(self.found) == 1:
            body = self.found[0][1]
        else:
            body = (f"{len(self.found)} refusals ({', '.join(keys)}): "
                    + "; ".join(f"({i}) {why}" for i, (_, why) in enumerate(self.found, 1)))
        raise VllmLoadError(self.prefix + body, keys=keys)


def _listed(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _env_twin() -> bool:
    raw = os.environ.get(ENV_CPU_TWIN)
    text = (raw or "").strip().lower()
    if text in ("", "0", "false", "no", "off"):
        return False
    if text in ("1", "true", "yes", "on"):
        return True
    raise EnvSettingError(ENV_CPU_TWIN, raw or "", "expected 1 (run offloaded layers through the device "
                                                   "pipeline's CPU twin on vLLM's CPU backend), 0 or unset")


@dataclass(frozen=True)
class LoaderOptions:
    """What ``model_loader_extra_config`` asked for (each value checked once, in :meth:`parse`).

    ``prefetch_layers`` None: not given (1 ahead); ``cpu_twin``: :data:`ENV_CPU_TWIN`.
    """

    keep_mapping: bool | None = None
    linear: str | None = None
    cache_dir: str | None = None
    stream_layers: bool | None = None
    offload_layers: int | None = None
    prefetch_layers: int | None = None
    cpu_twin: bool = False

    # -- how an option was given: the key (the variable, for cpu_twin), the key and its value as shown --------
    def _key(self, name: str) -> str:
        return ENV_CPU_TWIN if name == "cpu_twin" else name

    def _shown(self, name: str) -> str:
        if name == "cpu_twin":
            return f"{ENV_CPU_TWIN}=1"
        value = getattr(self, name)
        shown = str(value).lower() if isinstance(value, bool) else repr(value) if isinstance(value, str) else value
        return f"{name}={shown}"

    def _names(self, names: list[str]) -> tuple[list[str], str]:
        return [self._key(n) for n in names], _listed([self._shown(n) for n in names])

    @property
    def prefetch(self) -> int:
        """How many offloaded layers ahead the copier streams (1 unless given)."""
        return 1 if self.prefetch_layers is None else self.prefetch_layers

    @classmethod
    def parse(cls, extra: Any) -> LoaderOptions:
        """Options from vLLM's extra loader config (a dict; None or {} for the defaults), and
        :data:`ENV_CPU_TWIN`.

        Raises
        ------
        VllmLoadError
            Not a dict, an unknown key (the known ones are listed), a value of the wrong type, a
            ``cache_dir`` that is a file or lies under one (``~`` in it is expanded), or keys that
            cannot go together (every such key named, in one error).
        EnvSettingError
            :data:`ENV_CPU_TWIN` holds neither 1 nor 0.
        """
        if extra is None:
            extra = {}
        if not isinstance(extra, dict):
            raise VllmLoadError(f"model_loader_extra_config must be a dict for load format 'mapoffload', "
                                f"got {type(extra).__name__}")
        odd = [k for k in extra if not isinstance(k, str)]
        if odd:  # JSON keys are text; a dict built in Python may hold anything
            raise VllmLoadError(f"model_loader_extra_config: keys must be text, not {odd!r} (it takes "
                                f"{', '.join(KEYS)})", keys=tuple(map(repr, odd)))
        unknown = sorted(set(extra) - set(KEYS))
        if unknown:
            close = difflib.get_close_matches(unknown[0], list(KEYS), n=1)
            known = "; ".join(f"{k}: {v}" for k, v in KEYS.items())
            raise VllmLoadError(f"model_loader_extra_config: unknown key(s) {unknown} for load format 'mapoffload'"
                                f"{f' (did you mean {close[0]}?)' if close else ''} (it takes {known})",
                                keys=tuple(unknown))
        for key in _FLAGS:
            if extra.get(key) is not None and not isinstance(extra[key], bool):
                raise VllmLoadError(f"model_loader_extra_config[{key!r}] must be true, false or absent, "
                                    f"got {extra[key]!r}", keys=(key,))
        linear = extra.get("linear")
        if linear is not None and linear not in LINEAR:
            raise VllmLoadError(f"model_loader_extra_config['linear'] must be one of {LINEAR} or absent, "
                                f"got {linear!r}", keys=("linear",))
        cache_dir = _cache_dir(extra.get("cache_dir"))
        for key, low in (("offload_layers", 1), ("prefetch_layers", 0)):
            value = extra.get(key)
            if value is not None and (type(value) is not int or value < low):
                raise VllmLoadError(f"model_loader_extra_config[{key!r}] must be a whole number >= {low} or absent, "
                                    f"got {value!r}", keys=(key,))
        refusals = _Refusals("model_loader_extra_config: ")
        options = cls(extra.get("keep_mapping"), linear, cache_dir, extra.get("stream_layers"),
                      extra.get("offload_layers"), extra.get("prefetch_layers"), _env_twin())
        options._refuse_keys(refusals)
        refusals.raise_any()
        return options

    def _refuse_keys(self, refusals: _Refusals) -> None:
        """The rules the keys alone decide."""
        if self.keep_mapping is False:  # vLLM's own loader and offloader: ours would be ignored
            ours = [n for n, asked in (("offload_layers", self.offload_layers is not None),
                                       ("prefetch_layers", self.prefetch_layers is not None),
                                       ("stream_layers", self.stream_layers is True),
                                       ("cpu_twin", self.cpu_twin)) if asked]
            if ours:
                keys, shown = self._names(ours)
                refusals.add(["keep_mapping", *keys],
                             f"keep_mapping=false loads with vLLM's own loader and offloader: {shown} "
                             f"{'is' if len(ours) == 1 else 'are'} for the layers the mapoffload load format keeps "
                             f"mapped, streams or offloads, and would be ignored: leave "
                             f"{'it' if len(ours) == 1 else 'them'} out (or keep_mapping unset)")
        if self.offload_layers is not None:
            bad = self._not_on_the_device_path()
            if bad:
                keys, shown = self._names(bad)
                refusals.add(["offload_layers", *keys],
                             f"offload_layers={self.offload_layers} keeps the offloaded layers mapped, computed from "
                             f"their rows, and streams them through the copier: it cannot go with {shown}")
        if self.stream_layers is True and self.linear == "packed":
            keys, shown = self._names(["linear"])
            refusals.add(["stream_layers", *keys], f"stream_layers=true streams mapped weights computed unpacked: "
                                                   f"it cannot go with {shown}")

    def _not_on_the_device_path(self) -> list[str]:
        return [n for n, asked in (("linear", self.linear in ("packed", "vnni")),
                                   ("stream_layers", self.stream_layers is True)) if asked]

    def plan(self, engine: EngineFacts) -> EnginePlan:
        """What to load on this engine: the device, and what the device path offloads (with the
        :class:`~mapoffload.OffloadOptions` its managers take whole).

        Raises
        ------
        VllmLoadError
            What the engine's settings and these options cannot do together, every one found,
            each naming the keys and settings (``cpu_offload_gb``, ``enforce_eager``, ...).
        """
        refusals = _Refusals("")
        device = engine.device
        if engine.quantization is not None:
            refusals.add(["quantization"], f"quantization {engine.quantization!r} is not kept mapped by the "
                                           f"mapoffload load format (vLLM rebuilds its weights); load with "
                                           f"load_format='auto'")
        if self.keep_mapping is False:  # vLLM's own loader, and its own offloader, as asked
            refusals.raise_any()
            return EnginePlan(device, None)
        gib = engine.cpu_offload_gb
        # As vLLM's create_offloader chooses: "uva" ignores the prefetch fields, "prefetch" the UVA ones.
        group = 0 if engine.offload_backend == "uva" else engine.offload_group_size
        if group or engine.offload_backend == "prefetch":
            what = f"offload_group_size={group}" if group else "offload_backend='prefetch'"
            refusals.add([what.split("=")[0]], f"vLLM's prefetch offloader ({what}) copies the layers into pinned "
                                               f"memory; with load format 'mapoffload' give offload_layers in "
                                               f"model_loader_extra_config (or --cpu-offload-gb) instead")
        if self.offload_layers is not None and gib:
            refusals.add(["offload_layers", "cpu_offload_gb"], f"both offload_layers={self.offload_layers} "
                                                               f"(model_loader_extra_config) and cpu_offload_gb="
                                                               f"{gib:g} are set: give one")
        if gib and engine.cpu_offload_params:
            refusals.add(["cpu_offload_params"], "cpu_offload_params: the mapoffload load format offloads whole "
                                                 "decoder layers; leave cpu_offload_params unset (or use "
                                                 "offload_layers)")
        if self.offload_layers is None and not gib:
            return self._nothing_offloaded(refusals, device)
        if device.type == "cpu" and not self.cpu_twin and self.offload_layers is None:
            refusals.raise_any()
            logger.info("mapoffload: cpu_offload_gb=%g on vLLM's CPU backend: nothing to offload to (as for vLLM's "
                        "own offloader); %s=1 runs the device pipeline's CPU twin", gib, ENV_CPU_TWIN)
            return EnginePlan(device, None)
        why = f"offload_layers={self.offload_layers}" if self.offload_layers is not None else f"cpu_offload_gb={gib:g}"
        bad = self._not_on_the_device_path()
        if bad and self.offload_layers is None:  # (with offload_layers, parse refused them)
            keys, shown = self._names(bad)
            refusals.add(["cpu_offload_gb", *keys], f"{shown} cannot go with {why}: offloaded layers stay mapped, "
                                                    f"computed from their rows, and stream through the copier; "
                                                    f"leave {'it' if len(bad) == 1 else 'them'} out")
        self._refuse_device(refusals, device, why)
        if not engine.enforce_eager:
            refusals.add(["enforce_eager"], "offloaded layers are streamed into buffers made for each forward, which "
                                            "CUDA graphs (and vLLM's compiled graphs) would capture once: start the "
                                            "engine with enforce_eager=True (--enforce-eager)")
        if engine.speculative:
            refusals.add(["speculative_config"], f"{why} with speculative decoding (speculative_config): vLLM loads "
                                                 f"the draft model with the same load format and options, so it "
                                                 f"would offload the drafter's layers too; offloading with "
                                                 f"speculative decoding is not supported")
        refusals.raise_any()
        options = OffloadOptions(device=device, prefetch_layers=self.prefetch, host_store="mapped",
                                 cpu_twin=self.cpu_twin)  # host_store: never a host copy of the offloaded layers
        if self.offload_layers is not None:
            return EnginePlan(device, OffloadRequest(self.offload_layers, None, options, why))
        return EnginePlan(device, OffloadRequest(None, int(gib * (1 << 30)), options, why))

    def _nothing_offloaded(self, refusals: _Refusals, device: torch.device) -> EnginePlan:
        unused = [n for n, asked in (("prefetch_layers", self.prefetch_layers is not None),
                                     ("cpu_twin", self.cpu_twin)) if asked]
        if unused:
            keys, shown = self._names(unused)
            refusals.add(keys, f"{shown} {'is' if len(unused) == 1 else 'are'} for offloaded layers (prefetch_layers: "
                               f"how many the copier streams ahead; the CPU twin: the device pipeline they run "
                               f"through on vLLM's CPU backend): give offload_layers (or --cpu-offload-gb) too, or "
                               f"leave {'it' if len(unused) == 1 else 'them'} out")
        if device.type != "cpu":
            refusals.add(["device"], f"on {device} the mapoffload load format keeps only offloaded layers on the "
                                     f"mapping (offload_layers in model_loader_extra_config, or --cpu-offload-gb, "
                                     f"with --enforce-eager); nothing is offloaded here: load with load_format='auto'")
        refusals.raise_any()
        return EnginePlan(device, None)

    def _refuse_device(self, refusals: _Refusals, device: torch.device, why: str) -> None:
        if device.type not in ("cpu", "cuda"):
            refusals.add(["device"], f"the mapoffload load format streams offloaded layers to CUDA devices (or the "
                                     f"CPU twin), not {device}; load with load_format='auto'")
        elif device.type == "cpu" and not self.cpu_twin:
            refusals.add(["offload_layers"], f"{why}: offloading layers to a device on vLLM's CPU backend: there is "
                                             f"no device (the layers compute from the mapping in place: "
                                             f"stream_layers); {ENV_CPU_TWIN}=1 runs the device pipeline's CPU twin")
        elif device.type == "cuda" and self.cpu_twin:
            refusals.add([self._key("cpu_twin")], f"{self._shown('cpu_twin')} is for vLLM's CPU backend; this "
                                                  f"engine loads onto {device}")

    def linear_for(self, keep: bool) -> str:
        """How linear layers compute when the weights are kept mapped (``keep``) or copied: as asked,
        else packed exactly when they are copies."""
        return self.linear or ("mapped" if keep else "packed")

    def streams(self, linear: str) -> bool:
        """Whether the decoder layers stream through the page cache: as asked, else whenever the
        weights are mapped and computed unpacked (``linear``, as resolved)."""
        return self.stream_layers if self.stream_layers is not None else linear != "packed"

    @staticmethod
    def stream_options() -> OffloadOptions:
        """The options of the in-place managers that stream a mapped model's decoder layers."""
        return OffloadOptions(device="cpu")


def _cache_dir(cache_dir: Any) -> str | None:
    """:func:`~mapoffload._checks.check_cache_dir`'s answer, refused as this door refuses (before any weight
    is read: making it would fail with a bare ``FileExistsError`` out of vLLM's loader, after the model was
    built)."""
    if cache_dir is not None and not isinstance(cache_dir, str):
        raise VllmLoadError(f"model_loader_extra_config['cache_dir'] must be a folder path, got {cache_dir!r}",
                            keys=("cache_dir",))
    try:
        return check_cache_dir(cache_dir)  # "~/conv": no shell expanded it in the JSON
    except (TypeError, ValueError) as exc:
        raise VllmLoadError(f"model_loader_extra_config: {exc}", keys=("cache_dir",)) from None
