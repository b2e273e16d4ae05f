"""Dagster resources, swapped per environment by config (see `batchrl.definitions`)."""
from batchrl.resources.artifacts import Artifact, ArtifactIOManager
from batchrl.resources.catalog import CatalogResource
from batchrl.resources.compute import ComputeResource
from batchrl.resources.landing import LandingResource
from batchrl.resources.launcher import TrainerLauncherResource
from batchrl.resources.rollout import RolloutEngineResource
from batchrl.resources.storage import ArtifactRef, StorageResource
from batchrl.resources.tracking import TrackingResource

__all__ = ["Artifact", "ArtifactIOManager", "ArtifactRef", "CatalogResource", "ComputeResource", "LandingResource", "RolloutEngineResource", "StorageResource", "TrackingResource",
           "TrainerLauncherResource"]
