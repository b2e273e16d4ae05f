"""AdamW's state carried from one RL iteration's policy update into the next (``carry_optimizer_state``).

Why: every RL iteration is its own update job, and by default each starts a new AdamW — the moments and the bias
correction restart every iteration (1.5x larger steps at the same lr, ``bench/check_optimizer_carry.py``), where verl's actor, OpenRLHF and TRL's GRPOTrainer keep one optimiser over
the whole run. With the option on, the update publishes its optimiser state with the checkpoint and the next
iteration's update, which trains that checkpoint, takes it up: the chain of jobs steps exactly as one optimiser
would over the iterations' batches (tested bitwise on the CPU), and each checkpoint stays an immutable artifact
whose data version covers the state the next update starts from (so ``reproduce`` gets the same update).

What is kept, per trainable parameter (by its name in the module, so the parameter order may change): AdamW's
``exp_avg``, ``exp_avg_sq`` (float32) and ``step`` in ``optimizer/state-*.safetensors`` inside the checkpoint folder
— a subfolder, so loaders and ``batchrl export`` see an HF folder as before. The learning rate, betas and schedule
come from the new update's config; a critic's optimiser is not carried. Size: 8 bytes per trainable parameter (1.1
GB for a 135M model fully fine-tuned, MBs for a LoRA adapter). Needs the trainer's own AdamW over the module's
parameters: ZeRO stage 0 and precision fp32 or bf16_amp (``PolicyConfig`` refuses the rest when written).
"""
from __future__ import annotations

import os

import torch

FOLDER = "optimizer"
SHARD_BYTES = 256 * 2**20  # shards written by several threads, each hashed as it is written (as the export's)
FORMAT = "batchrl-adamw-1"
MOMENTS = ("exp_avg", "exp_avg_sq", "step")


def _shard_name(index: int, count: int) -> str:
    return f"state-{index:05d}-of-{count:05d}.safetensors"


def read(checkpoint: str) -> dict[str, torch.Tensor] | None:
    """The state ``save`` wrote into ``checkpoint`` (``<parameter>/<moment>`` -> tensor), or None: it holds none."""
    from safetensors.torch import load_file

    folder = os.path.join(checkpoint, FOLDER)
    names = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors")) if os.path.isdir(folder) else []
    state: dict[str, torch.Tensor] = {}
    for name in names:
        state.update(load_file(os.path.join(folder, name)))
    return state if names else None


def _named_indices(optimizer: torch.optim.Optimizer, module: torch.nn.Module) -> dict[int, str]:
    """The optimiser's parameter index (as its ``state_dict`` numbers them) -> the parameter's name."""
    names = {id(p): name for name, p in module.named_parameters()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    missing = [i for i, p in enumerate(params) if id(p) not in names]
    if missing:
        raise ValueError(f"the optimiser holds {len(missing)} parameters that are not the module's (a wrapped "
                         "optimiser's own copies?): carry_optimizer_state needs the trainer's AdamW over the module")
    return {i: names[id(p)] for i, p in enumerate(params)}


def save(optimizer: torch.optim.Optimizer, module: torch.nn.Module, checkpoint: str) -> int:
    """Write the optimiser's state into ``checkpoint`` (shards of ~``SHARD_BYTES``, copied off the device and hashed
    by a thread pool as the export's shards are); returns the step count it holds (0: never stepped)."""
    from concurrent.futures import ThreadPoolExecutor

    from batchrl.training.trainer.safetensors_writer import write_safetensors

    state = optimizer.state_dict()["state"]
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for index, name in _named_indices(optimizer, module).items():
        for key in MOMENTS if index in state else ():
            value = state[index][key]
            tensor = (value if torch.is_tensor(value) else torch.tensor(float(value))).detach().float()
            if size and size + tensor.numel() * 4 > SHARD_BYTES:
                shards.append({})
                size = 0
            shards[-1][f"{name}/{key}"] = tensor
            size += tensor.numel() * 4
    folder = os.path.join(checkpoint, FOLDER)
    os.makedirs(folder, exist_ok=True)
    with ThreadPoolExecutor(8, thread_name_prefix="optimizer-state") as pool:
        writes = [pool.submit(write_safetensors, shard, os.path.join(folder, _shard_name(i + 1, len(shards))),
                              {"format": FORMAT}) for i, shard in enumerate(shards)]
        for write in writes:
            write.result()
    steps = [int(t) for shard in shards for k, t in shard.items() if k.endswith("/step")]
    return max(steps, default=0)


def load(optimizer: torch.optim.Optimizer, module: torch.nn.Module, checkpoint: str) -> int | None:
    """Take up the state ``save`` wrote into ``checkpoint`` (None: it holds none — a base model, or a checkpoint of
    an update that did not carry its state); returns the step count it resumes from. A state that does not fit the
    module (another parameter set or shape) is an error naming the file and the parameter."""
    saved = read(checkpoint)
    if saved is None:
        return None
    path = os.path.join(checkpoint, FOLDER)
    indices = _named_indices(optimizer, module)
    params = {name: p for name, p in module.named_parameters()}
    kept_names = {key.rsplit("/", 1)[0] for key in saved}
    unknown = sorted(kept_names - set(indices.values()))
    if unknown:
        raise ValueError(f"{path}: optimiser state for {unknown[0]!r} ({len(unknown)} in all), which this model does "
                         "not train (another model or LoRA layout than the checkpoint's update): start a new chain "
                         "or set carry_optimizer_state: false")
    state = {}
    for index, name in indices.items():
        if name not in kept_names:
            continue  # a parameter its update never stepped: AdamW starts it as a new one
        for key in ("exp_avg", "exp_avg_sq"):
            if saved[f"{name}/{key}"].shape != params[name].shape:
                raise ValueError(f"{path}: {name}/{key} has shape {tuple(saved[f'{name}/{key}'].shape)}, the "
                                 f"parameter {tuple(params[name].shape)}")
        state[index] = {key: saved[f"{name}/{key}"] for key in MOMENTS}
    # torch's own load casts each moment to its parameter's device and dtype and places `step` as the kernel wants
    optimizer.load_state_dict({"state": state, "param_groups": optimizer.state_dict()["param_groups"]})
    return max((int(s["step"]) for s in state.values()), default=0)
