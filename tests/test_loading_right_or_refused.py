"""Loading and conversions, right or refused (issue 41): a load reads the files transformers'
own ``from_pretrained`` reads and its conversion key is made from those; a checkpoint on a
memory filesystem is a file; a conversion made ahead of time is reused from a read-only
folder; a shared cache works for more than one user; the CLI's refusals are one line."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import mapoffload  # noqa: E402
from conftest import MEMORY_FILESYSTEMS, filesystem_type  # noqa: E402
from hf_models import save  # noqa: E402
from mapoffload.pagecache.file_places import MapsView  # noqa: E402


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _theirs(folder, **kwargs):
    """transformers' own load of ``folder``: what a mapoffload load must equal."""
    model = transformers.LlamaForCausalLM.from_pretrained(folder, **kwargs)
    return _state(model)


def _ours(folder, tmp_path, **kwargs):
    model = mapoffload.from_pretrained(transformers.LlamaForCausalLM, folder, device=None,
                                       cache_dir=str(tmp_path / "cache"), **kwargs)
    return model, _state(model)


def _equal(a, b):
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"{len(different)} of {len(a)} weights differ from transformers': {different[:3]}"


def _unsharded(tmp_path, seed, name="model.safetensors", dtype=torch.bfloat16):
    """A model saved whole with ``seed``; returns its weights file."""
    other = tmp_path / f"whole-{seed}"
    save("llama", dtype, other, shard=None, seed=seed)
    return other / name


# --- 1. the files transformers reads, and the conversion key made from them ----------------------


def test_model_safetensors_beside_an_index_is_what_loads_and_keys_the_conversion(tmp_path):
    """transformers loads ``model.safetensors`` where it lies beside an index and its shards:
    a conversion must be keyed on it, so replacing it converts again."""
    folder = tmp_path / "model"
    save("llama", torch.bfloat16, folder, seed=0)  # sharded: index + shards
    assert (folder / "model.safetensors.index.json").exists()
    shutil.copy(_unsharded(tmp_path, 1), folder / "model.safetensors")
    model, ours = _ours(str(folder), tmp_path, dtype=torch.float32)
    assert not model.mapoffload_report.conversion_reused
    _equal(ours, _theirs(folder, dtype=torch.float32))
    assert [os.path.basename(f) for f in model.mapoffload_report.files] == ["model.safetensors"]
    del model
    shutil.copy(_unsharded(tmp_path, 2), folder / "model.safetensors.new")
    os.replace(folder / "model.safetensors.new", folder / "model.safetensors")
    model, ours = _ours(str(folder), tmp_path, dtype=torch.float32)
    assert not model.mapoffload_report.conversion_reused
    _equal(ours, _theirs(folder, dtype=torch.float32))


def test_a_folder_resaved_whole_over_a_sharded_save_loads(tmp_path):
    """save_pretrained unsharded over a sharded save leaves the old index (its shards gone):
    transformers loads model.safetensors, and so must mapoffload."""
    folder = tmp_path / "model"
    save("llama", torch.bfloat16, folder, seed=0)
    for shard in folder.glob("model-0000*-of-*.safetensors"):
        shard.unlink()
    shutil.copy(_unsharded(tmp_path, 1), folder / "model.safetensors")
    model, ours = _ours(str(folder), tmp_path)
    _equal(ours, _theirs(folder))


def test_variant_loads_and_keys_the_variant(tmp_path):
    folder = tmp_path / "model"
    save("llama", torch.bfloat16, folder, seed=0)
    shutil.copy(_unsharded(tmp_path, 1), folder / "model.v2.safetensors")
    model, ours = _ours(str(folder), tmp_path, dtype=torch.float32, variant="v2")
    _equal(ours, _theirs(folder, dtype=torch.float32, variant="v2"))
    assert [os.path.basename(f) for f in model.mapoffload_report.files] == ["model.v2.safetensors"]
    del model
    shutil.copy(_unsharded(tmp_path, 2), folder / "model.v2.safetensors")
    model, ours = _ours(str(folder), tmp_path, dtype=torch.float32, variant="v2")
    assert not model.mapoffload_report.conversion_reused
    _equal(ours, _theirs(folder, dtype=torch.float32, variant="v2"))


