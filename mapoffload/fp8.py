"""``mapoffload.fp8``, the name the docs give the fp8 parametrization (``docs/usage.md``): the module is :mod:`mapoffload.loading.fp8`.

The same module object under both names, so that an attribute set on one (a test's monkeypatch) is
seen through the other.
"""

import sys

from .loading import fp8 as _module

sys.modules[__name__] = _module
