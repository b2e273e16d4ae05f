"""Model assets: the base model (embedded default, HF folder or GGUF) and the Bradley-Terry reward model."""

import os
import shutil
import warnings
from typing import Literal, Optional

import dagster as dg
import pandas as pd
from pydantic import Field, model_validator

from batchrl.assets.common import code_version, publish, run_config_for, train_and_publish, work_dir
from batchrl.common.fsutil import link_tree
from batchrl.ingest.window import first_drop
from batchrl.resources import Artifact, CatalogResource, StorageResource, TrackingResource, TrainerLauncherResource
from batchrl.resources.artifacts import OPTIONAL_KEY
from batchrl.training.trainer.config import RewardModelConfig


class BaseModelConfig(dg.Config):
    """The base model, from one source: ``model_path`` (an HF model folder), ``gguf_file`` (a GGUF
    file path, or ``distribution:relative/path`` inside an installed package, converted once into a
    cached HF folder), or neither: the tiny default built offline from the data (dims below): the
    first log drop of the training window and the prompts (whichever is materialised), so that retraining
    on a new drop keeps the base model and continues its policy chain (with ``last_drops: K`` the base model
    changes, and a new chain starts, when its drop leaves the window). A model from a path or GGUF reads no
    data: it needs neither the window nor the prompts."""

    model_path: str | None = Field(None, description="an HF causal-LM folder to use as the base model")
    gguf_file: str | None = Field(None, description="a GGUF file (path or distribution:relative/path in an "
                                  "installed package), converted once into a cached HF folder")
    gguf_parts: list[str] | None = Field(None, description="a GGUF shipped as raw parts, in order (each a path or "
                                         "distribution:relative/path): joined once into the cache, each part checked "
                                         "against its package's RECORD hash, the whole against gguf_sha256")
    gguf_sha256: str | None = Field(None, description="the joined GGUF's sha256 (64 hex digits); needed with "
                                    "gguf_parts")
    vocab_size: int = Field(1024, description="tiny default: BPE vocabulary size")
    hidden_size: int = Field(256, description="tiny default: hidden size")
    intermediate_size: int = Field(512, description="tiny default: MLP size")
    num_layers: int = Field(4, description="tiny default: transformer layers")
    seed: int = Field(0, description="tiny default: seed of the weights' initialisation")
    warm_start_steps: int = Field(0, ge=0, description="tiny default: supervised steps on the prompts' gold answers "
                                  "after it is built, so RL starts from a model that is sometimes right "
                                  "(training/models/warm_start.py); 0: random weights")
    warm_start_lr: float = Field(1e-3, gt=0, description="tiny default: learning rate of the warm start")
    warm_start_lr_schedule: Literal["constant", "cosine"] = Field(
        "constant", description="tiny default: the warm start's learning rate over its steps: constant; cosine = a "
        "tenth of the steps of linear warmup, then a cosine decay to 0 (with a gold share below 1 the model then "
        "ends near the taught mixture instead of its last batches' draws)")
    warm_start_gold_share: float = Field(1.0, gt=0, le=1, description="tiny default: share of the warm start's "
                                         "draws taught the gold answer; the others are taught the near miss (gold + "
                                         "warm_start_near_miss_offset), drawn afresh each time an example is seen: "
                                         "a habit RL can unlearn (samples right about this often, greedy mostly "
                                         "not). 1: always gold, the plain warm start")
    warm_start_near_miss_offset: int = Field(1, description="tiny default: the near miss taught when a draw is not "
                                             "gold: the gold answer (a whole number) plus this; not 0")

    @model_validator(mode="after")
    def _near_miss_misses(self):
        if self.warm_start_near_miss_offset == 0:
            raise ValueError("warm_start_near_miss_offset: 0 teaches the gold answer as its own near miss: set a "
                             "whole number other than 0, or warm_start_gold_share: 1")
        return self

    @model_validator(mode="after")
    def _split_gguf_names_its_hash(self):
        """A split GGUF names its joined hash (nothing else says the parts make one whole file); whether each part
        is installed is checked before a run that builds the base model starts (``assets.run_rules``), not here:
        a profile's config stays checkable on a machine without the weights."""
        if self.gguf_sha256 and not self.gguf_parts:
            raise ValueError("gguf_sha256 is set without gguf_parts (a single gguf_file is hashed when converted)")
        if self.gguf_parts:
            from batchrl.training.models.gguf_parts import check_expected_sha256

            check_expected_sha256(self.gguf_sha256)
        return self


