"""What a model class's code is, for a conversion's key (:func:`~.naming.fingerprint`).

A conversion holds what a load made of the checkpoint: its bytes follow from the model class as much as
from the files. A class a package release ships (transformers, diffusers) is named by that release's
version. Everything else is keyed on what runs, not on a source file, which may have been edited since
the class was imported, or may not exist (a class made by ``exec``):

- the attributes the loaders read to decide what a weight becomes (``_keep_in_fp32_modules``, the
  checkpoint's key conversions, tied names: :data:`LOAD_ATTRIBUTES`), as the class answers them through
  its MRO: set in a class body, after it, or on a package's class by a monkeypatch;
- the bytecode of each function a class outside those packages defines (its ``__init__`` builds the
  modules), normalised so that two processes running the same code agree; and what that code reaches
  through its module's names and its closures (a helper function, a block class, a constant such as a
  dtype), followed as far as it stays outside those packages;
- where the config maps classes to the checkpoint's own code (``auto_map``), the ``.py`` files beside it
  (an Auto class stays itself before the load: which class it builds is not known yet).

A change in any of these converts again; missed, an old conversion gave the old code's weights, silently.
"""

from __future__ import annotations

import builtins
import hashlib
import inspect
import os
import re
import sys
import types
from typing import Any

# Packages whose release names their classes' code: their version stands for it.
VERSIONED = ("transformers", "diffusers", "torch", "vllm")
# Class attributes transformers' and diffusers' loaders read to decide a weight's dtype, name or tie.
LOAD_ATTRIBUTES = re.compile(r"base_model_prefix|_keep_in_fp32_modules\w*|_keys_to_ignore_on_load\w*|"
                             r"_checkpoint_conversion_mapping|_tied_weights_keys|_supports_param_buffer_assignment|"
                             r"_precision_sensitive_module_patterns|_skip_layerwise_casting_patterns")


