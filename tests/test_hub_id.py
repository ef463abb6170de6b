"""A hub id or URL where a local path is taken: every entry point refuses it with one type,
:class:`mapoffload.NotLocalError` (a ``FileNotFoundError`` and a ``ValueError``), naming it and saying
to download it first (issue 42: it was a ``FileNotFoundError``, a ``ValueError`` or a ``VllmLoadError``
depending on the door). A local path that is merely missing is not called a hub id."""

from __future__ import annotations

import pytest
import torch

import mapoffload
from mapoffload import NotLocalError

HUB_ID = "meta-llama/Llama-3-8B"


def _doors():
    import diffusers
    import transformers as tf

    from mapoffload.hf.convert import check_model_folder
    from mapoffload.vllm.loader import _local_folder

    return {
        "load_checkpoint": lambda p: mapoffload.load_checkpoint(torch.nn.Linear(2, 2), p),
        "checkpoint_files": mapoffload.checkpoint_files,
        "from_pretrained": lambda p: mapoffload.from_pretrained(tf.LlamaForCausalLM, p, device="cpu"),
        "pipeline_from_pretrained": lambda p: mapoffload.pipeline_from_pretrained(diffusers.DiffusionPipeline, p,
                                                                              device="cpu"),
        "convert": check_model_folder,
        "vllm": _local_folder,
    }


@pytest.mark.parametrize("door", ["load_checkpoint", "checkpoint_files", "from_pretrained",
                                  "pipeline_from_pretrained", "convert", "vllm"])
def test_every_door_refuses_a_hub_id_with_one_type(door):
    with pytest.raises(NotLocalError) as info:
        _doors()[door](HUB_ID)
    text = str(info.value)
    assert f"{HUB_ID!r} is not a local" in text and "looks like a hub id" in text
    assert f"hf download {HUB_ID} --local-dir DIR" in text and "\n" not in text
    assert info.value.path == HUB_ID
    assert isinstance(info.value, FileNotFoundError) and isinstance(info.value, ValueError)


def test_a_url_is_called_a_url():
    with pytest.raises(NotLocalError, match=r"looks like a URL: mapoffload loads local paths only \(download it "
                                            r"first and pass its local path\)"):
        mapoffload.checkpoint_files("https://example.com/model.safetensors")


def test_a_missing_local_path_is_not_called_a_hub_id(tmp_path):
    (tmp_path / "models").mkdir()
    typo = str(tmp_path / "models" / "lama")
    with pytest.raises(FileNotFoundError) as info:
        mapoffload.checkpoint_files(typo)
    assert not isinstance(info.value, NotLocalError) and "hub id" not in str(info.value)
