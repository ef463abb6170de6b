"""MappedRegions and the residency helpers on real mappings."""

from __future__ import annotations

import inspect
import mmap
import os
import subprocess
import tempfile
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import mapoffload
from mapoffload import MappedRegions, component_residency_bytes, cow_report, resident_bytes

from conftest import drop_page_cache
from native_mem import PAGE, file_page_then_anonymous_page, mmap_raw, mprotect, munmap, tensor_at


@pytest.fixture
def checkpoint(tmp_path):
    path = tmp_path / "w.safetensors"
    save_file({"a": torch.randn(300, 100), "b": torch.randn(7), "c": torch.arange(4096, dtype=torch.int64)}, path)
    return path


def test_load_file_views_are_held_and_anonymous_tensors_are_not(checkpoint):
    loaded = load_file(checkpoint)
    other = torch.randn(1000)
    regions = MappedRegions()
    assert regions.available
    assert regions.classify([loaded["a"], loaded["b"], loaded["c"], other]) == [True, True, True, False]
    assert regions.holds(loaded["a"][10:20]) and regions.holds(loaded["a"][:, 3])
    assert regions.holds_pointer(loaded["c"].data_ptr())
    assert not regions.holds_pointer(other.data_ptr())
    assert not regions.holds_pointer(0)
    assert regions.span_classes([loaded["a"], other]) == ["file", "anonymous"]
    assert regions.mapped_bytes([loaded["a"], other]) == loaded["a"].nbytes


def test_safe_open_and_torch_load_mmap(checkpoint, tmp_path):
    with safe_open(checkpoint, framework="pt") as f:
        a = f.get_tensor("a")
        sl = f.get_slice("a")[0:5]
    pt = tmp_path / "w.pt"
    torch.save({"x": torch.randn(5000)}, pt)
    loaded_pt = torch.load(pt, mmap=True, weights_only=True)
    regions = MappedRegions()
    assert regions.holds(loaded_pt["x"])
    # safe_open copies get_tensor results out of its own mapping in some
    # versions; what matters is that the index agrees with smaps.
    for t in (a, sl):
        assert regions.holds(t) == (regions.span_classes([t]) == ["file"])


def test_empty_meta_and_non_tensors():
    regions = MappedRegions()
    assert regions.classify([torch.empty(0), torch.empty(3, device="meta")]) == [False, False]
    assert regions.classify([]) == []
    with pytest.raises(TypeError, match="item 1 is list"):
        regions.classify([torch.zeros(1), [1, 2]])


def test_dev_shm_storage_is_shmem_not_file():
    path = f"/dev/shm/mapoffload-test-{os.getpid()}"
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    with open(path, "wb") as f:
        f.write(b"\1" * PAGE * 2)
    try:
        with open(path, "r+b") as f:
            m = mmap.mmap(f.fileno(), PAGE * 2)
        t = torch.frombuffer(m, dtype=torch.uint8)
        regions = MappedRegions()
        assert not regions.holds(t)
        assert regions.span_classes([t]) == ["shmem"]
        shared = torch.zeros(1000).share_memory_()
        regions = MappedRegions()
        assert not regions.holds(shared)
        assert regions.span_classes([shared]) == ["shmem"]
        del t
        m.close()
    finally:
        os.unlink(path)


def test_span_crossing_file_page_into_anonymous_page(tmp_path):
    with file_page_then_anonymous_page(tmp_path) as base:
        regions = MappedRegions()
        assert regions.holds(tensor_at(base, PAGE))
        crossing = tensor_at(base + PAGE - 8, 16)
        assert not regions.holds(crossing)
        assert regions.span_classes([crossing]) == ["mixed"]
        assert not regions.holds(tensor_at(base + PAGE, 8))


def test_file_mapping_split_by_mprotect_counts_as_one(tmp_path):
    path = tmp_path / "three.bin"
    path.write_bytes(os.urandom(3 * PAGE))
    fd = os.open(path, os.O_RDONLY)
    try:
        base = mmap_raw(3 * PAGE, mmap.PROT_READ, mmap.MAP_PRIVATE, fd)
    finally:
        os.close(fd)
    try:
        mprotect(base + PAGE, PAGE, mmap.PROT_READ | mmap.PROT_WRITE)
        regions = MappedRegions()
        table = regions.table
        first = table.find(base)
        assert table.ends[first] == base + PAGE  # really split
        assert regions.holds(tensor_at(base, 3 * PAGE))
    finally:
        munmap(base, 3 * PAGE)


