"""The offload options: one frozen object, each field checked and documented once, here.

Every entry point that offloads (:class:`~mapoffload.LayerwiseOffloadManager`,
:func:`mapoffload.offload`, :func:`mapoffload.offload_pipeline`, :func:`mapoffload.from_pretrained`,
:func:`mapoffload.pipeline_from_pretrained`, the vLLM load format) takes an :class:`OffloadOptions`
as ``options=``, or the same names as keyword arguments, which build one at the door
(:func:`gather`). The parts behind them receive the object whole and check nothing again.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import inspect
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._checks import check_bool, check_count, check_device

if TYPE_CHECKING:
    import torch

__all__ = ["FIELDS", "HOST_STORES", "OffloadOptions", "READS", "RESTS", "caller_stacklevel", "gather", "load_options", "shows_option_keywords", "take",
           "unexpected_keyword"]

HOST_STORES = ("auto", "mapped", "pinned", "pageable")
READS = ("auto", "mapping", "uncached")
RESTS = ("auto", "device", "stream")


def caller_stacklevel() -> int:
    """The ``stacklevel`` of ``warnings.warn`` called here that names the user's line: the first frame
    outside mapoffload and the dataclass machinery (an entry point, ``OffloadOptions(...)``, its
    ``replace``), so that Python's default filter shows a warning a script's own call caused."""
    frame, level = sys._getframe(1), 1
    while frame is not None:
        # A frame's module, not its file: code typed in ``python -c`` or at the prompt is ``<string>``
        # or ``<stdin>``, and the dataclass's generated methods run in this module's globals.
        name = frame.f_globals.get("__name__", "")
        if not (name == "mapoffload" or name.startswith("mapoffload.") or name == "dataclasses"):
            return level
        frame, level = frame.f_back, level + 1
    return level


@dataclass(frozen=True)
class OffloadOptions:
    """How a model's layers are offloaded: what streams, where it computes, what the host holds.

    Parameters
    ----------
    device
        Where the layers compute: ``"cuda"``, ``"cuda:N"`` (the index is fixed when the
        options are made) or ``"cpu"``: there each layer computes from its host store and
        nothing is copied (see ``cpu_twin``). CUDA is refused where torch sees none.
    layers
        Which block lists :func:`~mapoffload.offload` streams: ``"auto"`` (the repeated
        ones, :func:`~mapoffload.find_block_lists`), an attribute path (``"model.layers"``),
        an ``nn.ModuleList``, or a list of those. A manager streams the list it is given.
    rest
        The parameters and buffers outside the streamed lists: ``"auto"`` places them on
        the device when they fit in its free memory (less what streaming needs), else
        streams their modules to it one by one; ``"device"`` or ``"stream"`` force one way.
        On the CPU they compute where they are (``"stream"`` is refused there): the page-cache
        plan streams them through the page cache wherever it has no room for them.
    prefetch_layers
        How many layers ahead each layer's pre-hook starts loading (the prefetch depth).
    resident_layers
        The first N layers stay loaded once loaded.
    host_store
        Where each layer's weights live on the host: ``"auto"`` (pinned while the budget
        covers it, mapped when copies would not fit; on the CPU in place, mapped: a copy
        buys nothing there), or ``"mapped"``, ``"pinned"``, ``"pageable"`` where possible.
    reads
        How streamed layers are read: ``"mapping"`` (through the file mapping, let go
        after use), ``"uncached"`` (``O_DIRECT`` into ``1 + depth``
        reused buffers, on CUDA page-locked and copied by DMA; cached layers stay on the
        mapping), or ``"auto"``: on a device (and the CPU twin), uncached as soon as the
        plan streams layers and their files take ``O_DIRECT``, except while replicas of this
        cgroup map the same bytes (the shared page cache serves them both); in place (``device="cpu"``)
        through the mapping, and uncached where two warm forwards in a row read more than 1.2x
        what the plan streams — docs/design.md has the measurements.
    available_bytes
        The host budget to plan against; None measures it when the plan is made
        (:func:`~mapoffload.host_memory_available_bytes`). It is the host's, shared by
        every local rank.
    device_free_bytes
        Free device memory ``rest="auto"`` plans against; None measures it.
    page_cache_bytes
        Page cache the streamed layers' mapped weights may fill; None measures it
        (less the mapped weights outside the layers that every forward reads).
    local_ranks
        Ranks sharing this host, each with its own managers; None detects them
        (``LOCAL_WORLD_SIZE``, else ``torch.distributed``'s world size, else 1).
    cpu_twin
        With ``device="cpu"``: run the device pipeline's CPU twin (layers copied into
        separate CPU buffers, as on a GPU) to exercise it without one.
    kernel_caps
        What to assume of the kernel's page-cache behaviour instead of probing it: text as
        for ``MAPOFFLOAD_KERNEL_CAPS`` (``"no-large-folios"``, ``"no-pageout"``, ...).

    Raises
    ------
    TypeError
        A field of the wrong type (``prefetch_layers=1.5``, ``cpu_twin="false"``).
    ValueError
        A value not among the choices, out of range, or fields that do not go together.
    NoCudaDeviceError
        ``device="cuda"`` where torch sees no CUDA device.

    Notes
    -----
    Every entry point takes ``options=`` and the fields as keywords; given both, each
    keyword replaces that field of ``options`` (``options.replace(**keywords)``: the
    keyword wins, ``options`` itself is left as it is). The one exception:
    ``from_pretrained``'s ``device=None`` (load without offloading) beside ``options=``
    is refused, the two asking opposite things.
    """

    device: torch.device
    layers: Any = "auto"
    rest: str = "auto"
    prefetch_layers: int = 1
    resident_layers: int = 0
    host_store: str = "auto"
    reads: str = "auto"
    available_bytes: int | None = None
    device_free_bytes: int | None = None
    page_cache_bytes: int | None = None
    local_ranks: int | None = None
    cpu_twin: bool = False
    kernel_caps: str | None = None

    def __post_init__(self) -> None:
        import torch

        dev = check_device(self.device, "device")
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        elif dev.type == "cpu":
            dev = torch.device("cpu")  # "cpu:0" is the CPU: tensors on it report plain "cpu"
        object.__setattr__(self, "device", dev)
        _check_layers(self.layers)
        if isinstance(self.layers, list):
            object.__setattr__(self, "layers", tuple(self.layers))  # frozen: not the caller's list
        _check_choice("rest", self.rest, RESTS)
        check_count("prefetch_layers", self.prefetch_layers)
        check_count("resident_layers", self.resident_layers)
        _check_choice("host_store", self.host_store, HOST_STORES)
        _check_choice("reads", self.reads, READS)
        for name in ("available_bytes", "device_free_bytes", "page_cache_bytes"):
            check_count(name, getattr(self, name), none=True)
        check_count("local_ranks", self.local_ranks, minimum=1, none=True)
        check_bool("cpu_twin", self.cpu_twin)
        if self.kernel_caps is not None:
            if not isinstance(self.kernel_caps, str):
                raise TypeError(f"kernel_caps must be text as for MAPOFFLOAD_KERNEL_CAPS or None, "
                                f"not {self.kernel_caps!r}")
            from .pagecache.kernel import parse_overrides

            parse_overrides(self.kernel_caps)  # an unknown feature is refused now, not when a manager is built
        if self.cpu_twin and dev.type != "cpu":
            raise ValueError(f"cpu_twin is for device='cpu', not {dev}")
        if self.rest == "stream" and self.in_place:
            raise ValueError("rest='stream' streams the weights outside the stacks to the device; on the CPU they "
                             "compute where they are, and the page-cache plan streams them (read in as their "
                             "modules run, let go after) wherever it has no room for them: leave rest='auto' "
                             "(cpu_twin=True runs the device path's streaming on the CPU)")

    @property
    def in_place(self) -> bool:
        """On the CPU without ``cpu_twin``: layers compute from their host stores, nothing moves."""
        return self.device.type == "cpu" and not self.cpu_twin

    @property
    def cuda(self) -> bool:
        """The layers compute on a CUDA device."""
        return self.device.type == "cuda"

    def replace(self, **changes: Any) -> OffloadOptions:
        """These options with ``changes`` (checked again, as when made)."""
        return dataclasses.replace(self, **changes)

    def filled(self, **measured: Any) -> OffloadOptions:
        """These options with what the environment measured for the fields left to it (None): the
        host budget, the local ranks, or the block lists an entry point found. Only those fields,
        each checked for its kind; the user's choices are not checked again."""
        new = copy.copy(self)
        for name, value in measured.items():
            if name not in _MEASURED:
                raise ValueError(f"filled() takes what the environment measures ({', '.join(_MEASURED)}), "
                                 f"not {name}: use replace({name}=...)")
            if name == "layers":
                _check_layers(value)
                value = tuple(value) if isinstance(value, list) else value
            else:
                check_count(name, value, minimum=1 if name == "local_ranks" else 0)
            object.__setattr__(new, name, value)
        return new


