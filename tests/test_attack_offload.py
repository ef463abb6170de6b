"""The layerwise offload manager attacked with hostile modules and the paths
deployments take: zero-size weights, updates racing a prefetch, inference
mode, fork with prefetches in flight, forwards from several threads."""

from __future__ import annotations

import threading

import pytest
import torch

from mapoffload import Copier, LayerwiseOffloadManager

from child import describe, run_python
from models import TinyModel

IDS = torch.arange(24).reshape(3, 8) % 64


@pytest.fixture(scope="module")
def reference():
    torch.manual_seed(0)
    return TinyModel(width=32, layers=4)


def copy_of(reference, width=32, layers=4):
    model = TinyModel(width=width, layers=layers)
    model.load_state_dict(reference.state_dict())
    return model


def run(model, ids=IDS):
    with torch.no_grad():
        return model(ids)


class ZeroSized(torch.nn.Module):
    """A layer whose only float64 weight has no elements."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.empty = torch.nn.Parameter(torch.empty(0, 3, dtype=torch.float64), requires_grad=False)
        self.empty_t = torch.nn.Parameter(torch.empty(3, 0, dtype=torch.float16).t(), requires_grad=False)

    def forward(self, x):
        return self.lin(x) + self.empty.sum() + self.empty_t.float().sum()


def test_zero_size_weights_alone_in_their_dtype():
    torch.manual_seed(1)
    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList([ZeroSized(), ZeroSized()])

    def forward(x):
        for b in model.blocks:
            x = b(x)
        return x

    x = torch.randn(2, 4)
    with torch.no_grad():
        want = forward(x)
    with LayerwiseOffloadManager(model, "blocks", device="cpu") as mgr:
        mgr.register_forward_hooks()
        for _ in range(2):
            with torch.no_grad():
                assert torch.equal(forward(x), want)
        assert model.blocks[0].empty_t.shape == (0, 3)
    assert model.blocks[1].empty.shape == (0, 3)


def test_update_while_the_layers_prefetch_is_in_flight_reaches_the_device():
    # A layer big enough (and a copier slow enough) that the prefetch is still
    # copying when the update comes: the device copy must end up new, not old
    # or torn.
    torch.manual_seed(2)
    big = TinyModel(width=512, layers=2)
    model = copy_of(big, width=512, layers=2)
    copier = Copier("cpu", threads=1, staging_bytes=1 << 16, slots=1)
    mgr = LayerwiseOffloadManager(model, "blocks", device="cpu", host_store="pageable", copier=copier, cpu_twin=True)
    name = "blocks.0.fc1.weight"
    for trial in range(3):
        new = torch.full((1024, 512), float(trial + 1))
        mgr.prefetch_layer(0)
        mgr.update_cpu_weights({name: new})
        mgr.prefetch_layer(0, non_blocking=False)
        assert torch.equal(model.blocks[0].fc1.weight, new), trial
        mgr.release_layer(0)
        mgr.prefetch_layer(0, non_blocking=False)
        assert torch.equal(model.blocks[0].fc1.weight, new), trial
        mgr.release_layer(0)
    mgr.close()
    copier.close()


def test_manager_made_and_run_under_inference_mode_can_be_updated_outside(reference):
    model = copy_of(reference)
    with torch.inference_mode():
        mgr = LayerwiseOffloadManager(model, "blocks", device="cpu", resident_layers=1)
        mgr.register_forward_hooks()
        want = reference(IDS)
        assert torch.equal(model(IDS), want)
    changed = {
        "blocks.0.fc1.weight": reference.blocks[0].fc1.weight * 2,  # resident: on the device now
        "blocks.2.fc2.weight": reference.blocks[2].fc2.weight * 2,
    }
    mgr.update_cpu_weights(changed)
    edited = copy_of(reference)
    edited.load_state_dict(changed, strict=False)
    assert torch.equal(run(model), run(edited))
    mgr.close()
    assert torch.equal(run(model), run(edited))


def test_forked_child_runs_the_model_with_the_parents_prefetches_in_flight(tmp_path):
    proc = run_python("""
import os, sys, time, signal
import torch
from mapoffload import Copier, LayerwiseOffloadManager
from models import TinyModel
torch.manual_seed(0)
model = TinyModel(width=512, layers=3)
ids = torch.arange(24).reshape(3, 8) % 64
with torch.no_grad():
    want = model(ids)