def test_snapshot_does_not_see_later_mappings(checkpoint):
    regions = MappedRegions()
    loaded = load_file(checkpoint)
    assert not regions.holds(loaded["a"])
    assert MappedRegions().holds(loaded["a"])


def test_unreadable_proc_answers_false_and_never_raises(checkpoint):
    loaded = load_file(checkpoint)
    regions = MappedRegions(maps_path="/nonexistent/maps")
    assert not regions.available
    assert regions.classify([loaded["a"]]) == [False]
    assert not regions.holds(loaded["a"]) and not regions.holds_pointer(loaded["a"].data_ptr())
    assert regions.span_classes([loaded["a"]]) == ["unmapped"]
    assert not cow_report(smaps_path="/nonexistent/smaps").available


def test_missing_mountinfo_keeps_path_rules(checkpoint):
    loaded = load_file(checkpoint)
    regions = MappedRegions(mountinfo_path="/nonexistent/mountinfo")
    assert regions.available and regions.holds(loaded["a"])


def test_residency_follows_the_page_cache(tmp_path):
    path = tmp_path / "cold.safetensors"
    # 64 MiB: reading the header triggers kernel readahead of up to a few MiB.
    save_file({"w": torch.ones(16 << 20)}, path)
    drop_page_cache(path)
    w = load_file(path)["w"]
    cold = resident_bytes([w])[0]
    assert cold <= w.nbytes // 4, f"{cold} of {w.nbytes} bytes resident right after dropping"
    float(w.sum())
    # All of it, less what the kernel's own reclaim may take back meanwhile (a CI run lost 4 pages of
    # 16384 between the sum and the count: this machine runs DAMON's kdamond).
    warm = resident_bytes([w])[0]
    assert w.nbytes - w.nbytes // 100 <= warm <= w.nbytes, f"{warm} of {w.nbytes} bytes resident after a read"
    anon = torch.ones(1000)
    assert resident_bytes([anon, torch.empty(0)]) == [anon.nbytes, 0]


def test_cow_report_sees_a_write_and_not_a_read(checkpoint):
    loaded = load_file(checkpoint)
    a = loaded["a"]
    before = cow_report([a])
    assert before.anonymous_bytes == 0 and len(before.mappings) == 1
    assert before.mappings[0].path == str(checkpoint)
    float(a.sum())
    assert cow_report([a]).anonymous_bytes == 0
    a[0, 0] = 42.0
    after = cow_report([a])
    assert after.anonymous_bytes >= PAGE
    assert after.by_path()[str(checkpoint)] == after.anonymous_bytes
    assert cow_report().anonymous_bytes >= after.anonymous_bytes
    assert "turned anonymous" in str(after)


def test_component_residency_bytes(checkpoint):
    loaded = load_file(checkpoint)
    module = torch.nn.Module()
    module.a = torch.nn.Parameter(loaded["a"], requires_grad=False)
    module.a_view = torch.nn.Parameter(loaded["a"][:10], requires_grad=False)  # same storage
    module.register_buffer("anon", torch.zeros(10))
    module.register_buffer("meta", torch.empty(10, device="meta"))
    out = component_residency_bytes(module)
    assert out["vram"] == 0 and out["host_pinned"] == 0
    assert out["host"] == 40
    # The storage of a mapped view is the file region safetensors exposes for it.
    assert out["host_mapped"] == loaded["a"].untyped_storage().nbytes()


