"""`pagedkv make-model`: a small random-weight checkpoint laid out exactly like a downloaded one.

The directory holds config.json, generation_config.json, model.safetensors (or shards and their index),
tokenizer.json, tokenizer_config.json (with a ChatML `chat_template`) and special_tokens_map.json, so everything
downstream (checkpoint reader, executor, gateway, transformers itself as the reference) runs unchanged on it,
without a download. The weights come from the real transformers classes under a fixed seed; the tokenizer is a
byte-level BPE trained here on a generated corpus. The same options and seed give byte-identical files.
"""

from pagedkv.tools.model_gen.corpus import tokenizer_corpus
from pagedkv.tools.model_gen.spec import ARCHITECTURES, ModelSpec, ModelSpecError
from pagedkv.tools.model_gen.tokenizer import train_tokenizer
from pagedkv.tools.model_gen.writer import generate_default_model, write_model

__all__ = [
    "ARCHITECTURES",
    "ModelSpec",
    "ModelSpecError",
    "generate_default_model",
    "tokenizer_corpus",
    "train_tokenizer",
    "write_model",
]
