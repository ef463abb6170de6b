"""Several stacks and pipelines, attacked by a hostile review: three results that were wrong, each test
failing before its fix.

- On the device path, a model with two stacks whose weights outside the stacks (a head) are streamed (no
  room beside the window): the outside weights' streaming asked another stack's placeholders for their
  data and the first forward raised.
- The stacks of one offload each weighed their host copies against one budget, measured once: two stacks
  that fit each but not together were both copied, over the copy gate, silently.
- ``offload_pipeline`` on a pipeline with no model component left to offload raised from its summary.
"""

from __future__ import annotations

import os
import warnings

import pytest

torch = pytest.importorskip("torch")

import mapoffload  # noqa: E402
from mapoffload import empty_weights, load_checkpoint, rss_anon_bytes  # noqa: E402

MIB = 1 << 20


def test_two_stacks_on_the_device_path_with_the_head_streamed_run(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.T5Config(d_model=256, d_ff=512, d_kv=32, num_layers=3, num_decoder_layers=3, num_heads=8,
                                decoder_start_token_id=0, vocab_size=8192, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.T5ForConditionalGeneration(cfg).save_pretrained(tmp_path)
    ids = torch.tensor([[1, 7, 42, 3, 9, 5]])
    cls = transformers.T5ForConditionalGeneration
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = mapoffload.from_pretrained(cls, tmp_path, device=None)
        with torch.no_grad():
            want = plain(input_ids=ids, decoder_input_ids=ids[:, :4]).logits
        del plain
        monkeypatch.setenv("MAPOFFLOAD_PAGE_CACHE_MARGIN_MIB", "0")
        monkeypatch.setenv("MAPOFFLOAD_HOST_AVAILABLE_GIB", str((rss_anon_bytes() + 4 * MIB) / 2**30))  # tight
        model = mapoffload.from_pretrained(cls, tmp_path, device="cpu", cpu_twin=True)
    with model.mapoffload_handle as handle:
        assert len(handle.managers) == 2 and all(m.residency.always_streamed for m in handle.managers.values())
        with torch.no_grad():
            assert torch.equal(model(input_ids=ids, decoder_input_ids=ids[:, :4]).logits, want)


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(512, 512), torch.nn.Linear(512, 512)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


class TwoStacks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.ModuleList(Block() for _ in range(4))
        self.b = torch.nn.ModuleList(Block() for _ in range(4))

    def forward(self, x):
        for blk in (*self.a, *self.b):
            x = blk(x)
        return x


def test_the_stacks_of_one_offload_share_one_budget_for_their_copies(tmp_path, monkeypatch):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    path = os.path.join(tmp_path, "m.safetensors")
    save_file(TwoStacks().state_dict(), path)
    with empty_weights():
        model = TwoStacks().eval()
    load_checkpoint(model, path, keep_mapping=True)
    stack = sum(t.nbytes for t in model.a.parameters())
    x = torch.randn(2, 512)
    with torch.no_grad():
        want = model(x)
    room = int(1.5 * stack)  # one stack's copies fit, not two
    monkeypatch.setenv("MAPOFFLOAD_HOST_AVAILABLE_GIB", str((4 * 2**30 + rss_anon_bytes() + room) / 2**30))
    with mapoffload.offload(model, layers=["a", "b"], device="cpu", cpu_twin=True) as handle:
        copied = [m.pinned_bytes + m.pageable_bytes for m in handle.managers.values()]
        assert sum(copied) <= room, [c / MIB for c in copied]
        assert max(copied) > 0  # the first stack's copies fit: made
        with torch.no_grad():
            assert torch.equal(model(x), want)


def test_a_pipeline_with_nothing_left_to_offload_gives_an_empty_handle():
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    unet = diffusers.UNet2DModel(block_out_channels=(8, 16), layers_per_block=1, sample_size=8, in_channels=3,
                                 out_channels=3, down_block_types=("DownBlock2D", "DownBlock2D"),
                                 up_block_types=("UpBlock2D", "UpBlock2D"), norm_num_groups=8)
    pipe = diffusers.DDPMPipeline(unet=unet, scheduler=diffusers.DDPMScheduler())
    with mapoffload.offload_pipeline(pipe, device="cpu", skip=("unet",)) as handle:
        assert not handle.components and handle.rows == []
        assert isinstance(handle.summary(), str)
