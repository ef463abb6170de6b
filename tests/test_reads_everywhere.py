"""``reads=`` reaches every manager an entry point makes: the stacks, a
streamed rest, and each component of a pipeline (offload_pipeline,
pipeline_from_pretrained). It was ignored for a streamed rest, and the
pipeline entry points could not pass it."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import mapoffload  # noqa: E402
from stacks import mapped  # noqa: E402


@pytest.mark.parametrize("reads", ["uncached", "mapping"])
def test_offload_passes_reads_to_a_streamed_rest(ckpt, reads):
    path, x, want = ckpt
    model = mapped(path).eval()
    with mapoffload.offload(model, device="cpu", cpu_twin=True, layers="blocks", rest="stream", reads=reads) as handle:
        assert sorted(handle.managers) == ["blocks", "rest"]
        assert {m.parts.member.reads_mode for m in handle.managers.values()} == {reads}
        with torch.no_grad():
            assert torch.equal(model(x), want)


class _Pipe:
    """What offload_pipeline needs of a pipeline: its components."""

    def __init__(self, **components):
        self.components = components


def test_offload_pipeline_passes_reads_to_every_component(ckpt):
    path, x, want = ckpt
    a, b = mapped(path).eval(), mapped(path).eval()
    with mapoffload.offload_pipeline(_Pipe(a=a, b=b), device="cpu", cpu_twin=True, rest="stream",
                                     reads="uncached") as handle:
        managers = [m for h in handle.components.values() for m in h.managers.values()]
        assert len(managers) == 2 and {m.parts.member.reads_mode for m in managers} == {"uncached"}
        with torch.no_grad():
            assert torch.equal(a(x), want) and torch.equal(b(x), want)


def test_pipeline_from_pretrained_takes_reads(tmp_path):
    diffusers = pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    unet = diffusers.UNet2DModel(block_out_channels=(8, 16), layers_per_block=1, sample_size=8, in_channels=3,
                                 out_channels=3, down_block_types=("DownBlock2D", "DownBlock2D"),
                                 up_block_types=("UpBlock2D", "UpBlock2D"), norm_num_groups=8)
    diffusers.DDPMPipeline(unet=unet, scheduler=diffusers.DDPMScheduler()).save_pretrained(tmp_path)
    pipe = mapoffload.pipeline_from_pretrained(diffusers.DDPMPipeline, tmp_path, device="cpu",
                                               reads="uncached")
    managers = [m for h in pipe.mapoffload_handle.components.values() for m in h.managers.values()]
    assert managers and {m.parts.member.reads_mode for m in managers} == {"uncached"}
    pipe.mapoffload_handle.close()
