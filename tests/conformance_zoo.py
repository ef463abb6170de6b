"""Tiny random models of many transformers architectures, saved by transformers
itself, for the conformance matrix (tests/test_hf_conformance.py).

Every parameter is perturbed after construction, so a weight left at its
initial value (a norm at 1, a bias at 0) cannot pass for a loaded one; every
decoder folder carries its own ``generation_config.json`` (eos token, length,
repetition penalty) that ``generate()`` must honour.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

VOCAB = 96
IDS = [[3, 17, 42, 5, 88, 9, 61]]


def _dec(**kw: Any) -> dict:
    base = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    base.update(kw)
    return base


def _enc(**kw: Any) -> dict:
    base = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=64)
    base.update(kw)
    return base


def _vit(**kw: Any) -> dict:
    base = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                image_size=32, patch_size=8)
    base.update(kw)
    return base


def zoo() -> dict[str, tuple[Callable[[], Any], str]]:
    """name -> (a function building (class, config), input kind)."""
    import transformers as tf

    def c(cls_name: str, cfg_name: str, **kw: Any) -> Callable[[], Any]:
        return lambda: (getattr(tf, cls_name), getattr(tf, cfg_name)(**kw))

    moe = dict(num_local_experts=4, num_experts_per_tok=2)
    text = _enc(vocab_size=VOCAB)
    vision = _vit()
    return {
        # dense decoders
        "llama": (c("LlamaForCausalLM", "LlamaConfig", **_dec(tie_word_embeddings=True)), "causal"),
        "mistral": (c("MistralForCausalLM", "MistralConfig", **_dec()), "causal"),
        "qwen2": (c("Qwen2ForCausalLM", "Qwen2Config", **_dec()), "causal"),
        "qwen3": (c("Qwen3ForCausalLM", "Qwen3Config", **_dec(head_dim=8)), "causal"),
        "gemma2": (c("Gemma2ForCausalLM", "Gemma2Config", **_dec(head_dim=8)), "causal"),
        "phi3": (c("Phi3ForCausalLM", "Phi3Config", **_dec(pad_token_id=0)), "causal"),
        "gpt2": (c("GPT2LMHeadModel", "GPT2Config", vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                   n_positions=64), "causal"),
        "gpt_neox": (c("GPTNeoXForCausalLM", "GPTNeoXConfig", **_enc()), "causal"),
        "opt": (c("OPTForCausalLM", "OPTConfig", vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=32), "causal"),
        "bloom": (c("BloomForCausalLM", "BloomConfig", vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4),
                  "causal"),
        "falcon": (c("FalconForCausalLM", "FalconConfig", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                     num_attention_heads=4), "causal"),
        "stablelm": (c("StableLmForCausalLM", "StableLmConfig", **_dec()), "causal"),
        "olmo2": (c("Olmo2ForCausalLM", "Olmo2Config", **_dec()), "causal"),
        # mixture of experts
        "mixtral": (c("MixtralForCausalLM", "MixtralConfig", **_dec(**moe)), "causal"),
        "qwen2_moe": (c("Qwen2MoeForCausalLM", "Qwen2MoeConfig", **_dec(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)),
            "causal"),
        "qwen3_moe": (c("Qwen3MoeForCausalLM", "Qwen3MoeConfig", **_dec(
            head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)), "causal"),
        "olmoe": (c("OlmoeForCausalLM", "OlmoeConfig", **_dec(num_experts=4, num_experts_per_tok=2)), "causal"),
        "deepseek_v3": (c("DeepseekV3ForCausalLM", "DeepseekV3Config", **_dec(
            n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=16,
            first_k_dense_replace=1, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=16,
            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, num_key_value_heads=4)), "causal"),
        # encoders
        "bert": (c("BertForMaskedLM", "BertConfig", **_enc()), "encoder"),
        "roberta": (c("RobertaForMaskedLM", "RobertaConfig", **_enc(pad_token_id=1)), "encoder"),
        "xlm_roberta": (c("XLMRobertaModel", "XLMRobertaConfig", **_enc(vocab_size=2000, pad_token_id=1)),
                        "encoder"),
        "deberta_v2": (c("DebertaV2Model", "DebertaV2Config", **_enc()), "encoder"),
        "distilbert": (c("DistilBertModel", "DistilBertConfig", vocab_size=VOCAB, dim=32, hidden_dim=64, n_layers=2,
                         n_heads=4, max_position_embeddings=64), "encoder"),
        # encoder-decoders
        "t5": (c("T5ForConditionalGeneration", "T5Config", vocab_size=VOCAB, d_model=32, d_ff=64, d_kv=8,
                 num_layers=2, num_decoder_layers=2, num_heads=4, decoder_start_token_id=0), "seq2seq"),
        "bart": (c("BartForConditionalGeneration", "BartConfig", vocab_size=VOCAB, d_model=32, encoder_layers=2,
                   decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                   decoder_ffn_dim=64, max_position_embeddings=64), "seq2seq"),
        "whisper": (c("WhisperForConditionalGeneration", "WhisperConfig", vocab_size=VOCAB, d_model=32,
                      encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                      encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8, max_source_positions=16,
                      max_target_positions=32, decoder_start_token_id=1, pad_token_id=0, eos_token_id=2,
                      bos_token_id=1, suppress_tokens=None, begin_suppress_tokens=None), "whisper"),
        # vision
        "vit": (c("ViTModel", "ViTConfig", **vision), "vision"),
        "dinov2": (c("Dinov2Model", "Dinov2Config", **_vit(mlp_ratio=2)), "vision"),
        "clip": (c("CLIPModel", "CLIPConfig", text_config=dict(text, vocab_size=VOCAB),
                   vision_config=vision, projection_dim=16), "clip"),
        "siglip": (c("SiglipModel", "SiglipConfig", text_config=dict(text, vocab_size=VOCAB),
                     vision_config=vision), "clip"),
        # vision-language
        "llava": (c("LlavaForConditionalGeneration", "LlavaConfig",
                    text_config=dict(_dec(), model_type="llama"),
                    vision_config=dict(_vit(), model_type="clip_vision_model", projection_dim=16),
                    image_token_index=95, vision_feature_layer=-1), "llava"),
        "qwen2_vl": (c("Qwen2VLForConditionalGeneration", "Qwen2VLConfig",
                       text_config=dict(_dec(), rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}),
                       vision_config=dict(depth=2, embed_dim=32, hidden_size=32, num_heads=4, mlp_ratio=2,
                                          patch_size=2, spatial_merge_size=2, temporal_patch_size=2),
                       image_token_id=90, video_token_id=91, vision_start_token_id=92), "qwen2_vl"),
        # hybrids
        "jamba": (c("JambaForCausalLM", "JambaConfig", **_dec(
            num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
            expert_layer_offset=1, num_experts=2, num_experts_per_tok=1, mamba_d_state=4, mamba_d_conv=2,
            mamba_expand=1, mamba_dt_rank=4, use_mamba_kernels=False)), "causal"),
        "mamba": (c("MambaForCausalLM", "MambaConfig", vocab_size=VOCAB, hidden_size=32, state_size=4,
                    num_hidden_layers=2, expand=1, use_mambapy=False), "causal"),
    }


def perturb(model: torch.nn.Module, seed: int = 0) -> None:
    """Move every parameter off its initial value (norms included)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.add_(torch.randn(p.shape, generator=g).to(p.dtype) * 0.2)


