"""The conversion cache behind from_pretrained: where it goes, ahead-of-time
conversion, damaged or stale folders, write failures, the safetensors it writes."""

from __future__ import annotations

import json
import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import mapoffload  # noqa: E402
from same_kernels import host_weights, seat_like  # noqa: E402
from conformance_zoo import build  # noqa: E402
from mapoffload.conversion import cache as _converted, naming as _fingerprint, marks as _sweep  # noqa: E402
from mapoffload.hf.convert import convert_pretrained, model_class_for  # noqa: E402


def test_ahead_of_time_conversion_is_reused(tmp_path):
    cls, _ = build("mixtral", str(tmp_path))
    assert model_class_for(str(tmp_path)) is cls
    report = convert_pretrained(str(tmp_path))
    assert report.converted_tensors == 4 and not report.conversion_reused
    model = mapoffload.from_pretrained(cls, str(tmp_path), device=None)
    assert model.mapoffload_report.conversion_reused
    assert model.mapoffload_report.conversion_dir == report.conversion_dir


def test_convert_refuses_a_folder_without_config(tmp_path):
    with pytest.raises(mapoffload.CheckpointError, match="config.json"):
        convert_pretrained(str(tmp_path))


def test_default_root_beside_the_checkpoint_env_and_hub(tmp_path, monkeypatch):
    monkeypatch.delenv("MAPOFFLOAD_CONVERT_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    plain = tmp_path / "model"
    plain.mkdir()
    assert _fingerprint.default_root(str(plain)) == str(plain / ".mapoffload-converted")
    snap = tmp_path / "hub" / "models--org--name" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    assert _fingerprint.default_root(str(snap)) == str(tmp_path / "xdg" / "mapoffload" / "converted")
    monkeypatch.setenv("MAPOFFLOAD_CONVERT_DIR", str(tmp_path / "env"))
    assert _fingerprint.default_root(str(plain)) == str(tmp_path / "env")


@pytest.mark.parametrize("damage", ["garbage", "other-key", "missing-part"])
def test_a_damaged_conversion_folder_is_converted_again(tmp_path, damage):
    cls, _ = build("mixtral", str(tmp_path))
    first = convert_pretrained(str(tmp_path))
    manifest = os.path.join(first.conversion_dir, _converted.MANIFEST)
    if damage == "garbage":
        with open(manifest, "w") as f:
            f.write("{not json")
    elif damage == "other-key":
        data = json.load(open(manifest))
        data["key"] = "0" * 24
        json.dump(data, open(manifest, "w"))
    else:
        os.remove(os.path.join(first.conversion_dir, "part-00000.safetensors"))
    model = mapoffload.from_pretrained(cls, str(tmp_path), device=None)
    assert not model.mapoffload_report.conversion_reused and model.mapoffload_report.converted_tensors == 4
    ref = cls.from_pretrained(str(tmp_path)).eval()
    seat_like(ref, host_weights(model))  # the same kernels on both sides (tests/same_kernels.py)
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        assert torch.equal(ref(ids).logits, model(ids).logits)


def test_a_write_failure_names_the_folder_and_leaves_nothing(tmp_path, monkeypatch):
    cls, _ = build("mixtral", str(tmp_path / "m"))

    def full(path, tensors):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_converted, "write_safetensors", full)
    cache = tmp_path / "cache"
    with pytest.raises(OSError, match=r"writing converted weights .* to .*cache.*cache_dir="):
        mapoffload.from_pretrained(cls, str(tmp_path / "m"), device=None, cache_dir=str(cache))
    assert os.listdir(cache) == []  # the unfinished folder is gone


def test_written_files_are_valid_safetensors_for_every_dtype(tmp_path):
    from safetensors.torch import load_file

    tensors = {
        "a": torch.randn(3, 5), "b": torch.randn(7).to(torch.bfloat16), "c": torch.arange(10, dtype=torch.int64),
        "d": torch.randn(4, 4).to(torch.float8_e4m3fn), "e": torch.ones(2, dtype=torch.bool),
        "f": torch.randn(6, 4).t(),  # not contiguous
        "g": torch.empty(0, 3),
    }
    path = str(tmp_path / "x.safetensors")
    _converted.write_safetensors(path, tensors)
    back = load_file(path)
    assert back.keys() == tensors.keys()
    for k, t in tensors.items():
        assert back[k].dtype == t.dtype and torch.equal(back[k].view(torch.uint8), t.contiguous().view(torch.uint8))
    with open(path, "rb") as f:
        assert (8 + int.from_bytes(f.read(8), "little")) % 4096 == 0  # data page-aligned