FIELDS = tuple(f.name for f in dataclasses.fields(OffloadOptions))
_MEASURED = ("available_bytes", "local_ranks", "layers")


def _named_fields_only(init: Any) -> Any:
    """The dataclass's ``__init__`` with a misspelt field named with the one meant (the entry points'
    :func:`unexpected_keyword`), where Python's own message names only the misspelling."""
    @functools.wraps(init)
    def __init__(self: OffloadOptions, *args: Any, **fields: Any) -> None:
        for name in fields:
            if name not in FIELDS:
                raise unexpected_keyword("OffloadOptions", name, FIELDS, why=f"its fields are {', '.join(FIELDS)}")
        init(self, *args, **fields)

    return __init__


OffloadOptions.__init__ = _named_fields_only(OffloadOptions.__init__)  # type: ignore[method-assign]


def shows_option_keywords(fn: Any) -> Any:
    """``fn`` (an entry point taking ``**keywords``, or a class whose ``__init__`` does) with a
    signature that shows the fields of :class:`OffloadOptions` as the keyword-only parameters
    they are (``device`` required, the others with their defaults), for ``help()``, editors and
    :func:`inspect.signature`. The fields stay documented once, on the class."""
    target = fn.__init__ if isinstance(fn, type) else fn
    params = list(inspect.signature(target).parameters.values())
    if isinstance(fn, type):
        params = params[1:]  # self
    plain = [p for p in params if p.kind is not p.VAR_KEYWORD]
    rest = [p for p in params if p.kind is p.VAR_KEYWORD and fn.__name__ not in _OPTIONS_ONLY]
    taken = {p.name for p in plain}
    fields = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, annotation=f.type,
                                default=inspect.Parameter.empty if f.name == "device" else f.default)
              for f in dataclasses.fields(OffloadOptions) if f.name not in taken]
    fn.__signature__ = inspect.Signature(plain + fields + rest)
    return fn


