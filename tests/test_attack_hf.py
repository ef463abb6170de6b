"""Attacks on from_pretrained's driving of transformers' load and on its
conversion cache: damaged or colliding conversion folders, a fork during a
load, what an fp8-kept model gives back."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import mapoffload  # noqa: E402
from same_kernels import host_weights, seat_like  # noqa: E402
from conformance_zoo import build  # noqa: E402
from mapoffload.conversion import cache as _converted  # noqa: E402
from mapoffload.hf.convert import convert_pretrained  # noqa: E402

IDS = torch.tensor([[1, 2, 3]])


def _same_as_transformers(cls, folder, model) -> bool:
    ref = cls.from_pretrained(folder).eval()
    seat_like(ref, host_weights(model))  # the same kernels on both sides (tests/same_kernels.py)
    with torch.no_grad():
        return torch.equal(ref(IDS).logits, model(IDS).logits)


def test_an_empty_manifest_is_replaced_not_converted_forever(tmp_path):
    # An empty manifest.json (what a crash leaves when the manifest was renamed into place
    # before it reached the disk) made every later load convert again and throw its result away.
    cls, _ = build("mixtral", str(tmp_path / "m"))
    first = convert_pretrained(str(tmp_path / "m"))
    with open(os.path.join(first.conversion_dir, _converted.MANIFEST), "w"):
        pass
    second = convert_pretrained(str(tmp_path / "m"))
    assert not second.conversion_reused and second.converted_tensors == 4
    third = mapoffload.from_pretrained(cls, str(tmp_path / "m"), device=None)
    assert third.mapoffload_report.conversion_reused
    assert _same_as_transformers(cls, str(tmp_path / "m"), third)


@pytest.mark.parametrize("damage", ["truncated", "tensor-missing"])
def test_a_damaged_part_is_converted_again_not_a_failed_load(tmp_path, damage):
    from safetensors.torch import load_file

    cls, _ = build("mixtral", str(tmp_path / "m"))
    first = convert_pretrained(str(tmp_path / "m"))
    part = os.path.join(first.conversion_dir, "part-00000.safetensors")
    if damage == "truncated":  # e.g. an interrupted copy of the cache folder
        os.truncate(part, os.path.getsize(part) // 2)
    else:
        kept = {k: v.clone() for k, v in list(load_file(part).items())[1:]}
        _converted.write_safetensors(part, kept)
    model = mapoffload.from_pretrained(cls, str(tmp_path / "m"), device=None)
    assert not model.mapoffload_report.conversion_reused and model.mapoffload_report.converted_tensors == 4
    assert _same_as_transformers(cls, str(tmp_path / "m"), model)
    again = mapoffload.from_pretrained(cls, str(tmp_path / "m"), device=None)
    assert again.mapoffload_report.conversion_reused  # and the folder was repaired


def test_two_checkpoints_alike_but_for_their_weights_never_share_a_conversion(tmp_path):
    # Two fine-tunes of one model: same config, same file names and sizes; timestamps
    # normalised (an image layer, a tar, a nix store); one shared conversion root.
    cls, _ = build("mixtral", str(tmp_path / "a"))
    other = cls.from_pretrained(str(tmp_path / "a"))
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    other.save_pretrained(str(tmp_path / "b"))
    shutil.copy(tmp_path / "a" / "config.json", tmp_path / "b" / "config.json")
    for name in os.listdir(tmp_path / "a"):
        for x in "ab":
            os.utime(tmp_path / x / name, ns=(10**18, 10**18))
    cache = str(tmp_path / "shared")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mapoffload.from_pretrained(cls, str(tmp_path / "a"), device=None, cache_dir=cache)
        b = mapoffload.from_pretrained(cls, str(tmp_path / "b"), device=None, cache_dir=cache)
    assert not b.mapoffload_report.conversion_reused
    assert _same_as_transformers(cls, str(tmp_path / "b"), b)


_FORK = """
import os, sys, threading, time, warnings
warnings.simplefilter("ignore")
import transformers as tf
import mapoffload
from mapoffload.conversion import cache as _converted
folder, cache = sys.argv[1], sys.argv[2]
entered, release = threading.Event(), threading.Event()
real = _converted.write_safetensors
def slow(path, tensors):
    entered.set(); release.wait(60); real(path, tensors)
_converted.write_safetensors = slow
t = threading.Thread(target=lambda: mapoffload.from_pretrained(
    tf.MixtralForCausalLM, folder, device=None, cache_dir=cache))
