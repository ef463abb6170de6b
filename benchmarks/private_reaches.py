"""Count the tests' reaches into private attributes of the library's objects (a code-health measure).

A reach is a line of ``tests/*.py`` with ``obj._name`` (an attribute access, or ``getattr`` /
``setattr`` / ``hasattr`` / ``monkeypatch.setattr`` of the string ``"_name"``) where ``_name`` is not
a module of the package (``mapoffload._core``, ``vllm._options``: a module path, not an object's
insides), not torch's or Python's own (``_parameters``, ``_buffers``, ``sys._getframe``...) and not
on a test's own object (``self._x``).

    python benchmarks/private_reaches.py [REPO]      # the count, then the lines
"""

from __future__ import annotations

import ast
import os
import sys

TORCH_OWN = {"_parameters", "_buffers", "_modules", "_forward_hooks", "_forward_pre_hooks", "_make_subclass",
             "_dynamo", "_inductor", "_C", "_getframe", "_exit", "_version", "_memo", "_utils",
             "_set_warn_deprecated_on_mutable_data_ptr", "_asdict", "_replace", "_fields", "_value_", "_name_"}


NOT_LIBRARY = {"self", "torch", "argparse", "sys", "os", "ctypes", "np", "transformers", "diffusers", "vllm"}


def module_names(repo: str) -> set[str]:
    names = set()
    for root, dirs, files in os.walk(os.path.join(repo, "mapoffload")):
        names.update(d for d in dirs if d.startswith("_"))
        names.update(f[:-3] for f in files if f.endswith(".py") and f.startswith("_"))
    return names


def reaches(repo: str) -> list[str]:
    skip = module_names(repo) | TORCH_OWN
    found = []
    folder = os.path.join(repo, "tests")
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".py"):
            continue
        path = os.path.join(folder, name)
        with open(path) as f:
            source = f.read()
        lines = set()
        for node in ast.walk(ast.parse(source)):
            attr = None
            if isinstance(node, ast.Attribute):
                base = node.value
                while isinstance(base, ast.Attribute):
                    base = base.value
                if isinstance(base, ast.Name) and base.id in NOT_LIBRARY:
                    continue  # a test's own object (self), or another library's
                attr = node.attr
            elif isinstance(node, ast.Call) and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
                fn = node.func
                fname = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
                if fname in ("getattr", "setattr", "hasattr", "delattr") and isinstance(node.args[1].value, str):
                    attr = node.args[1].value
            if attr and attr.startswith("_") and not attr.startswith("__") and attr not in skip:
                lines.add(node.lineno)
        text = source.splitlines()
        found += [f"tests/{name}:{n}: {text[n - 1].strip()}" for n in sorted(lines)]
    return found


if __name__ == "__main__":
    found = reaches(sys.argv[1] if len(sys.argv) > 1 else ".")
    print(len(found))
    print("\n".join(found))