def build(name: str, folder: str, *, dtype: torch.dtype = torch.float32, shard: str | None = None,
          seed: int = 0) -> tuple[Any, str]:
    """Build ``name``, perturb, give decoders a generation config, save; returns (class, input kind)."""
    import transformers as tf

    make, kind = zoo()[name]
    cls, config = make()
    torch.manual_seed(seed)
    model = cls(config).eval()
    perturb(model, seed)
    model = model.to(dtype)
    if kind == "causal":
        model.generation_config = tf.GenerationConfig(
            eos_token_id=7, pad_token_id=0, max_new_tokens=9, repetition_penalty=1.3, do_sample=False)
    model.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
    return cls, kind


def inputs(kind: str, config: Any) -> dict[str, torch.Tensor]:
    """Inputs for one forward of a model of this input kind."""
    g = torch.Generator().manual_seed(1)
    ids = torch.tensor(IDS)
    if kind in ("causal", "encoder"):
        return {"input_ids": ids}
    if kind == "seq2seq":
        return {"input_ids": ids, "decoder_input_ids": ids[:, :4]}
    if kind == "whisper":
        return {"input_features": torch.randn(1, config.num_mel_bins, 2 * config.max_source_positions, generator=g),
                "decoder_input_ids": ids[:, :4]}
    if kind == "qwen2_vl":  # one 4x4-patch image, merged 2x2 into 4 image tokens
        ids = torch.tensor([[1, config.vision_start_token_id] + [config.image_token_id] * 4 + [5, 9]])
        return {"input_ids": ids, "pixel_values": torch.randn(16, 3 * 2 * 2 * 2, generator=g),
                "image_grid_thw": torch.tensor([[1, 4, 4]]), "mm_token_type_ids": (ids == config.image_token_id).long()}
    vc = getattr(config, "vision_config", config)
    pixels = torch.randn(1, 3, vc.image_size, vc.image_size, generator=g)
    if kind == "vision":
        return {"pixel_values": pixels}
    if kind == "clip":
        return {"input_ids": ids, "pixel_values": pixels}
    if kind == "llava":
        n = (vc.image_size // vc.patch_size) ** 2
        return {"input_ids": torch.tensor([[1] + [config.image_token_index] * n + [5, 9]]), "pixel_values": pixels}
    raise ValueError(kind)


def first_output(out: Any) -> torch.Tensor:
    """The tensor to compare of a model's output."""
    for name in ("logits", "logits_per_image", "last_hidden_state"):
        t = getattr(out, name, None)
        if t is not None:
            return t
    raise AttributeError(type(out).__name__)


def to_fp8(folder: str, block: int | str = 128) -> None:
    """Rewrite a saved model in the fine-grained FP8 layout (DeepSeek-V3, Qwen3-FP8):
    every 2-D projection weight as ``float8_e4m3fn`` codes with a
    ``weight_scale_inv`` per ``block``×``block`` tile (ragged at the edges),
    or one per row (``block="channel"``) or per tensor (``block="tensor"``),
    ``quantization_config`` in config.json."""
    import json
    import os

    from safetensors.torch import load_file, save_file

    shards = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    weight_map = {}
    for shard in shards:
        path = os.path.join(folder, shard)
        out = _fp8_state(load_file(path), block)
        save_file(out, path, metadata={"format": "pt"})
        weight_map.update({k: shard for k in out})
    for f in os.listdir(folder):
        if f.endswith(".index.json"):
            with open(os.path.join(folder, f)) as fh:
                index = json.load(fh)
            index["weight_map"] = weight_map
            with open(os.path.join(folder, f), "w") as fh:
                json.dump(index, fh)
    cfg_path = os.path.join(folder, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                  "weight_block_size": [block, block] if isinstance(block, int) else None}
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)


def _fp8_state(state: dict, block: int | str) -> dict:
    from mapoffload.loading.fp8 import quantize_fp8

    out = {}
    for k, v in state.items():
        if not (k.endswith("proj.weight") or ".experts." in k and k.endswith(".weight")) or v.dim() != 2:
            out[k] = v
            continue
        out[k], out[k + "_scale_inv"] = quantize_fp8(v, block if isinstance(block, str) else (block, block))
    return out
