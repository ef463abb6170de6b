"""Every buffer mapoffload makes counts against the page-cache budget it plans (issue 25).

Uncached buffers are anonymous memory: the plan charges them before they
exist (``1 + depth`` of the largest layer's bytes, from its first page to its last), never
beside the window they replace (once), and ``reads="auto"`` reads
around the page cache only where the room the plan has for the layers holds
them and the plan that charges them streams no more than the mapping's.
Fake cgroup v2 trees fix the budget; the margin is pinned (no thin share).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from mapoffload import LayerwiseOffloadManager, empty_weights, load_checkpoint
from mapoffload.pagecache import coordinator as coordinator_module
from mapoffload.pagecache import member
from mapoffload.pagecache.residency import plan_shared
from mapoffload.memory.budget import ENV_HOST_AVAILABLE_GIB

from fake_cgroups import pin_whole_margin, v2_cap
from stacks import save_reference

MIB, KIB = 1 << 20, 1 << 10
LAYERS, WIDTH = 24, 720  # 720 * 720 * 4 = 2025 KiB a layer
HEAD = 2674  # 720 * 2674 * 4 = 7,701,120 bytes, read every forward outside the layers
LAYER = WIDTH * WIDTH * 4
HEAD_BYTES = WIDTH * HEAD * 4
# A layer's uncached buffer: its bytes from the first page to the last (a page more at each end at most).
BUFFER = (LAYER, LAYER + 8 * KIB)


def buffers_of(n: int, got: int) -> bool:
    return n * BUFFER[0] <= got <= n * BUFFER[1]


class Headed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH, HEAD, bias=False)

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.head(x)


@pytest.fixture
def ckpt(tmp_file_dir):
    torch.manual_seed(0)
    return save_reference(Headed(), torch.randn(2, WIDTH), tmp_file_dir / "headed.safetensors")


def mapped(path) -> Headed:
    with empty_weights():
        model = Headed()
    load_checkpoint(model, path, keep_mapping=True)
    return model


@pytest.fixture
def cap(tmp_path, monkeypatch):
    assert not coordinator_module.coordinator().managers()
    monkeypatch.delenv(ENV_HOST_AVAILABLE_GIB, raising=False)
    monkeypatch.setattr(coordinator_module, "CGROUP_ROOT", str(tmp_path))
    monkeypatch.setenv("MAPOFFLOAD_PEERS_DIR", str(tmp_path / "peers"))

    def set_cap(mib: int, in_use: int = 10 * MIB) -> None:
        v2_cap(tmp_path, mib * MIB, in_use, 0, 0)  # 10 MiB in use besides the weights, no file cache
        pin_whole_margin(monkeypatch, mib * MIB)

    return set_cap


def forward(model, x, want) -> None:
    with torch.no_grad():
        assert torch.equal(model(x), want)


def takes_uncached(mgr) -> None:
    capable, why = mgr.parts.member.probe_uncached()
    if not capable:
        pytest.skip(f"the checkpoint's files are not read with O_DIRECT here: {why}")


def thrashing(monkeypatch) -> None:
    """Every forward reads far more than the plan streams: in place, ``reads="auto"`` tries reading uncached
    at the 4th forward (two warm forwards in a row over 1.2x)."""
    counter = itertools.count(0, 1 << 40)
    monkeypatch.setattr(member, "_process_read_bytes", lambda: next(counter))


def test_plan_charges_uncached_buffers_once_and_whole():
    sizes = [10] * 6
    base = plan_shared([sizes], 45, prefetch_layers=[1])[0]
    assert base.cached == (0, 1) and base.depth == 1  # 45 - a window of 2 x 10
    # Buffers holding that window are the window: charged once, the same plan.
    assert plan_shared([sizes], 45, prefetch_layers=[1], buffers=20)[0] == base
    # Buffers larger than the window (grown to 2 x 16) take the cached set's room.
    more = plan_shared([sizes], 45, prefetch_layers=[1], buffers=32)[0]
    assert more.cached == (0,) and more.cached_bytes + 32 <= 45
    # Two stacks reading uncached hold a set each: the plan keeps their sum beside the cached layers.
    plans = plan_shared([sizes, sizes], 60, prefetch_layers=[1, 1], buffers=40)
    assert sum(p.cached_bytes for p in plans) + 40 <= 60 and [p.cached for p in plans] == [(0, 1), ()]
    # Buffers left over where everything else would fit still count.
    assert plan_shared([[10] * 3], 35, buffers=10)[0].streamed != ()
    with pytest.raises(ValueError, match="buffers must be >= 0"):
        plan_shared([sizes], 45, buffers=-1)


def test_auto_reads_through_the_mapping_where_the_room_cannot_hold_the_buffers(ckpt, cap, monkeypatch):
    path, x, want = ckpt
    thrashing(monkeypatch)
    # 85 MiB - 17 MiB in use - the 66.65625 MiB margin = 1376 KiB usable: the head (7.3 MiB) does not
    # fit beside one layer, so it streams too and leaves the layers all of it (issue 35); 24 layers of
    # 2025 KiB all stream, and one layer's buffer is too much.
    cap(85, in_use=17 * MIB)
    model = mapped(path)
    with LayerwiseOffloadManager(model, "blocks", device="cpu") as mgr:
        takes_uncached(mgr)
        coord = coordinator_module.coordinator()
        assert coord.always_streamed and mgr.residency.always_streamed
        assert coord.room == 1376 * KIB and coord.room < 2 * MIB
        assert len(mgr.residency.streamed) == LAYERS
        mgr.register_forward_hooks()
        for _ in range(5):
            forward(model, x, want)
            assert mgr.parts.member.reads_mode == "mapping", mgr.parts.member.reads_why
        assert "do not fit" in mgr.parts.member.reads_why, mgr.parts.member.reads_why
        assert coord.buffers == 0


def test_auto_reads_uncached_where_the_room_holds_the_buffers_and_charges_them(ckpt, cap, monkeypatch):
    path, x, want = ckpt
    thrashing(monkeypatch)  # in place auto reads uncached only where the mapping thrashes
    # 100 MiB - 10 - 67.125 = 23424 KiB usable, less the head: 15903 KiB for the layers. Through the
    # mapping: a window of 2 x 2025 KiB, 5 layers cached; reading uncached: 2 buffers of a layer, still 5.
    cap(100)
    model = mapped(path)
    with LayerwiseOffloadManager(model, "blocks", device="cpu") as mgr:
        takes_uncached(mgr)
        coord = coordinator_module.coordinator()
        assert coord.room == 23424 * KIB - HEAD_BYTES
        assert mgr.residency.cached == (0, 1, 2, 3, 4) and mgr.residency.depth == 1
        mgr.register_forward_hooks()
        for _ in range(4):
            forward(model, x, want)
        assert mgr.parts.member.reads_mode == "uncached", mgr.parts.member.reads_why
        # Charged from the switch on, before a buffer was made: 2 buffers of a layer.
        assert buffers_of(2, coord.buffers), coord.buffers
        charged = coord.buffers
        forward(model, x, want)
        assert mgr.parts.loads.source.reader.held_bytes == charged == coord.buffers
        assert mgr.residency.cached_bytes + coord.buffers <= coord.room
        # The cap shrinks under the buffers (which the cgroup counts in use): the next forward
        # reads through the mapping again (the head streamed too: they do not fit even so).
        cap(85, in_use=17 * MIB + mgr.parts.loads.source.reader.held_bytes)
        forward(model, x, want)
        assert mgr.parts.member.reads_mode == "mapping" and "do not fit" in mgr.parts.member.reads_why, mgr.parts.member.reads_why
        assert coord.buffers == 0 and mgr.parts.loads.source.reader.held_bytes == 0  # the free buffers dropped
        forward(model, x, want)
        # Room again: read uncached again.
        cap(100)
        forward(model, x, want)
        assert mgr.parts.member.reads_mode == "uncached", mgr.parts.member.reads_why
        forward(model, x, want)


def test_uncached_buffers_are_charged_before_they_are_made(ckpt, cap):
    path, x, want = ckpt
    cap(100)
    model = mapped(path)
    with LayerwiseOffloadManager(model, "blocks", device="cpu", reads="uncached") as mgr:
        coord = coordinator_module.coordinator()
        assert mgr.parts.loads.source.reader.held_bytes == 0
        assert buffers_of(2, coord.buffers), coord.buffers  # 1 + depth buffers of a layer, none made yet
        assert mgr.residency.cached_bytes + coord.buffers <= coord.room
        mgr.register_forward_hooks()
        forward(model, x, want)
        assert mgr.parts.loads.source.reader.held_bytes <= coord.buffers


def test_the_copiers_ring_and_the_cpu_twins_buffers_are_charged_beside_the_window(ckpt, cap, monkeypatch):
    """The device pipeline's host memory (an owned copier's staging ring; on the CPU twin its
    "device" buffers) is charged by the plan beside the page-cache window it reads the layers
    through, at the most it takes before it is made; in place there is none."""
    path, x, want = ckpt
    monkeypatch.setenv("MAPOFFLOAD_STAGING_MIB", "1")
    monkeypatch.setenv("MAPOFFLOAD_STAGING_SLOTS", "2")
    cap(100)
    coord = coordinator_module.coordinator()
    with LayerwiseOffloadManager(mapped(path), "blocks", device="cpu", reads="mapping") as mgr:
        in_place, room = mgr.residency, coord.room
        assert mgr.parts.loads.planned_host_bytes == 0 and coord.working_buffers == 0
    assert in_place.cached == (0, 1, 2, 3, 4) and in_place.depth == 1  # see the test above
    model = mapped(path)
    with LayerwiseOffloadManager(model, "blocks", device="cpu", cpu_twin=True, host_store="mapped",
                                 reads="mapping") as mgr:
        ring = 2 * (1 << 20)
        held, charged = mgr.parts.loads.host_bytes, mgr.parts.loads.planned_host_bytes
        assert held == ring  # the ring is made with the copier; no layer is loaded yet
        assert charged == ring + 2 * LAYER  # a layer computing and one prefetched, before they exist
        assert coord.working_buffers == charged and coord.room == room + held - charged
        assert "staging and CPU-twin buffers charged" in coord.describe()
        plan = mgr.residency
        assert plan.cached == (0, 1, 2) and plan.depth == 1, plan  # 2 layers fewer: the charge is honoured
        assert plan.cached_bytes + 2 * LAYER + charged <= room + held
        mgr.register_forward_hooks()
        for _ in range(2):
            forward(model, x, want)
            assert mgr.parts.loads.host_bytes <= charged  # what it made stays within what the plan charged


def test_the_cpu_twins_charge_covers_every_buffer_size_its_pool_keeps():
    """The twin's pool keeps given-back buffers by exact size: layers of two sizes (or of two dtypes)
    leave up to a window of each, and the charge covers that, not a window of the largest."""
    from types import SimpleNamespace

    from mapoffload.offload.device_copies import DeviceCopies

    def charge(sizes, window):
        stores = [SimpleNamespace(dev_bytes=dict(zip((torch.bfloat16, torch.float32), s))) for s in sizes]
        target = DeviceCopies(stores, None, torch.device("cpu"), None, owns_copier=False, buffer_layers=window)
        return target.planned_host_bytes

    a, b = 3 * MIB, 1 * MIB
    assert charge([(a,)] * 4, 2) == 2 * a
    assert charge([(a,), (b,), (a,), (b,)], 2) == 2 * a + 2 * b  # not 2 x max(a, b)
    assert charge([(a,), (b,)], 3) == a + b  # never more of a size than the layers of that size
    assert charge([(a, b)] * 3, 2) == 2 * (a + b)  # two dtypes: a buffer each
