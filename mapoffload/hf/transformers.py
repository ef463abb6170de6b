"""``mapoffload.from_pretrained``: a transformers model from a local folder,
loaded by transformers' own ``from_pretrained`` with the weights left on the
file mapping, offloaded onto a device.

transformers decides everything it decides for the same folder — the key
conversions of its conversion mapping (legacy names, fused experts, split or
merged projections), ``dtype="auto"``, ``_keep_in_fp32_modules``, ties, ignore
lists, the generation config, quantizers, which missing weights it
initialises — so the model computes exactly what transformers' model
computes. mapoffload only makes sure nothing of it is an anonymous copy:
tensors transformers *makes* on the way are converted once into mapped files
(:mod:`mapoffload.conversion`, :mod:`._drive`, :mod:`._drive_transformers`).
"""

from __future__ import annotations

import inspect
import json
import os
import time
import warnings
from typing import TYPE_CHECKING, Any

from .._checks import check_cache_dir
from ..loading.files import CheckpointError, pretrained_files
from ..loading.report import LoadReport
from . import _keys
from ..conversion import ConversionCache
from ..conversion import concrete_class, default_root, fingerprint
from ..offload.hooks import CallNames
from ..options import FIELDS, OffloadOptions, load_options, shows_option_keywords, unexpected_keyword
from ._args import check_flags, check_folder, check_model_class, keyword_names
from ._drive import convert_again, driving
from ._drive_transformers import transformers_hooks
from ._report import Unsettled, settle
from ._extras import require

if TYPE_CHECKING:
    import torch

    from .offload import OffloadHandle

__all__ = ["KeyMismatchError", "from_pretrained", "load_pretrained"]

# quantization_config methods whose checkpoints load (transformers' quantizer
# runs; what it makes is converted into mapped files like any conversion).
SUPPORTED_QUANT_METHODS = ("fp8",)
WHAT = "mapoffload.from_pretrained"

# transformers' own arguments that mean something else here, with the answer.
_TRANSFORMERS_HABITS = {
    "device_map": "mapoffload places the model itself: pass device='cuda' (or 'cpu'); the block lists are "
                  "streamed there and the rest placed, see mapoffload.offload",
    "torch_dtype": "pass dtype= (transformers 5's name; 'auto' is the default)",
    "low_cpu_mem_usage": "mapoffload always loads on the file mapping (nothing to pass)",
    "offload_folder": "weights stay on the checkpoint's own file mapping (nothing to pass)",
    "max_memory": "the host budget is measured (cgroups); see mapoffload.host_memory_available_bytes",
    "quantization_config": "the checkpoint's own quantization_config (config.json) is read from the folder, and "
                           "fp8= says how fp8 weights load ('keep' or 'dequantize'); quantizing while loading "
                           "would make an anonymous copy of the model",
    "output_loading_info": "mapoffload asks for it itself: model.mapoffload_report lists the missing and "
                           "unexpected keys",
    "state_dict": "mapoffload loads the folder's own files (a state dict in memory is on no file mapping, and "
                  "a conversion keyed on the files would be reused for other values): save it with "
                  "save_pretrained and load that folder",
}

# transformers' from_pretrained keywords it reads from its **kwargs (those of its signature are read from
# it): passed to it as they are. The hub's are passed to the configuration's loading too, as it does.
_TRANSFORMERS_KEYWORDS = (
    "attn_implementation", "experts_implementation", "trust_remote_code", "code_revision", "variant",
    "generation_config", "key_mapping", "use_kernels", "kernel_config", "allow_all_kernels", "adapter_kwargs",
    "adapter_name", "proxies", "subfolder", "gguf_file", "distributed_config", "device_mesh",
    "tp_plan", "tp_size", "tqdm_class", "offload_buffers",
)
_HUB_KEYWORDS = ("force_download", "proxies", "local_files_only", "token", "revision", "subfolder")


class KeyMismatchError(CheckpointError):
    """A checkpoint's keys do not match the model (with ``strict=True``), or a
    weight transformers would load could not be (``.keys`` names them)."""

    def __init__(self, path: str | os.PathLike, message: str, keys: list[str] | None = None) -> None:
        super().__init__(path, message)
        self.keys = list(keys or [])