def test_a_manifest_naming_files_outside_its_folder_is_ignored(tmp_path):
    cls, _ = build("mixtral", str(tmp_path))
    first = convert_pretrained(str(tmp_path))
    manifest = os.path.join(first.conversion_dir, _converted.MANIFEST)
    data = json.load(open(manifest))
    outside = tmp_path / "elsewhere.safetensors"
    os.rename(os.path.join(first.conversion_dir, "part-00000.safetensors"), outside)
    for entry in data["tensors"].values():
        entry["file"] = "../../elsewhere.safetensors"
    json.dump(data, open(manifest, "w"))
    report = convert_pretrained(str(tmp_path))
    assert not report.conversion_reused and report.converted_tensors == 4


def test_an_interrupted_conversion_restores_transformers_and_leaves_nothing(tmp_path, monkeypatch):
    from transformers import core_model_loading, modeling_utils

    originals = (core_model_loading.set_param_for_module, modeling_utils.convert_and_load_state_dict_in_model,
                 core_model_loading.WeightConverter.convert)
    cls, kind = build("mixtral", str(tmp_path / "m"))

    def interrupted(path, tensors):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(_converted, "write_safetensors", interrupted)
        with pytest.raises(KeyboardInterrupt):
            mapoffload.from_pretrained(cls, str(tmp_path / "m"), device=None, cache_dir=str(tmp_path / "c"))
    assert (core_model_loading.set_param_for_module, modeling_utils.convert_and_load_state_dict_in_model,
            core_model_loading.WeightConverter.convert) == originals
    assert os.listdir(tmp_path / "c") == []
    model = mapoffload.from_pretrained(cls, str(tmp_path / "m"), device=None, cache_dir=str(tmp_path / "c"))
    assert model.mapoffload_report.converted_tensors == 4


def test_another_threads_plain_transformers_load_is_untouched(tmp_path, monkeypatch):
    import threading

    cls, _ = build("mixtral", str(tmp_path / "m"))
    entered, release = threading.Event(), threading.Event()
    real = _converted.write_safetensors

    from transformers import core_model_loading as cml

    seen = {}

    def slow(path, tensors):
        # In our load's thread transformers is answered "no loader threads" (one tensor at a time)...
        seen.setdefault("ours", cml.is_env_variable_true("HF_DEACTIVATE_ASYNC_LOAD"))
        entered.set()
        assert release.wait(60)
        real(path, tensors)

    monkeypatch.setattr(_converted, "write_safetensors", slow)
    out = {}
    ours = threading.Thread(target=lambda: out.setdefault("m", mapoffload.from_pretrained(
        cls, str(tmp_path / "m"), device=None, cache_dir=str(tmp_path / "c"))))
    ours.start()
    try:
        assert entered.wait(60)  # our load is inside transformers, its hooks installed
        # ... by no process-wide switch: this thread's load keeps transformers' threads (issue 42).
        assert "HF_DEACTIVATE_ASYNC_LOAD" not in os.environ
        assert not cml.is_env_variable_true("HF_DEACTIVATE_ASYNC_LOAD")
        plain = cls.from_pretrained(str(tmp_path / "m"))  # transformers' own, in this thread
    finally:
        release.set()
        ours.join(60)
    experts = [p for n, p in plain.named_parameters() if "experts" in n and p.dim() == 3]
    assert experts and not any(mapoffload.MappedRegions().classify(experts))  # transformers' own fusing
    assert out["m"].mapoffload_report.converted_tensors == 4
    assert len([f for f in os.listdir(out["m"].mapoffload_report.conversion_dir) if f.startswith("part-")]) == 1
    assert seen == {"ours": True}


_PEAK = """
import sys, threading, time, warnings
import torch, transformers as tf
import mapoffload
from mapoffload.hf import _drive
from mapoffload.memory.budget import rss_anon_bytes
warnings.simplefilter("ignore")
cls, folder, who = tf.MixtralForCausalLM, sys.argv[1], sys.argv[2]
_drive.PART_BYTES = 4 << 20
base = peak = rss_anon_bytes()
done = threading.Event()
def sample():
    global peak
    while not done.wait(0.002):
        peak = max(peak, rss_anon_bytes())
t = threading.Thread(target=sample); t.start()
if who == "transformers":
    model = cls.from_pretrained(folder)
else:
    model = mapoffload.from_pretrained(cls, folder, device=None, cache_dir=sys.argv[3])
done.set(); t.join()
print(max(peak, rss_anon_bytes()) - base)
"""


