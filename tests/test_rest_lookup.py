"""The rest's lookup tables (embeddings no head shares) read the rows a forward
looks up, not the kernel's fault-around of each: under a tight cap a 125 MiB
table read 131-216 MiB a forward for 128 rows (issue 18, the rest's first
fault), the disk's read_ahead_kb being 8 MiB."""

from __future__ import annotations

import torch
from safetensors.torch import save_file
from torch import nn

from mapoffload import LayerwiseOffloadManager, drop_page_cache, empty_weights, load_checkpoint, resident_bytes
from models import Block

VOCAB, WIDTH = 4096, 256  # a 4 MiB fp32 table, 1 KiB a row


class Untied(nn.Module):
    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block(WIDTH) for _ in range(2))
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _vm_flags(addr: int) -> set[str]:
    """VmFlags of the mapping holding ``addr`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "VmFlags:":
                return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {addr:#x}")


def _loaded(tmp_path, tied: bool = False):
    torch.manual_seed(0)
    src = Untied(tied)
    state = {k: v.detach().clone().contiguous() for k, v in src.state_dict().items()}
    if tied:
        state.pop("head.weight")
    path = tmp_path / "model.safetensors"
    save_file(state, str(path))
    with empty_weights():
        model = Untied(tied)
    load_checkpoint(model, str(path), keep_mapping=True)
    return model, path


def _manager(model: nn.Module) -> LayerwiseOffloadManager:
    mgr = LayerwiseOffloadManager(model, "blocks", device="cpu", reads="mapping")
    mgr.register_forward_hooks()
    return mgr


def _middle(t: torch.Tensor) -> int:
    return t.data_ptr() + t.nbytes // 2


def test_an_untied_embedding_is_advised_random_and_set_back_on_close(tmp_path):
    model, _ = _loaded(tmp_path)
    mgr = _manager(model)
    try:
        with torch.inference_mode():
            model(torch.tensor([[1, 2, 3]]))
        assert "rr" in _vm_flags(_middle(model.embed.weight))
        assert "rr" not in _vm_flags(_middle(model.head.weight))  # read whole: readahead helps it
        assert mgr.parts.outside.table_bytes == model.embed.weight.nbytes
    finally:
        mgr.close()
    assert "rr" not in _vm_flags(_middle(model.embed.weight))


def test_a_tied_embedding_is_read_whole_by_the_head_and_keeps_its_readahead(tmp_path):
    model, _ = _loaded(tmp_path, tied=True)
    with _manager(model) as mgr:
        with torch.inference_mode():
            model(torch.tensor([[1, 2, 3]]))
        assert "rr" not in _vm_flags(_middle(model.embed.weight))
        assert mgr.parts.outside.table_bytes == 0


def test_a_cold_lookup_reads_its_rows_not_the_readahead(tmp_path):
    model, path = _loaded(tmp_path)
    drop_page_cache(path)  # save_file left the table cached
    with _manager(model):
        with torch.inference_mode():
            model(torch.tensor([[7, 1500, 3000, 4000]]))  # the first forward advises the table
        # What that forward read around its rows and did not map goes; what it mapped stays.
        drop_page_cache(path)
        before = resident_bytes([model.embed.weight])[0]
        assert before < model.embed.weight.nbytes // 2, before
        with torch.inference_mode():
            model.embed(torch.tensor([[11, 1700, 3300, 4090]]))  # four rows far from those
        grew = resident_bytes([model.embed.weight])[0] - before
    # Four rows of 1 KiB: a page each, not megabytes of readahead each.
    assert 0 < grew <= 4 * 2 * 4096, grew


class TwoStacks(nn.Module):
    """An embedding outside two stacks, each a manager's."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block(WIDTH) for _ in range(2))
        self.more = nn.ModuleList(Block(WIDTH) for _ in range(2))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for b in (*self.blocks, *self.more):
            x = b(x)
        return x


def test_two_managers_share_the_advice_until_the_last_closes(tmp_path):
    torch.manual_seed(0)
    path = tmp_path / "two.safetensors"
    save_file({k: v.detach().clone().contiguous() for k, v in TwoStacks().state_dict().items()}, str(path))
    for first in (0, 1):  # closed in either order
        with empty_weights():
            model = TwoStacks()
        load_checkpoint(model, str(path), keep_mapping=True)
        mgrs = [LayerwiseOffloadManager(model, name, device="cpu", reads="mapping") for name in ("blocks", "more")]
        try:
            for m in mgrs:
                m.register_forward_hooks()
            with torch.inference_mode():
                model(torch.tensor([[1, 2, 3]]))
            assert "rr" in _vm_flags(_middle(model.embed.weight))
            mgrs[first].close()
            with torch.inference_mode():
                model(torch.tensor([[4, 5]]))
            assert "rr" in _vm_flags(_middle(model.embed.weight)), "the other manager still runs"
        finally:
            for m in mgrs:
                m.close()
        assert "rr" not in _vm_flags(_middle(model.embed.weight))
        del model, mgrs


def test_an_embedding_tied_to_a_head_after_the_first_forward_is_read_whole_again(tmp_path):
    # The head's own weight is not one the guard watches (not on the CPU):
    # tying it to the embedding adds no tensor, only a holder that reads it whole.
    model, _ = _loaded(tmp_path)
    model.head.to("meta")
    with _manager(model) as mgr:
        with torch.inference_mode():
            model.embed(torch.tensor([[1, 2, 3]]))
            mgr.parts.outside.check()
        assert "rr" in _vm_flags(_middle(model.embed.weight))
        model.head.weight = model.embed.weight
        with torch.inference_mode():
            model(torch.tensor([[1, 2, 3]]))
        assert "rr" not in _vm_flags(_middle(model.embed.weight))
        assert mgr.parts.outside.table_bytes == 0
