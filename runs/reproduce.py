"""`batchrl reproduce`: re-materialise an artifact and everything it came from, from its lineage alone.

Each artifact in the lineage of the target is materialised again, inputs first, into a fresh storage
root: with the run config and resource configs its ``lineage.json`` recorded (seeds are part of the
run config), by today's code, and with its upstream inputs pinned to the reproduced versions of the
recorded ones (an IO manager hands each step exactly those, so several versions of one asset in a
chain, e.g. RL iterations, each get their own). Every artifact's new data version is compared with
the recorded one; the first that differs is named with what differs in its lineage (code version,
config, input files, packages, ...).
"""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any

import dagster as dg

from batchrl.assets.policy_chain import PROMOTED
from batchrl.common.storage_layout import cache_dir_of, catalog_path_of, input_uri
from batchrl.lineage.audit import read_lineage
from batchrl.resources.storage import ArtifactRef

# lineage fields compared when a data version differs (environment: what explains a numeric drift)
COMPARED = ("code_version", "run_config", "config", "seed", "resources")


class ReproduceError(RuntimeError):
    """The target cannot be re-run from its lineage (e.g. published before lineage held run config)."""


@dataclass
class Node:
    asset: str
    data_version: str
    uri: str
    lineage: dict[str, Any]
    inputs: dict[str, tuple[str, str]] = field(default_factory=dict)  # input name -> (asset, data version)


def lineage_graph(uri: str, storage_options: dict | None = None) -> list[Node]:
    """Every artifact the one at ``uri`` came from (itself last), inputs before the artifacts using them."""
    order: list[Node] = []
    seen: dict[tuple[str, str], Node] = {}

    def visit(artifact_uri: str) -> tuple[str, str]:
        lineage = read_lineage(artifact_uri, storage_options)
        key = (lineage["asset"], lineage["data_version"])
        if key in seen:
            return key
        node = Node(lineage["asset"], lineage["data_version"], artifact_uri, lineage)
        seen[key] = node
        for name, ref in sorted(lineage.get("inputs", {}).items()):
            node.inputs[name] = visit(input_uri(ref, artifact_uri))
        order.append(node)
        return key

    visit(uri.rstrip("/"))
    return order


def _nearest(nodes: dict[tuple[str, str], Node], start: Node, asset: str) -> tuple[str, str] | None:
    """The closest ancestor of ``start`` materialised as ``asset`` (breadth first over recorded inputs).
    An asset may read an upstream it does not name as an input (policy_checkpoint reads rollouts for
    the policy they came from): the nearest one in its lineage is the one it read."""
    frontier, seen = [start], set()
    while frontier:
        following = []
        for node in frontier:
            for key in node.inputs.values():
                if key[0] == asset:
                    return key
                if key not in seen:
                    seen.add(key)
                    following.append(nodes[key])
        frontier = following
    return None


class PinnedInputs(dg.IOManager):
    """Hands each step the artifacts it is told to (the reproduced versions of its recorded inputs), made
    local with their lineage like ``ArtifactIOManager`` does."""

    def __init__(self, storage) -> None:
        self.storage = storage
        self.pinned: dict[str, dict | None] = {}
        self.outputs: dict[str, dict] = {}

    def handle_output(self, context: dg.OutputContext, obj: dict) -> None:
        self.outputs[context.asset_key.to_user_string()] = obj

    def load_input(self, context: dg.InputContext):
        from batchrl.resources.artifacts import OPTIONAL_KEY, load_artifacts

        asset = context.asset_key.to_user_string()
        if (asset, "partitions") in self.pinned:  # the training window: {drop: ref} of the recorded drops
            drops = self.pinned[(asset, "partitions")]
            return load_artifacts(context, self.storage, lambda partition: ArtifactRef(**drops[partition]))
        if asset in self.outputs:  # an asset check reading the asset of its own run
            ref = self.outputs[asset]
        elif asset in self.pinned:
            ref = self.pinned[asset]
        elif (context.definition_metadata or {}).get(OPTIONAL_KEY):
            return None  # an optional input the recorded step did not use (e.g. a reward model at weight 0)
        else:
            raise ReproduceError(f"no recorded version of input {asset} for step {context.op_def.name}")
        return load_artifacts(context, self.storage, lambda partition: ref and ArtifactRef(**ref))


