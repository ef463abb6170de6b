"""What names a conversion folder and where it goes.

A conversion is reused by the next load of the same folder and invalidated by
any change of the sources (their real paths, sizes, modification and change
times), the model class (an ``AutoModel*`` class counts as the concrete class
it resolves to) or its code where no package's version names it (a user's
subclass, a checkpoint's own code), the requested dtype (however it is spelled),
the config or the versions: :func:`fingerprint` names the folder they live in
(:mod:`.cache`). Its root (:func:`default_root`) is, in order: the
``cache_dir`` argument, ``$MAPOFFLOAD_CONVERT_DIR`` (``~`` expanded in both), ``<checkpoint
folder>/.mapoffload-converted`` when it holds the finished conversion (a conversion made
ahead of time is reused from a read-only folder) or this user can write it, and the folder is
not a hub cache snapshot (and no file has that name), ``$XDG_CACHE_HOME/mapoffload/converted``
(``~/.cache/mapoffload/converted``).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from .code_key import class_code, class_versions

FORMAT = 1  # of the conversion folder (its manifest, and so its fingerprint)
MANIFEST = "manifest.json"  # written last in a conversion folder: a folder without it is unfinished


def default_root(folder: str, key: str | None = None) -> str:
    """Where converted files go for ``folder`` when no ``cache_dir`` is given.

    ``<folder>/.mapoffload-converted`` where it holds the finished conversion ``key`` (made
    ahead of time: reused even where this user cannot write there, a read-only folder or another
    user's), else where this user can write it (the folder made if missing); else the user's
    cache. ``$MAPOFFLOAD_CONVERT_DIR`` overrides all of it (an absolute path, ``~`` expanded;
    a relative one is refused with an :class:`~mapoffload._env.EnvSettingError`).
    """
    from ..loading.files import _hub_blobs

    env = os.environ.get("MAPOFFLOAD_CONVERT_DIR")
    if env:  # "~/conv" in a unit file or a quoted assignment: no shell expanded it
        root = os.path.expanduser(env)
        if not os.path.isabs(root):  # it would follow each process's current folder
            from .._env import EnvSettingError

            raise EnvSettingError("MAPOFFLOAD_CONVERT_DIR", env, "an absolute path (or one starting with ~/): a "
                                  "relative one would name another folder in each process's current directory")
        return root
    # Never inside a hub cache snapshot: the hub manages those folders.
    # Nor over a file of that name (someone's): it is stepped around as a folder that cannot be written is.
    local = os.path.join(folder, ".mapoffload-converted")
    if _hub_blobs(os.path.realpath(folder)) is None:
        if os.path.isdir(local):
            if key is not None and os.path.isfile(os.path.join(local, key, MANIFEST)):
                return local
            if os.access(local, os.W_OK | os.X_OK):
                return local
        elif not os.path.lexists(local) and os.access(folder, os.W_OK | os.X_OK):
            return local
    xdg = os.path.expanduser(os.environ.get("XDG_CACHE_HOME") or "")
    # The XDG spec: a relative value is invalid and ignored (it would follow each process's current folder).
    base = xdg if os.path.isabs(xdg) else os.path.expanduser(os.path.join("~", ".cache"))
    return os.path.join(base, "mapoffload", "converted")


def concrete_class(cls: Any, config: Any) -> Any:
    """The model class ``cls.from_pretrained`` builds for ``config``: an ``AutoModel*`` class resolved
    as transformers resolves it (``AutoModelForCausalLM`` -> ``LlamaForCausalLM``), any other as it is.

    A conversion's bytes are made by that class, so every entry point that ends in the same class
    shares one conversion folder. An Auto class the config maps to remote code (``auto_map``) or
    does not map at all stays itself (its own key).
    """
    mapping = getattr(cls, "_model_mapping", None)
    if mapping is None:
        return cls
    if cls.__name__ in (getattr(config, "auto_map", None) or {}):
        return cls
    try:
        from transformers.models.auto.auto_factory import _get_model_class

        return _get_model_class(config, mapping)
    except (ImportError, KeyError, ValueError, AttributeError, TypeError):
        return cls


def _class_name(model_class: Any) -> str:
    if isinstance(model_class, str):
        return model_class
    return f"{model_class.__module__}.{model_class.__qualname__}"


def _dtype_name(dtype: Any) -> str:
    """One spelling per dtype: ``"float16"``, ``"half"`` and ``torch.float16`` make the same bytes."""
    import torch

    if isinstance(dtype, str) and dtype != "auto":
        value = getattr(torch, dtype, None)
        if isinstance(value, torch.dtype):
            return str(value)
    return str(dtype)


def _config_text(config: Any) -> str:
    """The config as its values, without ``_name_or_path`` (the folder as the caller spelled it;
    ``AutoConfig`` sets it, a model's own config class does not)."""
    if not hasattr(config, "to_json_string"):
        return repr(config)
    data = json.loads(config.to_json_string(use_diff=False))
    if isinstance(data, dict):
        data.pop("_name_or_path", None)
    return json.dumps(data, sort_keys=True)


def fingerprint(files: list[str], *, model_class: Any, dtype: Any, config: Any, extra: Any = None) -> str:
    """A hex digest of everything a conversion's result depends on: the sources, the concrete model
    class (a class or its qualified name; see :func:`concrete_class`) and its code where no package
    version names it (:mod:`.code_key`), the dtype, the config, the versions, ``extra`` -- never how the
    caller spelled them."""
    import torch
    import transformers

    sources = []
    for f in files:
        # Where the bytes are (the real path: two checkpoints with the same names, sizes and
        # times -- normalised timestamps of an image layer or a tar -- never share a conversion
        # in a shared root), and their change time, which no copy (cp -p, rsync -a) preserves.
        st = os.stat(f)
        sources.append([os.path.realpath(f), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino])
    # diffusers' loader (its key conversions) for its models and their subclasses, say
    versions = {"transformers": transformers.__version__, "torch": torch.__version__, **class_versions(model_class)}
    blob = json.dumps({
        "format": FORMAT, **versions, "code": class_code(model_class, config, files),
        "class": _class_name(model_class), "dtype": _dtype_name(dtype), "sources": sources,
        "config": _config_text(config),
        "extra": repr(extra),
    }, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]