@pytest.mark.slow
def test_conversion_holds_a_bounded_batch_where_transformers_holds_every_expert(tmp_path):
    import subprocess
    import sys

    import transformers as tf

    cfg = tf.MixtralConfig(vocab_size=64, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2)
    torch.manual_seed(0)
    tf.MixtralForCausalLM(cfg).save_pretrained(tmp_path / "m")
    experts = 4 * 8 * 3 * 256 * 512 * 4  # 48 MiB of expert weights, fused on load

    def peak(who: str) -> int:
        # A fixed mmap threshold: freed tensors go back to the kernel at once (glibc raises the threshold
        # after the first large free and keeps later ones in its heap, which would measure the allocator).
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
        out = subprocess.run([sys.executable, "-c", _PEAK, str(tmp_path / "m"), who, str(tmp_path / "c")],
                             capture_output=True, text=True, timeout=300, cwd="/", env=env)
        assert out.returncode == 0, out.stderr
        return int(out.stdout.split()[-1])

    theirs, ours = peak("transformers"), peak("mapoffload")
    assert theirs > 0.9 * experts  # the measurement sees the fused experts
    assert ours < 0.4 * experts, (ours, theirs)  # a conversion or two (8 MiB each) at a time, then mapped


def test_the_convert_command(tmp_path, capsys):
    from mapoffload.cli import main

    build("olmoe", str(tmp_path / "moe"))
    build("gpt2", str(tmp_path / "dense"))
    assert main(["convert", str(tmp_path / "moe"), "--cache-dir", str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    assert "4 tensors converted" in out and "written" in out and str(tmp_path / "c") in out
    assert main(["convert", str(tmp_path / "moe"), "--cache-dir", str(tmp_path / "c"), "-v"]) == 0
    assert "reused" in capsys.readouterr().out
    assert main(["convert", str(tmp_path / "dense")]) == 0
    assert "nothing to convert" in capsys.readouterr().out
    assert main(["convert", str(tmp_path / "nothing")]) == 2
    assert "config.json" in capsys.readouterr().err


@pytest.mark.slow
def test_a_cast_holds_a_bounded_batch_too(tmp_path):
    """dtype= other than the stored one: transformers' loader threads would cast every tensor ahead
    of the loop that sets them; driven, they are cast one by one and written out in batches."""
    import subprocess
    import sys

    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=64, hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=8)
    torch.manual_seed(0)
    tf.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "m")  # float32, 8 x 10 MiB layers
    code = _PEAK.replace("cls, folder, who = tf.MixtralForCausalLM,", "cls, folder, who = tf.LlamaForCausalLM,")
    code = code.replace("model = cls.from_pretrained(folder)", "model = cls.from_pretrained(folder, dtype=torch.float16)")
    code = code.replace("device=None, cache_dir=sys.argv[3])", "device=None, cache_dir=sys.argv[3], dtype=torch.float16)")
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")

    def peak(who: str) -> int:
        out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "m"), who, str(tmp_path / "c")],
                             capture_output=True, text=True, timeout=300, cwd="/", env=env)
        assert out.returncode == 0, out.stderr
        return int(out.stdout.split()[-1])

    half = 8 * (4 * 512 * 512 + 3 * 512 * 1024) * 2  # the float16 model's layers (40 MiB)
    theirs, ours = peak("transformers"), peak("mapoffload")
    assert theirs > 0.9 * half
    assert ours < 0.4 * half, (ours, theirs)


_AFTER = """
import sys, warnings
import torch, transformers as tf
import mapoffload
from mapoffload.memory.budget import rss_anon_bytes
warnings.simplefilter("ignore")
import mapoffload.hf.transformers, transformers.models.llama.modeling_llama
base = rss_anon_bytes()
model = mapoffload.from_pretrained(tf.LlamaForCausalLM, sys.argv[1], device=None, cache_dir=sys.argv[2],
                                   dtype=torch.float16)
print(rss_anon_bytes() - base)
"""


@pytest.mark.slow  # 8-11 s on 2 cores (Zen 3): the slow part
def test_after_a_converting_load_the_freed_temporaries_are_given_back(tmp_path):
    """glibc keeps freed large temporaries (its mmap threshold grows): RssAnon after a
    converting load stayed at the converted model's size until they are trimmed."""
    import subprocess
    import sys

    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=64, hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=8)
    torch.manual_seed(0)
    tf.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "m")
    out = subprocess.run([sys.executable, "-c", _AFTER, str(tmp_path / "m"), str(tmp_path / "c")],
                         capture_output=True, text=True, timeout=300, cwd="/")
    assert out.returncode == 0, out.stderr
    half = 8 * (4 * 512 * 512 + 3 * 512 * 1024) * 2  # 40 MiB cast
    assert int(out.stdout.split()[-1]) < 0.25 * half, out.stdout