def _storage(root: str):
    from batchrl.resources import StorageResource

    return StorageResource(root=root, cache_dir=cache_dir_of(root))


def _resources(root: str, recorded: dict[str, dict], io_manager: PinnedInputs) -> dict:
    from batchrl.resources import (
        CatalogResource, ComputeResource, LandingResource, RolloutEngineResource, TrainerLauncherResource,
    )
    from batchrl.resources.rl_recipe import RLRecipe

    classes = {"landing": LandingResource, "rollout_engine": RolloutEngineResource,
               "trainer": TrainerLauncherResource, "compute": ComputeResource, "rl_recipe": RLRecipe}
    resources = {key: cls(**{k: v for k, v in recorded.get(key, {}).items() if v != "<redacted>"})
                 for key, cls in classes.items()}
    return {**resources, "storage": io_manager.storage,
            "catalog": CatalogResource(path=catalog_path_of(root)), "io_manager": io_manager}


def _execute(defs: dg.Definitions, instance: dg.DagsterInstance, node: Node, run_config: dict,
             partition: str | None, drops: dict[str, dict]) -> dg.ExecuteInProcessResult:
    """One asset again: a log drop's step for its recorded partition; the window over the recorded drops
    (registered in the order it read them); anything else as ``batchrl run`` does."""
    from batchrl.assets.drops import LOG_DROPS
    from batchrl.runs.execute import execute_assets, selected_job

    order = node.lineage.get("config", {}).get("drops") or sorted(drops)
    if partition is not None or order and drops:
        instance.add_dynamic_partitions(LOG_DROPS.name, [partition] if partition is not None else order)
    if partition is None:
        return execute_assets(defs, instance, [node.asset], run_config)
    step = defs.resolve_asset_graph().get(dg.AssetKey(node.asset)).execution_set_asset_keys
    return selected_job(defs, [k.to_user_string() for k in step]).execute_in_process(
        instance=instance, run_config=run_config, partition_key=partition, raise_on_error=False)


def lineage_differences(recorded: dict, reproduced: dict) -> list[str]:
    """What differs between two lineage records of one asset (inputs by data version, files by hash)."""
    out = []
    for key in COMPARED:
        if recorded.get(key) != reproduced.get(key):
            out.append(f"{key}: {json.dumps(recorded.get(key), sort_keys=True, default=str)[:300]} -> "
                       f"{json.dumps(reproduced.get(key), sort_keys=True, default=str)[:300]}")
    before = {n: r["data_version"] for n, r in recorded.get("inputs", {}).items()}
    after = {n: r["data_version"] for n, r in reproduced.get("inputs", {}).items()}
    out += [f"input {n}: {before.get(n)} -> {after.get(n)}" for n in sorted(set(before) | set(after))
            if before.get(n) != after.get(n)]
    files = lambda lin: {f["uri"]: f.get("sha256") for f in lin.get("input_files", [])}  # noqa: E731
    old, new = files(recorded), files(reproduced)
    out += [f"file {u}: sha256 {str(old.get(u))[:16]} -> {str(new.get(u))[:16]}" for u in sorted(set(old) | set(new))
            if old.get(u) != new.get(u)]
    env_old, env_new = recorded.get("environment", {}), reproduced.get("environment", {})
    for name in sorted(set(env_old.get("packages", {})) | set(env_new.get("packages", {}))):
        a, b = env_old.get("packages", {}).get(name), env_new.get("packages", {}).get(name)
        if a != b:
            out.append(f"package {name}: {a} -> {b}")
    for key in ("torch", "python", "git"):
        if env_old.get(key) != env_new.get(key):
            out.append(f"environment {key}: {env_old.get(key)} -> {env_new.get(key)}")
    return out


