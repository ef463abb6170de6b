"""close() and remove_forward_hooks() from one thread while another runs
forwards: the model is whole afterwards (real parameters, right outputs),
whatever point the other thread's forward had reached."""

from __future__ import annotations

import threading

import pytest
import torch

from mapoffload import LayerwiseOffloadManager, OffloadedWeight

from models import TinyModel

IDS = torch.arange(24).reshape(3, 8) % 64
TRIALS = 40
BOUND_S = 120  # a hang fails the test instead of blocking the suite; not a timing assertion


@pytest.fixture(scope="module")
def reference():
    torch.manual_seed(0)
    ref = TinyModel(width=64, layers=6)
    with torch.no_grad():
        want = ref(IDS)
    return ref, want


@pytest.mark.slow
@pytest.mark.parametrize("how", ["close", "remove_forward_hooks"])
@pytest.mark.parametrize("twin", [True, False], ids=["twin", "in-place"])
def test_model_is_whole_after_close_from_another_thread(reference, twin, how):
    ref, want = reference
    for trial in range(TRIALS):
        model = TinyModel(width=64, layers=6)
        model.load_state_dict(ref.state_dict())
        mgr = LayerwiseOffloadManager(model, "blocks", device="cpu", cpu_twin=twin)
        mgr.register_forward_hooks()
        started, stop = threading.Event(), threading.Event()
        outcomes: list[str] = []

        def loop():
            while not stop.is_set():
                try:
                    with torch.no_grad():
                        out = model(IDS)
                    outcomes.append("ok" if torch.equal(out, want) else "wrong")
                except RuntimeError as exc:
                    outcomes.append(f"refused: {exc}")
                except Exception as exc:  # a forward in flight that crashed: the thread goes on, the test fails
                    outcomes.append(f"crashed: {exc!r}")
                started.set()

        t = threading.Thread(target=loop, daemon=True)
        t.start()
        assert started.wait(BOUND_S)
        getattr(mgr, how)()  # while the other thread is anywhere in a forward
        n = len(outcomes)
        while len(outcomes) < n + 2 and t.is_alive():  # two forwards started after the call returned
            started.clear()
            assert started.wait(BOUND_S)
        assert len(outcomes) >= n + 2, (trial, outcomes[-3:])  # the forwards after the call did run
        stop.set()
        t.join(BOUND_S)
        assert not t.is_alive()
        crashed = [o for o in outcomes if o.startswith("crashed")]
        assert not crashed, (trial, crashed[:3])
        placeholders = [n for n, p in model.named_parameters() if isinstance(p, OffloadedWeight)]
        assert not placeholders, f"trial {trial}: {placeholders[:3]} left as placeholders"
        assert "wrong" not in outcomes, trial
        assert outcomes[-1] == "ok", (trial, outcomes[-3:])
        with torch.no_grad():
            assert torch.equal(model(IDS), want), trial
        mgr.close()


@pytest.mark.parametrize("how", ["close", "remove_forward_hooks"])
@pytest.mark.parametrize("twin", [True, False], ids=["twin", "in-place"])
def test_a_forward_past_a_layers_hook_lookup_when_the_hooks_go_runs_them_as_no_ops(reference, twin, how):
    """The point the loop above does not reach by chance: torch has taken a layer's hooks
    (its pre-hook list is read once per call), the manager's have not run yet, and the
    hooks go. They run anyway: as no-ops, on a whole model, the right output."""
    ref, want = reference
    model = TinyModel(width=64, layers=6)
    model.load_state_dict(ref.state_dict())
    mgr = LayerwiseOffloadManager(model, "blocks", device="cpu", cpu_twin=twin)
    mgr.register_forward_hooks()
    reached, go = threading.Event(), threading.Event()

    def pause(module, args):  # runs before the manager's pre-hook of this layer, in the same call
        reached.set()
        assert go.wait(BOUND_S)

    gate = model.blocks[3].register_forward_pre_hook(pause, prepend=True)
    out: dict[str, object] = {}

    def run():
        try:
            with torch.no_grad():
                out["y"] = model(IDS)
        except BaseException as exc:  # reported below
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert reached.wait(BOUND_S)
    getattr(mgr, how)()  # the paused forward holds no layer turn: this returns at once
    go.set()
    t.join(BOUND_S)
    assert not t.is_alive()
    gate.remove()
    assert "error" not in out, out.get("error")
    assert torch.equal(out["y"], want)
    assert not [n for n, p in model.named_parameters() if isinstance(p, OffloadedWeight)]
    with torch.no_grad():
        assert torch.equal(model(IDS), want)
    mgr.close()