def test_use_safetensors_false_loads_and_keys_the_torch_file(tmp_path):
    folder = tmp_path / "model"
    save("llama", torch.bfloat16, folder, shard=None, seed=0)
    one = transformers.LlamaForCausalLM.from_pretrained(_unsharded(tmp_path, 1).parent)
    torch.save(_state(one), folder / "pytorch_model.bin")
    model, ours = _ours(str(folder), tmp_path, dtype=torch.float32, use_safetensors=False)
    _equal(ours, _theirs(folder, dtype=torch.float32, use_safetensors=False))
    assert [os.path.basename(f) for f in model.mapoffload_report.files] == ["pytorch_model.bin"]
    del model
    other = transformers.LlamaForCausalLM.from_pretrained(_unsharded(tmp_path, 2).parent)
    torch.save(_state(other), folder / "pytorch_model.bin")
    model, ours = _ours(str(folder), tmp_path, dtype=torch.float32, use_safetensors=False)
    assert not model.mapoffload_report.conversion_reused
    _equal(ours, _theirs(folder, dtype=torch.float32, use_safetensors=False))


def test_pretrained_files_follows_transformers_rule(tmp_path):
    """The one rule, on names alone: what transformers' local-folder resolution picks."""
    from mapoffload.loading.files import pretrained_files

    folder = tmp_path / "m"
    folder.mkdir()
    for name in ("model.safetensors", "model.v2.safetensors", "pytorch_model.bin"):
        (folder / name).write_bytes(b"x")
    f = str(folder)
    assert pretrained_files(f) == [f"{f}/model.safetensors"]
    assert pretrained_files(f, variant="v2") == [f"{f}/model.v2.safetensors"]
    assert pretrained_files(f, use_safetensors=False) == [f"{f}/pytorch_model.bin"]
    with pytest.raises(FileNotFoundError, match="model.v3.safetensors"):
        pretrained_files(f, variant="v3")
    (folder / "model.safetensors").unlink()
    os.mkfifo(folder / "model.safetensors")  # not a file to transformers (os.path.isfile) either
    assert pretrained_files(f) == [f"{f}/pytorch_model.bin"]
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        pretrained_files(f, use_safetensors=True)


def test_a_load_reading_other_files_than_its_key_is_refused(tmp_path, monkeypatch):
    """The safety net under the rule: should transformers ever resolve other files than those
    the conversion is keyed on, the load is refused before a weight is read, naming them."""
    from mapoffload.hf import transformers as hf

    folder = tmp_path / "model"
    save("llama", torch.bfloat16, folder, seed=0)
    shutil.copy(_unsharded(tmp_path, 1), folder / "model.safetensors")
    shards = sorted(str(p) for p in folder.glob("model-0000*.safetensors"))
    monkeypatch.setattr(hf, "pretrained_files", lambda *a, **k: shards)
    with pytest.raises(mapoffload.CheckpointError, match=r"transformers reads .*model\.safetensors"):
        _ours(str(folder), tmp_path, dtype=torch.float32)


# --- 2. a checkpoint on a memory filesystem is a file --------------------------------------------


@pytest.fixture
def memory_dir():
    """A fresh folder on tmpfs (``/dev/shm``), removed afterwards; skipped where there is none."""
    base = "/dev/shm"
    if not os.path.isdir(base) or filesystem_type(base) not in MEMORY_FILESYSTEMS or not os.access(base, os.W_OK):
        pytest.skip("no writable tmpfs at /dev/shm")
    folder = tempfile.mkdtemp(prefix="mapoffload-test-", dir=base)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _places(model):
    """The file each weight lies in (None: not in a file mapping), from one maps snapshot."""
    view = MapsView()
    out = {}
    for name, t in model.state_dict().items():
        place = view.place(t.data_ptr())
        out[name] = None if place is None else place.path
    return out


def test_a_checkpoint_on_tmpfs_loads_as_views_of_its_file(memory_dir, tmp_path):
    """In its own dtype nothing is converted: every weight is a view of the checkpoint on tmpfs,
    and the report says so (not "0 B left on the file mapping")."""
    save("llama", torch.float32, memory_dir, shard=None)
    model, ours = _ours(memory_dir, tmp_path)
    report = model.mapoffload_report
    assert report.converted_tensors == 0 and report.bytes_copied == 0
    weights = {t.data_ptr(): t.nbytes for t in model.state_dict().values()}  # tied ones once
    assert report.bytes_mapped == sum(weights.values()) > 0
    checkpoint = os.path.join(memory_dir, "model.safetensors")
    assert set(_places(model).values()) == {checkpoint}
    _equal(ours, _theirs(memory_dir))


