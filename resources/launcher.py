"""Trainer launcher: runs a training job as a subprocess through Dagster Pipes.

Locally the job is `python -m batchrl.training.jobs.<job>` (DeepSpeed on CPU with gloo); a training job with
``num_gpus > 1`` runs under torchrun, one rank per GPU. Beyond one host (``resources.scaleout``):
``hostfile`` starts training jobs under the ``deepspeed`` launcher over the hostfile's nodes, and
``backend: k8s`` runs every job in a GPU pod through ``PipesK8sClient``. The job code and its reporting
stay the same everywhere.
"""
from __future__ import annotations

import json
import os
from typing import Any, Literal

import dagster as dg
from dagster_pipes import DagsterPipesError
from pydantic import Field

from batchrl.resources.pipes_messages import DrainingTempFileMessageReader
from batchrl.resources.ray_launch import RayJobs


class TrainerLauncherResource(dg.ConfigurableResource):
    num_gpus: int = Field(0, description="GPUs per job (per pod with backend k8s); > 1: data-parallel under torchrun")
    env: dict[str, str] = Field({}, description="extra environment variables of the jobs")
    hostfile: str | None = Field(None, description="DeepSpeed multi-node: an MPI-style hostfile ('host slots=N' "
                                 "lines, this host first); training jobs run over all its nodes")
    backend: Literal["subprocess", "worker", "k8s", "ray"] = Field(
        "subprocess", description="subprocess: a fresh process per job on this host; worker: one-process jobs "
        "in a long-lived worker that keeps imports, CUDA context and process group between jobs (data-parallel "
        "and multi-node jobs still start their own processes); k8s: each job in a GPU pod through "
        "PipesK8sClient (extra .[k8s]); ray: each job on a Ray cluster through dagster-ray's PipesRayJobClient, "
        "training data-parallel over the cluster's nodes (extra .[ray], resources/ray_launch.py)")
    ray: RayJobs = Field(RayJobs(), description="ray: the cluster, the ranks and where job files travel")
    worker_idle_s: float = Field(600.0, gt=0, description="worker: seconds without a job before it exits")
    gpu_job_slots: int = Field(1, ge=1, description="worker: jobs that may run at once on this host, one-process "
                               "ones each in a warm worker of its own, the others (vLLM rollouts, data-parallel "
                               "training) in their own processes (steps a multiprocess run executes side by side, e.g. "
                               "the DPO branch beside the RL branch, then share the GPU instead of queueing; each "
                               "worker keeps its CUDA context and cached memory); 1 = one at a time")
    k8s_image: str = Field("", description="k8s: the container image with batchrl installed")
    k8s_namespace: str = Field("default", description="k8s: namespace of the job pods")
    k8s_volume_claim: str = Field("batchrl-cache", description="k8s: a ReadWriteMany claim holding the storage "
                                  "cache, mounted at the same path as here (k8s_mount_path)")
    k8s_mount_path: str = Field(".storage/_cache", description="k8s: the storage cache folder (absolute in the pod)")
    k8s_node_selector: dict[str, str] = Field({}, description="k8s: node selector of the GPU pods")

    def run_job(self, context: dg.AssetExecutionContext, job: str, config: dict[str, Any],
                workdir: str, fresh_process: bool = False, worker: str | None = None) -> dg.MaterializeResult:
        """Run ``job`` through Pipes; ``fresh_process`` keeps it out of the warm worker (a job whose
        libraries hold processes or memory beyond its end); ``worker`` (backend worker): in the named worker of
        its own (``detached_worker``), after the jobs handed to it before."""
        config_path = self._config_file(job, config, workdir)
        own: dict[str, float] = {}  # the launcher's numbers beside the job's
        if worker is not None and self.detached_worker():
            from batchrl.resources.job_worker import named_worker_path, run_in_worker

            env = self.job_env()
            invocation = run_in_worker(context, job, config_path, workdir, env, self.worker_idle_s,
                                       named_worker_path(env, worker))
        elif self.backend == "ray":
            from batchrl.resources.ray_launch import run_on_ray

            invocation, own = run_on_ray(context, self.ray, job, config, workdir, self.env)
        elif self.backend == "k8s":
            from batchrl.resources.scaleout import k8s_client

            client, options = k8s_client(self.k8s_namespace)
            invocation = client.run(context=context, **options, **self.pod_request(job, config_path))
        elif self.backend == "worker":
            from batchrl.resources.job_worker import free_slot, run_in_worker

            # every job here holds a GPU job slot, in its warm worker or in processes of its own (vLLM
            # rollouts, data-parallel training): what shares the GPUs at once stays within gpu_job_slots
            env = self.job_env()
            with free_slot(env, self.gpu_job_slots) as slot:
                invocation = run_in_worker(context, job, config_path, workdir, env, self.worker_idle_s, slot) \
                    if self.one_process(job) and not fresh_process \
                    else self._run_in_subprocesses(context, job, config_path, workdir)
        else:
            invocation = self._run_in_subprocesses(context, job, config_path, workdir)
        try:  # every job reports one materialisation with its numbers: without it the step must not publish
            result = invocation.get_materialize_result(implicit_materialization=False)
        except DagsterPipesError as error:
            raise dg.Failure(f"job {job!r} ended without its materialisation report ({error}); its numbers would "
                             f"be missing from the asset's metadata, so nothing is published (work dir {workdir})")
        if not own:
            return result
        return dg.MaterializeResult(asset_key=result.asset_key, metadata={**(result.metadata or {}), **own},
                                    check_results=result.check_results, data_version=result.data_version,
                                    tags=result.tags)

    @staticmethod
    def _config_file(job: str, config: dict[str, Any], workdir: str) -> str:
        config_path = os.path.join(workdir, f"{job}.json")
        with open(config_path, "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
        return config_path

    def detached_worker(self) -> bool:
        """Whether jobs can be handed to a named worker of their own and left running (backend worker)."""
        return self.backend == "worker"

    def ahead_root(self, cache_dir: str) -> str | None:
        """Where an update's job leaves the next iteration's samples it drew ahead, for the next rollouts job to
        take: the storage cache (the warm worker shares this host's disk), the node's own cache under ``ray``
        (``ray_staging.node_cache``: the job that samples ahead and the job that takes the samples run in the
        node's resident job worker, one rank and one rollout replica each), else None: nothing is sampled ahead."""
        from batchrl.common.prefetch_key import FOLDER
        from batchrl.resources import ray_staging

        if self.backend == "worker":
            return os.path.join(cache_dir, FOLDER)
        if self.backend == "ray" and self.ray.resident_worker_idle_s > 0 and self.ray.world_size == 1 \
                and self.ray.rollout_replicas == 1:
            return ray_staging.node_cache(FOLDER)
        return None

    def start_detached(self, job: str, config: dict[str, Any], workdir: str, worker: str) -> int:
        """Hand ``job`` to the named worker ``worker`` and return at once (its pid): it runs while the run goes
        on, without Pipes (its outputs are its files); a later ``run_job(..., worker=worker)`` waits behind it."""
        from batchrl.resources.job_worker import named_worker_path, run_detached

        env = self.job_env()
        return run_detached(job, self._config_file(job, config, workdir), workdir, env, self.worker_idle_s,
                            named_worker_path(env, worker))

    def _run_in_subprocesses(self, context: dg.AssetExecutionContext, job: str, config_path: str,
                             workdir: str) -> dg.PipesClientCompletedInvocation:
        client = dg.PipesSubprocessClient(env=self.job_env(), cwd=workdir,
                                          message_reader=DrainingTempFileMessageReader())
        return client.run(context=context, command=self.command(job, config_path))

    def prestart_worker(self, concurrent: bool = False, named: tuple[str, ...] = ()) -> None:
        """backend worker: start the warm worker ahead of the first job (a run calls this before its first step);
        ``concurrent`` (a run that executes steps side by side): the worker of every GPU job slot; ``named``: those
        named workers too (e.g. the off-policy rollouts')."""
        if self.backend == "worker":
            from batchrl.resources.job_worker import connect_or_start, named_worker_path, prestart

            env = self.job_env()
            prestart(env, self.worker_idle_s, self.gpu_job_slots if concurrent else 1)
            for name in named:
                connect_or_start(named_worker_path(env, name), env, self.worker_idle_s).close()

    def one_process(self, job: str) -> bool:
        """The job runs as one process here (not data-parallel, not over a hostfile)."""
        from batchrl.training.jobs import TRAINING_JOBS

        return job not in TRAINING_JOBS or (self.num_gpus <= 1 and not self.hostfile)

    def command(self, job: str, config_path: str) -> list[str]:
        """This host's command line: one process, torchrun over ``num_gpus``, or DeepSpeed over ``hostfile``."""
        from batchrl.training.jobs import TRAINING_JOBS, job_command

        if self.hostfile and job in TRAINING_JOBS:
            from batchrl.resources.scaleout import multinode_command

            return multinode_command(f"batchrl.training.jobs.{job}", config_path, os.path.abspath(self.hostfile))
        return job_command(job, config_path, num_gpus=self.num_gpus)  # the resource decides, not this process's env

    def pod_request(self, job: str, config_path: str) -> dict[str, Any]:
        """``PipesK8sClient.run`` arguments for ``job``: image, command and GPU pod spec (plain data)."""
        from batchrl.resources.scaleout import gpu_pod_spec, pod_command
        from batchrl.training.jobs import JOBS, TRAINING_JOBS

        if job not in JOBS:
            raise ValueError(f"unknown job {job!r}; expected one of {JOBS}")
        if not self.k8s_image:
            raise ValueError("TrainerLauncherResource backend 'k8s' needs k8s_image")
        gpus = self.num_gpus if job in TRAINING_JOBS else min(self.num_gpus, 1)
        mount = os.path.abspath(self.k8s_mount_path)
        env = {**self.env, "BATCHRL_NUM_GPUS": str(gpus)}
        return {"image": self.k8s_image, "command": pod_command(f"batchrl.training.jobs.{job}", config_path, gpus),
                "base_pod_spec": gpu_pod_spec(self.k8s_image, gpus, self.k8s_volume_claim, mount,
                                              node_selector=self.k8s_node_selector, env=env)}

    def job_env(self) -> dict[str, str]:
        """The children's environment: ours, NVLink multicast off with several GPUs, then ``env``."""
        from batchrl.training.jobs import MULTI_GPU_ENV

        return {**os.environ, **(MULTI_GPU_ENV if self.num_gpus > 1 or self.hostfile else {}), **self.env,
                "BATCHRL_NUM_GPUS": str(self.num_gpus)}
