"""KTO on unpaired thumbs: the trainer moves desirable completions up and undesirable ones down against the
cached reference, resumes exactly, and runs as an asset on the shipped feedback logs."""
from __future__ import annotations

import dagster as dg
import numpy as np
import pandas as pd
import pytest

from batchrl.training.trainer.config import KTOConfig
from batchrl.training.trainer.kto import KTO_REFERENCE, train_kto


@pytest.fixture(scope="module")
def feedback(tmp_path_factory):
    path = tmp_path_factory.mktemp("kto") / "feedback.parquet"
    rows = [{"prompt": f"What is {a} + {a}?", "completion": c, "label": up}
            for a in range(1, 9) for c, up in ((str(2 * a), True), (f"{2 * a + 1} I think", False))]
    pd.DataFrame(rows).to_parquet(path)
    return str(path)


def test_kto_separates_desirable_from_undesirable_and_resumes(arith_model, feedback, tmp_path):
    cfg = KTOConfig(epochs=3, micro_batch_size=8, lr=2e-3, beta=0.5)
    full = train_kto(cfg, feedback_parquet=feedback, model_path=arith_model, out_dir=str(tmp_path / "full"))
    curve = full["loss_curve"]
    assert np.isfinite(curve).all() and np.mean(curve[-2:]) < curve[0]
    assert full["final"]["rewards/desirable"] > full["final"]["rewards/undesirable"]
    assert (tmp_path / "full" / KTO_REFERENCE).exists() and full["num_desirable"] == 8
    assert full["desirable_weight"] == 1.0 and full["desirable_share"] == 0.5  # balanced by default: 8 up, 8 down
    train_kto(cfg.model_copy(update={"stop_after_steps": 2}), feedback_parquet=feedback, model_path=arith_model,
              out_dir=str(tmp_path / "cut"))
    resumed = train_kto(cfg, feedback_parquet=feedback, model_path=arith_model, out_dir=str(tmp_path / "cut"))
    assert resumed["resumed_from_step"] == 2
    np.testing.assert_allclose(resumed["loss_curve"], curve, atol=1e-6)


def test_unset_desirable_weight_balances_few_thumbs_up(arith_model, tmp_path):
    rows = [{"prompt": f"{a} + {a}", "completion": str(2 * a + (a % 4 != 0)), "label": a % 4 == 0} for a in range(1, 9)]
    pd.DataFrame(rows).to_parquet(tmp_path / "f.parquet")
    result = train_kto(KTOConfig(epochs=1, micro_batch_size=8), feedback_parquet=str(tmp_path / "f.parquet"),
                       model_path=arith_model, out_dir=str(tmp_path / "out"))
    assert result["desirable_weight"] == 3.0 and result["desirable_share"] == 0.5  # 2 up, 6 down


def test_max_rows_trains_on_a_seeded_sample_and_needs_two_rows(arith_model, feedback, tmp_path):
    """The smoke-size cap (profiles/real.yaml): a seeded sample of the rows, the same on every call."""
    from pydantic import ValidationError

    from batchrl.training.trainer.kto import load_feedback

    cfg = KTOConfig(epochs=1, micro_batch_size=4, max_rows=8)
    sample = load_feedback(feedback, cfg)
    assert len(sample) == 8 and sample.equals(load_feedback(feedback, cfg))
    assert set(sample["completion"]) < set(pd.read_parquet(feedback)["completion"])
    result = train_kto(cfg, feedback_parquet=feedback, model_path=arith_model, out_dir=str(tmp_path / "out"))
    assert result["num_examples"] == 8 and result["global_step"] == 2
    with pytest.raises(ValidationError, match="max_rows"):  # the reference point pairs a row with another
        KTOConfig(max_rows=1)


def test_kto_checkpoint_through_dagster_on_the_shipped_feedback_logs(tmp_path, upstream_copy):
    from pipeline_helpers import latest_metadata, local_resources, run_assets

    root, home = upstream_copy(tmp_path)  # the session's data stages and tiny base model, copied
    ops = {"kto_checkpoint": {"config": {"epochs": 1}}}
    with dg.DagsterInstance.local_temp(home) as instance:
        result = run_assets(local_resources(root), instance, ["feedback_logs", "kto_checkpoint"], {"ops": ops})
        assert result.success
        meta = latest_metadata(instance, "kto_checkpoint")
        assert meta["num_examples"] == latest_metadata(instance, "feedback_logs")["valid"] and meta["num_desirable"] > 0
        # the per-step curves in the UI: a PNG chart (the KL and both reward terms among its series) above the table
        chart, table = meta["curves"].split("\n\n", 1)
        assert chart.startswith("![per-step curves](data:image/png;base64,")
        header = table.splitlines()[0]
        assert all(f" {name} |" in header for name in ("loss", "kl", "rewards/desirable", "rewards/undesirable"))
        assert table.splitlines()[-1].startswith(f"| {meta['global_step']} |")  # the last step is a row
