"""Real-CUDA semantics the stand-in runtime and the CPU twin cannot show.

torch's default stream is handle 0 (the legacy default stream) and its side
streams are non-blocking, so nothing orders them but events; the runtime keeps
a per-thread last error that torch checks after every kernel launch; a pinned
source is read by the DMA engine when the device reaches the copy, not when
it was queued. Each test holds a stream busy with ``torch.cuda._sleep`` so
that a missing wait shows as wrong bytes (or a held host), not as luck; the
``wait=False`` controls show that the hold is long enough to tell.
"""

from __future__ import annotations

import time

import pytest
import torch

from mapoffload import Copier, LayerwiseOffloadManager

pytestmark = pytest.mark.cuda

HOLD_S = 0.3


def _hold(seconds: float = HOLD_S, stream=None) -> None:
    """Queue a spin kernel of roughly ``seconds`` (at <= 2 GHz: longer on a slower
    clock) on ``stream`` (None: the current stream)."""
    with torch.cuda.stream(stream):
        torch.cuda._sleep(int(seconds * 2e9))


@pytest.mark.parametrize("wait", [True, False])
def test_wait_for_the_default_stream_orders_a_side_stream_copy(wait):
    assert torch.cuda.current_stream().cuda_stream == 0, "torch's default stream should be handle 0"
    src = torch.randn(4 << 20)
    dst = torch.zeros(4 << 20, device="cuda")
    side = torch.cuda.Stream()  # non-blocking: the default stream does not order it
    with Copier("cuda") as c:
        _hold()
        dst.fill_(7.0)  # compute that still writes (or reads) the destination
        h = c.copy_spans([dst.data_ptr()], [src.data_ptr()], [src.nbytes], stream=side, keepalive=(src, dst),
                         wait_for=torch.cuda.current_stream() if wait else None)
        h.wait()
    torch.cuda.synchronize()
    if wait:
        assert torch.equal(dst.cpu(), src), "the copy ran before the compute queued on the default stream"
    else:
        assert bool((dst == 7.0).all()), "control: the hold did not outlast the copy; the test cannot tell"


def test_wait_stream_on_the_default_stream_orders_without_a_host_wait():
    src = torch.randn(4 << 20)
    dst = torch.empty(4 << 20, device="cuda")
    side = torch.cuda.Stream()
    with Copier("cuda") as c:
        _hold(stream=side)
        h = c.copy([dst], [src], stream=side)
        t0 = time.monotonic()
        h.wait_stream()  # torch's current stream: the default one, handle 0
        waited = time.monotonic() - t0
        total = dst.double().sum()  # queued on the default stream after the wait
        assert waited < HOLD_S / 2, f"wait_stream held the host {waited:.3f} s: it waited for the device"
        assert float(total) == pytest.approx(float(src.double().sum()))
        h.wait()


def test_a_copy_still_running_leaves_no_error_for_the_next_kernel():
    src = torch.randn(1 << 20)
    dst = torch.empty(1 << 20, device="cuda")
    with Copier("cuda") as c:
        _hold()
        h = c.copy([dst], [src])  # on the default stream, behind the spin
        h.wait_stream()
        assert not h.done()  # cudaEventQuery: cudaErrorNotReady, this thread's last error unless cleared
        c.collect()
        y = torch.ones(8, device="cuda") * 2  # torch checks this launch with cudaGetLastError
        h.wait()
    assert float(y.sum()) == 16


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_cuda1_default_stream_waits_while_device0_is_current():
    torch.cuda.set_device(0)  # as while a model runs on cuda:1: torch's ops use device guards
    src = torch.randn(4 << 20)
    dst = torch.zeros(4 << 20, device="cuda:1")
    side = torch.cuda.Stream("cuda:1")
    with Copier("cuda:1") as c:
        _hold(stream=side)
        h = c.copy([dst], [src], stream=side)
        h.wait_stream(torch.cuda.default_stream(1))  # handle 0: cuda:1's, not the current device's
        total = dst.double().sum()  # on cuda:1's default stream
        assert float(total) == pytest.approx(float(src.double().sum()))
        h.wait()


def _model(layers: int = 6):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(layers)])


def test_prefetch_into_a_recycled_buffer_waits_for_the_compute_still_reading_it():
    model = _model()
    x = torch.randn(8, 256)
    with torch.no_grad():
        want = model(x)
    with LayerwiseOffloadManager(model, model, device="cuda", prefetch_layers=1, host_store="pageable") as mgr:
        mgr.register_forward_hooks()
        xs = x.cuda()
        with torch.no_grad():
            _hold()  # the compute lags: the host queues every layer, its prefetches take recycled buffers
            got = model(xs).cpu()
        assert mgr.peak_device_bytes < 6 * mgr.parts.layer_bytes(0)  # buffers were recycled
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)


def test_update_cpu_weights_waits_for_copies_still_reading_a_pinned_store():
    model = _model(4)
    x = torch.randn(8, 256)
    with torch.no_grad():
        want = model(x)
    with LayerwiseOffloadManager(model, model, device="cuda", host_store="pinned") as mgr:
        assert mgr.pinned_bytes > 0
        mgr.register_forward_hooks()
        xs = x.cuda()
        with torch.no_grad():
            _hold(stream=mgr.parts.loads.copy_stream)  # the layers' DMAs wait behind it
            y = model(xs)  # the host runs through; the device has copied nothing yet
            mgr.update_cpu_weights({n: torch.zeros_like(t) for n, t in mgr.iter_cpu_weights()})
            got = y.cpu()
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), "a forward queued before the update read the update"


def test_placing_a_mapped_weight_on_the_device_leaves_its_pages_clean(tmp_path):
    """What ``offload(..., rest="device")`` (``hf/offload.py:_place_rest``) does with the
    mapped weights outside the layers: ``tensor.to("cuda")``, a pageable H2D copy the
    driver stages itself. It must read the private mapping, never pin it for write
    (that would turn its pages anonymous, as seen on a unified-memory GPU)."""
    from safetensors.torch import load_file, save_file

    from mapoffload import cow_report

    path = tmp_path / "w.safetensors"
    save_file({"w": torch.randn(16 << 20)}, path)
    t = load_file(path)["w"]
    before = cow_report([t]).anonymous_bytes
    d = t.to("cuda")
    torch.cuda.synchronize()
    assert cow_report([t]).anonymous_bytes == before, "the driver's pageable copy broke copy-on-write"
    assert torch.equal(d.cpu(), t)
