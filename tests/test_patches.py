"""The instance patches torch has no hook for (a layer's forward, a module's _apply) go through one
registry (mapoffload/offload/hooks.py): shared by the managers of one model, given back whole."""

from __future__ import annotations

import pytest
import torch

from mapoffload import LayerwiseOffloadManager
from mapoffload.offload.hooks import patched
from stacks import mapped


def _ours(model: torch.nn.Module) -> dict[str, tuple[str, ...]]:
    return {name: patched(m) for name, m in model.named_modules() if patched(m)}


def _instance_attrs(model: torch.nn.Module) -> set[str]:
    return {k for m in model.modules() for k in m.__dict__ if k in ("forward", "_apply", "share_memory") or k.startswith("_mapoffload")}


def test_a_model_given_back_carries_nothing_of_ours(ckpt):
    path, x, want = ckpt
    model = mapped(path).eval()
    with LayerwiseOffloadManager(model, "blocks", device="cpu") as m:
        m.register_forward_hooks()
        ours = _ours(model)
        # share_memory: refused with true words while offloaded (issue 41)
        assert ours[""] == ("_apply", "share_memory") and ours["blocks.0"] == ("_apply", "forward", "share_memory")
        with torch.no_grad():
            assert torch.equal(model(x), want)
    assert _ours(model) == {} and _instance_attrs(model) == set()


def test_two_managers_share_the_conversion_guard_until_the_last_lets_go(ckpt):
    path, x, want = ckpt
    model = mapped(path).eval()
    first = LayerwiseOffloadManager(model, model.blocks[:6], device="cpu")
    second = LayerwiseOffloadManager(model, model.blocks[6:], device="cpu")
    first.register_forward_hooks()
    second.register_forward_hooks()
    first.close()
    assert _ours(model)[""] == ("_apply", "share_memory")  # the second still guards the model
    with pytest.raises(TypeError):
        model.to(torch.float16)  # refused before anything converts
    assert all(p.dtype == torch.float32 for p in model.parameters())
    second.close()
    assert _ours(model) == {} and _instance_attrs(model) == set()
    with torch.no_grad():
        assert torch.equal(model(x), want)


def test_a_forward_set_by_the_user_is_kept_whichever_came_first(ckpt):
    path, x, want = ckpt
    model = mapped(path).eval()

    def theirs(*args, **kwargs):
        return type(model.blocks[0]).forward(model.blocks[0], *args, **kwargs)

    model.blocks[0].forward = theirs  # before the offload: put back after it
    with LayerwiseOffloadManager(model, "blocks", device="cpu") as m:
        m.register_forward_hooks()
        assert model.blocks[0].forward is not theirs
        mine = model.blocks[1].forward
        model.blocks[1].forward = theirs  # during it: theirs stays
    assert model.blocks[0].forward is theirs and model.blocks[1].forward is theirs and mine is not theirs
    assert _ours(model) == {}


def test_a_child_forked_while_the_registry_is_locked_can_still_patch():
    # Only the registry runs in the child: torch's OpenMP pool hangs in a forked child that computes.
    import os
    import signal

    from mapoffload.offload import hooks as patches

    layer = torch.nn.Linear(2, 2)
    with patches._LOCK:  # another thread inside install() at the fork
        pid = os.fork()
        if pid == 0:  # the child: its lock is a fresh one
            code = 1
            try:
                signal.alarm(20)  # a deadlock ends the child, failing the test
                patches.install(layer, "forward", print)
                code = 0 if patches.patched(layer) == ("forward",) else 2
                patches.uninstall(layer, "forward")
                code = code or (0 if "forward" not in layer.__dict__ else 3)
            finally:
                os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
