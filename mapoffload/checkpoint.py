"""``mapoffload.checkpoint``, a contract name (``shared/DESIGN.md``): the module is :mod:`mapoffload.loading.checkpoint`.

The same module object under both names, so that an attribute set on one (a test's monkeypatch) is
seen through the other.
"""

import sys

from .loading import checkpoint as _module

sys.modules[__name__] = _module
