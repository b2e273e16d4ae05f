"""The resources' config checked before anything runs: names that only the stage using them would look up (an
unknown ``rollout_engine.kind`` failed in the rollouts step, after six assets had run). Field names and types
are checked where the resources are built (``resources.profiles.apply_resource_overrides``)."""
from __future__ import annotations

from batchrl.common.run_config_error import problem_line

# the engines training/rollout registers (checked against its ROLLOUT_ENGINES by a test): a kind among these needs
# no import of the engines (torch: a slow import before the first step)
BUILT_IN_ENGINES = ("static", "transformers", "vllm")
DTYPES = ("float32", "bfloat16", "float16")
# (resource, field) -> what its value must name
ENGINE_FIELDS = (("rollout_engine", "kind"), ("compute", "generation_engine"))
DTYPE_FIELDS = (("rollout_engine", "dtype"), ("compute", "dtype"))


def resource_problems(resources: dict) -> list[str]:
    """One line per resource field naming something unknown: an engine kind, a dtype."""
    problems = []
    for resource, field in ENGINE_FIELDS:
        kind = getattr(resources.get(resource), field, None)
        if isinstance(kind, str) and kind not in BUILT_IN_ENGINES and kind not in _registered_engines():
            problems.append(problem_line(f"resources.{resource}.{field}", "not a rollout engine; known: "
                                         f"{', '.join(sorted(_registered_engines()))}", kind))
    for resource, field in DTYPE_FIELDS:
        dtype = getattr(resources.get(resource), field, None)
        if isinstance(dtype, str) and dtype not in DTYPES:
            problems.append(problem_line(f"resources.{resource}.{field}", f"one of {', '.join(DTYPES)}", dtype))
    return problems


def _registered_engines() -> set[str]:
    """Every engine kind, those registered beside the built-in ones included (imports the engines)."""
    from batchrl.training.rollout import ROLLOUT_ENGINES

    return set(ROLLOUT_ENGINES)