def test_convert_and_the_readmes_auto_class_load_share_one_conversion(tmp_path):
    # `mapoffload convert FOLDER` keyed its folder by config.architectures[0], from_pretrained by the class
    # passed in: AutoModelForCausalLM (the README's call) converted again into a second folder. A conversion
    # is keyed by what makes its bytes: the class the Auto class resolves to, not the name typed.
    from mapoffload.cli import main

    cls, _ = build("mixtral", str(tmp_path / "m"))
    first = convert_pretrained(str(tmp_path / "m"))
    auto = mapoffload.from_pretrained(transformers.AutoModelForCausalLM, str(tmp_path / "m"), device=None)
    assert auto.mapoffload_report.conversion_reused
    assert auto.mapoffload_report.conversion_dir == first.conversion_dir
    spelled = mapoffload.from_pretrained(cls, str(tmp_path / "m") + "/", device=None)
    assert spelled.mapoffload_report.conversion_reused  # the folder's spelling makes no other bytes
    assert main(["convert", str(tmp_path / "m"), "--class", "AutoModelForCausalLM"]) == 0
    assert main(["convert", str(tmp_path / "m"), "--class", "MixtralForCausalLM"]) == 0
    root = os.path.dirname(first.conversion_dir)
    assert os.listdir(root) == [os.path.basename(first.conversion_dir)]


def test_a_dtypes_spellings_share_one_conversion(tmp_path):
    cls, _ = build("mixtral", str(tmp_path / "m"))
    first = mapoffload.from_pretrained(cls, str(tmp_path / "m"), device=None, dtype=torch.float16)
    assert not first.mapoffload_report.conversion_reused
    named = convert_pretrained(str(tmp_path / "m"), dtype="float16")
    assert named.conversion_reused and named.conversion_dir == first.mapoffload_report.conversion_dir


_STALLED = """
import os, sys, time, warnings
warnings.simplefilter("ignore")
import torch, transformers as tf
import mapoffload
from mapoffload.conversion import cache as _converted
folder, cache, dtype, ready, go = sys.argv[1:6]
real = _converted.write_safetensors
def stalled(path, tensors):
    real(path, tensors)
    open(ready, "w").close()  # a part is on disk, the manifest not yet
    while not os.path.exists(go):
        time.sleep(0.05)
_converted.write_safetensors = stalled
m = mapoffload.from_pretrained(tf.MixtralForCausalLM, folder, device=None, cache_dir=cache, dtype=dtype)
print("converted", m.mapoffload_report.converted_tensors)
"""