def reproduce(uri: str, new_root: str, storage_options: dict | None = None, log=print) -> dict[str, Any]:
    """Re-materialise the artifact at ``uri`` and its whole lineage into ``new_root``; compare versions.

    Returns ``{"equal": bool, "assets": [{asset, recorded, reproduced, equal}], "first_difference":
    {asset, recorded, reproduced, lineage_differences} | None, "root": new_root}``."""
    from batchrl.definitions import build_definitions

    nodes = lineage_graph(uri, storage_options)
    by_key = {(n.asset, n.data_version): n for n in nodes}
    missing = [n.asset for n in nodes if "run_config" not in n.lineage]
    if missing:
        raise ReproduceError(f"lineage of {sorted(set(missing))} holds no run_config (published before batchrl "
                             "recorded it): re-materialise them once, then reproduce")
    os.makedirs(new_root, exist_ok=True)
    new_root = os.path.abspath(new_root)
    reproduced: dict[tuple[str, str], dict] = {}
    per_drop_runs: dict[str, dict[str, dict]] = {}
    rows, first = [], None
    for index, node in enumerate(nodes, 1):
        io_manager = PinnedInputs(_storage(new_root))
        defs = build_definitions(_resources(new_root, node.lineage.get("resources", {}), io_manager),
                                 # dpo_pairs as recorded: with its rewards input (self-play pairs) or without
                                 dpo_self_play=node.asset == "dpo_pairs" and "rewards" in node.inputs)
        graph = defs.resolve_asset_graph()
        for parent in graph.get(dg.AssetKey(node.asset)).parent_keys:
            if parent.to_user_string() == PROMOTED:  # the loop's back edge: the policy this step recorded
                # (off-policy rollouts record the promoted one apart from the one they sampled)
                policy = node.inputs.get(PROMOTED) or node.inputs.get("policy")
                io_manager.pinned[PROMOTED] = reproduced[policy] if policy else None
                continue
            found = _nearest(by_key, node, parent.to_user_string())
            if found is not None:
                io_manager.pinned[parent.to_user_string()] = reproduced[found]
        drops = {name[name.index("[") + 1:-1]: reproduced[key] for name, key in node.inputs.items() if "[" in name}
        if drops:  # the window's drops, pinned to their reproduced versions
            io_manager.pinned[("validated_preferences", "partitions")] = drops
        op = graph.get(dg.AssetKey(node.asset)).assets_def.node_def.name
        run_config = {"ops": {op: {"config": node.lineage["run_config"]}}} if node.lineage["run_config"] else {}
        partition = node.lineage.get("partition")
        run_key = json.dumps([op, partition, run_config], sort_keys=True)
        if partition is None or run_key not in per_drop_runs:  # one run of a drop's step gives its three assets
            with tempfile.TemporaryDirectory(prefix="batchrl-reproduce-home-") as home, \
                    dg.DagsterInstance.local_temp(home) as instance:
                result = _execute(defs, instance, node, run_config, partition, drops)
            if not result.success:
                errors = [str(e.event_specific_data.error.message).strip().splitlines()[-1]
                          for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
                raise ReproduceError(f"re-materialising {node.asset}@{node.data_version} failed: {errors}")
            if partition is not None:
                per_drop_runs[run_key] = dict(io_manager.outputs)
        new_ref = (per_drop_runs[run_key] if partition is not None else io_manager.outputs)[node.asset]
        reproduced[(node.asset, node.data_version)] = new_ref
        equal = new_ref["data_version"] == node.data_version
        rows.append({"asset": node.asset, "recorded": node.data_version, "reproduced": new_ref["data_version"],
                     "equal": equal})
        log(f"[{index:>2}/{len(nodes)}] {'equal' if equal else 'DIFFERS'} {node.asset:<22} "
            f"{node.data_version} -> {new_ref['data_version']}")
        if not equal and first is None:
            new_lineage = read_lineage(new_ref["uri"])
            first = {"asset": node.asset, "recorded": node.data_version, "reproduced": new_ref["data_version"],
                     "lineage_differences": lineage_differences(node.lineage, new_lineage)
                     or ["lineage identical: a nondeterministic computation (same inputs, code, config, seed)"]}
    return {"equal": first is None, "assets": rows, "first_difference": first, "root": new_root}
