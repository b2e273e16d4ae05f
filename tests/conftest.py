"""Shared fixtures. ``s3_server``: a real S3 API (moto server) on 127.0.0.1 for the whole session.

Use it with ``storage_options={"client_kwargs": {"endpoint_url": s3_server}}`` (no region_name there:
moto's bucket creation fails with it; the region comes from AWS_DEFAULT_REGION, set here).
"""
from __future__ import annotations

import os
import signal
import socket

import pytest


def _share_the_cores_between_workers() -> None:
    """Under xdist each worker (and every job it launches: Pipes subprocesses, torchrun ranks, `batchrl run`)
    gets cores / workers intra-op threads, not torch's default of every core: on the 2-core CI box two
    workers of 2 threads each oversubscribe the cores and the tiny models' short ops wait in thread barriers
    (two trainer-job tests side by side, dev box: 48 s / 75 s at 2 threads each, 38 s / 61 s at 1). Both
    variables: torch takes its thread count from MKL_NUM_THREADS when set. A value already in the environment
    wins. Set before torch is imported (this module is imported before any test module), inherited by the
    subprocesses."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    if workers < 2:
        return
    threads = str(max(1, len(os.sched_getaffinity(0)) // workers))
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, threads)


_share_the_cores_between_workers()


# Seconds per module (junit, setup included) in a full CI run from a clean clone with -n 2 on the idle 2-core dev box
# (2026-12-04, 868 s of pytest; test_real_profile as measured alone after its jobs moved into a warm worker): the
# heaviest go first. Under loadscope a module runs whole on one worker, and xdist's own order (most tests first)
# started test_real_profile (then ~600 s) last: ~10 min alone at the end.
MODULE_SECONDS = {
    "test_pipeline_e2e.py": 270, "test_rl_choices.py": 140, "test_real_profile.py": 130, "test_job_worker.py": 90,
    "test_ui.py": 30, "test_trainer_jobs_global_batch.py": 70, "test_trainer_jobs_data_parallel.py": 60,
    "test_loop_kill.py": 80, "test_faults_pipeline.py": 60, "test_faults_rl.py": 45, "test_warm_server.py": 40,
    "test_trainer_jobs.py": 40, "test_ui_browser.py": 35, "test_copied_root.py": 40, "test_tracking.py": 35,
    "test_resident_loop.py": 55, "test_lora_graph.py": 35, "test_mixed_sources.py": 30, "test_rl_metadata.py": 25,
    "test_pipeline_data.py": 25, "test_lineage_audit.py": 20, "test_sandbox.py": 20, "test_lora.py": 20,
    "test_agent_graph.py": 20, "test_off_policy.py": 55, "test_packing.py": 10,
    "test_sample_ahead.py": 30, "test_dg_cli.py": 70, "test_sandbox_escape.py": 35, "test_sandbox_session.py": 20,
    "test_ray_cluster.py": 150,  # alone on the dev box, 2026-12-05: a two-node Ray cluster (issue 49)
    "test_worker_stream.py": 15,
    "test_retention_loop.py": 35,  # alone on the dev box, 2026-12-06: three RL iterations through `batchrl run`
}


def pytest_configure(config) -> None:
    """SIGINT's default back where the suite was started as a shell's background job (`cmd &` leaves SIGINT
    ignored, and every child inherits that): `dagster dev` gives SIGTERM SIGINT's disposition, so a server
    started by a test ignored its stop and was killed 30 s later, and children stopped with SIGINT would not stop.
    Set in each process (xdist's workers too); the children of a Python handler start with the default."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(items) -> None:
    """Heaviest modules first (a stable sort: the rest keep their order); `--no-loadscope-reorder` in pyproject
    makes xdist hand modules out in this order."""
    items.sort(key=lambda item: -MODULE_SECONDS.get(item.path.name, 0))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(autouse=True)
def _announced_run_file_resources_undone():
    """`batchrl run` in a test's own process announces its resource overrides (its -c files', the embedded
    default's rl_recipe) in os.environ for the code location it builds: put back after each test, so that no
    test's overrides reach the next one's resources."""
    name = "BATCHRL_CONFIG_RESOURCES"
    before = os.environ.get(name)
    yield
    if before is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = before


@pytest.fixture(scope="session")
def s3_server():
    from moto.server import ThreadedMotoServer

    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_SESSION_TOKEN": "testing",
           "AWS_DEFAULT_REGION": "us-east-1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def s3_options(s3_server):
    """storage_options for s3fs against the session's moto server (fresh instance cache per test)."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    return {"client_kwargs": {"endpoint_url": s3_server}}


@pytest.fixture(scope="session")
def arith_model(tmp_path_factory) -> str:
    """The tiny default model trained on the arithmetic texts, built once per session (read-only)."""
    from arith_pairs import build_arith_model

    return build_arith_model(tmp_path_factory.mktemp("arith_model") / "model")


@pytest.fixture(scope="session")
def arith_job_inputs(tmp_path_factory) -> dict:
    """The small tiny model (hidden 64) and 32 arithmetic pairs (rejected = gold + 2) that the trainer-job and
    job-worker tests train on, built once per session (read-only): model_path, pairs_parquet, root."""
    from arith_pairs import build_arith_pairs

    root = tmp_path_factory.mktemp("arith_jobs")
    return {**build_arith_pairs(root, rejected_offset=2), "root": root}


@pytest.fixture(scope="session")
def _upstream_template(tmp_path_factory) -> tuple[str, str]:
    """The assets an RL iteration needs first (``pipeline_helpers.UPSTREAM``, the base model at
    ``TINY_BASE``) materialised once per test process: (storage root, Dagster home), never written to."""
    import dagster as dg
    from pipeline_helpers import TINY_BASE, UPSTREAM, local_resources, run_assets

    folder = tmp_path_factory.mktemp("upstream")
    root, home = folder / "storage", folder / "home"
    home.mkdir()
    with dg.DagsterInstance.local_temp(str(home)) as instance:
        assert run_assets(local_resources(str(root)), instance, UPSTREAM, TINY_BASE).success
    return str(root), str(home)


def _copy_upstream(template: tuple[str, str], folder) -> tuple[str, str]:
    import shutil

    root, home = os.path.join(folder, "storage"), os.path.join(folder, "home")
    shutil.copytree(template[0], root)
    shutil.copytree(template[1], home)
    return root, home


@pytest.fixture
def upstream_copy(_upstream_template):
    """``copy(folder) -> (root, home)``: a storage root and Dagster home of their own holding the upstream assets
    (copies of the session's: a copied root with its home is a root of its own), for RL iterations on top."""
    return lambda folder: _copy_upstream(_upstream_template, folder)


@pytest.fixture(scope="module")
def module_upstream(_upstream_template, tmp_path_factory) -> tuple[str, str]:
    """(root, home): a copy of the session's upstream assets for a module's own fixture to build on (the data
    stages and the tiny base model are not trained again per module). The copied home's materialisations name
    the template's folders (``uri``): a test comparing a path in the copy with one must build its own upstream."""
    return _copy_upstream(_upstream_template, tmp_path_factory.mktemp("upstream_copy"))
