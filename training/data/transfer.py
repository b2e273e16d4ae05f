"""Host-to-device copies without a host sync (shared by the trainer, the reward model and inference)."""
from __future__ import annotations

from typing import Any

import torch


def to_device_async(tensor: torch.Tensor, device: Any) -> torch.Tensor:
    """``tensor`` on ``device``; to a GPU through pinned memory and a non-blocking copy (a plain copy from
    pageable memory waits for the GPU to drain, idling it while the next step is launched)."""
    if torch.device(device).type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)
