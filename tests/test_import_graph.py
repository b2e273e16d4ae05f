"""The package's shape, read from the source with ``ast`` (nothing is imported or executed):

- the root holds only ``__init__.py`` and ``definitions.py`` (the Dagster code location); every other module lives
  in the folder of its concern;
- imports between top-level folders form no circle (``batchrl.X...`` imports anywhere in a file, imports inside
  functions included; a folder may import itself), so the folders stack in floors and imports only point down;
- nothing imports ``batchrl.definitions`` but the few modules in ``DEFINITIONS_IMPORTERS``;
- the stages that never train import nothing of ``training/trainer/`` (and, checked in a fresh process that imports
  them, neither the trainer nor DeepSpeed gets loaded);
- no test module imports another: what tests share lives in a helper module of tests/ (not named ``test_*``);
- no module but ``common/dagster_internals.py`` uses Dagster's private API (``dagster._…``).
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys

PACKAGE = "batchrl"
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT_MODULES = {"__init__.py", "definitions.py"}

# The code location is the top of the graph: it declares assets, resources, jobs and the executor, so the modules
# below must not need it. Only these load it, each because its job is to build or preload the code location itself:
DEFINITIONS_IMPORTERS = {
    # `batchrl run` and `batchrl stale` build the code location of the command's environment, as `dagster dev` does
    "batchrl.cli.run_command", "batchrl.cli.lineage_commands",
    # the step server's preload: the code location the multiprocess executor's step processes rebuild their job from
    "batchrl.runs.step_preload",
    # `batchrl reproduce` builds the code location with the recorded resources of the artifact it re-materialises
    "batchrl.runs.reproduce",
}

# The stages that never train: advantages (critic values, KL in the reward), evaluation, reward scoring. They score
# sequences (``training.scoring``, the value model, the reward model) and import nothing of ``training/trainer/``
# (DeepSpeed engines, optimisers, checkpoints), not even inside a function: neither their processes nor their code
# versions carry the trainer.
NON_TRAINING_STAGES = ("batchrl.training.rl.advantages", "batchrl.training.evaluation.evaluate", "batchrl.training.rewards.kl_in_reward",
                       "batchrl.training.rewards.registry", "batchrl.training.rewards.reward_model", "batchrl.training.data.scoring",
                       "batchrl.training.models.value_model")
TRAINER = f"{PACKAGE}.training.trainer"


def package_modules(package_dir: str = PACKAGE_DIR) -> dict[str, str]:
    """Dotted name -> file of every module of the package: the root's files and the package folders below it
    (folders with an ``__init__.py``; tests/, bench/, scripts/ and docs/ are not part of the package)."""
    modules = {}
    for folder, dirs, files in os.walk(package_dir):
        dirs[:] = sorted(d for d in dirs if os.path.isfile(os.path.join(folder, d, "__init__.py")))
        rel = os.path.relpath(folder, package_dir)
        prefix = PACKAGE if rel == "." else f"{PACKAGE}.{rel.replace(os.sep, '.')}"
        for name in sorted(f for f in files if f.endswith(".py")):
            modules[prefix if name == "__init__.py" else f"{prefix}.{name[:-3]}"] = os.path.join(folder, name)
    return modules


def imported_names(path: str, module: str) -> set[str]:
    """The ``batchrl`` names a file imports anywhere (``from batchrl import x`` gives ``batchrl.x``; relative
    imports resolved against ``module``)."""
    with open(path, "rb") as f:
        tree = ast.parse(f.read(), filename=path)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return {n for n in names if n.startswith(PACKAGE + ".")}


def top_level(name: str) -> str:
    """``batchrl.runs.execute`` -> ``runs``; ``batchrl.definitions`` -> ``definitions``."""
    return name.split(".")[1]


def folder_in(name: str, parent: str) -> str | None:
    """The folder (or module) directly under package ``parent`` that ``name`` lies in: ``folder_in(
    "batchrl.training.models.lora", "batchrl.training")`` -> ``models``; None outside ``parent``."""
    if not name.startswith(parent + "."):
        return None
    return name[len(parent) + 1:].split(".")[0]


def folder_graph(modules: dict[str, str], parent: str = PACKAGE) -> dict[str, set[str]]:
    """Folder directly under ``parent`` -> the other such folders its modules import (modules directly in
    ``parent`` are left out: at the root that is the code location, the top, which
    ``test_only_the_allowed_modules_import_the_code_location`` guards)."""
    folders = {folder_in(m, parent) for m in modules if m.startswith(parent + ".")
               and os.path.basename(modules[m]) == "__init__.py" and m.count(".") == parent.count(".") + 1}
    graph: dict[str, set[str]] = {folder: set() for folder in folders}
    for module, path in modules.items():
        source = folder_in(module, parent)
        if source not in folders:
            continue
        for name in imported_names(path, module):
            target = folder_in(name, parent)
            if target in folders and target != source:
                graph[source].add(target)
    return graph


def module_graph(modules: dict[str, str]) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (``from batchrl.x import f`` counts as importing ``batchrl.x``;
    a package's ``__init__`` importing its own modules, or a module its own package, is no edge)."""
    graph = {}
    for module, path in modules.items():
        targets = set()
        for name in imported_names(path, module):
            while name not in modules and "." in name:
                name = name.rpartition(".")[0]
            if name in modules and name != module and not module.startswith(name + ".") \
                    and not name.startswith(module + "."):
                targets.add(name)
        graph[module] = targets
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of ``graph`` (``[a, b, ..., a]``), or None when it has none."""
    state: dict[str, str] = {}  # node -> "open" while on the path, "done" once every path from it is walked
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def edges_of(cycle: list[str], modules: dict[str, str], parent: str = PACKAGE) -> list[str]:
    """The imports that make each step of a circle, for the failure message."""
    lines = []
    for source, target in zip(cycle, cycle[1:]):
        lines += [f"{module} imports {name}" for module, path in sorted(modules.items())
                  if module != parent and folder_in(module, parent) == source
                  for name in sorted(imported_names(path, module)) if folder_in(name, parent) == target]
    return lines


def loose_modules(package_dir: str = PACKAGE_DIR, allowed: set[str] = frozenset(ROOT_MODULES)) -> list[str]:
    """A folder's .py files other than ``allowed`` (at the root: ``ROOT_MODULES``)."""
    return sorted(f for f in os.listdir(package_dir) if f.endswith(".py") and f not in allowed)