def test_a_conversion_on_tmpfs_is_reused_in_place(memory_dir, tmp_path):
    """With cache_dir on tmpfs, a later load maps the finished conversion itself: no work folder
    written again, no deleted copy mapped."""
    folder = tmp_path / "model"
    save("llama", torch.float32, folder, shard=None)
    cache = os.path.join(memory_dir, "cache")
    for round in range(2):
        model = mapoffload.from_pretrained(transformers.LlamaForCausalLM, str(folder), device=None,
                                           cache_dir=cache, dtype=torch.bfloat16)
        report = model.mapoffload_report
        assert report.conversion_reused == (round == 1)
        assert report.bytes_copied == 0, report.copied
        part = os.path.join(report.conversion_dir, "part-00000.safetensors")
        assert set(_places(model).values()) == {part}
        assert os.listdir(cache) == [os.path.basename(report.conversion_dir)]
    _equal(_state(model), _theirs(folder, dtype=torch.bfloat16))


def test_mapped_regions_counts_the_named_files_on_tmpfs(memory_dir):
    """``MappedRegions(files=...)``: a view of a named tmpfs file is held; another tmpfs file's
    (shared memory someone made) is not."""
    from safetensors.torch import save_file

    from mapoffload.loading.read import read_file

    paths = [os.path.join(memory_dir, f"{n}.safetensors") for n in ("ours", "other")]
    for p in paths:
        save_file({"w": torch.arange(4096, dtype=torch.float32)}, p)
    ours, other = (read_file(p)["w"] for p in paths)
    plain = mapoffload.MappedRegions()
    assert plain.span_classes([ours, other]) == ["shmem", "shmem"]
    assert plain.classify([ours, other]) == [False, False]
    named = mapoffload.MappedRegions(files=[paths[0]])
    assert named.classify([ours, other]) == [True, False]
    assert named.holds(ours[1:]) and named.mapped_bytes([ours, other]) == ours.nbytes


# --- 5. inspect never blocks on a FIFO ------------------------------------------------------------


def _alarm(seconds):
    """SIGALRM raising in this thread: a blocked open() is interrupted, the test fails, never hangs."""
    import signal

    def ring(signum, frame):  # not an OSError: no "cannot be read" handler takes it for one
        raise RuntimeError("blocked (a FIFO opened for reading waits for a writer that never comes)")

    previous = signal.signal(signal.SIGALRM, ring)
    signal.alarm(seconds)
    return lambda: (signal.alarm(0), signal.signal(signal.SIGALRM, previous))


def test_inspect_does_not_block_on_a_fifo_named_manifest(tmp_path, capsys):
    import json

    from mapoffload.cli import main

    folder = tmp_path / "model"
    save("llama", torch.float32, folder, shard=None)
    conversion = folder / ".mapoffload-converted" / ("0" * 24)
    conversion.mkdir(parents=True)
    os.mkfifo(conversion / "manifest.json")
    stop = _alarm(20)
    try:
        assert main(["inspect", str(folder), "--json"]) == 0
    finally:
        stop()
    found = json.loads(capsys.readouterr().out)["conversions"]
    assert [(c["key"], c["finished"]) for c in found] == [("0" * 24, False)]


# --- 6. mapoffload convert: a wrong class or architectures is one line, exit 2 ---------------------


def _convert_refused(capsys, *argv):
    from mapoffload.cli import main

    capsys.readouterr()
    assert main(["convert", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured.err
    assert captured.err.startswith("mapoffload convert: error: ")
    return captured.err


def test_convert_with_a_class_of_another_model_type_is_refused(tmp_path, capsys):
    from conformance_zoo import build

    build("mixtral", str(tmp_path / "m"))
    err = _convert_refused(capsys, str(tmp_path / "m"), "--class", "LlamaForCausalLM",
                           "--cache-dir", str(tmp_path / "c"))
    assert "'llama' model class" in err and "'mixtral' model" in err
    assert not (tmp_path / "c").exists()


def test_convert_with_pretrainedmodel_is_refused(tmp_path, capsys):
    save("llama", torch.float32, tmp_path / "m", shard=None)
    err = _convert_refused(capsys, str(tmp_path / "m"), "--class", "PreTrainedModel")
    assert "'PreTrainedModel' is not a transformers model class" in err
    with pytest.raises(TypeError, match="PreTrainedModel is the base of every model class"):
        mapoffload.from_pretrained(transformers.PreTrainedModel, tmp_path / "m", device=None)


def test_convert_with_null_architectures_is_refused(tmp_path, capsys):
    import json

    save("llama", torch.float32, tmp_path / "m", shard=None)
    path = tmp_path / "m" / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | {"architectures": [None]}))
    err = _convert_refused(capsys, str(tmp_path / "m"))
    assert '"architectures" holds null' in err and "config.json" in err


