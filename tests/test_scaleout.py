"""Scale-out as plain data (< 1 s): the GPU pod spec and command the launcher hands to PipesK8sClient, and the
DeepSpeed multi-node command over a hostfile. No cluster here: dagster-k8s (the optional extra `.[k8s]`) runs
them; what it is given is what is tested."""
import os
import shlex

import pytest

from batchrl.resources import TrainerLauncherResource
from batchrl.resources.scaleout import gpu_pod_spec, read_hostfile


def test_k8s_backend_builds_a_gpu_pod_with_torchrun_and_the_shared_cache(tmp_path):
    launcher = TrainerLauncherResource(backend="k8s", num_gpus=4, k8s_image="registry.local/batchrl:1",
                                       k8s_mount_path=str(tmp_path / "cache"), k8s_node_selector={"gpu": "h200"},
                                       env={"HF_HUB_OFFLINE": "1"})
    config = str(tmp_path / "cache" / "_work" / "policy_checkpoint" / "abc" / "train_policy.json")
    request = launcher.pod_request("train_policy", config)
    assert request["image"] == "registry.local/batchrl:1"
    assert request["command"] == ["python", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
                                  "-m", "batchrl.training.jobs.train_policy", config]
    spec = request["base_pod_spec"]
    container = spec["containers"][0]
    assert container["resources"] == {"limits": {"nvidia.com/gpu": "4"}}
    assert {"name": "BATCHRL_NUM_GPUS", "value": "4"} in container["env"]
    assert {"name": "HF_HUB_OFFLINE", "value": "1"} in container["env"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["batchrl-cache"] == str(tmp_path / "cache") and config.startswith(mounts["batchrl-cache"])
    assert mounts["dshm"] == "/dev/shm"  # NCCL needs more shared memory than a pod's default 64 MiB
    claims = {v["name"]: v for v in spec["volumes"]}
    assert claims["batchrl-cache"]["persistentVolumeClaim"] == {"claimName": "batchrl-cache"}
    assert spec["nodeSelector"] == {"gpu": "h200"} and spec["restartPolicy"] == "Never"
    # an inference job takes one GPU of the pod, without torchrun
    inference = launcher.pod_request("inference", config)
    assert inference["command"][:3] == ["python", "-m", "batchrl.training.jobs.inference"]
    assert inference["base_pod_spec"]["containers"][0]["resources"] == {"limits": {"nvidia.com/gpu": "1"}}


def test_k8s_backend_needs_an_image_and_a_known_job():
    with pytest.raises(ValueError, match="k8s_image"):
        TrainerLauncherResource(backend="k8s").pod_request("train_dpo", "/x.json")
    with pytest.raises(ValueError, match="unknown job"):
        TrainerLauncherResource(backend="k8s", k8s_image="i").pod_request("rm_rf", "/x.json")


def test_a_cpu_pod_has_no_gpu_limit():
    spec = gpu_pod_spec("img", 0, "claim", "/cache")
    assert spec["containers"][0]["resources"] == {} and spec["tolerations"] == []


def test_hostfile_training_jobs_run_under_the_deepspeed_launcher_with_the_pipes_env(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# two nodes\nnode-a slots=8\n\nnode-b slots=8  # second\n")
    assert read_hostfile(str(hostfile)) == [("node-a", 8), ("node-b", 8)]
    launcher = TrainerLauncherResource(num_gpus=8, hostfile=str(hostfile))
    shell, flag, script = launcher.command("train_dpo", "/w/train_dpo.json")
    assert (shell, flag) == ("sh", "-c")
    export, launch = script.split(" && exec ")
    assert export.startswith("env | grep -E '^(DAGSTER_PIPES_|BATCHRL_|") and export.endswith("> .deepspeed_env")
    assert shlex.split(launch) == ["deepspeed", "--hostfile", str(hostfile), "--num_nodes", "2", "--master_addr",
                                   "node-a", "--master_port", "29500", "--module", "batchrl.training.jobs.train_dpo",
                                   "/w/train_dpo.json"]
    assert launcher.job_env()["NCCL_NVLS_ENABLE"] == "0"
    # jobs that are not data-parallel stay one process on this host
    assert launcher.command("inference", "/w/i.json")[1:] == ["-m", "batchrl.training.jobs.inference", "/w/i.json"]


def test_a_bad_hostfile_line_is_named(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=8\nnode-b 8\n")
    with pytest.raises(ValueError, match=f"{os.path.basename(hostfile)}:2"):
        read_hostfile(str(hostfile))