def _stalled_conversion(tmp_path, folder, cache, dtype="auto"):
    """A child process converting ``folder`` into ``cache``, stopped once its first part is written
    (until ``go`` exists); returns (process, go)."""
    import subprocess
    import sys
    import time

    ready, go = tmp_path / f"ready-{dtype}", tmp_path / f"go-{dtype}"
    child = subprocess.Popen([sys.executable, "-c", _STALLED, folder, cache, dtype, str(ready), str(go)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/")
    deadline = time.monotonic() + 240
    while not ready.exists():
        if child.poll() is not None or time.monotonic() > deadline:
            child.kill()
            pytest.fail(f"the converting child did not reach its first part: {child.communicate()[1][-2000:]}")
        time.sleep(0.05)
    return child, go


def _unfinished(cache) -> list[str]:
    return sorted(e for e in os.listdir(cache) if e.startswith("."))


@pytest.mark.slow  # 8-11 s on 2 cores (Zen 3): the slow part
def test_a_conversion_killed_part_way_is_cleaned_by_the_next_load(tmp_path):
    # kill -9 (or the OOM killer) mid-conversion left .<key>.XXXX/part-*.safetensors behind for good:
    # nothing ever looked at it again. The next load (here one that reuses another conversion) removes it.
    import signal

    cls, _ = build("mixtral", str(tmp_path / "m"))
    cache = str(tmp_path / "c")
    first = convert_pretrained(str(tmp_path / "m"), cache_dir=cache)
    child, _ = _stalled_conversion(tmp_path, str(tmp_path / "m"), cache, dtype="float16")
    (left,) = _unfinished(cache)
    assert any(f.startswith("part-") for f in os.listdir(os.path.join(cache, left)))
    child.send_signal(signal.SIGKILL)
    child.wait(60)
    again = mapoffload.from_pretrained(cls, str(tmp_path / "m"), device=None, cache_dir=cache)
    assert again.mapoffload_report.conversion_reused
    assert _unfinished(cache) == [] and os.listdir(cache) == [os.path.basename(first.conversion_dir)]


@pytest.mark.slow  # 8-11 s on 2 cores (Zen 3): the slow part
def test_a_live_concurrent_conversions_folder_is_left_alone(tmp_path):
    # The same-looking folder of a conversion still running is not a leftover: both finish, one folder stays.
    cls, _ = build("mixtral", str(tmp_path / "m"))
    cache = str(tmp_path / "c")
    child, go = _stalled_conversion(tmp_path, str(tmp_path / "m"), cache)
    try:
        (theirs,) = _unfinished(cache)
        ours = mapoffload.from_pretrained(cls, str(tmp_path / "m"), device=None, cache_dir=cache)
        assert ours.mapoffload_report.converted_tensors == 4 and not ours.mapoffload_report.conversion_reused
        assert _unfinished(cache) == [theirs]  # still being written
        assert any(f.startswith("part-") for f in os.listdir(os.path.join(cache, theirs)))
        go.touch()
        out, err = child.communicate(timeout=240)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 0, err[-2000:]
    assert out.split()[-2:] == ["converted", "4"]
    assert _unfinished(cache) == [] and os.listdir(cache) == [os.path.basename(ours.mapoffload_report.conversion_dir)]


def test_the_sweep_judges_unmarked_folders_by_age_and_touches_nothing_else(tmp_path):
    root = tmp_path / "c"
    key = "0123456789abcdef01234567"
    old, young = root / f".{key}.abcd_123", root / f".{key}.zz99yy88"
    for d in (old, young):
        d.mkdir(parents=True)
        (d / "part-00000.safetensors").write_bytes(b"x")
    long_ago = os.path.getmtime(old) - _sweep.UNMARKED_GRACE_S - 60
    for p in (old / "part-00000.safetensors", old):
        os.utime(p, (long_ago, long_ago))
    (root / f".{key}.afile123").write_text("not a folder")
    (root / f".{key}.alink123").symlink_to(young)
    (root / key).mkdir()  # a finished conversion
    (root / "other").mkdir()
    assert _sweep.sweep(str(root)) == [str(old)]  # an older version's dead folder
    assert sorted(os.listdir(root)) == sorted([young.name, f".{key}.afile123", f".{key}.alink123", key, "other"])
    assert _sweep.sweep(str(tmp_path / "nowhere")) == []


def test_a_full_disk_at_the_manifest_names_the_folder_and_the_bytes_and_leaves_nothing(tmp_path, monkeypatch):
    # The disk filling exactly at manifest.json gave a bare "[Errno 28] No space left on device" naming no
    # path, and the finished parts stayed in the work folder.
    import errno

    cls, _ = build("mixtral", str(tmp_path / "m"))
    real = os.fsync

    def fsync(fd):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(_converted.MANIFEST):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd)

    cache = str(tmp_path / "cache")
    with monkeypatch.context() as m:
        m.setattr(os, "fsync", fsync)
        with pytest.raises(OSError) as info:
            mapoffload.from_pretrained(cls, str(tmp_path / "m"), device=None, cache_dir=cache)
    err = info.value
    assert err.errno == errno.ENOSPC
    assert cache in str(err) and "cache_dir=" in str(err)
    assert os.listdir(cache) == []  # the work folder is gone
    assert isinstance(err, mapoffload.hf.ConversionWriteError) and err.path == cache
    assert err.bytes_needed > 4 * 2 * 64 * 32 * 4  # the converted experts, at least
    assert f"{err.bytes_needed} bytes" in str(err)
    again = mapoffload.from_pretrained(cls, str(tmp_path / "m"), device=None, cache_dir=cache)
    assert again.mapoffload_report.converted_tensors == 4


def test_a_conversion_discarded_by_another_process_after_it_was_opened(tmp_path):
    """Opened (checked, reused), then removed by another process's discard() (the net under the key) or
    rewritten: its tensors were mapped only when the load asked for them, which raised KeyError or
    FileNotFoundError. They are mapped as it is opened."""
    import torch

    cls, _ = build("mixtral", str(tmp_path))
    first = convert_pretrained(str(tmp_path))
    root, key = os.path.dirname(first.conversion_dir), os.path.basename(first.conversion_dir)
    opened = _converted.ConversionCache.open(root, key)
    assert opened.reused
    want = {k: v.clone() for k, v in _converted.ConversionCache.open(root, key).mapped().items()}
    _converted.ConversionCache.open(root, key).discard()  # the other process
    assert not os.path.exists(first.conversion_dir)
    got = opened.mapped()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
