"""mapoffload.from_pretrained / mapoffload.offload on tiny transformers models:
the same outputs and generated tokens as transformers' own from_pretrained,
nothing copied for a dtype-matching checkpoint, HF key conventions."""

from __future__ import annotations

import os
import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import mapoffload  # noqa: E402
from same_kernels import host_weights, seat_like  # noqa: E402
from hf_models import save  # noqa: E402
from mapoffload.hf import KeyMismatchError, find_block_lists  # noqa: E402

IDS = [[3, 17, 42, 5, 88, 9, 61]]
KINDS = ["llama", "gpt2", "bert", "t5"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(kind, dtype name) -> (class, folder); every one sharded."""
    out = {}
    for kind in KINDS:
        for dtype in (torch.float32, torch.bfloat16):
            name = str(dtype).removeprefix("torch.")
            folder = tmp_path_factory.mktemp(f"{kind}-{name}")
            out[kind, name] = (save(kind, dtype, folder), str(folder))
    return out


def _forward(model, kind):
    ids = torch.tensor(IDS)
    with torch.no_grad():
        if kind == "t5":
            return model(input_ids=ids, decoder_input_ids=ids[:, :4]).logits
        return model(input_ids=ids).logits


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", KINDS)
def test_same_outputs_and_tokens_as_transformers(folders, kind, dtype):
    cls, folder = folders[kind, dtype]
    assert any(f.endswith(".index.json") for f in os.listdir(folder))  # sharded
    ref = cls.from_pretrained(folder).eval()
    model = mapoffload.from_pretrained(cls, folder, device="cpu", keep_mapping=True)
    report, handle = model.mapoffload_report, model.mapoffload_handle
    # Built in the checkpoint's dtype: every byte transformers maps stays on the mapping (BERT's
    # decoder bias is the one tensor transformers itself re-makes after loading).
    allowed = {"made by transformers after loading"} if kind == "bert" else set()
    assert set(report.copied) <= allowed and report.bytes_copied < 1024, report
    assert report.bytes_mapped > 0
    assert not model.training
    assert next(iter(handle.managers.values())).mapped_bytes > 0
    assert {p.dtype for p in ref.parameters()} == {getattr(torch, dtype)}
    seat_like(ref, host_weights(model))  # the same kernels on both sides (tests/same_kernels.py)
    assert torch.equal(_forward(ref, kind), _forward(model, kind))
    if kind != "bert":  # generate() with a KV cache
        ids = torch.tensor(IDS)
        kw = dict(max_new_tokens=6, do_sample=False)
        with torch.no_grad():
            expected = ref.generate(ids, **kw)
            got = model.generate(ids, **kw)
        assert torch.equal(expected, got)
    summary = handle.summary()
    # On the CPU the layers compute in place from the mapping: nothing is streamed or copied.
    assert "in place" in summary and "streamed" not in summary and "nothing is copied" in summary
    handle.close()
    assert torch.equal(_forward(ref, kind), _forward(model, kind))  # whole again, real weights


def test_t5_streams_two_stacks(folders):
    cls, folder = folders["t5", "float32"]
    model = mapoffload.from_pretrained(cls, folder, device="cpu", keep_mapping=True)
    assert sorted(model.mapoffload_handle.managers) == ["decoder.block", "encoder.block"]
    model.mapoffload_handle.close()


def test_tied_embeddings_stay_tied(folders):
    cls, folder = folders["llama", "bfloat16"]
    model = mapoffload.from_pretrained(cls, folder, device=None, keep_mapping=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.device.type == "cpu"
    cls, folder = folders["t5", "bfloat16"]
    model = mapoffload.from_pretrained(cls, folder, device=None, keep_mapping=True)
    assert model.encoder.embed_tokens.weight is model.shared.weight
    assert model.decoder.embed_tokens.weight is model.shared.weight


def test_non_persistent_buffers_are_real(folders):
    cls, folder = folders["llama", "bfloat16"]
    ref = cls.from_pretrained(folder)
    model = mapoffload.from_pretrained(cls, folder, device=None, keep_mapping=True)
    inv = model.model.rotary_emb.inv_freq
    assert inv.device.type == "cpu" and torch.equal(inv, ref.model.rotary_emb.inv_freq)


def test_gate_keeps_the_mapping_when_copies_would_not_fit(folders, monkeypatch):
    cls, folder = folders["gpt2", "bfloat16"]
    monkeypatch.setenv("MAPOFFLOAD_HOST_AVAILABLE_GIB", "1")  # below the 4 GiB reserve
    model = mapoffload.from_pretrained(cls, folder, device="cpu")
    assert model.mapoffload_report.keep_mapping and model.mapoffload_report.bytes_copied == 0
    model.mapoffload_handle.close()
    weights = list(model.state_dict().values())
    assert all(mapoffload.MappedRegions().classify(weights))
    assert mapoffload.cow_report(weights).anonymous_bytes == 0


def test_offloaded_load_stays_mapped_even_when_copies_would_fit(folders, monkeypatch):
    cls, folder = folders["llama", "bfloat16"]
    monkeypatch.setenv("MAPOFFLOAD_HOST_AVAILABLE_GIB", "1000")  # copies would fit: still no copy
    model = mapoffload.from_pretrained(cls, folder, device="cpu")
    assert model.mapoffload_report.bytes_copied == 0 and model.mapoffload_report.bytes_mapped > 0
    model.mapoffload_handle.close()
    # Without a device too: transformers' own load maps it, so does ours (never more anonymous memory).
    plain = mapoffload.from_pretrained(cls, folder, device=None)
    assert plain.mapoffload_report.keep_mapping and plain.mapoffload_report.bytes_copied == 0
    copied = mapoffload.from_pretrained(cls, folder, device=None, keep_mapping=False)
    assert copied.mapoffload_report.bytes_mapped == 0
    assert copied.mapoffload_report.copied == {"keep_mapping=False": copied.mapoffload_report.bytes_copied}


def test_dtype_conversion_is_written_once_and_mapped(folders, caplog):
    cls, folder = folders["llama", "bfloat16"]
    with caplog.at_level("WARNING", logger="mapoffload"):
        model = mapoffload.from_pretrained(cls, folder, device=None, dtype=torch.float32, keep_mapping=True)
    report = model.mapoffload_report
    assert report.bytes_copied == 0 and report.converted_tensors > 0 and report.bytes_converted > 0
    assert any("converted" in r.message and report.conversion_dir in r.message for r in caplog.records)
    assert all(mapoffload.MappedRegions().classify(list(model.parameters())))
    ref = cls.from_pretrained(folder, dtype=torch.float32).eval()
    seat_like(ref, host_weights(model))  # converted weights sit where the conversion file put them
    assert torch.equal(_forward(ref, "llama"), _forward(model, "llama"))


def test_prefixed_checkpoint_into_base_model_and_back(tmp_path):
    save("bert", torch.float32, tmp_path / "mlm")  # keys bert.*, cls.*
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        base = mapoffload.from_pretrained(transformers.BertModel, tmp_path / "mlm", device="cpu", keep_mapping=True)
    ref = transformers.BertModel.from_pretrained(tmp_path / "mlm").eval()
    seat_like(ref, host_weights(base))
    ids = torch.tensor(IDS)
    with torch.no_grad():
        assert torch.equal(ref(ids).last_hidden_state, base(ids).last_hidden_state)
    # The head's keys are unexpected: reported in one short line, not key by key.
    msgs = [str(w.message) for w in rec if "unexpected" in str(w.message)]
    assert len(msgs) == 1 and "common prefix 'cls.predictions.'" in msgs[0] and len(msgs[0]) < 600
    # Only the pooler, which the checkpoint lacks, is made (by transformers, as its own load does).
    report = base.mapoffload_report
    assert report.missing_keys == ["pooler.dense.bias", "pooler.dense.weight"]
    assert set(report.copied) == {"initialised by transformers (not in the checkpoint)"}

    base.mapoffload_handle.close()
    base.save_pretrained(tmp_path / "base")  # keys without the prefix
    with pytest.warns(UserWarning, match=r"missing keys? \(common prefix 'cls") as rec:
        mlm = mapoffload.from_pretrained(transformers.BertForMaskedLM, tmp_path / "base", device="cpu",
                                         keep_mapping=True)
    seat_like(ref, {k.removeprefix("bert."): v for k, v in host_weights(mlm).items()})
    with torch.no_grad():
        assert torch.equal(mlm.bert(ids).last_hidden_state, ref(ids).last_hidden_state)
    assert mlm.cls.predictions.decoder.weight is mlm.bert.embeddings.word_embeddings.weight


def _rewrite(folder, extra: dict):
    """Add tensors to a single-file checkpoint."""
    from safetensors.torch import load_file, save_file

    path = os.path.join(folder, "model.safetensors")
    state = {k: v.clone() for k, v in load_file(path).items()}
    state.update(extra)
    save_file(state, path, metadata={"format": "pt"})


def test_ignore_lists_and_old_buffers(tmp_path):
    save("bert", torch.float32, tmp_path, shard=None)
    # Old checkpoints saved position_ids (persistent then): ignored, as transformers does.
    _rewrite(tmp_path, {"bert.embeddings.position_ids": torch.arange(64)[None]})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = mapoffload.from_pretrained(transformers.BertForMaskedLM, tmp_path, device=None, keep_mapping=True)
    assert model.mapoffload_report.unexpected_keys == []  # transformers' ignore list, applied by transformers


def test_gpt2_ignore_list_and_strict(tmp_path):
    save("gpt2", torch.float32, tmp_path, shard=None)
    # GPT-2 declares attn.bias (the old causal mask) ignorable.
    _rewrite(tmp_path, {"transformer.h.0.attn.bias": torch.ones(1, 1, 4, 4)})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mapoffload.from_pretrained(transformers.GPT2LMHeadModel, tmp_path, device=None, keep_mapping=True)
    _rewrite(tmp_path, {f"junk.{i}.w": torch.zeros(2) for i in range(25)})
    with pytest.raises(KeyMismatchError) as err:
        mapoffload.from_pretrained(transformers.GPT2LMHeadModel, tmp_path, device=None, strict=True)
    msg = str(err.value)
    assert "25 unexpected keys (common prefix 'junk.')" in msg and "(15 more)" in msg
    assert msg.count("junk.") == 1 + 10


def test_offload_built_model_on_cpu_is_exact(folders):
    cls, folder = folders["gpt2", "float32"]
    model = cls.from_pretrained(folder).train()  # as from_config leaves it
    assert [p for p, _ in find_block_lists(model)] == ["transformer.h"]
    with pytest.warns(UserWarning, match="train mode"):
        mapoffload.offload(model, device="cpu").close()
    model.eval()
    expected = _forward(model, "gpt2")
    with mapoffload.offload(model, device="cpu") as handle:
        assert list(handle.managers) == ["transformer.h"] and "rest: left where it is" in handle.summary()
        assert torch.equal(expected, _forward(model, "gpt2"))
    with mapoffload.offload(model, device="cpu", cpu_twin=True, rest="stream") as handle:  # the device path's
        assert "rest" in handle.managers and "rest: copied module by module" in handle.summary()
        assert [r.unit for r in handle.rows] == ["transformer.h", "rest", "placed", "buffers"]
        assert torch.equal(expected, _forward(model, "gpt2"))
    assert torch.equal(expected, _forward(model, "gpt2"))


def test_offload_layers_by_path(folders):
    cls, folder = folders["bert", "float32"]
    model = cls.from_pretrained(folder).eval()
    expected = _forward(model, "bert")
    with mapoffload.offload(model, device="cpu", layers="bert.encoder.layer") as handle:
        assert list(handle.managers) == ["bert.encoder.layer"]
        assert torch.equal(expected, _forward(model, "bert"))



def test_t5_fp16_keeps_wo_in_float32_as_transformers_does(tmp_path):
    cls = save("t5", torch.float16, tmp_path, shard=None)
    ref = cls.from_pretrained(tmp_path).eval()
    model = mapoffload.from_pretrained(cls, tmp_path, device="cpu", keep_mapping=True)
    assert model.mapoffload_report.converted_tensors > 0  # the float32 copies of wo, in a mapped file
    model.mapoffload_handle.close()
    assert model.encoder.block[0].layer[1].DenseReluDense.wo.weight.dtype == torch.float32
    assert {n: p.dtype for n, p in model.named_parameters()} == {n: p.dtype for n, p in ref.named_parameters()}
    assert torch.equal(_forward(ref, "t5"), _forward(model, "t5"))
