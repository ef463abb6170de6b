"""What a user's code is, followed as it runs: for a conversion's key (:mod:`.code_key`).

A function is hashed by its bytecode (normalised: the same in every process), its default values, what it
wraps (a decorator's ``__wrapped__``), and what it reaches: the names its code loads as globals
(``LOAD_GLOBAL``: never an attribute of the same name, ``self.model`` is not the script's ``model``), the
values in its closure, and the attributes it reads of a user module it loads. A class is hashed by the
functions its body defines, its plain values (a ``DTYPE`` its code reads as ``self.DTYPE``) and its
bases. What is reached is followed where it is a user's code:

- **ours** (a script, a notebook, a project's module not installed, a checkpoint's own code): followed;
- **installed** (under ``site-packages``: accelerate, peft, a project installed with ``pip install .``):
  named by its distribution's version, not followed;
- **versioned** (transformers, diffusers, torch, vLLM: their versions are in the key) and Python's own:
  named only.

Values are hashed as text the same in every process (:func:`canonical`): containers of the builtin kinds
by their items, enums, partials, tensors and arrays by what they hold; any other object by its class
(walked when ours) and its ``__dict__``. Nothing here raises: a value that cannot be read (its ``repr``
raises, a ``__getattr__`` that fails) is hashed as unreadable, by its label.
"""

from __future__ import annotations

import builtins
import dis
import enum
import functools
import hashlib
import importlib.metadata
import os
import re
import sys
import sysconfig
import types
from typing import Any

# Packages whose release names their classes' code: their version stands for it (in the key beside it).
VERSIONED = ("transformers", "diffusers", "torch", "vllm")
_INSTALLED = ("site-packages", "dist-packages")
_STDLIB = tuple(os.path.realpath(sysconfig.get_paths()[k]) for k in ("stdlib", "platstdlib"))
_DEPTH = 24  # how deep values and code are followed
_ITEMS = 100_000  # a container larger than this is named by its kind and length only
_TENSOR_BYTES = 1 << 24  # a constant tensor or array up to this is hashed by its bytes
_CODE_KINDS = (types.FunctionType, staticmethod, classmethod, property, functools.cached_property)


def _is_python(module_name: str, where: Any = None) -> bool:
    """Whether a module is Python's own (the standard library, ``builtins``): not a user's package that
    happens to share a standard module's name (``code.model``). Told by its file (``where``, from the
    globals its code runs in, else the imported module's); a module of that name not imported is a user's
    code run by ``exec``."""
    top = module_name.partition(".")[0]
    if top == "builtins" or module_name in sys.builtin_module_names:
        return True
    if top not in sys.stdlib_module_names:
        return False
    if not isinstance(where, str):
        module = sys.modules.get(module_name)
        if not isinstance(module, types.ModuleType):
            return False
        where = vars(module).get("__file__")
        if not isinstance(where, str):
            return True  # frozen or built in
    return os.path.realpath(where).startswith(_STDLIB)


def shipped(klass: type) -> str | None:
    """The versioned package ``klass`` comes from; "" for Python's own classes; None for any other."""
    module = klass.__module__ if isinstance(klass.__module__, str) else ""
    top = module.partition(".")[0]
    if top in VERSIONED:
        return top
    if top == "builtins":  # a genuine builtin, or a class exec'd without a __name__ in its globals
        return "" if getattr(builtins, klass.__name__, None) is klass else None
    return "" if _is_python(module, _code_globals(klass).get("__file__")) else None


def _code_globals(value: Any) -> dict:
    """The globals ``value``'s code runs in: a function's (under its decorators: the innermost wrapped
    one's), a class's functions' (else its module's)."""
    if isinstance(value, type):
        functions = _own_functions(value)
        if functions:
            return _code_globals(functions[0])
        module = sys.modules.get(value.__module__) if isinstance(value.__module__, str) else None
        return vars(module) if isinstance(module, types.ModuleType) else {}
    inner = [f for f in _wraps(value) if isinstance(f, types.FunctionType)]
    found = inner[-1].__globals__ if inner else getattr(value, "__globals__", None)
    return found if isinstance(found, dict) else {}