# The fixed public names of the design's contract (DESIGN.md, "Contract: the public names"), written
# out here, each with its kind and what the contract fixes of its signature: positional parameters in
# order, then keyword-only ones (name -> default, or REQUIRED).
REQUIRED = object()
CONTRACT_FUNCTIONS = {
    "component_residency_bytes": (["module"], {}),
    "resident_bytes": (["tensors"], {}),
    "drop_page_cache": (["path"], {}),
    "cgroup_memory_limit_bytes": ([], {"root": "/"}),
    "host_memory_available_bytes": ([], {"root": "/"}),
    "host_copies_would_not_fit": (["weight_bytes"], {"available_bytes": None}),
    "checkpoint_bytes": (["path"], {}),
    "checkpoint_files": (["path"], {}),
    "keep_checkpoint_mapped": ([], {"weight_bytes": REQUIRED, "component": REQUIRED}),
    "match_checkpoint_dtypes": (["loaded", "target_state"], {}),
    "load_checkpoint": (["module", "path"], {"keep_mapping": None, "strict": True, "device": "cpu"}),
    "rss_anon_bytes": ([], {}),
    "empty_weights": ([], {}),
    "from_pretrained": (["cls", "folder"], {"device": REQUIRED, "dtype": "auto"}),
    "offload": (["model"], {"device": REQUIRED, "layers": "auto", "rest": "auto"}),
}
CONTRACT_CONSTANTS = {"GIB_BYTES": 1 << 30, "HOST_COPY_RESERVE_BYTES": 4 << 30}
CONTRACT_EXCEPTIONS = {"CheckpointError": Exception, "MappingFaultError": OSError, "CudaError": Exception}
CONTRACT_CLASSES = {
    "MappedRegions": ("available", "holds_pointer", "holds", "classify", "span_classes"),
    "LayerwiseOffloadManager": (
        "register_forward_hooks", "remove_forward_hooks", "prefetch_layer", "release_layer", "release_all",
        "load_all_layers", "sync_layer_to_cpu", "update_cpu_weights", "iter_cpu_weights", "close", "__enter__",
        "__exit__", "mapped_bytes", "pinned_bytes", "pageable_bytes", "peak_device_bytes",
    ),
    "LoadReport": ("files", "tensors", "bytes_mapped", "bytes_copied", "copied", "missing_keys", "unexpected_keys",
                   "seconds"),
    "OffloadedWeight": (),
}


def test_public_names_are_sorted_and_importable():
    names = list(mapoffload.__all__)
    assert names == sorted(set(names))  # sorted, no name twice
    contract = {*CONTRACT_FUNCTIONS, *CONTRACT_CONSTANTS, *CONTRACT_EXCEPTIONS, *CONTRACT_CLASSES}
    assert contract - set(names) == set()  # every name of the contract is public
    namespace: dict = {}
    exec(f"from mapoffload import {', '.join(names)}", namespace)  # as a user imports them
    for name in names:
        assert not inspect.ismodule(namespace[name]), name  # e.g. `offload` the function, not the submodule
        assert namespace[name] is getattr(mapoffload, name)


def test_contract_names_are_of_their_kind():
    import contextlib
    import dataclasses

    for name, value in CONTRACT_CONSTANTS.items():
        got = getattr(mapoffload, name)
        assert type(got) is int and got == value, name
    for name, base in CONTRACT_EXCEPTIONS.items():
        cls = getattr(mapoffload, name)
        assert inspect.isclass(cls) and issubclass(cls, base), (name, cls.__mro__)
    for name, (positional, keyword) in CONTRACT_FUNCTIONS.items():
        fn = getattr(mapoffload, name)
        assert inspect.isfunction(fn), (name, fn)
        params = list(inspect.signature(fn).parameters.values())
        pos = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        assert pos[:len(positional)] == positional, (name, pos)
        assert all(p.default is not p.empty for p in params[len(positional):] if p.kind == p.POSITIONAL_OR_KEYWORD), \
            (name, "a required positional parameter the contract does not have")
        kw = {p.name: p for p in params if p.kind == p.KEYWORD_ONLY}
        for arg, default in keyword.items():
            assert arg in kw, (name, arg, list(kw))
            if default is REQUIRED:
                assert kw[arg].default is inspect.Parameter.empty, (name, arg, kw[arg].default)
            else:
                assert kw[arg].default == default, (name, arg, kw[arg].default)
    with mapoffload.empty_weights() as inside:  # a context manager: parameters on meta, buffers real
        assert inside is None
        lin, norm = torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2)
    assert not norm.running_mean.is_meta and torch.equal(norm.running_var, torch.ones(2))
    assert lin.weight.is_meta and norm.weight.is_meta
    assert isinstance(mapoffload.empty_weights(), contextlib.AbstractContextManager)
    for name, members in CONTRACT_CLASSES.items():
        cls = getattr(mapoffload, name)
        assert inspect.isclass(cls), name
        missing = [a for a in members if not hasattr(cls, a) and a not in getattr(cls, "__dataclass_fields__", {})]
        assert missing == [], (name, missing)
    assert issubclass(mapoffload.OffloadedWeight, torch.nn.Parameter)
    assert dataclasses.is_dataclass(mapoffload.LoadReport)
    assert isinstance(MappedRegions.available, property)
    sig = inspect.signature(mapoffload.LayerwiseOffloadManager)
    assert list(sig.parameters)[:2] == ["model", "layers"]
    for arg, default in {"prefetch_layers": 1, "host_store": "auto", "available_bytes": None, "cpu_twin": False,
                         "page_cache_bytes": None, "local_ranks": None}.items():
        p = sig.parameters[arg]
        assert p.kind == p.KEYWORD_ONLY and p.default == default, (arg, p)
    assert sig.parameters["device"].kind == inspect.Parameter.KEYWORD_ONLY
    assert sig.parameters["device"].default is inspect.Parameter.empty
    prefetch = inspect.signature(mapoffload.LayerwiseOffloadManager.prefetch_layer).parameters
    assert prefetch["non_blocking"].default is True


