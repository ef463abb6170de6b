"""From the torch hook to the work in three of our calls (issue 42): torch calls the layer's ``Hook``,
which calls the layer's pre-hook (``offload/runtime.py``); from there one call into the sequencer and one
into the load target reach the copy (the twin's ``Copier.copy_spans``) or the read in place
(``LayerPages.read_in``), and the wait for it (``Target.ready``)."""

from __future__ import annotations

import inspect

import pytest
import torch

from mapoffload import LayerwiseOffloadManager
from mapoffload.copier import Copier
from mapoffload.offload.device_copies import DeviceCopies
from mapoffload.offload.loads import InPlace
from mapoffload.pagecache.layer_pages import LayerPages
from stacks import mapped

MAX_CALLS = 3


def calls_after_hook(frames: list[inspect.FrameInfo]) -> list[str] | None:
    """The functions between the innermost ``Hook.__call__`` (left out) and the recorded one (left out),
    outermost first, torch's own frames left out (TorchDynamo's ``disable`` wrapper, once it is imported);
    None where no hook is on the stack (a call not made by a torch hook)."""
    names = [f.frame.f_code.co_qualname for f in frames[1:]  # frames[0]: the recorder itself
             if not f.frame.f_globals.get("__name__", "").startswith("torch")]
    try:
        hook = names.index("Hook.__call__")
    except ValueError:
        return None
    return names[:hook][::-1]


def _record(monkeypatch, cls, name: str, seen: list) -> None:
    original = getattr(cls, name)

    def recorder(*args, **kwargs):
        seen.append((name, calls_after_hook(inspect.stack(0))))
        return original(*args, **kwargs)

    monkeypatch.setattr(cls, name, recorder)


def _run(ckpt, **kw) -> None:
    path, x, want = ckpt
    model = mapped(path)
    with LayerwiseOffloadManager(model, "blocks", **kw) as mgr:
        mgr.register_forward_hooks()
        with torch.no_grad():
            assert torch.equal(model(x), want)


@pytest.mark.parametrize("twin", [True, False], ids=["device-twin", "in-place"])
def test_from_the_hook_to_the_copy_in_three_calls(ckpt, monkeypatch, twin):
    seen: list = []
    if twin:
        _record(monkeypatch, Copier, "copy_spans", seen)
        _record(monkeypatch, DeviceCopies, "ready", seen)
    else:
        _record(monkeypatch, LayerPages, "read_in", seen)
        _record(monkeypatch, InPlace, "ready", seen)
    _run(ckpt, device="cpu", cpu_twin=twin, prefetch_layers=0)
    from_hooks = [(name, calls) for name, calls in seen if calls is not None]
    work = "copy_spans" if twin else "read_in"
    assert {name for name, _ in from_hooks} == {work, "ready"}, seen
    for name, calls in from_hooks:
        ours = calls + ["Target.ready"] if name == "ready" else calls  # the copy is called by Target.start
        assert len(ours) <= MAX_CALLS, (name, calls)
        assert ours[-1].split(".")[-1] in ("start", "ready"), calls
        assert calls[0].endswith("pre_hook"), calls  # the hook's work is in the runtime's pre-hook


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "dynamo-imported"])
def test_the_count_sees_every_frame(compiled):
    """The control: a function two calls below a ``Hook`` counts two, with TorchDynamo imported too."""
    if compiled:
        import torch._dynamo  # noqa: F401  (a Hook made now wraps its function in compiler.disable)
    from mapoffload.offload.hooks import Hook

    got = []

    def work():
        got.append(calls_after_hook(inspect.stack(0)))

    def middle():
        work()

    def outer(*_):
        middle()

    Hook(outer)(None, None)
    assert got == [["test_the_count_sees_every_frame.<locals>.outer", "test_the_count_sees_every_frame.<locals>.middle"]]