def definitions_importers(modules: dict[str, str]) -> list[str]:
    """The modules that import ``batchrl.definitions`` (or a name from it)."""
    code_location = f"{PACKAGE}.definitions"
    return sorted(m for m, path in modules.items() if m != code_location and any(
        n == code_location or n.startswith(code_location + ".") for n in imported_names(path, m)))


def import_closure(names: tuple[str, ...], modules: dict[str, str]) -> set[str]:
    """The modules ``names`` import, transitively (imports inside functions included; ``from batchrl.x import f``
    counts as importing ``batchrl.x``)."""
    seen: set[str] = set()
    pending = list(names)
    while pending:
        name = pending.pop()
        while name not in modules and "." in name:  # an attribute of a module: the module
            name = name.rpartition(".")[0]
        if name in seen or name not in modules:
            continue
        seen.add(name)
        pending += imported_names(modules[name], name)
    return seen


def imports_of_test_modules(path: str) -> list[str]:
    """The ``test_*`` modules a file imports (``import test_x``, ``from tests.test_x import ...``, ``from . import
    test_x``)."""
    with open(path, "rb") as f:
        tree = ast.parse(f.read(), filename=path)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module] if node.module else []
            if node.module in ("tests", None):  # the package of the tests, or a relative import of a module
                names += [alias.name for alias in node.names]
        else:
            continue
        found += [name for name in names if name and name.rpartition(".")[2].startswith("test_")]
    return found


def private_dagster_uses(path: str) -> list[str]:
    """The ``dagster._…`` modules a file imports, or names as a whole string (a module list to preload)."""
    with open(path, "rb") as f:
        tree = ast.parse(f.read(), filename=path)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            found.append(node.module or "")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and " " not in node.value:
            found.append(node.value)
    return sorted({name for name in found if name.startswith("dagster._")})


def test_only_the_isolating_module_uses_dagsters_private_api(tmp_path):
    isolating = f"{PACKAGE}.common.dagster_internals"
    users = {m: names for m, path in package_modules().items() if m != isolating
             for names in [private_dagster_uses(path)] if names}
    assert not users, f"private Dagster API outside {isolating} (move it there, with its test): {users}"
    assert private_dagster_uses(package_modules()[isolating])  # the check reads what it should
    (tmp_path / "x.py").write_text('import dagster._core.x\nPRELOAD = ("dagster._core.y",)\n"""dagster._z in prose"""\n')
    assert private_dagster_uses(str(tmp_path / "x.py")) == ["dagster._core.x", "dagster._core.y"]


def test_the_root_holds_only_the_code_location():
    loose = loose_modules()
    assert not loose, f"modules at the package root: {loose}; move each into the folder of its concern"


def test_no_import_circle_between_folders():
    modules = package_modules()
    cycle = find_cycle(folder_graph(modules))
    assert cycle is None, f"import circle between folders {' -> '.join(cycle)}:\n  " + "\n  ".join(
        edges_of(cycle, modules))


