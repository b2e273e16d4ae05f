"""``batchrl export <checkpoint> --to DIR``: a checkpoint as a folder that plain transformers / PEFT / TRL load.

- default: a merged HF folder (``AutoModelForCausalLM.from_pretrained(DIR)``; a reward model loads with
  ``AutoModelForSequenceClassification``, a critic with ``AutoModelForTokenClassification``): a full checkpoint's
  own files, or a LoRA checkpoint's base with the adapter merged in (``W + (alpha / r) B A``), written here only;
- ``--adapter``: a LoRA checkpoint as a PEFT folder (``PeftModel.from_pretrained(base, DIR)``, or
  ``AutoPeftModelForCausalLM.from_pretrained(DIR)``): the adapter's two files with ``base_model_name_or_path``
  set to where its base is (``--base-name``: e.g. the base's hub id instead), plus the base's tokenizer files.

Either way the folder is written to a temp dir and renamed into place; batchrl's records (lineage, metrics) stay
with the artifact. Torch, transformers and peft are imported only when a command runs.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from typing import Any, Callable

DTYPES = ("float32", "bfloat16", "float16")


class ExportError(ValueError):
    """The checkpoint cannot be exported as asked (not found, not an adapter, the target is in use)."""


def _fresh_target(to: str) -> str:
    to = os.path.abspath(to)
    if os.path.exists(to) and (not os.path.isdir(to) or os.listdir(to)):
        raise ExportError(f"{to} exists and is not empty: export into a new folder")
    return to


def _into_place(fill: Callable[[str], None], to: str) -> None:
    tmp = f"{to.rstrip('/')}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        fill(tmp)
        if os.path.isdir(to):
            os.rmdir(to)  # empty (checked)
        os.replace(tmp, to)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _load_merged(checkpoint: str):
    """(model, tokenizer) of the LoRA checkpoint, merged in memory, by the kind of model its adapter is for."""
    from batchrl.training.models import lora

    task = lora.read_adapter_config(checkpoint).get("task_type")
    if task == lora.SEQ_CLS:
        from batchrl.training.rewards.reward_model import load_reward_model

        return load_reward_model(checkpoint)
    if task == lora.TOKEN_CLS:
        from batchrl.training.models.value_model import load_value_model

        model, tokenizer = load_value_model(checkpoint)
        model.config.use_cache = True
        return model, tokenizer
    from batchrl.training.models.loading import load_model_and_tokenizer

    return load_model_and_tokenizer(checkpoint)


def export_merged(checkpoint: str, to: str, *, dtype: str | None = None) -> dict[str, Any]:
    """A merged HF folder at ``to`` from a full or LoRA checkpoint folder; ``dtype`` casts the weights."""
    from batchrl.common import fsutil
    from batchrl.common.expired import MARKER
    from batchrl.training.models import lora

    to = _fresh_target(to)
    if not lora.is_adapter_folder(checkpoint) and dtype is None:  # a full checkpoint: its files as they are
        def copy(tmp: str) -> None:
            for name in sorted(os.listdir(checkpoint)):
                if name not in fsutil.RECORD_FILES | {MARKER} and os.path.isfile(os.path.join(checkpoint, name)):
                    shutil.copyfile(os.path.join(checkpoint, name), os.path.join(tmp, name))

        _into_place(copy, to)
        return {"kind": "merged", "from": "full checkpoint", "path": to}
    import torch

    from batchrl.training.trainer.checkpoint import export_hf_model

    if lora.is_adapter_folder(checkpoint):
        model, tokenizer = _load_merged(checkpoint)
    else:
        from batchrl.training.models.loading import load_model_and_tokenizer

        model, tokenizer = load_model_and_tokenizer(checkpoint)
    if dtype is not None:
        model = model.to(getattr(torch, dtype))
    export_hf_model(model, tokenizer, to)
    return {"kind": "merged", "from": "adapter" if lora.is_adapter_folder(checkpoint) else "full checkpoint",
            "base": lora.resolve_base(checkpoint), "path": to}


def export_adapter(checkpoint: str, to: str, *, base_name: str | None = None) -> dict[str, Any]:
    """A PEFT folder at ``to`` from the LoRA checkpoint ``checkpoint``: its adapter, its base named by
    ``base_name`` (default: the base folder's absolute path), the base's tokenizer files."""
    from batchrl.training.models import lora
    from batchrl.training.models.folders import tokenizer_files

    if not lora.is_adapter_folder(checkpoint):
        raise ExportError(f"{checkpoint} is a full checkpoint, not a LoRA adapter: export it without --adapter")
    base = lora.resolve_base(checkpoint)
    if base_name is None and not os.path.isdir(base):
        raise ExportError(f"the base model of {checkpoint} ({base}) is not here: give --base-name")
    to = _fresh_target(to)
    config = lora.read_adapter_config(checkpoint)
    config["base_model_name_or_path"] = base_name or os.path.abspath(base)

    def fill(tmp: str) -> None:
        shutil.copyfile(os.path.join(checkpoint, lora.ADAPTER_WEIGHTS), os.path.join(tmp, lora.ADAPTER_WEIGHTS))
        with open(os.path.join(tmp, lora.ADAPTER_CONFIG), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
        for name in tokenizer_files(base) if os.path.isdir(base) else []:
            shutil.copyfile(os.path.join(base, name), os.path.join(tmp, name))

    _into_place(fill, to)
    return {"kind": "adapter", "base": config["base_model_name_or_path"], "path": to,
            "adapter_bytes": lora.adapter_bytes(to)}


def export_checkpoint(checkpoint: str, to: str, *, adapter: bool = False, base_name: str | None = None,
                      dtype: str | None = None) -> dict[str, Any]:
    """``export_adapter`` with ``adapter``, else ``export_merged``, of the checkpoint folder ``checkpoint``."""
    if "://" in checkpoint:
        raise ExportError(f"{checkpoint}: export reads a local folder; localise the artifact first")
    if not os.path.isdir(checkpoint):
        raise ExportError(f"{checkpoint}: no such checkpoint folder")
    from batchrl.common import fsutil
    from batchrl.common.expired import expired_refusal

    refusal = expired_refusal(fsutil.filesystem_for(checkpoint)[0], checkpoint)
    if refusal is not None:  # retention deleted its weights: said, not an export of its records alone
        raise ExportError(refusal)
    if adapter:
        if dtype is not None:
            raise ExportError("--dtype applies to a merged export; an adapter keeps the dtype it was trained in")
        return export_adapter(checkpoint, to, base_name=base_name)
    if base_name is not None:
        raise ExportError("--base-name names the base of a PEFT folder: use it with --adapter")
    return export_merged(checkpoint, to, dtype=dtype)


def add_command(sub: Any, resolve: Callable[[str], str | None]) -> None:
    """Register ``batchrl export`` on the CLI's subparsers; ``resolve``: an asset name or folder -> its folder."""
    export = sub.add_parser("export", help="write a checkpoint as a merged HF folder, or with --adapter a PEFT "
                                           "folder (LoRA checkpoints)")
    export.add_argument("checkpoint", help="an asset name (its latest materialisation, e.g. policy_checkpoint) or a "
                                           "checkpoint folder")
    export.add_argument("--to", required=True, help="the folder to write (new or empty)")
    export.add_argument("--adapter", action="store_true",
                        help="a PEFT folder (adapter + base's tokenizer) instead of merged weights")
    export.add_argument("--base-name", help="with --adapter: how the folder names its base (default: the base "
                                            "folder's absolute path), e.g. the hub id the base came from")
    export.add_argument("--dtype", choices=DTYPES, help="merged export: cast the weights (default: as stored)")
    export.set_defaults(func=lambda args: cmd_export(args, resolve))


def cmd_export(args: argparse.Namespace, resolve: Callable[[str], str | None]) -> int:
    checkpoint = resolve(args.checkpoint)
    if checkpoint is None:
        print(f"batchrl export: no materialisation of {args.checkpoint}", file=sys.stderr)
        return 2
    try:
        report = export_checkpoint(checkpoint, args.to, adapter=args.adapter, base_name=args.base_name,
                                   dtype=args.dtype)
    except (ExportError, OSError) as error:
        print(f"batchrl export: {error}", file=sys.stderr)
        return 2
    print(f"exported {checkpoint}\n  as {report['kind']} to {report['path']}" +
          (f"\n  base: {report['base']}" if report.get("base") else ""))
    return 0
