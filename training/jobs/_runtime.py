"""Shared job plumbing: argv -> config, Pipes (or stdout JSON) reporting, rank-0-only output."""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from typing import Any, Callable, Iterator

from batchrl.common.environment_variables import read


MAX_CURVE_POINTS = 500
STEPS_FILE = "steps.jsonl"  # in a training job's out_dir: each step's metrics as reported, one JSON line per step


def read_job_config(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser()
    parser.add_argument("config", nargs="?", help="path of the job's JSON config")
    parser.add_argument("--config", dest="config_flag")
    parser.add_argument("--local_rank", type=int, default=None)  # set by the deepspeed launcher
    args, _ = parser.parse_known_args(argv)
    path = args.config_flag or args.config
    if not path:
        parser.error("a JSON config path is required")
    with open(path) as f:
        return json.load(f)


def is_rank0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def _scalar(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def metadata_from(result: dict[str, Any]) -> dict[str, Any]:
    """Flat JSON-able metadata: scalars as they are, ``final`` metrics prefixed, lists kept."""
    meta: dict[str, Any] = {}
    for k, v in result.items():
        if isinstance(v, dict):
            meta.update({f"{k}/{kk}": _scalar(vv) for kk, vv in v.items() if isinstance(vv, (int, float, str, bool))})
        elif isinstance(v, (int, float, str, bool)) or v is None:
            meta[k] = _scalar(v) if v is not None else "none"
        elif isinstance(v, list):  # curves: at most MAX_CURVE_POINTS evenly spaced points
            stride = max(1, -(-len(v) // MAX_CURVE_POINTS))
            meta[k] = [_scalar(x) for x in v[::stride]]
    return meta


def tree_hash(root: str) -> str:
    """Content hash of the output folder (relative names + bytes), streamed file by file."""
    from batchrl.common.fsutil import filesystem_for, sha256_tree

    fs, path = filesystem_for(root)
    return sha256_tree(fs, path)


class Reporter:
    """Logs per-step metrics and the final materialisation to Pipes, or JSON lines on stdout. ``steps_file``: each
    step's line is also appended there (a training job's ``out_dir``): the asset draws its curves from it, and a
    resumed or already completed run in the same folder still has the steps of the runs before it."""

    def __init__(self, pipes: Any | None, steps_file: str | None = None):
        self.pipes = pipes
        self.steps_file = steps_file

    def log(self, message: str) -> None:
        if not is_rank0():
            return
        if self.pipes is not None:
            self.pipes.log.info(message)
        else:
            print(json.dumps({"log": message}), flush=True)

    def step(self, metrics: dict, step: int) -> None:
        if not is_rank0():
            return
        line = json.dumps({"step": step, **{k: _scalar(v) for k, v in metrics.items()}})
        if self.steps_file:
            with open(self.steps_file, "a") as f:
                f.write(line + "\n")
        if self.pipes is not None:
            self.pipes.log.info(line)
        else:
            print(line, flush=True)

    def materialize(self, metadata: dict[str, Any], data_version: str | None) -> None:
        if not is_rank0():
            return
        if self.pipes is not None:
            self.pipes.report_asset_materialization(metadata=metadata, data_version=data_version)
        else:
            print(json.dumps({"materialization": metadata, "data_version": data_version}, default=str), flush=True)


@contextlib.contextmanager
def reporter() -> Iterator[Reporter]:
    from dagster_pipes import PipesEnvVarParamsLoader, open_dagster_pipes

    # one Pipes writer per job: under a multi-GPU launcher only rank 0 reports
    if is_rank0() and PipesEnvVarParamsLoader().is_dagster_pipes_process():
        with open_dagster_pipes() as pipes:
            yield Reporter(pipes)
    else:
        yield Reporter(None)


def choose_attention_kernels() -> None:
    """cuDNN attention off for this job unless ``BATCHRL_CUDNN_ATTENTION=1``. On Hopper torch tries cuDNN first
    for masked ``scaled_dot_product_attention``, and cuDNN builds an execution plan for every batch shape it
    has not seen (H200, 0.5B shape, 8 new shapes: forward 1.49 s vs 0.30 s, train steps 3.72 s vs 1.05 s;
    bench/bench_sdpa_shapes.py). The jobs' right-padded, length-sorted batches change shape batch by batch, so
    masked batches run the memory-efficient kernel instead. Set per job (the warm worker runs jobs of several
    settings), not per process."""
    import torch

    torch.backends.cuda.enable_cudnn_sdp(read("BATCHRL_CUDNN_ATTENTION"))


@contextlib.contextmanager
def _settling_sampling_ahead() -> Iterator[Callable[[str | None], dict]]:
    """``settle(content_hash)`` for a sampling ahead this job started (``training/rollout/ahead.py``); a job that
    fails before it hashed its output drops those samples."""
    def settle(version: str | None) -> dict:
        ahead = sys.modules.get("batchrl.training.rollout.ahead")  # imported by a job that samples ahead
        return ahead.settle(version) if ahead is not None else {}
    try:
        yield settle
    finally:
        settle(None)  # after a settle with the version: nothing left to drop


def _gpu_cuda():
    """``torch.cuda`` where this process already uses a GPU, else None (a CPU job never initialises CUDA for this)."""
    torch = sys.modules.get("torch")
    return torch.cuda if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized() else None


def gpu_memory(cuda) -> dict[str, float]:
    """This process's peak GPU memory since the last reset (PyTorch's allocator: what the job's own tensors took, and
    what the allocator held) and the device's free memory now (every process on it): the headroom a larger weight
    cache or batch would have to fit in. Empty without ``cuda``."""
    if cuda is None:
        return {}
    free, total = cuda.mem_get_info()
    return {"gpu_peak_allocated_gb": round(cuda.max_memory_allocated() / 1e9, 2),
            "gpu_peak_reserved_gb": round(cuda.max_memory_reserved() / 1e9, 2),
            "gpu_free_gb_after": round(free / 1e9, 2), "gpu_total_gb": round(total / 1e9, 1)}


def run_job(work: Callable[[dict, Reporter], tuple[dict, str | None]], argv: list[str] | None = None) -> int:
    """Read the config, run ``work(config, reporter) -> (result, output_dir)``, report materialisation
    with ``data_version`` = content hash of ``output_dir`` and the job's ``weight_cache_hits``/``_misses``
    (its model loads built from the job worker's weight cache / read from their files while the cache was on;
    both 0 where it is off) and, on a GPU, its peak memory (``gpu_memory``: from this job's start in a warm worker,
    and for the worker's first job from the process's start)."""
    from batchrl.training.timing import profiling
    from batchrl.training.models import resident_weights
    from batchrl.training.models import weight_cache
    from batchrl.training.trainer import resident_trainer

    config = read_job_config(argv if argv is not None else sys.argv[1:])
    choose_attention_kernels()
    before = weight_cache.stats()
    if (cuda := _gpu_cuda()) is not None:  # a warm worker's earlier jobs: not this one's peak
        cuda.reset_peak_memory_stats()
    with reporter() as rep, _settling_sampling_ahead() as settle_ahead:
        if config.get("out_dir"):
            os.makedirs(config["out_dir"], exist_ok=True)
            rep.steps_file = os.path.join(config["out_dir"], STEPS_FILE)
        source = getattr(sys.modules.get(work.__module__), "__file__", None) or work.__module__
        job_name = "-".join(filter(None, (os.path.splitext(os.path.basename(source))[0], config.get("task"))))
        with profiling.profiled(job_name):  # BATCHRL_PROFILE_JOBS: where this job left the GPU idle
            result, output = work(config, rep)
        meta = metadata_from(result)
        after = weight_cache.stats()  # models this job built from the warm worker's cached weights, or loaded
        meta.update({f"weight_cache_{k}": after[k] - before[k] for k in ("hits", "misses")})
        meta.update(gpu_memory(_gpu_cuda()))
        started = time.perf_counter()
        version = tree_hash(output) if output and os.path.exists(output) and is_rank0() else None
        if version:
            meta.update(content_hash=version, hash_s=round(time.perf_counter() - started, 3))
            record = read("BATCHRL_OUTPUT_RECORD")  # for whoever ran the job (a Ray rank: resources/ray_rank.py)
            if record:
                with open(record, "w") as f:
                    json.dump({"content_hash": version, "dir": os.path.abspath(output)}, f)
        # the trainer's exported weights stay in the worker under the content they are published as
        meta["resident_weights"] = resident_weights.settle(output, version)
        resident_trainer.settle(output, version)  # the kept policy trainer stands for this artifact
        meta.update(settle_ahead(version))  # the next iteration's samples, drawn meanwhile, named by this version
        rep.materialize(meta, version)
    _close_process_group()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        _exit_rank()
    return 0


def _exit_rank() -> None:
    """A torchrun rank ends here, its work reported and its process group torn down, without the interpreter's
    teardown: a C++ thread of the distributed stack still joinable at exit aborts the rank ("terminate called
    without an active exception", SIGABRT: seen on the 2-core CI box under load for a ZeRO-3 job whose model
    was already written), which fails the whole job."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _close_process_group() -> None:
    """Under torchrun: every rank waits for the others, then the process group is torn down in order (a rank
    that just exits while its peer still finishes can abort in gloo's teardown: seen on a loaded CPU box)."""
    torch = sys.modules.get("torch")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and torch is not None and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