def test_device_check_path_and_tensors_without_storage(checkpoint):
    loaded = load_file(checkpoint)
    table = MappedRegions().table
    items = [loaded["a"], torch.zeros(3), torch.zeros(3).to_sparse(), torch.empty(2, device="meta")]
    expected = [True, False, False, False]
    assert table.classify_tensors(items, torch.Tensor, True) == expected
    assert table.classify_tensors(items, torch.Tensor, False) == expected
    assert mapoffload.tensor_spans(items).sizes == [loaded["a"].nbytes, 3 * 4, 0, 0]


def test_non_utf8_mapped_path_comes_back_fsdecoded(tmp_path):
    # Before: UnicodeDecodeError from cow_report() and MapsTable.paths for any
    # mapped file whose name is not UTF-8, anywhere in the process.
    name = os.path.join(os.fsencode(tmp_path), b"w\xff.safetensors")
    with open(name, "wb") as f:
        f.write(b"\3" * PAGE)
    with open(name, "rb") as f:
        m = mmap.mmap(f.fileno(), PAGE, access=mmap.ACCESS_COPY)  # MAP_PRIVATE, writable
    try:
        t = torch.frombuffer(m, dtype=torch.uint8)
        expected = os.fsdecode(name)
        regions = MappedRegions()
        assert expected in regions.table.paths
        assert regions.holds(t)
        report = cow_report()
        assert expected in report.by_path()
        assert [mp.path for mp in cow_report([t]).mappings] == [expected]
        assert os.fsencode(cow_report([t]).mappings[0].path) == name
        del t
    finally:
        m.close()


def test_file_resident_bytes_takes_any_path(tmp_path):
    name = os.path.join(os.fsencode(tmp_path), b"f\xfe.bin")
    with open(name, "wb") as f:
        f.write(b"\0" * 3 * PAGE)
    assert mapoffload._core.file_resident_bytes(os.fsdecode(name))[1] == 3 * PAGE
    assert mapoffload._core.file_resident_bytes(name)[1] == 3 * PAGE
    missing = os.path.join(os.fsencode(tmp_path), b"gone\xff.bin")
    with pytest.raises(FileNotFoundError) as info:
        mapoffload._core.file_resident_bytes(missing)
    assert info.value.filename == os.fsdecode(missing)


def test_file_resident_bytes_never_blocks_on_a_fifo(tmp_path):
    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)
    # Before: open(O_RDONLY) on a FIFO with no writer blocked forever.
    code = f"from mapoffload import _core; print(_core.file_resident_bytes({str(fifo)!r}))"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20, env=env,
                          cwd=tempfile.gettempdir())
    assert proc.returncode == 0 and proc.stdout.strip() == "(0, 0)", proc.stderr[-2000:]