def _canonical(value: Any) -> str:
    """A value as the same text in every process (sets sorted; no addresses)."""
    if isinstance(value, (set, frozenset)):
        return "{" + ", ".join(sorted(_canonical(v) for v in value)) + "}"
    if isinstance(value, (list, tuple)):
        return type(value).__name__ + "[" + ", ".join(_canonical(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(sorted(f"{_canonical(k)}: {_canonical(v)}" for k, v in value.items())) + "}"
    if isinstance(value, re.Pattern):
        return f"re({value.pattern!r}, {value.flags})"
    if type(value).__module__ == "torch" and type(value).__name__ in ("dtype", "device", "Size"):
        return repr(value)  # torch.float16 and torch.float32 are two values of one kind
    if isinstance(value, (str, bytes, int, float, complex, bool, type(None))):
        return repr(value)
    return type(value).__qualname__  # an object of its own: its kind, not its address


def _hash_code(code: types.CodeType, h: Any) -> None:
    h.update(code.co_code)
    h.update(repr((code.co_names, code.co_varnames, code.co_freevars, code.co_argcount)).encode())
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            _hash_code(const, h)
        else:
            h.update(_canonical(const).encode())


def _functions(klass: type) -> list[tuple[str, types.CodeType, Any]]:
    """The code of each function ``klass`` itself defines (methods, static and class methods, properties),
    with the function."""
    out = []
    for name, value in vars(klass).items():
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        parts = [value.fget, value.fset, value.fdel] if isinstance(value, property) else [value]
        for i, part in enumerate(parts):
            for depth in range(8):  # a decorated method: the wrapper's code, then what it wraps (__wrapped__)
                code = getattr(part, "__code__", None)
                if isinstance(code, types.CodeType):
                    out.append((f"{name}.{i}.{depth}", code, part))
                part = getattr(part, "__wrapped__", None)
                if part is None:
                    break
    return sorted(out, key=lambda item: item[0])


def _reached(code: types.CodeType, function: Any) -> list[tuple[str, Any]]:
    """What ``code`` (of ``function``) names in its module's globals and holds in its closure, by name."""
    names: set[str] = set()
    stack = [code]
    while stack:
        c = stack.pop()
        names.update(c.co_names)
        stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    found = getattr(function, "__globals__", None) or {}
    out = [(f"global {n}", found[n]) for n in sorted(names) if n in found]
    cells = getattr(function, "__closure__", None) or ()
    for name, cell in zip(getattr(code, "co_freevars", ()), cells):
        try:
            out.append((f"cell {name}", cell.cell_contents))
        except ValueError:  # an empty cell
            continue
    return out


def _ours(value: Any) -> bool:
    """Whether a function or class is code no package install names: a user's (a script, a notebook, a
    module of their project) or a checkpoint's own (``trust_remote_code``), not an installed package's
    (under ``site-packages``) nor Python's. Told by the globals its code runs in (a class: its module's,
    or its functions'), which an ``exec`` gives too."""
    if isinstance(value, type):
        if _shipped(value) is not None:
            return False
        functions = [f for _, _, f in _functions(value) if hasattr(f, "__globals__")]
        module = sys.modules.get(value.__module__)
        found = functions[0].__globals__ if functions else vars(module) if module is not None else {}
    else:
        found = value.__globals__
    top = str(found.get("__name__", "")).partition(".")[0]
    if top in VERSIONED or top in sys.stdlib_module_names or top == "builtins":
        return False
    where = found.get("__file__")
    return not isinstance(where, str) or not any(p in _INSTALLED for p in os.path.normpath(where).split(os.sep))


_INSTALLED = ("site-packages", "dist-packages")


def _hash_reached(items: list[tuple[str, Any]], h: Any, seen: set[int], depth: int) -> None:
    """Hash what code reaches (:func:`_reached`): another function or class of ours by its code (each once,
    however often reached: recursion ends), a value by its canonical text, anything else by its kind."""
    for label, value in items:
        h.update(label.encode())
        if isinstance(value, (types.FunctionType, type)) and _ours(value):
            if id(value) in seen or depth > 32:
                h.update(b"seen " + value.__qualname__.encode())
                continue
            seen.add(id(value))
            _hash_class_or_function(value, h, seen, depth + 1)
        elif isinstance(value, (types.ModuleType, types.FunctionType, types.BuiltinFunctionType, type)):
            h.update(f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', value.__name__)}".encode())
        else:
            h.update(_canonical(value).encode())


def _hash_class_or_function(value: Any, h: Any, seen: set[int], depth: int) -> None:
    """A class's or a function's code and what it reaches; a class's plain values too (a ``DTYPE = ...`` its
    code reads as ``self.DTYPE``)."""
    functions = _functions(value) if isinstance(value, type) else [("", value.__code__, value)]
    for name, code, function in functions:
        h.update(name.encode())
        _hash_code(code, h)
        _hash_reached(_reached(code, function), h, seen, depth)
    if isinstance(value, type):
        values = [(f"attribute {n}", v) for n, v in sorted(vars(value).items(), key=lambda item: item[0])
                  if not n.startswith("__") and not isinstance(v, _CODE_KINDS)]
        _hash_reached(values, h, seen, depth)


_CODE_KINDS = (types.FunctionType, staticmethod, classmethod, property)


def _shipped(klass: type) -> str | None:
    """The versioned package ``klass`` comes from; "" for Python's own classes; None for any other."""
    top = klass.__module__.partition(".")[0]
    if top in VERSIONED:
        return top
    if top == "builtins":  # a genuine builtin, or a class exec'd without a __name__ in its globals
        return "" if getattr(builtins, klass.__name__, None) is klass else None
    return "" if top in sys.stdlib_module_names else None


def class_versions(model_class: Any) -> dict[str, str]:
    """The version of each package that ships a class in ``model_class``'s MRO (a user's subclass of a
    diffusers model: diffusers' too)."""
    out = {}
    for klass in inspect.getmro(model_class) if isinstance(model_class, type) else ():
        package = _shipped(klass)
        version = getattr(sys.modules.get(package or ""), "__version__", None)
        if package and version is not None:
            out[package] = str(version)
    return out


def class_code(model_class: Any, config: Any, files: list[str]) -> dict[str, str]:
    """Digests of what ``model_class``'s code is (see the module): the load attributes, the functions of
    its classes no package ships, and the checkpoint's own ``.py`` files under ``auto_map``."""
    out: dict[str, str] = {}
    if isinstance(model_class, type):
        values = {name: _canonical(getattr(model_class, name)) for name in dir(model_class)
                  if LOAD_ATTRIBUTES.fullmatch(name)}
        out["attributes"] = hashlib.sha256(repr(sorted(values.items())).encode()).hexdigest()
        for klass in inspect.getmro(model_class):
            if _shipped(klass) is not None:
                continue
            h = hashlib.sha256(repr(sys.version_info[:2]).encode())  # bytecode is Python's version's
            seen: set[int] = {id(k) for k in inspect.getmro(model_class)}  # each hashed on its own
            _hash_class_or_function(klass, h, seen, 0)
            out[f"{klass.__module__}.{klass.__qualname__}"] = h.hexdigest()
    if getattr(config, "auto_map", None):
        for folder in sorted({os.path.dirname(os.path.realpath(f)) for f in files}):
            for name in sorted(os.listdir(folder)):
                if name.endswith(".py"):
                    with open(os.path.join(folder, name), "rb") as fh:
                        out[os.path.join(folder, name)] = hashlib.sha256(fh.read()).hexdigest()
    return out
