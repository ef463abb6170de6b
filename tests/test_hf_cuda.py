"""The conformance matrix on a GPU: ``mapoffload.from_pretrained(cls, folder,
device="cuda")`` against transformers' own model on the same device, on every
architecture of the zoo — with the plan's defaults, and with every layer
streamed (a host of 0 GiB), read through the mapping and read uncached
into page-locked buffers (``reads="uncached"``). Needs a CUDA
device (``cuda`` marker): skipped elsewhere.

The streamed runs must equal each other bit for bit (the same kernels on the
same bytes: a misplaced byte in the uncached path shows); against
transformers' own model on the device, the output is compared to the GPU's
rounding (the same kernels run, but on buffers of another layout).
"""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import mapoffload  # noqa: E402
from conformance_zoo import build, first_output, inputs, zoo  # noqa: E402
from mapoffload.memory.budget import ENV_HOST_AVAILABLE_GIB  # noqa: E402

pytestmark = pytest.mark.cuda

ARCHS = sorted(zoo())


def _to(x: dict, device: str) -> dict:
    return {k: v.to(device) for k, v in x.items()}


def _ours(cls, folder, x, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = mapoffload.from_pretrained(cls, folder, device="cuda", **kwargs)
    handle = model.mapoffload_handle
    try:
        with torch.no_grad():
            outs = [first_output(model(**x)).cpu() for _ in range(2)]  # a cold forward and a warm one
        streamed = sum(len(m.residency.streamed) for m in handle.managers.values() if m.residency is not None)
        modes = {m.parts.member.reads_mode for m in handle.managers.values()}
    finally:
        handle.close()
    assert torch.equal(outs[0], outs[1]), f"{cls.__name__}: the warm forward differs from the cold one"
    return outs[0], streamed, modes


@pytest.mark.parametrize("arch", ARCHS)
def test_every_architecture_on_the_device(tmp_path, arch, monkeypatch):
    cls, kind = build(arch, str(tmp_path))
    ref = cls.from_pretrained(str(tmp_path)).eval().cuda()
    x = _to(inputs(kind, ref.config), "cuda")
    with torch.no_grad():
        expected = first_output(ref(**x)).cpu()
    del ref
    got, _, _ = _ours(cls, str(tmp_path), x)
    scale = expected.abs().max().item() or 1.0
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * scale)

    monkeypatch.setenv(ENV_HOST_AVAILABLE_GIB, "0")  # no page cache to keep: every layer streams
    mapping, streamed, modes = _ours(cls, str(tmp_path), x, reads="mapping")
    uncached, streamed_uncached, _ = _ours(cls, str(tmp_path), x, reads="uncached")
    assert streamed > 0 and streamed_uncached == streamed and modes == {"mapping"}
    assert torch.equal(mapping, uncached), (mapping - uncached).abs().max()
    torch.testing.assert_close(mapping, expected, rtol=1e-4, atol=1e-4 * scale)


@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_fp8_on_the_device_is_the_dequantized_model(tmp_path, arch, monkeypatch):
    """The copier moves codes and scales; the device dequantizes them as transformers did on load."""
    pytest.importorskip("accelerate")  # transformers' fp8 quantizer needs it
    from conformance_zoo import to_fp8

    cls, kind = build(arch, str(tmp_path), dtype=torch.bfloat16)
    to_fp8(str(tmp_path), 128)
    dense = mapoffload.from_pretrained(cls, str(tmp_path), device=None, fp8="dequantize").cuda().eval()
    x = _to(inputs(kind, dense.config), "cuda")
    with torch.no_grad():
        expected = first_output(dense(**x)).cpu()
    del dense
    monkeypatch.setenv(ENV_HOST_AVAILABLE_GIB, "0")
    got, streamed, _ = _ours(cls, str(tmp_path), x)
    assert streamed > 0
    scale = expected.float().abs().max().item() or 1.0
    torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2 * scale)