def _own_functions(klass: type) -> list[Any]:
    """The functions ``klass``'s own body defined (not one assigned from elsewhere: ``ACT = F.silu``)."""
    out = []
    for value in vars(klass).values():
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        if isinstance(value, types.FunctionType) and value.__qualname__.startswith(klass.__qualname__ + "."):
            out.append(value)
    return out


@functools.lru_cache(maxsize=None)
def _distribution(top: str) -> str:
    """``name==version`` of the installed distributions that provide the top-level module ``top``."""
    try:
        names = importlib.metadata.packages_distributions().get(top) or []
        return ",".join(sorted(f"{n}=={importlib.metadata.version(n)}" for n in set(names))) or f"{top}==?"
    except Exception:  # noqa: BLE001 - a broken distribution's metadata: named without a version
        return f"{top}==?"


def origin(value: Any) -> tuple[str, str]:
    """Where a function's or class's code comes from: ``("ours", "")``, ``("installed", "dist==version")``,
    ``("versioned", package)`` or ``("python", "")``. Told by the globals its code runs in (a class: those
    of a function its body defined, else its module's), which an ``exec`` gives too."""
    if isinstance(value, type):
        package = shipped(value)
        if package is not None:
            return ("versioned", package) if package else ("python", "")
    found = _code_globals(value)
    name = found.get("__name__")
    name = name if isinstance(name, str) else ""
    top = name.partition(".")[0]
    if top in VERSIONED:
        return "versioned", top
    if name and _is_python(name, found.get("__file__")):
        return "python", ""
    where = found.get("__file__")
    if isinstance(where, str) and any(p in _INSTALLED for p in os.path.normpath(where).split(os.sep)):
        return "installed", _distribution(top)
    return "ours", ""


def canonical(value: Any, depth: int = 0) -> str:
    """A value as the same text in every process (sets sorted; no addresses; an object by its kind)."""
    kind = type(value)
    if depth > _DEPTH:
        return f"<{kind.__qualname__} too deep>"
    if kind in (str, bytes, int, float, complex, bool, type(None)):
        return repr(value)
    if kind.__module__ == "torch" and kind.__name__ in ("dtype", "device", "Size", "memory_format", "layout"):
        return repr(value)  # torch.float16 and torch.float32 are two values of one kind
    if kind in (set, frozenset, list, tuple, dict) or (isinstance(value, tuple) and hasattr(value, "_fields")):
        if len(value) > _ITEMS:
            return f"<{kind.__qualname__} of {len(value)}>"
        if isinstance(value, dict):
            return "{" + ", ".join(sorted(f"{canonical(k, depth + 1)}: {canonical(v, depth + 1)}"
                                          for k, v in value.items())) + "}"
        items = [canonical(v, depth + 1) for v in value]
        return kind.__qualname__ + "[" + ", ".join(sorted(items) if kind in (set, frozenset) else items) + "]"
    if isinstance(value, re.Pattern):
        return f"re({value.pattern!r}, {value.flags})"
    if isinstance(value, enum.Enum):
        return f"{kind.__qualname__}.{value.name}={canonical(value.value, depth + 1)}"
    if kind.__module__ == "torch" and kind.__name__ in ("Tensor", "Parameter") or kind.__name__ == "ndarray":
        return _array_text(value)
    return kind.__qualname__  # an object of its own: its kind, not its address (followed by hash_reached)


def _array_text(value: Any) -> str:
    """A tensor or array constant: its kind, dtype, shape, and a digest of its bytes where it has them."""
    kind = type(value).__qualname__
    shape, dtype = tuple(getattr(value, "shape", ())), str(getattr(value, "dtype", ""))
    try:
        if kind == "ndarray":
            data = value.tobytes() if value.nbytes <= _TENSOR_BYTES else b""
        elif value.device.type == "cpu" and str(value.layout) == "torch.strided" and value.nbytes <= _TENSOR_BYTES:
            torch = sys.modules["torch"]
            data = value.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        else:
            data = b""
    except Exception:  # noqa: BLE001 - a meta tensor, a subclass's own views: its shape and dtype only
        data = b""
    return f"{kind}({dtype}, {shape}, {hashlib.sha256(data).hexdigest() if data else 'unread'})"