t.start()
assert entered.wait(60)  # the other thread is inside its load: lock held, hooks installed
pid = os.fork()
if pid == 0:
    from transformers import core_model_loading as cml
    code = 3 if cml.set_param_for_module.__qualname__.startswith("_wrap_") else 0  # hooks left installed
    _converted.write_safetensors = real
    try:
        m = mapoffload.from_pretrained(tf.MixtralForCausalLM, folder, device=None, cache_dir=cache + "-child")
        code = code or (0 if m.mapoffload_report.converted_tensors == 4 else 4)
    except BaseException:
        code = 5
    os._exit(code)
release.set(); t.join()
for _ in range(300):
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        print("exit", os.waitstatus_to_exitcode(status)); break
    time.sleep(0.1)
else:
    os.kill(pid, 9); os.waitpid(pid, 0); print("hung")
"""


@pytest.mark.slow
def test_a_child_forked_during_another_threads_load_can_load(tmp_path):
    build("mixtral", str(tmp_path / "m"))
    out = subprocess.run([sys.executable, "-c", _FORK, str(tmp_path / "m"), str(tmp_path / "c")],
                         capture_output=True, text=True, timeout=240, cwd="/")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-2:] == ["exit", "0"], out.stdout  # not hung on the parent's lock


def test_an_fp8_kept_model_saves_what_transformers_reloads(tmp_path):
    pytest.importorskip("accelerate")
    from conformance_zoo import to_fp8

    cls, _ = build("llama", str(tmp_path / "m"), dtype=torch.bfloat16)
    to_fp8(str(tmp_path / "m"))
    ref = cls.from_pretrained(str(tmp_path / "m")).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = mapoffload.from_pretrained(cls, str(tmp_path / "m"), device=None)
    assert model.mapoffload_report.fp8_weights > 0
    assert set(model.state_dict()) == set(ref.state_dict())
    model.save_pretrained(str(tmp_path / "saved"))
    back, info = cls.from_pretrained(str(tmp_path / "saved"), output_loading_info=True)
    assert not info["missing_keys"]
    seat_like(ref, host_weights(back))
    with torch.no_grad():
        assert torch.equal(back.eval()(IDS).logits, ref(IDS).logits)


def test_a_zero_dim_parameter_is_converted(tmp_path):
    # CLIP's logit_scale is a 0-d parameter: a dtype cast wrote it with view(uint8), which a
    # 0-d tensor refuses, and the load failed.
    from conformance_zoo import first_output, inputs

    cls, kind = build("clip", str(tmp_path / "m"))
    ref = cls.from_pretrained(str(tmp_path / "m"), dtype=torch.bfloat16).eval()
    x = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in inputs(kind, ref.config).items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = mapoffload.from_pretrained(cls, str(tmp_path / "m"), device=None, dtype=torch.bfloat16)
    assert model.logit_scale.dim() == 0 and model.mapoffload_report.converted_tensors > 0
    assert mapoffload.MappedRegions().holds(model.logit_scale)
    seat_like(ref, host_weights(model))
    with torch.no_grad():
        assert torch.equal(first_output(ref(**x)), first_output(model(**x)))
    path = str(tmp_path / "scalar.safetensors")
    _converted.write_safetensors(path, {"s": torch.tensor(2.5, dtype=torch.bfloat16)})
    from safetensors.torch import load_file

    assert load_file(path)["s"].shape == () and load_file(path)["s"].item() == 2.5


@pytest.mark.parametrize("fp8", ["keep", "dequantize"])
def test_an_fp8_checkpoints_conversion_is_reused(tmp_path, monkeypatch, fp8):
    pytest.importorskip("accelerate")
    from conformance_zoo import to_fp8

    cls, _ = build("mixtral", str(tmp_path / "m"), dtype=torch.bfloat16)
    to_fp8(str(tmp_path / "m"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = mapoffload.from_pretrained(cls, str(tmp_path / "m"), device=None, fp8=fp8)
        assert first.mapoffload_report.converted_tensors > 0
        written = []
        real = _converted.write_safetensors
        monkeypatch.setattr(_converted, "write_safetensors", lambda p, t: (written.append(p), real(p, t)))
        second = mapoffload.from_pretrained(cls, str(tmp_path / "m"), device=None, fp8=fp8)
    assert second.mapoffload_report.conversion_reused and not written
    assert _same_as_transformers(cls, str(tmp_path / "m"), second)


def _converted_folder(tmp_path):
    cls, _ = build("mixtral", str(tmp_path / "m"))
    first = convert_pretrained(str(tmp_path / "m"), cache_dir=str(tmp_path / "c"))
    return cls, first.conversion_dir


def _converts_again_then_reuses(tmp_path, conversion_dir):
    second = convert_pretrained(str(tmp_path / "m"), cache_dir=str(tmp_path / "c"))
    assert not second.conversion_reused and second.converted_tensors == 4
    third = convert_pretrained(str(tmp_path / "m"), cache_dir=str(tmp_path / "c"))
    assert third.conversion_reused and third.conversion_dir == conversion_dir  # repaired in place
    assert os.path.isdir(conversion_dir) and not os.path.islink(conversion_dir)
    assert os.listdir(tmp_path / "c") == [os.path.basename(conversion_dir)]  # nothing else left behind


def test_a_part_written_after_the_conversion_finished_is_converted_again(tmp_path):
    # Found by a hostile review: bytes of a part overwritten in place (its header intact, its size the same)
    # were mapped as they were - a converted weight silently held them. A part's size and modification time
    # are in the manifest now.
    _, conversion_dir = _converted_folder(tmp_path)
    part = os.path.join(conversion_dir, sorted(f for f in os.listdir(conversion_dir) if f.startswith("part-"))[0])
    size = os.path.getsize(part)
    with open(part, "r+b") as f:
        f.seek(size - 64)
        f.write(b"\x7f" * 64)
    _converts_again_then_reuses(tmp_path, conversion_dir)


@pytest.mark.parametrize("manifest", ["list", "string", "null", "deep", "bytes-bool", "bytes-negative"])
def test_a_manifest_of_the_wrong_types_is_converted_again(tmp_path, manifest):
    # A manifest that is JSON but not an object raised AttributeError; one nested deeply enough RecursionError.
    _, conversion_dir = _converted_folder(tmp_path)
    path = os.path.join(conversion_dir, _converted.MANIFEST)
    data = json.load(open(path))
    texts = {"list": "[1, 2]", "string": '"manifest"', "null": "null", "deep": "[" * 100_000 + "]" * 100_000}
    text = texts.get(manifest)
    if text is None:
        for entry in data["tensors"].values():
            entry["bytes"] = True if manifest == "bytes-bool" else -entry["bytes"]
        text = json.dumps(data)
    with open(path, "w") as f:
        f.write(text)
    _converts_again_then_reuses(tmp_path, conversion_dir)


_CONVERT = """
import sys, warnings
warnings.simplefilter("ignore")
from mapoffload.hf.convert import convert_pretrained
r = convert_pretrained(sys.argv[1], cache_dir=sys.argv[2])
print("converted", r.converted_tensors, "reused" if r.conversion_reused else "written")
"""


@pytest.mark.slow  # 8-11 s on 2 cores (Zen 3): the slow part
def test_a_manifest_that_is_a_fifo_does_not_hang_the_load(tmp_path):
    _, conversion_dir = _converted_folder(tmp_path)
    path = os.path.join(conversion_dir, _converted.MANIFEST)
    os.remove(path)
    os.mkfifo(path)
    try:  # in a child: a load blocked on the FIFO is killed at the timeout
        out = subprocess.run([sys.executable, "-c", _CONVERT, str(tmp_path / "m"), str(tmp_path / "c")],
                             capture_output=True, text=True, timeout=120, cwd="/")
    except subprocess.TimeoutExpired:
        pytest.fail("a FIFO named manifest.json blocked the load")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-3:] == ["converted", "4", "written"]


@pytest.mark.parametrize("what", ["file", "dangling-link", "part-link"])
def test_a_conversion_folder_that_is_not_one_is_replaced(tmp_path, what):
    # <root>/<key> a file or a dangling symlink: the commit's move-aside failed (IsADirectoryError),
    # leaving the finished work folder and the aside one behind, locked by the failed load for good.
    _, conversion_dir = _converted_folder(tmp_path)
    if what == "part-link":  # a part swapped for a link to another file: never mapped
        part = os.path.join(conversion_dir, "part-00000.safetensors")
        os.rename(part, tmp_path / "elsewhere.safetensors")
        os.symlink(tmp_path / "elsewhere.safetensors", part)
    else:
        shutil.rmtree(conversion_dir)
        if what == "file":
            with open(conversion_dir, "w") as f:
                f.write("not a folder")
        else:
            os.symlink(tmp_path / "nowhere", conversion_dir)
    _converts_again_then_reuses(tmp_path, conversion_dir)


def test_an_unwritable_conversion_root_is_named_with_the_way_out(tmp_path, monkeypatch):
    import errno
    import tempfile

    cls, _ = build("mixtral", str(tmp_path / "m"))
    (tmp_path / "ro").mkdir()

    def refused(*args, **kwargs):  # what mkdtemp meets in a read-only or foreign folder (root writes anywhere)
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

    monkeypatch.setattr(tempfile, "mkdtemp", refused)
    with pytest.raises(mapoffload.hf.ConversionWriteError) as info:
        mapoffload.from_pretrained(cls, str(tmp_path / "m"), device=None, cache_dir=str(tmp_path / "ro"))
    message = str(info.value)
    assert info.value.errno == errno.EACCES and str(tmp_path / "ro") in message and "cache_dir=" in message
    assert "free" not in message  # not a full disk
    assert os.listdir(tmp_path / "ro") == []


_RACER = """
import sys, warnings
warnings.simplefilter("ignore")
import transformers as tf
import mapoffload
m = mapoffload.from_pretrained(tf.MixtralForCausalLM, sys.argv[1], device=None, cache_dir=sys.argv[2])
print("converted", m.mapoffload_report.converted_tensors, m.mapoffload_report.conversion_dir)
"""


@pytest.mark.slow
def test_two_processes_converting_at_once_both_load_and_leave_one_folder(tmp_path):
    build("mixtral", str(tmp_path / "m"))
    racers = [subprocess.Popen([sys.executable, "-c", _RACER, str(tmp_path / "m"), str(tmp_path / "c")],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/")
              for _ in range(3)]
    outs = [r.communicate(timeout=300) for r in racers]
    for r, (out, err) in zip(racers, outs):
        assert r.returncode == 0, err[-2000:]
        assert out.split()[-3:-1] == ["converted", "4"], out
    dirs = {out.split()[-1] for out, _ in outs}
    assert len(dirs) == 1 and os.listdir(tmp_path / "c") == [os.path.basename(dirs.pop())]


def test_a_file_where_the_default_conversion_folder_goes_is_stepped_around(tmp_path, monkeypatch):
    # <checkpoint>/.mapoffload-converted a file: every converting load failed ("File exists") though the
    # cache folder was there to take it, as it does for a checkpoint folder that cannot be written.
    monkeypatch.delenv("MAPOFFLOAD_CONVERT_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    cls, _ = build("mixtral", str(tmp_path / "m"))
    (tmp_path / "m" / ".mapoffload-converted").write_text("someone's file")
    model = mapoffload.from_pretrained(cls, str(tmp_path / "m"), device=None)
    assert model.mapoffload_report.conversion_dir.startswith(str(tmp_path / "xdg" / "mapoffload" / "converted"))
    assert (tmp_path / "m" / ".mapoffload-converted").read_text() == "someone's file"


@pytest.mark.parametrize("where", ["file", "under a file"])
def test_a_conversion_root_that_is_a_file_is_refused_before_the_load(tmp_path, monkeypatch, where):
    """The check every entry point makes (``check_cache_dir``, vLLM's too): it was the write's error once
    the whole model was read and converted."""
    from mapoffload.hf import transformers as hf_transformers

    cls, _ = build("mixtral", str(tmp_path / "m"))
    (tmp_path / "afile").write_text("x")
    root = tmp_path / "afile" if where == "file" else tmp_path / "afile" / "conv"

    def no_load(*a, **k):
        raise AssertionError("loaded before refusing cache_dir")

    monkeypatch.setattr(hf_transformers, "_config", no_load)
    with pytest.raises(ValueError, match=rf"cache_dir='{root}' cannot hold .*afile is a file, not a folder"):
        mapoffload.from_pretrained(cls, str(tmp_path / "m"), device=None, cache_dir=str(root))
    assert (tmp_path / "afile").read_text() == "x"


@pytest.mark.parametrize("dtype", ["fp16", "half", torch.int8, "float8"])
def test_from_pretrained_refuses_a_dtype_it_cannot_make_before_loading(tmp_path, monkeypatch, dtype):
    """As convert --dtype does: one line naming the dtypes it takes (and the one meant), before any load."""
    from mapoffload.hf import transformers as hf_transformers

    cls, _ = build("llama", str(tmp_path / "m"))

    def no_load(*a, **k):
        raise AssertionError("loaded before refusing the dtype")

    monkeypatch.setattr(hf_transformers, "load_pretrained", no_load)
    monkeypatch.setattr(hf_transformers, "load_unsettled", no_load)  # what from_pretrained calls
    with pytest.raises(ValueError, match=r"dtype .* is not one a conversion takes: auto, bfloat16, float16"):
        mapoffload.from_pretrained(cls, str(tmp_path / "m"), device="cpu", dtype=dtype)
