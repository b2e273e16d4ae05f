"""What identifies a Hugging Face model folder apart from its weights: the key of its configs and tokenizer files,
shared by the weight cache (``weights``), the tokenizer cache (``loading``) and the exports."""
from __future__ import annotations

import hashlib
import json
import os

from batchrl.common import fsutil

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5")


# config.json keys that say how the weights were stored and who wrote them, not what the model is: a checkpoint
# exported in float32 from a bfloat16 base is the same model (its weights load into the same module)
STORAGE_ONLY_CONFIG_KEYS = frozenset({"dtype", "torch_dtype", "transformers_version", "_name_or_path"})


def folder_key(path: str, *, tokenizer_only: bool = False) -> str:
    """Hash of an HF folder's files other than its weights (config, tokenizer, generation config): equal for
    checkpoints of one model (batchrl's records beside them, ``fsutil.RECORD_FILES``, and the config's
    ``STORAGE_ONLY_CONFIG_KEYS`` left out too).
    ``tokenizer_only``: the tokenizer's files and the config's ``model_type`` (which AutoTokenizer may
    fall back on), so a reward model (another head and architecture) shares its base model's tokenizer."""
    digest = hashlib.blake2b(digest_size=16)
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if name.endswith(WEIGHT_SUFFIXES + (".safetensors.index.json",)) or name in fsutil.RECORD_FILES \
                or not os.path.isfile(full):
            continue
        if tokenizer_only and name == "generation_config.json":
            continue
        with open(full, "rb") as f:
            content = f.read()
        if name == "config.json":
            config = json.loads(content)
            content = (str(config.get("model_type")) if tokenizer_only else json.dumps(
                {k: v for k, v in config.items() if k not in STORAGE_ONLY_CONFIG_KEYS}, sort_keys=True)).encode()
        digest.update(name.encode() + b"\0" + content + b"\0")
    return digest.hexdigest()


def tokenizer_files(path: str) -> list[str]:
    """The files of an HF folder that ``folder_key(tokenizer_only=True)`` hashes besides the config: the
    tokenizer's (and chat template's) files, none of the weights, configs or batchrl's records."""
    return sorted(name for name in os.listdir(path) if os.path.isfile(os.path.join(path, name))
                  and not name.endswith(WEIGHT_SUFFIXES + (".safetensors.index.json",))
                  and name not in fsutil.RECORD_FILES and name not in ("config.json", "generation_config.json"))