def check_transformers_kwargs(kwargs: dict[str, Any]) -> None:
    """Refuse transformers' placement arguments with the mapoffload equivalent."""
    for name, answer in _TRANSFORMERS_HABITS.items():
        if name in kwargs:
            raise TypeError(f"mapoffload.from_pretrained does not take {name}=: {answer}")


def _model_types(data: Any) -> set[str]:
    """Every ``model_type`` in a config dict, its sub-configs' included."""
    out: set[str] = set()
    if isinstance(data, dict):
        if isinstance(data.get("model_type"), str):
            out.add(data["model_type"])
        for value in data.values():
            out |= _model_types(value)
    return out


def folder_model_mismatch(cls: Any, folder: str) -> str | None:
    """Why ``cls`` is not the model ``folder``'s ``config.json`` describes (a sentence naming both
    model types), or None: the same model, a composite config holding this model's (CLIP's
    ``text_config``), an ``AutoModel*`` class (it picks from the folder), or a config that cannot
    be read (transformers' own error says what is wrong with it)."""
    path = os.path.join(folder, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or hasattr(cls, "_model_mapping"):
        return None
    expected = getattr(getattr(cls, "config_class", None), "model_type", None)
    found = data.get("model_type")
    if not expected or not isinstance(found, str) or found == expected or expected in _model_types(data):
        return None
    return f"{cls.__name__} is a {expected!r} model class, and {path} describes a {found!r} model"


def _check_folder_config(cls: Any, folder: str) -> None:
    """The folder's ``config.json`` is there and describes a model ``cls`` is for.

    transformers builds a class from another architecture's folder with a
    warning and the class's default configuration (a 7B Llama from a tiny GPT-2
    folder: initialised in full, and killed for memory), so a mismatch is
    refused here, before anything is built; ``config=`` overrides.
    """
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.json in {folder}: mapoffload.from_pretrained takes the folder "
                                "save_pretrained wrote (config.json beside the weights), or config= for one without")
    mismatch = folder_model_mismatch(cls, folder)
    if mismatch is not None:
        raise TypeError(f"{mismatch}: pass its class (transformers.AutoModelForCausalLM or another AutoModel* picks "
                        f"it from the folder), or config= to load it into {cls.__name__} anyway")


def _transformers_keywords() -> tuple[str, ...]:
    """Every keyword transformers' ``from_pretrained`` takes itself (not passed on to the config)."""
    import transformers

    own = [n for n in keyword_names(transformers.PreTrainedModel.from_pretrained) if n not in ("config", "cache_dir")]
    return (*own, *_TRANSFORMERS_KEYWORDS)


def _config(cls: Any, folder: str, config: Any, kwargs: dict[str, Any], own: tuple[str, ...],
            what: str) -> tuple[Any, dict[str, Any]]:
    """The configuration, and the keywords for transformers' ``from_pretrained``.

    As transformers sends ``**kwargs``: its own keywords to it, the rest to the
    configuration's ``from_pretrained`` (a field given there is set on the
    configuration), and what no field takes to the model's ``__init__`` —
    here only where ``__init__`` names it. Anything else is refused by name
    (the closest keyword as the one meant), before anything is built; with
    ``config=`` given, a field of it is refused too (transformers would hand
    it to ``__init__``): it is set on that config.
    """
    transformers = require("transformers", "mapoffload.from_pretrained")
    known = _transformers_keywords()
    passed = {k: v for k, v in kwargs.items() if k in known}
    rest = {k: v for k, v in kwargs.items() if k not in known}
    if config is None:
        config_cls = getattr(cls, "config_class", None)
        auto = hasattr(cls, "_model_mapping") or config_cls is None
        if auto:
            config_cls = transformers.AutoConfig
        hub = {k: v for k, v in passed.items() if k in _HUB_KEYWORDS or (auto and k in ("trust_remote_code",
                                                                                      "code_revision"))}
        config, rest = config_cls.from_pretrained(folder, return_unused_kwargs=True, **hub, **rest)
        rest = {k: v for k, v in rest.items() if k not in hub}
    else:
        for name in rest:
            if hasattr(config, name):
                raise TypeError(f"{what} got {name}= beside config=: {name} is a field of {type(config).__name__}, "
                                f"set it on the config you pass (config.{name} = ...)")
    model_cls = concrete_class(cls, config)
    init = inspect.signature(model_cls.__init__).parameters if isinstance(model_cls, type) else {}
    for name in rest:
        if name in init and name not in ("self", "config") and init[name].kind in (
                inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY):
            continue
        fields = list(config.to_dict()) + list(getattr(config, "attribute_map", {}) or {})
        model_name = getattr(model_cls, "__name__", repr(model_cls))
        raise unexpected_keyword(what, name, (*own, *known, *fields),
                                 f"not a keyword of {what} nor of transformers' from_pretrained, not a field of "
                                 f"{type(config).__name__}, nor an argument of {model_name}.__init__")
    return config, {**passed, **rest}


