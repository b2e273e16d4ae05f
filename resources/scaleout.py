"""Where trainer jobs run beyond one host, as plain data the launcher hands to Dagster Pipes.

- **Kubernetes** (``TrainerLauncherResource.backend: k8s``): every job runs in a GPU pod started by
  ``dagster_k8s.PipesK8sClient`` (the optional extra ``.[k8s]``, dagster-k8s 0.29.27 = dagster 1.13.27),
  which streams the pod's Pipes messages back from its logs. :func:`gpu_pod_spec` builds the pod spec: the
  image, ``nvidia.com/gpu`` limits, shared memory for NCCL, and the volume holding the storage cache (work
  folders, localised artifacts) mounted at the *same path* as in the Dagster process, so the job config's
  paths hold in the pod (a ReadWriteMany claim).
- **DeepSpeed multi-node** (``hostfile``): a training job starts under the ``deepspeed`` launcher over the
  hosts of an MPI-style hostfile (``host slots=N`` lines); the launching host is rank 0 and reports through
  Pipes; the Pipes and batchrl variables reach the other ranks through DeepSpeed's ``.deepspeed_env`` file.
"""
from __future__ import annotations

import shlex
from typing import Any

EXPORTED_ENV_PREFIXES = ("DAGSTER_PIPES_", "BATCHRL_", "NCCL_", "TORCH_SYMM_MEM_")


def read_hostfile(path: str) -> list[tuple[str, int]]:
    """``[(host, slots)]`` of an MPI-style hostfile (comments and blank lines skipped); ValueError names the line."""
    hosts = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            text = line.split("#", 1)[0].strip()
            if not text:
                continue
            host, *rest = text.split()
            slots = [r.split("=", 1)[1] for r in rest if r.startswith("slots=")]
            if len(rest) != 1 or not slots or not slots[0].isdigit() or int(slots[0]) < 1:
                raise ValueError(f"{path}:{number}: expected 'host slots=N', got {text!r}")
            hosts.append((host, int(slots[0])))
    if not hosts:
        raise ValueError(f"{path}: no hosts")
    return hosts


def multinode_command(module: str, config_path: str, hostfile: str, master_port: int = 29500) -> list[str]:
    """The ``deepspeed`` launcher over every host and slot of ``hostfile``, running ``python -m module config``.

    The launcher exports only a few variable prefixes to the other nodes; the rest come from the
    ``.deepspeed_env`` file in its working folder, written here from the job's environment first (Dagster
    Pipes sets its variables when it starts the command, so the file is written by the command itself)."""
    hosts = read_hostfile(hostfile)
    launch = ["deepspeed", "--hostfile", hostfile, "--num_nodes", str(len(hosts)), "--master_addr", hosts[0][0],
              "--master_port", str(master_port), "--module", module, config_path]
    pattern = "^(" + "|".join(EXPORTED_ENV_PREFIXES) + ")"
    return ["sh", "-c", f"env | grep -E '{pattern}' > .deepspeed_env && exec {shlex.join(launch)}"]


def pod_command(module: str, config_path: str, num_gpus: int) -> list[str]:
    """The container's command: one process, or torchrun with one rank per GPU of the pod."""
    if num_gpus > 1:
        return ["python", "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={num_gpus}",
                "-m", module, config_path]
    return ["python", "-m", module, config_path]


def gpu_pod_spec(image: str, num_gpus: int, volume_claim: str, mount_path: str, *,
                 node_selector: dict[str, str] | None = None, shm_gib: int = 16,
                 env: dict[str, str] | None = None) -> dict[str, Any]:
    """The ``base_pod_spec`` of ``PipesK8sClient.run`` for one trainer job (Kubernetes API field names)."""
    resources = {"limits": {"nvidia.com/gpu": str(num_gpus)}} if num_gpus > 0 else {}
    return {
        "restartPolicy": "Never",
        "nodeSelector": dict(node_selector or {}),
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}] if num_gpus else [],
        "containers": [{
            "name": "batchrl-job", "image": image, "workingDir": mount_path, "resources": resources,
            "env": [{"name": k, "value": v} for k, v in sorted((env or {}).items())],
            "volumeMounts": [{"name": "batchrl-cache", "mountPath": mount_path},
                             {"name": "dshm", "mountPath": "/dev/shm"}],
        }],
        "volumes": [{"name": "batchrl-cache", "persistentVolumeClaim": {"claimName": volume_claim}},
                    {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{shm_gib}Gi"}}],
    }


def k8s_client(namespace: str):
    """``PipesK8sClient`` (import deferred: dagster-k8s is the optional extra ``.[k8s]``)."""
    try:
        from dagster_k8s import PipesK8sClient
    except ImportError as error:
        raise RuntimeError("TrainerLauncherResource backend 'k8s' needs dagster-k8s: pip install -e '.[k8s]'") from error
    return PipesK8sClient(), {"namespace": namespace}