TINY_DIMS = {"vocab_size", "hidden_size", "intermediate_size", "num_layers", "seed"}  # the tiny default's knobs
RewardModelRunConfig = run_config_for(RewardModelConfig, "RewardModelRunConfig")


#: what the tiny default trains its tokenizer on; optional: a base model from a path or GGUF reads neither, so a team
#: with only thumbs, scored logs or prompts trains without log drops (and a DPO-only run without a prompts file)
TOKENIZER_CORPUS = ("preference_window", "prompts")


@dg.asset(group_name="models", code_version=code_version("batchrl.training.models.tiny", "batchrl.training.models.loading", "batchrl.training.models.warm_start",
                                                      "batchrl.training.models.gguf",
                                                      "batchrl.training.models.gguf_parts", "batchrl.ingest.window",
                                                      config=BaseModelConfig),
          kinds={"pytorch"}, ins={name: dg.AssetIn(metadata={OPTIONAL_KEY: True}) for name in TOKENIZER_CORPUS})
def base_model(context: dg.AssetExecutionContext, config: BaseModelConfig, preference_window: Optional[Artifact],
               prompts: Optional[Artifact], storage: StorageResource, catalog: CatalogResource) -> dg.Output:
    """Tiny Qwen2 + byte-level BPE tokenizer trained offline on the data (or a user-supplied HF folder / GGUF)."""
    sources = [name for name in ("model_path", "gguf_file", "gguf_parts") if getattr(config, name)]
    if len(sources) > 1:
        raise dg.Failure(f"base_model: set one of model_path, gguf_file, gguf_parts, not {' and '.join(sources)}")
    inputs, input_files = {}, []
    with storage.staging_dir("base_model") as staging:
        if config.gguf_parts:
            info, input_files = _from_gguf_parts(config.gguf_parts, config.gguf_sha256, storage, staging)
        elif config.gguf_file:
            info, input_files = _from_gguf(config.gguf_file, storage, staging)
        elif config.model_path:
            shutil.copytree(config.model_path, staging, dirs_exist_ok=True)
            info = {"source": config.model_path}
        else:
            from batchrl.training.models.tiny import build_tiny_model  # torch: only to build the tiny default

            texts, inputs = _tokenizer_corpus(preference_window, prompts)
            info = build_tiny_model(texts, staging, **config.model_dump(include=TINY_DIMS))
            if config.warm_start_steps:
                info.update(_warm_started(staging, prompts, config))
        shown = {k: v for k, v in info.items() if isinstance(v, (int, float, str))}
        in_staging = {k for k, v in shown.items() if isinstance(v, str) and v.startswith(staging)}
        output = publish(context, storage, catalog, staging, seed=config.seed, config=config.model_dump(),
                         inputs=inputs, input_files=input_files,
                         metadata={k: v for k, v in shown.items() if k not in in_staging})
        # the builder's paths (path, model_file, tokenizer_file) named the staging folder, gone once published
        published = {k: dg.MetadataValue.path(output.value["uri"] + shown[k][len(staging):]) for k in in_staging}
        with warnings.catch_warnings():  # Output(data_version=...) is flagged beta, as in publish
            warnings.simplefilter("ignore", dg.BetaWarning)
            return dg.Output(output.value, output_name=output.output_name, data_version=output.data_version,
                             metadata={**output.metadata, **published})


def _from_gguf(gguf_file: str, storage: StorageResource, staging: str,
               expected_sha256: str | None = None) -> tuple[dict, list[dict]]:
    """The GGUF's cached HF folder put into ``staging`` as hard links (copied only across filesystems): (its info,
    the GGUF as the lineage's input file)."""
    from batchrl.training.models.gguf import cached_hf_from_gguf

    folder, info = cached_hf_from_gguf(gguf_file, storage.cache_dir, expected_sha256=expected_sha256)
    # linked, not copied: at 1.5B the dequantized fp32 weights are 7.1 GB, and a second copy per base model stopped
    # a GSM8K run on a 64 GiB disk (bench/RESULTS.md, 2026-12-06); both files are write-once, ours alone
    link_tree(folder, staging)
    return info, [{"uri": gguf_file, "sha256": info["gguf_sha256"], "bytes": info["gguf_bytes"],
                   "package": info.get("package"), "package_version": info.get("package_version")}]


