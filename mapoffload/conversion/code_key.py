"""What a model class's code is, for a conversion's key (:func:`~.naming.fingerprint`).

A conversion holds what a load made of the checkpoint: its bytes follow from the model class as much as
from the files. A class a package release ships (transformers, diffusers) is named by that release's
version. Everything else is keyed on what runs, not on a source file, which may have been edited since
the class was imported, or may not exist (a class made by ``exec``):

- the attributes the loaders read to decide what a weight becomes (``_keep_in_fp32_modules``, the
  checkpoint's key conversions, tied names: :data:`LOAD_ATTRIBUTES`), as the class answers them through
  its MRO: set in a class body, after it, or on a package's class by a monkeypatch;
- each class of its MRO outside those packages as :mod:`.code_reach` hashes it: the bytecode of what its
  body defines (its ``__init__`` builds the modules), its plain values, and what that code reaches as it
  runs (a helper function, a block class, a constant such as a dtype, a default argument), followed as
  far as it is a user's code; an installed package's is named by its version;
- where the config maps classes to the checkpoint's own code (``auto_map``), the ``.py`` files beside it
  (an Auto class stays itself before the load: which class it builds is not known yet).

A change in any of these converts again; missed, an old conversion gave the old code's weights, silently.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import re
import sys
from typing import Any

from .code_reach import canonical, hash_class, shipped

# Class attributes transformers' and diffusers' loaders read to decide a weight's dtype, name or tie.
LOAD_ATTRIBUTES = re.compile(r"base_model_prefix|_keep_in_fp32_modules\w*|_keys_to_ignore_on_load\w*|"
                             r"_checkpoint_conversion_mapping|_tied_weights_keys|_supports_param_buffer_assignment|"
                             r"_precision_sensitive_module_patterns|_skip_layerwise_casting_patterns")


def class_versions(model_class: Any) -> dict[str, str]:
    """The version of each package that ships a class in ``model_class``'s MRO (a user's subclass of a
    diffusers model: diffusers' too)."""
    out = {}
    for klass in inspect.getmro(model_class) if isinstance(model_class, type) else ():
        package = shipped(klass)
        version = getattr(sys.modules.get(package or ""), "__version__", None)
        if package and version is not None:
            out[package] = str(version)
    return out


def class_code(model_class: Any, config: Any, files: list[str]) -> dict[str, str]:
    """Digests of what ``model_class``'s code is (see the module): the load attributes, the functions of
    its classes no package ships, and the checkpoint's own ``.py`` files under ``auto_map``."""
    out: dict[str, str] = {}
    if isinstance(model_class, type):
        values = {name: canonical(getattr(model_class, name)) for name in dir(model_class)
                  if LOAD_ATTRIBUTES.fullmatch(name)}
        out["attributes"] = hashlib.sha256(repr(sorted(values.items())).encode()).hexdigest()
        mro = inspect.getmro(model_class)
        for klass in mro:
            if shipped(klass) is not None:
                continue
            h = hashlib.sha256(repr(sys.version_info[:2]).encode())  # bytecode is Python's version's
            hash_class(klass, h, {id(k) for k in mro}, 0)  # each class of the MRO hashed on its own
            out[f"{klass.__module__}.{klass.__qualname__}"] = h.hexdigest()
    if getattr(config, "auto_map", None):
        for folder in sorted({os.path.dirname(os.path.realpath(f)) for f in files}):
            for name in sorted(os.listdir(folder)):
                if name.endswith(".py"):
                    with open(os.path.join(folder, name), "rb") as fh:
                        out[os.path.join(folder, name)] = hashlib.sha256(fh.read()).hexdigest()
    return out