def test_training_is_split_by_concern_with_no_circle_between_its_folders():
    """training/ holds folders only (models/, rewards/, data/, algos/, trainer/, rollout/ ...), and they stack."""
    loose = loose_modules(os.path.join(PACKAGE_DIR, "training"), allowed={"__init__.py"})
    assert not loose, f"loose modules in training/: {loose}; move each into the folder of its concern"
    modules = package_modules()
    cycle = find_cycle(folder_graph(modules, f"{PACKAGE}.training"))
    assert cycle is None, f"import circle between training's folders {' -> '.join(cycle)}:\n  " + "\n  ".join(
        edges_of(cycle, modules, f"{PACKAGE}.training"))


def test_no_import_circle_between_files():
    """A registry is declared without a circle: the defining modules import it, never the reverse (the package, or a
    lookup module, imports the definitions)."""
    cycle = find_cycle(module_graph(package_modules()))
    assert cycle is None, f"import circle between files: {' -> '.join(cycle)}"


def test_only_the_allowed_modules_import_the_code_location():
    unexpected = [m for m in definitions_importers(package_modules()) if m not in DEFINITIONS_IMPORTERS]
    assert not unexpected, f"{unexpected} import batchrl.definitions (the top of the graph); import what it is " \
                           "built from instead, or justify the module in DEFINITIONS_IMPORTERS"


def test_the_stages_that_never_train_import_nothing_of_the_trainer_nor_deepspeed():
    modules = package_modules()
    reached = sorted(m for m in import_closure(NON_TRAINING_STAGES, modules)
                     if m == TRAINER or m.startswith(TRAINER + "."))
    assert not reached, f"the stages that never train reach {reached}: move what they need out of training/trainer/"
    stages = (*NON_TRAINING_STAGES, "batchrl.training.jobs.inference")  # the job that runs them on a GPU host
    code = (f"import importlib, sys; [importlib.import_module(m) for m in {stages!r}]; "
            f"print(sorted(m for m in sys.modules if m.split('.')[0] == 'deepspeed' or m.startswith({TRAINER!r})))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout


def test_the_checks_can_fail(tmp_path):
    """The readers see what the tests guard against: a folder circle through a function-local import, a
    ``from batchrl import module`` and a relative import, and a loose module at a root."""
    for folder, source in {"low": "def f():\n    from batchrl.high import api\n",
                           "high": "from batchrl import low\nfrom ..low import thing\n"}.items():
        os.makedirs(tmp_path / folder)
        (tmp_path / folder / "__init__.py").write_text("")
        (tmp_path / folder / "mod.py").write_text(source)
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "loose.py").write_text("from batchrl.definitions import defs\n")
    modules = package_modules(str(tmp_path))
    assert set(modules) == {"batchrl", "batchrl.loose", "batchrl.low", "batchrl.low.mod", "batchrl.high",
                            "batchrl.high.mod"}
    assert imported_names(str(tmp_path / "high" / "mod.py"), "batchrl.high.mod") == {"batchrl.low",
                                                                                      "batchrl.low.thing"}
    assert folder_graph(modules) == {"low": {"high"}, "high": {"low"}}
    assert find_cycle(folder_graph(modules)) in (["high", "low", "high"], ["low", "high", "low"])
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert loose_modules(str(tmp_path)) == ["loose.py"]
    assert module_graph(modules)["batchrl.high.mod"] == {"batchrl.low"}  # ``thing`` is read as a name of low
    assert find_cycle(module_graph(modules)) is None  # low.mod -> high, high.mod -> low: packages, not a file circle
    # a function-local import of a name is followed to its module
    assert import_closure(("batchrl.low.mod",), modules) == {"batchrl.low.mod", "batchrl.high"}
    assert definitions_importers(modules) == ["batchrl.loose"]
    (tmp_path / "low" / "reg.py").write_text("def register(f):\n    from batchrl.low.mod import f\n")
    (tmp_path / "low" / "mod.py").write_text("from batchrl.low.reg import register\n")
    modules = package_modules(str(tmp_path))
    assert find_cycle(module_graph(modules)) in (["batchrl.low.mod", "batchrl.low.reg", "batchrl.low.mod"],
                                                 ["batchrl.low.reg", "batchrl.low.mod", "batchrl.low.reg"])
    assert folder_graph(modules, "batchrl.low") == {}  # low holds modules, no folders


def test_no_test_module_imports_another(tmp_path):
    """Running one test file collects only its tests (and its fixtures' state is its own): what tests share lives in
    a helper module."""
    tests = os.path.dirname(os.path.abspath(__file__))
    offenders = [f"{name} imports {imported}" for name in sorted(os.listdir(tests)) if name.endswith(".py")
                 for imported in imports_of_test_modules(os.path.join(tests, name))]
    assert not offenders, offenders
    (tmp_path / "test_a.py").write_text("import test_b\nfrom tests.test_c import x\nfrom . import test_d, helper\n"
                                        "from helpers_e import test_value\n")
    assert imports_of_test_modules(str(tmp_path / "test_a.py")) == ["test_b", "tests.test_c", "test_d"]
