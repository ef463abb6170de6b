"""Tiny random transformers models from real configs, saved by the tests."""

from __future__ import annotations

import torch


def configs():
    import transformers as tf

    common = dict(vocab_size=96, initializer_range=0.5)
    return {
        "llama": (tf.LlamaForCausalLM, tf.LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True, **common)),
        "gpt2": (tf.GPT2LMHeadModel, tf.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=64, **common)),
        "bert": (tf.BertForMaskedLM, tf.BertConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=64, **common)),
        "t5": (tf.T5ForConditionalGeneration, tf.T5Config(
            d_model=32, d_ff=64, d_kv=8, num_layers=2, num_decoder_layers=2, num_heads=4,
            decoder_start_token_id=0, initializer_factor=4.0, vocab_size=96)),
    }


def save(kind: str, dtype: torch.dtype, folder, *, shard: str | None = "24KB", seed: int = 0):
    """Build ``kind`` with random weights, save it in ``dtype`` (sharded); returns the class."""
    cls, config = configs()[kind]
    torch.manual_seed(seed)
    model = cls(config).to(dtype)
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(folder, **kwargs)
    return cls