FP8_MODES = ("keep", "dequantize")


def quantization_refusal(quantization_config: Any) -> str | None:
    """Why :func:`from_pretrained` refuses a checkpoint's ``quantization_config``
    (a dict as in ``config.json``, or transformers' object); None when it loads."""
    q = quantization_config
    if q is None:
        return None
    if isinstance(q, (str, int, float, list)):  # not a method's settings ("fp8": said as "method 'None'" before)
        return (f"quantization_config is {q!r}, not the settings of a quantization method (an object with "
                "\"quant_method\"); correct config.json")
    method = q.get("quant_method") if isinstance(q, dict) else getattr(q, "quant_method", None)
    method = str(getattr(method, "value", method))
    if method in SUPPORTED_QUANT_METHODS:
        return None
    return (f"quantization_config method {method!r} is not supported by mapoffload yet "
            f"(supported: {', '.join(SUPPORTED_QUANT_METHODS)}); load it with transformers itself")


def _check_quantization(config: Any, folder: str, fp8: str) -> bool:
    """Refuse unsupported quantization methods; True when fp8 weights are kept
    as codes (``fp8="keep"``). transformers is then asked for its dequantizing
    load (plain modules, on any machine), whose result is checked weight by
    weight against the codes that replace it."""
    if fp8 not in FP8_MODES:
        raise ValueError(f"fp8 must be one of {FP8_MODES}, not {fp8!r}")
    q = getattr(config, "quantization_config", None)
    if q is None:
        return False
    method = q.get("quant_method") if isinstance(q, dict) else getattr(q, "quant_method", None)
    method = str(getattr(method, "value", method))
    if method == "fp8":
        if isinstance(q, dict):
            q["dequantize"] = True
        else:
            q.dequantize = True
        return fp8 == "keep"
    refusal = quantization_refusal(q)
    if refusal is not None:
        raise CheckpointError(os.path.join(folder, "config.json"), refusal)
    return False


def load_pretrained(
    cls: Any,
    folder: str | os.PathLike,
    *,
    dtype: Any = "auto",
    keep_mapping: bool | None = True,
    strict: bool = False,
    config: Any = None,
    cache_dir: str | os.PathLike | None = None,
    fp8: str = "keep",
    **model_kwargs: Any,
) -> tuple[torch.nn.Module, LoadReport]:
    """Load a transformers model from ``folder`` by transformers' own rules, on the mapping (no offload).

    See :func:`from_pretrained`; returns the model (in eval mode, its
    ``generation_config`` read from the folder as transformers reads it) and
    the :class:`~mapoffload.LoadReport`.
    """
    check_flags(keep_mapping=keep_mapping, strict=strict)
    loaded = load_unsettled(cls, folder, dtype=dtype, strict=strict, config=config, cache_dir=cache_dir, fp8=fp8,
                            model_kwargs=model_kwargs, own=keyword_names(load_pretrained))
    (report,) = settle([loaded], keep_mapping, component=type(loaded.model).__name__)
    return loaded.model, report