# Entry points whose **keywords are the options' fields only (the others pass the rest on).
_OPTIONS_ONLY = ("LayerwiseOffloadManager", "offload", "offload_pipeline")


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {choices}, not {value!r}")


def _check_layers(layers: Any) -> None:
    """``layers`` names block lists: ``"auto"``, an attribute path, an ``nn.ModuleList`` (or
    ``nn.Sequential``), or a list or tuple of those."""
    import torch

    for item in layers if isinstance(layers, (list, tuple)) else [layers]:
        if type(item) is str or isinstance(item, (torch.nn.ModuleList, torch.nn.Sequential)):
            continue
        what = "not how many" if isinstance(item, (int, float)) else f"not a {type(item).__name__}"
        raise TypeError(f"layers={layers!r}: layers names which block lists to stream ('auto', an attribute "
                        f"path such as 'model.layers', an nn.ModuleList, or a list of those), {what}; "
                        "prefetch_layers= sets how many layers are loaded ahead")


def take(keywords: dict[str, Any]) -> dict[str, Any]:
    """Remove the offload options from ``keywords``; return them."""
    return {name: keywords.pop(name) for name in list(keywords) if name in FIELDS}


def gather(what: str, options: OffloadOptions | None, keywords: dict[str, Any], *,
           others: tuple[str, ...] = ()) -> OffloadOptions:
    """The options an entry point runs with: ``options`` with the keyword arguments laid over it.

    ``keywords`` must hold only offload options; a misspelt one is named with the one
    meant, any other unknown one with the options there are.

    Parameters
    ----------
    what
        The entry point, for the messages (``"mapoffload.offload"``).
    others
        The entry point's other keywords, offered too when one is misspelt.

    Raises
    ------
    TypeError
        ``options`` not an :class:`OffloadOptions`, an unknown keyword, or no device given.
    """
    keywords = dict(keywords)
    given = take(keywords)
    if keywords:
        name = next(iter(keywords))
        raise unexpected_keyword(what, name, FIELDS + others, why=f"the offload options are {', '.join(FIELDS)}")
    if options is None and "device" not in given:
        raise TypeError(f"{what} needs a device: device='cuda', 'cuda:N' or 'cpu' (or options=OffloadOptions(...))")
    return _build(what, options, given)


