"""Dagster resources, swapped per environment by config (see `batchrl.definitions`).

The names below are loaded on first use (PEP 562), not when the package is imported: a stage whose code version
names one resource module (``batchrl.resources.rl_recipe``) then hashes that module's imports, not every resource's
(the code-version closure counts what a package's ``__init__`` imports)."""
from importlib import import_module

_HOMES = {"Artifact": "artifacts", "ArtifactIOManager": "artifacts", "CatalogResource": "catalog",
          "ComputeResource": "compute", "LandingResource": "landing", "TrainerLauncherResource": "launcher",
          "RolloutEngineResource": "rollout", "ArtifactRef": "storage", "StorageResource": "storage",
          "TrackingResource": "tracking"}
__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'batchrl.resources' has no attribute {name!r}")
    value = getattr(import_module(f"batchrl.resources.{_HOMES[name]}"), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return __all__