def _global_loads(code: types.CodeType) -> tuple[set[str], set[str]]:
    """The names ``code`` (and the code nested in it) loads as globals, and every name it uses (a user
    module's attributes among them)."""
    loads: set[str] = set()
    names: set[str] = set()
    stack = [code]
    while stack:
        c = stack.pop()
        names.update(c.co_names)
        loads.update(i.argval for i in dis.get_instructions(c) if i.opname in ("LOAD_GLOBAL", "LOAD_NAME"))
        stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    return loads, names


def hash_code(code: types.CodeType, h: Any) -> None:
    """The bytecode and the names and constants it uses (nested code included)."""
    h.update(code.co_code)
    h.update(repr((code.co_names, code.co_varnames, code.co_freevars, code.co_argcount)).encode())
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            hash_code(const, h)
        else:
            h.update(canonical(const).encode())


def _function_items(function: types.FunctionType) -> list[tuple[str, Any]]:
    """What a function reaches: its defaults, its globals loaded (a user module's attributes it reads),
    its closure's values."""
    loads, names = _global_loads(function.__code__)
    found = function.__globals__
    out: list[tuple[str, Any]] = [("defaults", function.__defaults__), ("kwdefaults", function.__kwdefaults__)]
    for n in sorted(loads):
        if n in found:
            value = found[n]
            out.append((f"global {n}", value))
            if isinstance(value, types.ModuleType) and origin_of_module(value) == "ours":
                out.extend((f"global {n}.{a}", vars(value)[a]) for a in sorted(names) if a in vars(value))
    for name, cell in zip(function.__code__.co_freevars, function.__closure__ or ()):
        try:
            out.append((f"cell {name}", cell.cell_contents))
        except ValueError:  # an empty cell
            continue
    return out


def origin_of_module(module: types.ModuleType) -> str:
    """``"ours"`` or not, for a module a function loads (its attributes are followed where ours)."""
    name = getattr(module, "__name__", "")
    if not isinstance(name, str) or name.partition(".")[0] in VERSIONED or _is_python(name):
        return "other"
    where = vars(module).get("__file__")  # not getattr: a module's __getattr__ may raise anything
    if isinstance(where, str) and any(p in _INSTALLED for p in os.path.normpath(where).split(os.sep)):
        return "other"
    return "ours"


def _wraps(function: Any) -> list[Any]:
    """``function`` and what it wraps in turn (a decorator's ``__wrapped__``: ``@torch.no_grad()`` on a
    user's helper is torch's wrapper around the user's code)."""
    out = [function]
    for _ in range(8):
        function = getattr(function, "__wrapped__", None)
        if function is None:
            break
        out.append(function)
    return out


def hash_function(function: Any, h: Any, seen: set[int], depth: int) -> None:
    """A function of ours: its code, and a decorator's wrapped code in turn, each with what it reaches."""
    for f in _wraps(function):
        h.update(b"wraps")
        if isinstance(f, types.FunctionType):
            hash_code(f.__code__, h)
            try:
                items = _function_items(f)
            except Exception as exc:  # noqa: BLE001 - a module of its globals whose attributes raise
                h.update(f"unreadable {type(exc).__name__}".encode())
                continue
            hash_reached(items, h, seen, depth + 1)


