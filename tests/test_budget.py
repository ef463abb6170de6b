"""Host memory budget: cgroup v1/v2 on fake trees, the override, the gate."""

from __future__ import annotations

import os

import pytest

from mapoffload import (
    GIB_BYTES,
    HOST_COPY_RESERVE_BYTES,
    cgroup_memory_limit_bytes,
    describe_host,
    host_copies_would_not_fit,
    host_memory_available_bytes,
)
from mapoffload.budget import ENV_HOST_AVAILABLE_GIB

GIB = GIB_BYTES


def write(root, rel, text):
    path = os.path.join(root, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def v2_tree(root, own="/user.slice/app.scope", caps=None):
    write(root, "proc/self/cgroup", f"0::{own}\n")
    for rel, (cap, usage) in (caps or {}).items():
        write(root, f"sys/fs/cgroup/{rel}/memory.max".replace("//", "/"), cap)
        write(root, f"sys/fs/cgroup/{rel}/memory.current".replace("//", "/"), str(usage))


def v1_tree(root, own="/process_api/abc", caps=None):
    write(root, "proc/self/cgroup", f"12:cpu,cpuacct:/\n4:memory:{own}\n0::/\n")
    for rel, (cap, usage) in (caps or {}).items():
        write(root, f"sys/fs/cgroup/memory/{rel}/memory.limit_in_bytes".replace("//", "/"), cap)
        write(root, f"sys/fs/cgroup/memory/{rel}/memory.usage_in_bytes".replace("//", "/"), str(usage))


def test_v2_leaf_cap(tmp_path):
    v2_tree(tmp_path, caps={"user.slice/app.scope": (str(8 * GIB), GIB), "user.slice": ("max", 3 * GIB)})
    assert cgroup_memory_limit_bytes(root=str(tmp_path)) == (8 * GIB, GIB)


def test_v2_nested_caps_take_the_tightest(tmp_path):
    v2_tree(
        tmp_path,
        caps={"user.slice/app.scope": (str(16 * GIB), GIB), "user.slice": (str(10 * GIB), 9 * GIB), "": ("max", 0)},
    )
    assert cgroup_memory_limit_bytes(root=str(tmp_path)) == (10 * GIB, 9 * GIB)


def test_v2_uncapped_garbage_and_missing(tmp_path):
    v2_tree(tmp_path, caps={"user.slice/app.scope": ("max\n", GIB), "user.slice": ("lots", 0)})
    assert cgroup_memory_limit_bytes(root=str(tmp_path)) is None
    assert cgroup_memory_limit_bytes(root=str(tmp_path / "nothing-here")) is None


def test_v1_nested_path_and_sentinel(tmp_path):
    v1_tree(
        tmp_path,
        caps={"process_api/abc": (str(9223372036854771712), GIB), "process_api": (str(12 * GIB), 2 * GIB)},
    )
    assert cgroup_memory_limit_bytes(root=str(tmp_path)) == (12 * GIB, 2 * GIB)


def test_container_path_missing_under_mount_tries_suffixes_then_mount(tmp_path):
    # The host's path is /kubepods/pod1/ctr; inside the container only /ctr exists.
    v2_tree(tmp_path, own="/kubepods/pod1/ctr", caps={"ctr": (str(6 * GIB), GIB)})
    assert cgroup_memory_limit_bytes(root=str(tmp_path)) == (6 * GIB, GIB)
    other = tmp_path / "mountonly"
    v2_tree(other, own="/kubepods/pod1/ctr", caps={"": (str(5 * GIB), 2 * GIB)})
    assert cgroup_memory_limit_bytes(root=str(other)) == (5 * GIB, 2 * GIB)


def test_v2_is_tried_before_v1(tmp_path):
    write(tmp_path, "proc/self/cgroup", "4:memory:/a\n0::/b\n")
    write(tmp_path, "sys/fs/cgroup/b/memory.max", str(3 * GIB))
    write(tmp_path, "sys/fs/cgroup/b/memory.current", "0")
    write(tmp_path, "sys/fs/cgroup/memory/a/memory.limit_in_bytes", str(2 * GIB))
    write(tmp_path, "sys/fs/cgroup/memory/a/memory.usage_in_bytes", "0")
    assert cgroup_memory_limit_bytes(root=str(tmp_path)) == (3 * GIB, 0)


def test_cap_wins_over_free_memory_and_the_reverse(tmp_path, monkeypatch):
    import psutil

    class VM:
        available = 64 * GIB

    monkeypatch.setattr(psutil, "virtual_memory", lambda: VM)
    v2_tree(tmp_path, caps={"user.slice/app.scope": (str(32 * GIB), 2 * GIB)})
    assert host_memory_available_bytes(root=str(tmp_path)) == 30 * GIB
    VM.available = 8 * GIB
    assert host_memory_available_bytes(root=str(tmp_path)) == 8 * GIB
    assert "cgroup cap 32.00 GiB" in describe_host(root=str(tmp_path))


def test_override_behaves_like_a_smaller_host(tmp_path, monkeypatch):
    write(tmp_path, "proc/self/status", "Name: python\nRssAnon:\t  1048576 kB\n")
    monkeypatch.setenv(ENV_HOST_AVAILABLE_GIB, "8")
    assert host_memory_available_bytes(root=str(tmp_path)) == 7 * GIB
    monkeypatch.setenv(ENV_HOST_AVAILABLE_GIB, "0.5")
    assert host_memory_available_bytes(root=str(tmp_path)) == 0
    assert ENV_HOST_AVAILABLE_GIB in describe_host(root=str(tmp_path))
    for bad in ("lots", "-1", "nan", "inf"):
        monkeypatch.setenv(ENV_HOST_AVAILABLE_GIB, bad)
        with pytest.raises(ValueError, match=ENV_HOST_AVAILABLE_GIB):
            host_memory_available_bytes()


def test_gate_matches_the_seed_expectations():
    assert HOST_COPY_RESERVE_BYTES == 4 * GIB
    assert host_copies_would_not_fit(62 * GIB, available_bytes=32 * GIB)
    assert not host_copies_would_not_fit(20 * GIB, available_bytes=128 * GIB)
    # The reserve is not spendable: exactly available - reserve does not fit.
    assert host_copies_would_not_fit(28 * GIB, available_bytes=32 * GIB)
    assert not host_copies_would_not_fit(28 * GIB - 1, available_bytes=32 * GIB)
    assert not host_copies_would_not_fit(0, available_bytes=0)
    assert not host_copies_would_not_fit(-5, available_bytes=0)
    assert host_copies_would_not_fit(1, available_bytes=2 * GIB)


def test_gate_reads_the_host_when_not_told(monkeypatch):
    monkeypatch.setenv(ENV_HOST_AVAILABLE_GIB, "16")
    assert host_copies_would_not_fit(13 * GIB)
    assert not host_copies_would_not_fit(GIB)


def test_this_machine_answers_something():
    assert host_memory_available_bytes() > 0
    result = cgroup_memory_limit_bytes()
    assert result is None or (result[0] > 0 and result[1] >= 0)