copier = Copier("cpu", threads=1, staging_bytes=1 << 16, slots=1)
mgr = LayerwiseOffloadManager(model, "blocks", device="cpu", copier=copier, prefetch_layers=2, cpu_twin=True)
mgr.register_forward_hooks()
mgr.prefetch_layer(0)
mgr.prefetch_layer(1)  # both still copying at the fork
pid = os.fork()
if pid == 0:
    code = 0
    try:
        with torch.no_grad():
            for _ in range(2):
                if not torch.equal(model(ids), want):
                    code = 3
    except Exception as e:
        print("child:", type(e).__name__, e, flush=True)
        code = 4
    os._exit(code)
from child import reap
code = reap(pid, 60)
with torch.no_grad():
    assert torch.equal(model(ids), want)
mgr.close()
print("child", code)
""", timeout=120, env={"OMP_NUM_THREADS": "1"})  # torch's OpenMP pool hangs in a forked child otherwise
    assert proc.returncode == 0 and "child 0" in proc.stdout, describe(proc)


def test_forwards_from_several_threads_are_right_or_refused_clearly(reference):
    torch.manual_seed(3)
    ref = TinyModel(width=128, layers=4)
    want = run(ref)
    model = copy_of(ref, width=128, layers=4)
    mgr = LayerwiseOffloadManager(model, "blocks", device="cpu", prefetch_layers=1)
    mgr.register_forward_hooks()
    outcomes: list[str] = []

    def worker():
        for _ in range(20):
            try:
                outcomes.append("ok" if torch.equal(run(model), want) else "wrong")
            except RuntimeError as e:
                outcomes.append("refused" if "concurrent" in str(e) else f"error: {e}")
            except Exception as e:  # any other: recorded (a thread that died would leave no outcome)
                outcomes.append(f"crashed: {e!r}")

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    mgr.close()
    assert len(outcomes) == 4 * 20  # every forward of every thread ended one of these ways
    assert all(o in ("ok", "refused") for o in outcomes), sorted(set(outcomes))[:3]
    assert "ok" in outcomes  # not all refused


def test_update_refuses_values_it_could_only_store_by_losing_data(reference):
    model = copy_of(reference)
    name = "blocks.1.fc1.weight"
    with LayerwiseOffloadManager(model, "blocks", device="cpu") as mgr:
        before = dict(mgr.iter_cpu_weights())[name].clone()
        with pytest.raises(TypeError, match=rf"{name}: a torch.complex64 value cannot be stored"):
            mgr.update_cpu_weights({name: torch.randn(64, 32, dtype=torch.complex64)})
        with pytest.raises(ValueError, match=rf"{name}: the new value is on the meta device"):
            mgr.update_cpu_weights({name: torch.empty(64, 32, device="meta")})
        with pytest.raises(TypeError, match=rf"{name}: the new value is a list"):
            mgr.update_cpu_weights({name: [[0.0] * 32] * 64})
        assert torch.equal(dict(mgr.iter_cpu_weights())[name], before)
        # A conversion that keeps the kind of value is fine.
        mgr.update_cpu_weights({name: before.double() * 2})
        assert torch.equal(dict(mgr.iter_cpu_weights())[name], before * 2)


def test_fork_while_another_thread_is_inside_a_layer():
    # A server thread is computing a layer (it holds the manager's layer turn)
    # when the main thread forks: the child must run the model, not wait for
    # a thread that does not exist there.
    proc = run_python("""
import os, threading
import torch
from mapoffload import LayerwiseOffloadManager
from models import TinyModel
from child import reap
torch.manual_seed(0)
model = TinyModel(width=32, layers=3)
ids = torch.arange(16).reshape(2, 8)
with torch.no_grad():
    want = model(ids)
inside, leave = threading.Event(), threading.Event()
def hold(module, args):
    inside.set()
    leave.wait()
mgr = LayerwiseOffloadManager(model, "blocks", device="cpu")
mgr.register_forward_hooks()
handle = model.blocks[1].fc1.register_forward_pre_hook(hold)
def serve():
    with torch.no_grad():
        model(ids)
t = threading.Thread(target=serve)
t.start()
assert inside.wait(20), "the server thread never reached the layer"
pid = os.fork()
if pid == 0:
    handle.remove()
    with torch.no_grad():
        ok = torch.equal(model(ids), want)
    os._exit(0 if ok else 3)
code = reap(pid, 30)
leave.set()
t.join()
print("child", code)
""", env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0 and "child 0" in proc.stdout, describe(proc)
