"""Tiny models saved by transformers, one per architecture vLLM's CPU build serves here.

Sizes fit vLLM's CPU attention (head_dim 64) and stay a few MiB; the vocabulary
(1000) is not a multiple of 64, so vLLM pads it: the embedding and the head are
built tensors (converted), the rest are copied unchanged (mapped).
"""

from __future__ import annotations

import os

COMMON = dict(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def _config(arch: str):
    import transformers as tf

    if arch == "llama":
        return tf.LlamaConfig(**COMMON, tie_word_embeddings=False), tf.LlamaForCausalLM
    if arch == "llama_tied":
        return tf.LlamaConfig(**COMMON, tie_word_embeddings=True), tf.LlamaForCausalLM
    if arch == "qwen2":
        return tf.Qwen2Config(**COMMON, tie_word_embeddings=False), tf.Qwen2ForCausalLM
    if arch == "qwen3":
        return tf.Qwen3Config(**COMMON, head_dim=64, tie_word_embeddings=False), tf.Qwen3ForCausalLM
    if arch == "mistral":
        return tf.MistralConfig(**COMMON, tie_word_embeddings=False), tf.MistralForCausalLM
    if arch == "mixtral":
        return tf.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2,
                                tie_word_embeddings=False), tf.MixtralForCausalLM
    if arch == "phi3":
        return tf.Phi3Config(**COMMON, pad_token_id=0, tie_word_embeddings=False), tf.Phi3ForCausalLM
    raise ValueError(arch)


ARCHITECTURES = ["llama", "llama_tied", "qwen2", "qwen3", "mistral", "mixtral", "phi3"]


def save_tiny(arch: str, folder: str, *, seed: int = 0, dtype: str = "bfloat16") -> str:
    """Save a tiny ``arch`` model (random weights, ``seed``) with ``save_pretrained``; returns ``folder``."""
    import torch

    config, cls = _config(arch)
    torch.manual_seed(seed)
    model = cls(config).to(getattr(torch, dtype))
    with torch.no_grad():  # weights far from zero: every layer moves the logits
        for p in model.parameters():
            p.normal_(0.0, 0.05)
    os.makedirs(folder, exist_ok=True)
    model.save_pretrained(folder)
    return folder


def save_llama(folder: str, *, hidden: int = 1024, intermediate: int = 4096, layers: int = 12,
               vocab: int = 32000, seed: int = 0) -> str:
    """A Llama of a chosen size (bf16, random weights): ``layers=12`` is about 0.5 GB."""
    import torch
    import transformers as tf

    config = tf.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                            num_hidden_layers=layers, num_attention_heads=hidden // 64,
                            num_key_value_heads=max(1, hidden // 256), max_position_embeddings=256,
                            tie_word_embeddings=False)
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = tf.LlamaForCausalLM(config)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.05)
    os.makedirs(folder, exist_ok=True)
    model.save_pretrained(folder)
    return folder