def load_unsettled(cls: Any, folder: str | os.PathLike, *, dtype: Any, strict: bool, config: Any,
                   cache_dir: str | os.PathLike | None, fp8: str, model_kwargs: dict[str, Any],
                   own: tuple[str, ...], what: str = "mapoffload.from_pretrained") -> Unsettled:
    """:func:`load_pretrained` up to the ``keep_mapping`` decision (:func:`._report.settle` makes it:
    for a pipeline, once for all its components). The model is in eval mode.

    ``own`` are the entry point's keywords, the first candidates of a "did you mean" for a
    keyword that goes nowhere (see :func:`_config`).
    """
    require("transformers", "mapoffload.from_pretrained")
    check_model_class(cls, what)
    check_flags(strict=strict)
    cache_dir = check_cache_dir(cache_dir)
    check_transformers_kwargs(model_kwargs)
    folder = check_folder(folder, what, beside="config.json beside the weights")
    start = time.perf_counter()
    if config is None:
        _check_folder_config(cls, folder)
    # transformers refuses custom code here
    config, model_kwargs = _config(cls, folder, config, model_kwargs, own, what)
    files = _weight_files(folder, config, model_kwargs)
    keep_fp8 = _check_quantization(config, folder, fp8)
    sources = _weight_files(folder, config, model_kwargs, index=True)  # the index too: its metadata dtype counts
    key = fingerprint(sources, model_class=concrete_class(cls, config), dtype=dtype, config=config,
                      extra=sorted((k, repr(v)) for k, v in {**model_kwargs, "fp8": fp8}.items()))
    root = os.fspath(cache_dir) if cache_dir is not None else default_root(folder, key)
    cache = ConversionCache.open(root, key, origin=folder)
    while True:
        session = None
        try:
            with driving(cache, transformers_hooks(), keep_fp8=keep_fp8, files=files) as session:
                model, info = cls.from_pretrained(folder, config=config, dtype=dtype, output_loading_info=True,
                                                  **model_kwargs)
        except RuntimeError as exc:  # transformers raises once its report lists conversion errors
            if session is None or not session.conversion_errors:
                raise
            _conversion_failed(folder, session.conversion_errors, exc)
        again = convert_again(cache, session, type(model).__name__)
        if again is None:
            break
        del model, info  # what the stale conversion made: never used
        cache = again
    if session.conversion_errors:
        _conversion_failed(folder, session.conversion_errors, None)
    problems = []
    if info.get("missing_keys"):
        problems.append(_keys.describe_keys("missing", sorted(info["missing_keys"]))
                        + " (initialised by transformers, as its own from_pretrained does)")
    if info.get("unexpected_keys"):
        problems.append(_keys.describe_keys("unexpected", sorted(info["unexpected_keys"])) + " (not loaded)")
    if info.get("mismatched_keys"):
        problems.append(_keys.describe_keys("mismatched", sorted(k[0] for k in info["mismatched_keys"])))
    if problems:
        message = f"{folder} into {type(model).__name__}: " + "; ".join(problems)
        if strict:
            raise KeyMismatchError(folder, message, sorted(info.get("missing_keys") or ()))
        warnings.warn(message, stacklevel=4)
    model.eval()
    return Unsettled(model, files, info, session.cache, time.perf_counter() - start, "transformers", folder)


def _weight_files(folder: str, config: Any, model_kwargs: dict[str, Any], index: bool = False) -> list[str]:
    """The files transformers' ``from_pretrained`` reads for these arguments
    (:func:`~mapoffload.loading.files.pretrained_files`): the load's conversion key and report
    are made from them, and the load checks that transformers resolved no other
    (:mod:`._drive_transformers`). ``index``: a sharded checkpoint's index too (the key's)."""
    return pretrained_files(
        folder, variant=model_kwargs.get("variant"), use_safetensors=model_kwargs.get("use_safetensors"),
        subfolder=model_kwargs.get("subfolder") or "", gguf_file=model_kwargs.get("gguf_file"),
        explicit=getattr(config, "transformers_weights", None), extra=tuple(getattr(type(config), "extra_files", ())),
        index=index)


def _conversion_failed(folder: str, errors: dict[str, str], cause: BaseException | None) -> None:
    """A weight transformers could not convert: an error naming it and why."""
    keys = sorted(errors)
    reasons = [line for line in errors[keys[0]].splitlines() if line.strip()]
    why = next((r for r in reasons if not r.startswith(("Traceback", " ", "Error"))), reasons[-1] if reasons else "")
    raise KeyMismatchError(folder, f"transformers could not convert {_keys.describe_keys('weight', keys)}: "
                           f"{why.strip()}", keys) from cause