# --- 3, 4. a conversion made ahead of time, a read-only folder, a cache shared by users ------------

NOBODY = 65534
# A child interpreter as another user (torch and transformers imported there): 6-8 s each on 2 cores,
# run by `pytest -m slow` so that the README's `pytest` stays within 5 minutes.
AS_ANOTHER_USER = pytest.mark.slow


@pytest.fixture
def shared_dir():
    """A fresh folder other users can reach (``0755``, outside pytest's own ``0700`` folders), removed
    afterwards; skipped where this process cannot run a child as another user."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to run a child as another user")
    folder = tempfile.mkdtemp(prefix="mapoffload-test-shared-")
    os.chmod(folder, 0o755)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _as_nobody(code: str, folder: str):
    """Run ``code`` as user 65534 in a fresh interpreter, with this mapoffload and an empty cache home
    of its own under ``folder``; returns its last stdout line (a failure fails the test)."""
    from child import describe, run_python

    home = os.path.join(folder, "nobody-home")
    os.makedirs(home, exist_ok=True)
    os.chown(home, NOBODY, NOBODY)
    source = os.path.dirname(os.path.dirname(mapoffload.__file__))
    # Everything imported before the switch: the interpreter's own files may be unreadable to that user.
    prelude = f"""
import os, sys
sys.path.insert(0, {source!r})
import torch, transformers, mapoffload, mapoffload.hf.transformers, mapoffload.hf.convert, mapoffload.cli.inspect
transformers.MixtralForCausalLM, transformers.MixtralConfig, transformers.AutoConfig
try:
    os.setgroups([]); os.setgid({NOBODY}); os.setuid({NOBODY})
except OSError as exc:
    print("SKIP", exc); sys.exit(0)
"""
    proc = run_python(prelude + code, timeout=300, env={"HOME": home, "XDG_CACHE_HOME": os.path.join(home, ".cache"),
                                                        "MAPOFFLOAD_CONVERT_DIR": "", "TRANSFORMERS_VERBOSITY": "error"})
    assert proc.returncode == 0, describe(proc)
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    if last.startswith("SKIP"):
        pytest.skip(f"cannot switch to user {NOBODY}: {last}")
    return last, home


_LOAD = """
import torch, transformers, mapoffload
kwargs = {kwargs}
m = mapoffload.from_pretrained(transformers.MixtralForCausalLM, {folder!r}, device=None, **kwargs)
r = m.mapoffload_report
print(r.conversion_reused, r.converted_tensors, r.conversion_dir)
"""


def _built(shared_dir, mode=0o755):
    from conformance_zoo import build

    folder = os.path.join(shared_dir, "m")
    cls, _ = build("mixtral", folder)
    for name in os.listdir(folder):  # readable by all, as a download is (save_pretrained writes 0600)
        os.chmod(os.path.join(folder, name), 0o644)
    os.chmod(folder, mode)
    return cls, folder


@AS_ANOTHER_USER
def test_a_conversion_made_ahead_is_reused_from_a_read_only_folder(shared_dir):
    """`mapoffload convert` beside the checkpoint, then a load by a user who cannot write that
    folder: the conversion is reused (as inspect says), nothing converted again elsewhere."""
    from mapoffload.cli.inspect import conversions
    from mapoffload.hf.convert import convert_pretrained

    _, folder = _built(shared_dir)
    made = convert_pretrained(folder)
    assert made.converted_tensors == 4 and made.conversion_dir.startswith(folder)
    assert [c["finished"] for c in conversions(folder)] == [True]
    line, home = _as_nobody(_LOAD.format(kwargs={}, folder=folder), shared_dir)
    assert line == f"True 4 {made.conversion_dir}"
    assert not os.path.exists(os.path.join(home, ".cache", "mapoffload"))


@AS_ANOTHER_USER
def test_a_shared_cache_dir_serves_a_second_user(shared_dir):
    """A cache_dir shared by users (sticky and world-writable, as /tmp): the second user reuses the
    first's conversion; nothing is left behind (no ``.old.*``)."""
    _, folder = _built(shared_dir)
    cache = os.path.join(shared_dir, "cache")
    os.mkdir(cache)
    os.chmod(cache, 0o1777)
    first = mapoffload.from_pretrained(transformers.MixtralForCausalLM, folder, device=None, cache_dir=cache)
    made = first.mapoffload_report
    assert made.converted_tensors == 4 and not made.conversion_reused
    line, _ = _as_nobody(_LOAD.format(kwargs={"cache_dir": cache}, folder=folder), shared_dir)
    assert line == f"True 4 {made.conversion_dir}"
    assert os.listdir(cache) == [os.path.basename(made.conversion_dir)]


