"""Non-finite numbers in training: counted where the loop skipped them, refused at the export (``TrainLoop``)."""
from __future__ import annotations

import math

import torch


def nonfinite_steps(history: list[dict]) -> int:
    """Optimiser steps skipped for a NaN or inf gradient (where the trainer clips: ``TrainLoop._skip_if_nonfinite``;
    where DeepSpeed steps itself, the export's ``check_finite_weights`` is the guard)."""
    return sum(1 for h in history if h.get("skipped_nonfinite"))


def check_finite_weights(module: torch.nn.Module, history: list[dict]) -> None:
    """Before an export: trained weights that hold a NaN or an inf are never published (one host sync)."""
    params = [p.detach() for p in module.parameters() if p.requires_grad and p.numel()]
    norms = [torch.linalg.vector_norm(p, dtype=torch.float32) for p in params]  # bf16 weights: summed in fp32
    if params and not bool(torch.stack(norms).isfinite().all()):  # a NaN or inf anywhere makes its norm one
        bad = [i + 1 for i, h in enumerate(history) if not math.isfinite(h.get("grad_norm", 0.0))]
        raise FloatingPointError(
            f"the trained weights hold NaN or inf after {len(history)} optimiser steps (gradient norm NaN, inf or "
            f"not measured at steps {bad[:10] or 'none'}); nothing is exported: look at the batch's rewards and "
            "advantages and the loss terms in the step metrics, or lower the learning rate")
