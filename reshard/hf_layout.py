"""The Hugging Face safetensors layout's names, shared by export and import."""

from __future__ import annotations

import re

HF_CONFIG_KEY = "hf_config"  # manifest metadata key holding a transformers config.json (spec section 8.1)
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
OUTPUT_EMBEDDING = "lm_head.weight"
INPUT_EMBEDDING_RE = re.compile(r"(^|\.)(embed_tokens|wte|word_embeddings|embed_in|tok_embeddings)\.weight$")


def shard_name(k: int, n: int) -> str:
    """The name of file ``k`` (from 0) of ``n``, as ``save_pretrained`` names it."""
    return SINGLE_NAME if n == 1 else f"model-{k + 1:05d}-of-{n:05d}.safetensors"


__all__ = ["CONFIG_NAME", "HF_CONFIG_KEY", "INDEX_NAME", "INPUT_EMBEDDING_RE", "OUTPUT_EMBEDDING", "SINGLE_NAME",
           "shard_name"]