@AS_ANOTHER_USER
def test_a_writable_folder_with_another_users_conversions_falls_back(shared_dir):
    """A user who can write the model folder but not another user's ``.mapoffload-converted``:
    the conversion goes to the user's own cache, the load works."""
    _, folder = _built(shared_dir, mode=0o777)
    mapoffload.from_pretrained(transformers.MixtralForCausalLM, folder, device=None)  # root's, beside it
    assert os.path.isdir(os.path.join(folder, ".mapoffload-converted"))
    line, home = _as_nobody(_LOAD.format(kwargs={"dtype": "float32"}, folder=folder), shared_dir)
    reused, count, where = line.split()
    assert reused == "False" and int(count) > 0
    assert where.startswith(os.path.join(home, ".cache", "mapoffload", "converted"))


@AS_ANOTHER_USER
def test_another_users_damaged_conversion_is_stepped_around_without_leftovers(shared_dir):
    """A damaged conversion another user owns, in a sticky shared cache: this user's load converts,
    cannot replace it, and says so; it loads, and leaves no ``.old.*`` or work folder behind."""
    _, folder = _built(shared_dir)
    cache = os.path.join(shared_dir, "cache")
    os.mkdir(cache)
    os.chmod(cache, 0o1777)
    first = mapoffload.from_pretrained(transformers.MixtralForCausalLM, folder, device=None, cache_dir=cache)
    made = first.mapoffload_report.conversion_dir
    os.remove(os.path.join(made, "manifest.json"))  # unfinished: converted again by the next load
    line, _ = _as_nobody(_LOAD.format(kwargs={"cache_dir": cache}, folder=folder), shared_dir)
    assert line.split()[:2] == ["False", "4"]
    assert os.listdir(cache) == [os.path.basename(made)]


# --- 7. shards linked elsewhere; a relative MAPOFFLOAD_CONVERT_DIR --------------------------------


def test_shards_that_are_links_elsewhere_load_as_transformers_loads_them(tmp_path):
    """An older hub ``local_dir`` download: the shards are links into a cache elsewhere."""
    staging = tmp_path / "staging"
    save("llama", torch.bfloat16, staging, seed=0)
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    folder = tmp_path / "model"
    folder.mkdir()
    for entry in staging.iterdir():
        if entry.name.startswith("model-"):
            os.replace(entry, blobs / entry.name)
            os.symlink(blobs / entry.name, folder / entry.name)
        else:
            os.replace(entry, folder / entry.name)
    model, ours = _ours(str(folder), tmp_path)
    assert model.mapoffload_report.converted_tensors == 0 and model.mapoffload_report.bytes_copied == 0
    assert {os.path.dirname(p) for p in _places(model).values()} == {str(blobs)}
    _equal(ours, _theirs(folder))


def test_a_relative_convert_dir_is_refused(tmp_path, monkeypatch):
    from mapoffload._env import EnvSettingError
    from mapoffload.conversion import default_root

    monkeypatch.setenv("MAPOFFLOAD_CONVERT_DIR", "conversions")
    with pytest.raises(EnvSettingError, match="MAPOFFLOAD_CONVERT_DIR='conversions'.*absolute"):
        default_root(str(tmp_path))
    monkeypatch.setenv("MAPOFFLOAD_CONVERT_DIR", "~/conversions")
    assert default_root(str(tmp_path)) == os.path.expanduser("~/conversions")


def test_a_state_dict_in_place_of_the_files_is_refused(tmp_path):
    """transformers takes ``state_dict=`` over the folder's files; the conversion key is made from
    the files: refused, before anything loads."""
    folder = tmp_path / "model"
    save("llama", torch.bfloat16, folder, shard=None, seed=0)
    other = _state(transformers.LlamaForCausalLM.from_pretrained(_unsharded(tmp_path, 1).parent))
    with pytest.raises(TypeError, match="does not take state_dict="):
        _ours(str(folder), tmp_path, dtype=torch.float32, state_dict=other)
