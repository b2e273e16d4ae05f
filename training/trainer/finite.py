"""Non-finite numbers in training: counted where the loop skipped them, refused at the export (``TrainLoop``)."""
from __future__ import annotations

import math

import torch


def nonfinite_steps(history: list[dict]) -> int:
    """Optimiser steps whose gradient norm was NaN or inf (skipped where the trainer clips: ``_skip_if_nonfinite``)."""
    return sum(1 for h in history if not math.isfinite(h.get("grad_norm", 0.0)) or h.get("skipped_nonfinite"))


def check_finite_weights(module: torch.nn.Module, history: list[dict]) -> None:
    """Before an export: trained weights that hold a NaN or an inf are never published (one host sync)."""
    params = [p.detach() for p in module.parameters() if p.requires_grad and p.numel()]
    if params and not bool(torch.stack(torch._foreach_norm(params)).isfinite().all()):
        bad = [i + 1 for i, h in enumerate(history) if not math.isfinite(h.get("grad_norm", 0.0))]
        raise FloatingPointError(
            f"the trained weights hold NaN or inf after {len(history)} optimiser steps (gradient norm not finite at "
            f"steps {bad[:10] or 'none recorded'}); nothing is exported: look at the batch's rewards and advantages "
            "and the loss terms in the step metrics, or lower the learning rate")