@shows_option_keywords
def from_pretrained(
    cls: Any,
    folder: str | os.PathLike,
    *,
    options: OffloadOptions | None = None,
    dtype: Any = "auto",
    keep_mapping: bool | None = True,
    strict: bool = False,
    config: Any = None,
    cache_dir: str | os.PathLike | None = None,
    fp8: str = "keep",
    **keywords: Any,
) -> torch.nn.Module:
    """A transformers model from a local folder, on the file mapping, offloaded onto ``device``.

    The model is what ``cls.from_pretrained(folder)`` builds — transformers'
    key conversions, dtype resolution, ties, generation config and quantizer
    run as they do there — with every weight on a file mapping: the
    checkpoint's own, or for tensors transformers makes while loading (fused
    experts, casts, dequantized fp8) a conversion folder written once and
    reused (``report.conversion_dir``).

    Parameters
    ----------
    cls
        A model class (``LlamaForCausalLM``) or an ``AutoModel*`` class.
    folder
        A local folder written by ``save_pretrained`` (``config.json`` and
        safetensors or PyTorch files, sharded or not).
    options
        How the model is offloaded (:class:`~mapoffload.OffloadOptions`:
        ``device``, ``layers``, ``prefetch_layers``, ...); its fields may be
        given as keywords instead (``device="cuda"``), laid over ``options``.
        ``device=None`` without ``options``: no offload (the loaded model on
        the host). Checked before any loading.
    dtype
        As in transformers 5: ``"auto"`` (the config's dtype, else the
        checkpoint's), a ``torch.dtype`` or its name. A dtype other than the
        stored one converts, once, into the conversion folder.
    keep_mapping
        True (default): every weight transformers maps stays on the mapping
        (never more anonymous memory than transformers' own load). False:
        copies into host memory. None asks the gate with the bytes the model
        holds on the mapping, as :func:`~mapoffload.load_checkpoint` does
        (copies when they fit).
    strict
        Missing, unexpected or mismatched keys raise :class:`KeyMismatchError`
        instead of a warning (transformers itself initialises missing ones).
    cache_dir
        Where converted tensors are written (default: beside the checkpoint
        when writable, else ``~/.cache/mapoffload/converted``;
        ``$MAPOFFLOAD_CONVERT_DIR`` overrides).
    fp8
        For a fine-grained FP8 checkpoint (``quant_method: fp8``): ``"keep"``
        leaves each weight's fp8 codes and block scales on the mapping (one
        byte a parameter, streamed as such) and dequantizes it as it is used
        (:mod:`mapoffload.loading.fp8`), wherever that gives exactly transformers'
        dequantized weight — the rest (experts stacked from many tensors) is
        dequantized once into the conversion folder; ``"dequantize"`` does
        that for every weight (transformers' dequantized model, in bf16).
    **keywords
        The fields of :class:`~mapoffload.OffloadOptions`; the others where transformers sends them: its own keywords to its
        ``from_pretrained`` (``attn_implementation=``, ``trust_remote_code=``…),
        a configuration field to the configuration (``rms_norm_eps=1e-5``,
        ``num_hidden_layers=1``: the config, and the model, that
        ``cls.from_pretrained(folder, rms_norm_eps=1e-5)`` builds; with
        ``config=`` given, set it on that config), an argument the model's
        ``__init__`` names to it. Anything else is refused by name before
        anything is built, a misspelt keyword with the one meant (``devcie=``:
        did you mean ``device=``?). ``device_map``/``torch_dtype`` are refused
        with the mapoffload equivalent.

    Returns
    -------
    torch.nn.Module
        In eval mode. ``model.mapoffload_report`` is the
        :class:`~mapoffload.LoadReport`, ``model.mapoffload_handle`` the
        :class:`OffloadHandle` (``summary()``, ``close()``) or None.
    """
    from ._args import check_dtype
    from .offload import offload_with

    offload = load_options(WHAT, options, keywords)  # the rest of keywords are transformers'
    check_transformers_kwargs(keywords)
    if dtype is not None:
        check_dtype(dtype)  # "fp16" is refused here, naming the names, not after a load inside transformers
    check_flags(keep_mapping=keep_mapping, strict=strict)
    loaded = load_unsettled(cls, folder, dtype=dtype, strict=strict, config=config, cache_dir=cache_dir, fp8=fp8,
                            model_kwargs=keywords, own=(*keyword_names(from_pretrained), *FIELDS))
    (report,) = settle([loaded], keep_mapping, component=type(loaded.model).__name__)
    model = loaded.model
    handle: OffloadHandle | None = None
    object.__setattr__(model, "mapoffload_report", report)
    if offload is not None:
        handle = offload_with(model, offload, CallNames(
            "model.mapoffload_handle.close()",
            "mapoffload.from_pretrained(cls, folder, device=..., dtype={dtype}): converted once into a mapped "
            "conversion folder"))
    object.__setattr__(model, "mapoffload_handle", handle)
    return model