def _from_gguf_parts(parts: list[str], sha256: str | None, storage: StorageResource,
                     staging: str) -> tuple[dict, list[dict]]:
    """The parts joined (once, verified) and converted like a GGUF file; the lineage names every part's package,
    version, bytes and sha256 beside the joined file's hash."""
    from batchrl.training.models.gguf_parts import join_parts
    from batchrl.training.models.gguf import GgufSourceError

    try:  # the join's hash goes through: the joined file is hashed once, and checked again when it was joined before
        joined, provenance = join_parts(parts, sha256, storage.cache_dir)
        info, _ = _from_gguf(joined, storage, staging, expected_sha256=provenance["gguf_sha256"])
    except GgufSourceError as err:
        raise dg.Failure(f"base_model.gguf_parts: {err}") from None
    files = [{"uri": part["spec"], "sha256": part["sha256"], "bytes": part["bytes"], "package": part["package"],
              "package_version": part["package_version"]} for part in provenance["parts"]]
    return {**info, "gguf_spec": f"{len(parts)} parts", "gguf_parts": len(parts)}, files


def _warm_started(model_dir: str, prompts: Artifact | None, config: BaseModelConfig) -> dict:
    """The tiny default trained ``warm_start_steps`` on the prompts' (prompt, answer) pairs, in place."""
    from batchrl.training.models.warm_start import WarmStartError, warm_start

    table = prompts.read_table() if prompts is not None else None
    if table is None or "answer" not in table or not table["answer"].notna().any():
        raise dg.Failure("base_model: warm_start_steps trains on the prompts' gold answers, and the prompts have "
                         "none: materialise prompts with an answer column, or set base_model.config."
                         "warm_start_steps: 0 (`batchrl run` without a profile sets it: resources/profiles.py "
                         "EMBEDDED_DEFAULT)")
    rows = table[table["answer"].notna()]
    try:
        return warm_start(model_dir, list(zip(rows["prompt"], rows["answer"].astype(str))),
                          steps=config.warm_start_steps, lr=config.warm_start_lr, seed=config.seed,
                          gold_share=config.warm_start_gold_share,
                          near_miss_offset=config.warm_start_near_miss_offset,
                          lr_schedule=config.warm_start_lr_schedule)
    except WarmStartError as err:
        raise dg.Failure(f"base_model: {err}") from None


def _tokenizer_corpus(preference_window: Artifact | None, prompts: Artifact | None) -> tuple[list[str], dict]:
    """The tiny default's texts and the inputs they came from: the window's first drop only (a new drop rebuilds
    the same model: same version, same policy chain), then the prompts; whichever of the two is materialised."""
    texts = []
    if preference_window is not None:
        prefs = first_drop(preference_window.read_table())
        texts += [*prefs["prompt"], *prefs["chosen"], *prefs["rejected"]]
    if prompts is not None:
        texts += list(prompts.read_table()["prompt"])
    inputs = {name: artifact for name, artifact in zip(TOKENIZER_CORPUS, (preference_window, prompts))
              if artifact is not None}
    if not inputs:
        raise dg.Failure("base_model: the tiny default model trains its tokenizer on the preference window's first "
                         "drop and the prompts, and neither is materialised: materialise one of them, or set "
                         "base_model's model_path or gguf_file")
    return texts, inputs


@dg.asset(group_name="models", code_version=code_version("batchrl.training.jobs.train_reward_model", "batchrl.training.rewards.reward_model",
                                                       config=RewardModelRunConfig),
          kinds={"deepspeed"})
def reward_model(context: dg.AssetExecutionContext, config: RewardModelRunConfig, preference_window: Artifact,
                 scored_pairs: Artifact, base_model: Artifact, storage: StorageResource,
                 catalog: CatalogResource, trainer: TrainerLauncherResource,
                 tracking: TrackingResource) -> dg.Output:
    """Bradley-Terry reward model on the validated pairs plus pairs mined from scored logs, trained on
    DeepSpeed through Pipes like DPO and the policy update."""
    pairs = pd.concat([preference_window.read_table(), scored_pairs.read_table()], ignore_index=True)
    data_dir = work_dir(storage, "reward_model_pairs", {"preference_window": preference_window.data_version,
                                                        "scored_pairs": scored_pairs.data_version})
    pairs_parquet = os.path.join(data_dir, "pairs.parquet")
    pairs[["prompt", "chosen", "rejected"]].to_parquet(pairs_parquet, index=False)
    job_config = {"trainer": config.model_dump(), "pairs_parquet": pairs_parquet,
                  "model_path": base_model.path}
    return train_and_publish(context, "train_reward_model", job_config,
                             {"preference_window": preference_window, "scored_pairs": scored_pairs,
                              "base_model": base_model}, config.seed, storage, catalog, trainer, tracking=tracking)
