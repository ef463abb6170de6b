"""An offloaded model dropped without ``close()`` is freed with everything it held: its mapping, its
stack's page worker threads and its place in the page-cache plan. Each module's patches were in a
process-wide table whose values (the wrapped forwards) held the modules, and the hooks waiting for
TorchDynamo in another: every model offloaded in a process stayed (an engine restarted in one process
added a stack's threads and mapping each time). With TorchDynamo imported before, and not."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import gc, sys, threading, time, weakref
    import torch
    if sys.argv[2] == "dynamo":
        import torch._dynamo  # noqa: F401
    from safetensors.torch import save_file
    import mapoffload
    from mapoffload import empty_weights, load_checkpoint
    from mapoffload.pagecache.coordinator import coordinator

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(3))
            self.head = torch.nn.Linear(64, 8)

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return self.head(x)

    path = sys.argv[1]
    save_file({k: v.contiguous() for k, v in M().state_dict().items()}, path)

    def run():
        with empty_weights():
            m = M().eval()
        load_checkpoint(m, path, keep_mapping=True)
        mapoffload.offload(m, layers="blocks", device="cpu")
        with torch.no_grad():
            m(torch.randn(2, 64))
        return weakref.ref(m)

    refs = [run() for _ in range(3)]
    gc.collect()
    deadline = time.monotonic() + 10
    while any(t.name.startswith("mapoffload-") for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    print("alive", sum(r() is not None for r in refs))
    print("members", len(coordinator().members()))
    print("mapped", sum(1 for line in open("/proc/self/maps") if path in line))
    print("threads", sorted(t.name for t in threading.enumerate() if t.name.startswith("mapoffload-")))
""")


@pytest.mark.parametrize("dynamo", ["dynamo", "no-dynamo"])
def test_a_model_dropped_without_close_is_freed(tmp_file_dir, dynamo):
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_file_dir / "m.safetensors"), dynamo],
                         capture_output=True, text=True, timeout=300, cwd="/")  # the installed package
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[:4] == ["alive 0", "members 0", "mapped 0", "threads []"], out.stdout


def test_a_manager_dropped_without_close_keeps_offloading_and_a_second_one_is_refused(tmp_file_dir):
    """Its hooks stay on the model and keep offloading it (bit-equal). A second manager was accepted: its
    forward patch was skipped (the first one's stayed), its plan was never applied, and after its close()
    the model still carried the first's hooks. Refused by name now."""
    import gc

    import torch
    from safetensors.torch import save_file

    from mapoffload import LayerwiseOffloadManager, empty_weights, load_checkpoint
    from mapoffload.offload.placeholder import AlreadyOffloadedError

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(3))

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    torch.manual_seed(0)
    ref = M().eval()
    path = str(tmp_file_dir / "m.safetensors")
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, path)
    with empty_weights():
        model = M().eval()
    load_checkpoint(model, path, keep_mapping=True)
    x = torch.randn(2, 64)
    mgr = LayerwiseOffloadManager(model, "blocks", device="cpu")
    mgr.register_forward_hooks()
    del mgr
    gc.collect()
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))
    with pytest.raises(AlreadyOffloadedError, match="layer blocks.0 is already offloaded.*close"):
        LayerwiseOffloadManager(model, "blocks", device="cpu")