def hash_class(klass: type, h: Any, seen: set[int], depth: int) -> None:
    """A class of ours: what its body defines (functions, properties), the plain values its own code reads
    (all of them in a class that defines no function: a holder of settings), its bases.

    Only the values its code reads: transformers caches answers on a model's class as it loads it
    (``_can_set_experts_implementation_cached_value``), which would change the key between the first
    two loads of every process."""
    own = _own_functions(klass)
    read: set[str] = set()
    for function in own:
        read |= _global_loads(function.__code__)[1]
    for name in sorted(vars(klass)):
        if name in ("__dict__", "__weakref__", "__module__", "__doc__", "__qualname__"):
            continue
        value = vars(klass)[name]
        if own and name not in read and not isinstance(value, (*_CODE_KINDS, type)):
            continue
        h.update(f"attribute {name}".encode())
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        if isinstance(value, property):
            for part in (value.fget, value.fset, value.fdel):
                hash_reached([("part", part)], h, seen, depth)
        elif isinstance(value, functools.cached_property):
            hash_reached([("cached", value.func)], h, seen, depth)
        elif isinstance(value, types.FunctionType) and value in _own_functions(klass):
            hash_function(value, h, seen, depth)
        else:
            hash_reached([("value", value)], h, seen, depth)
    hash_reached([(f"base {i}", base) for i, base in enumerate(klass.__bases__)], h, seen, depth)
    hash_reached([("metaclass", type(klass))], h, seen, depth)


def hash_reached(items: list[tuple[str, Any]], h: Any, seen: set[int], depth: int) -> None:
    """Hash what code reaches (see the module): never raises; what cannot be read is hashed as such."""
    for label, value in items:
        h.update(label.encode())
        try:
            _hash_value(value, h, seen, depth)
        except Exception as exc:  # noqa: BLE001 - a value whose repr, attributes or iteration raise
            h.update(f"unreadable {type(exc).__name__}".encode())


def _hash_value(value: Any, h: Any, seen: set[int], depth: int) -> None:
    if depth > _DEPTH:
        h.update(b"too deep")
        return
    if isinstance(value, (types.FunctionType, type)):
        where, version = origin(value)  # a user's helper under another's decorator is ours (_code_globals)
        h.update(f"{where} {version} {value.__module__}.{value.__qualname__}".encode())
        if where != "ours":
            return
        if id(value) in seen:
            return  # hashed once (recursion ends): the name says which
        seen.add(id(value))
        (hash_class if isinstance(value, type) else hash_function)(value, h, seen, depth + 1)
    elif isinstance(value, functools.partial):
        hash_reached([("func", value.func), ("args", value.args), ("keywords", value.keywords)], h, seen, depth + 1)
    elif isinstance(value, types.MethodType):
        hash_reached([("func", value.__func__), ("self", value.__self__)], h, seen, depth + 1)
    elif isinstance(value, (types.ModuleType, types.BuiltinFunctionType)):
        h.update(f"{getattr(value, '__name__', '')}".encode())
    elif type(value) in (list, tuple, set, frozenset, dict):
        if len(value) > _ITEMS or id(value) in seen:  # a container holding itself is hashed once
            h.update(f"<{type(value).__qualname__} of {len(value)}>".encode())
            return
        seen.add(id(value))
        members = sorted(value.items(), key=lambda kv: canonical(kv[0])) if isinstance(value, dict) else (
            sorted(value, key=canonical) if isinstance(value, (set, frozenset)) else list(value))
        h.update(type(value).__qualname__.encode())
        for i, member in enumerate(members):
            if isinstance(value, dict):
                h.update(canonical(member[0], depth + 1).encode())
                member = member[1]
            hash_reached([(f"[{i}]", member)], h, seen, depth + 1)
    else:
        text = canonical(value, depth)
        h.update(text.encode())
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(value, torch.nn.Module):  # a model: its class, never its weights
            h.update(" ".join(origin(type(value))).encode())
        elif text == type(value).__qualname__ and origin(type(value))[0] in ("ours", "python") \
                and id(value) not in seen:
            seen.add(id(value))  # an object of a class of ours: its class, and what it holds
            hash_reached([("class", type(value))], h, seen, depth + 1)
            state = getattr(value, "__dict__", None)
            if type(state) is dict:
                hash_reached([("state", state)], h, seen, depth + 1)
        elif text == type(value).__qualname__:  # another's object: its class's origin (a version) names it
            h.update(" ".join(origin(type(value))).encode())