def _build(what: str, options: OffloadOptions | None, given: dict[str, Any]) -> OffloadOptions:
    """``options`` with the fields ``given`` laid over it (checked once, here), or made of them."""
    if options is None:
        return OffloadOptions(**given)
    if not isinstance(options, OffloadOptions):
        raise TypeError(f"{what}: options must be a mapoffload.OffloadOptions, not {type(options).__name__}")
    return options.replace(**given) if given else options


def load_options(what: str, options: OffloadOptions | None, keywords: dict[str, Any]) -> OffloadOptions | None:
    """The offload options of an entry point that loads, then offloads (``from_pretrained``):
    the offload keywords are taken out of ``keywords`` (the rest are the loader's), checked now,
    before anything is loaded. None: ``device=None`` and no ``options``, no offload.

    Raises
    ------
    TypeError
        No device and no options (a misspelt ``device`` named with it), or offload
        keywords beside ``device=None``.
    """
    given = take(keywords)
    layers = given.get("layers", options.layers if isinstance(options, OffloadOptions) else "auto")
    import torch

    if any(isinstance(item, torch.nn.Module) for item in (layers if isinstance(layers, (list, tuple)) else [layers])):
        raise TypeError(f"{what}: layers={layers!r}: the model is built inside {what}, so its block lists are "
                        "named by attribute path ('model.layers') or found ('auto'), not given as modules")
    if options is not None and "device" in given and given["device"] is None:
        raise TypeError(f"{what}: device=None loads the model without offloading it, and options= offloads it: "
                        "give one of them (the device options= offloads to is its own device field)")
    if options is None and given.get("device", 0) is None:
        others = sorted(set(given) - {"device"})
        if others:
            raise TypeError(f"{what}: {', '.join(o + '=' for o in others)} offload(s) the model, and device=None "
                            "loads it without offloading: give a device, or leave them out")
        return None
    if options is None and "device" not in given:
        for name in keywords:
            if difflib.get_close_matches(name, ["device"], n=1):
                raise unexpected_keyword(what, name, ["device"])
        raise TypeError(f"{what} needs device=: 'cuda', 'cuda:N', 'cpu', or None (loaded, not offloaded); "
                        "or options=OffloadOptions(...)")
    return _build(what, options, given)


def unexpected_keyword(what: str, name: str, candidates: Any, why: str = "") -> TypeError:
    """A ``TypeError`` naming the keyword ``name`` nobody takes, with the closest of
    ``candidates`` (:func:`difflib.get_close_matches`) as the one meant, else ``why``."""
    close = difflib.get_close_matches(name, list(dict.fromkeys(candidates)), n=1)
    tail = f"did you mean {close[0]}=?" if close else why
    return TypeError(f"{what} got an unexpected keyword argument {name!r}{f': {tail}' if tail else ''}")
