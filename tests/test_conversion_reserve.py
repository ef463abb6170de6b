"""ConversionCache.reserve: a part computed into through a shared mapping (the vLLM load format's
way to convert with no anonymous copy), its manifest meta, and a writer killed mid-way."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import torch

from mapoffload.conversion import MANIFEST, ConversionCache
from mapoffload.memory.regions import MappedRegions

KEY = "0123456789abcdef01234567"


def _specs():
    return {"big": ((256, 1024), torch.float32), "small": ((7,), torch.bfloat16), "skip": ((64, 1024), torch.float32)}


def test_written_views_land_in_the_file_and_map_back(tmp_path):
    cache = ConversionCache.open(str(tmp_path), KEY)
    views = cache.reserve(_specs())
    assert all(MappedRegions().classify(list(views.values())))  # file-backed from the start, not anonymous
    views["big"].copy_(torch.arange(256 * 1024, dtype=torch.float32).view(256, 1024))
    views["small"].fill_(3.5)
    cache.forget(["skip"])  # never written: a hole in the part
    cache.meta = {"vllm": {"aliases": {"skip": ["w", 0]}}}
    cache.commit()
    again = ConversionCache.open(str(tmp_path), KEY)
    assert again.reused and again.meta == {"vllm": {"aliases": {"skip": ["w", 0]}}}
    mapped = again.mapped()
    assert set(mapped) == {"big", "small"}
    assert torch.equal(mapped["big"], torch.arange(256 * 1024, dtype=torch.float32).view(256, 1024))
    assert torch.equal(mapped["small"], torch.full((7,), 3.5, dtype=torch.bfloat16))
    part = next(p for p in os.listdir(again.path) if p.startswith("part-"))
    st = os.stat(os.path.join(again.path, part))
    assert st.st_blocks * 512 < st.st_size - 64 * 1024 * 4 // 2  # the unwritten tensor takes no disk


def test_meta_that_is_not_a_dict_is_not_reused(tmp_path):
    cache = ConversionCache.open(str(tmp_path), KEY)
    cache.reserve({"a": ((4,), torch.float32)})["a"].fill_(1)
    cache.commit()
    manifest = os.path.join(tmp_path, KEY, MANIFEST)
    data = json.load(open(manifest))
    data["meta"] = ["not", "a", "dict"]
    with open(manifest, "w") as f:
        json.dump(data, f)
    assert not ConversionCache.open(str(tmp_path), KEY).reused


def test_a_writer_killed_while_computing_is_swept(tmp_path):
    code = textwrap.dedent(f"""
        import os, sys, time, torch
        from mapoffload.conversion import ConversionCache
        cache = ConversionCache.open({str(tmp_path)!r}, {KEY!r})
        v = cache.reserve({{"a": ((1024, 1024), torch.float32)}})
        v["a"][:10].fill_(1)
        print("ready", flush=True)
        time.sleep(60)
    """)
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd="/")
    try:
        assert child.stdout.readline().strip() == "ready"
        work = [n for n in os.listdir(tmp_path) if n.startswith(".")]
        assert len(work) == 1
        assert not ConversionCache.open(str(tmp_path), KEY).reused  # a live writer's folder is left alone
        assert os.path.isdir(os.path.join(tmp_path, work[0]))
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        cache = ConversionCache.open(str(tmp_path), KEY)  # the next start sweeps what the dead one left
        assert not cache.reused and os.listdir(tmp_path) == []
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_a_writer_killed_just_before_its_folder_is_put_in_place_is_swept(tmp_path):
    """Killed between the manifest and the rename: the writer's mark was already gone, and the whole
    finished copy (a model's size) stayed as an unmarked folder for an hour. The mark now goes after
    the rename."""
    code = textwrap.dedent(f"""
        import os, torch
        from mapoffload.conversion import ConversionCache
        cache = ConversionCache.open({str(tmp_path)!r}, {KEY!r})
        cache.reserve({{"a": ((1024, 1024), torch.float32)}})["a"].fill_(1)
        ConversionCache._put_in_place = lambda self: os._exit(9)  # killed at the rename
        cache.commit()
    """)
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", timeout=120)
    assert child.returncode == 9, child.stderr[-2000:]
    (work,) = os.listdir(tmp_path)
    assert os.path.isfile(os.path.join(tmp_path, work, MANIFEST))  # whole, but not in place
    cache = ConversionCache.open(str(tmp_path), KEY)  # the next start sweeps it at once
    assert not cache.reused and os.listdir(tmp_path) == []


def test_a_finished_conversion_keeps_no_writer_mark(tmp_path):
    from mapoffload.conversion.marks import WRITER

    cache = ConversionCache.open(str(tmp_path), KEY)
    cache.reserve({"a": ((4,), torch.float32)})["a"].fill_(1)
    cache.commit()
    assert not os.path.lexists(os.path.join(tmp_path, KEY, WRITER))
    assert ConversionCache.open(str(tmp_path), KEY).reused
