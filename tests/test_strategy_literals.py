"""A strategy is named only by its own files: its spec, its runtime class and its estimator (and the
studies, which are sets of named experiments). Everywhere else reads traits, spec classes, registry
lookups or the strategy's own hooks, so a string equal to a registered strategy name outside those
files is counted here, and a few at most are allowed (docs/architecture.md, "What a strategy is")."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import ddlscope.specs.strategies  # noqa: F401  (registers the specs)
from ddlscope.predict.specs import ParallelSpec
from ddlscope.specs import STRATEGY_SPECS

ROOT = Path(__file__).resolve().parents[1] / "src" / "ddlscope"
OWN_DIRS = ("specs/strategies", "strategies", "predict/estimators")
MOST = 10

# ParallelSpec's fields are a layout's degrees and knobs (`tp` is the tensor-parallel size, the --tp flag),
# not strategies: one of them used as a key (a dict's, a subscript's, a .get's or getattr's, or beside
# other field names in a tuple of keys) is not a strategy's name even where it spells one.
PARALLEL_FIELDS = frozenset(f.name for f in dataclasses.fields(ParallelSpec))
MAPPING_METHODS = frozenset({"get", "pop", "setdefault"})
ATTRIBUTE_BUILTINS = frozenset({"getattr", "setattr", "hasattr"})


def _parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def _is_parallel_key(node: ast.Constant, parent: ast.AST | None) -> bool:
    if node.value not in PARALLEL_FIELDS:
        return False
    if isinstance(parent, ast.Dict):
        return node in parent.keys
    if isinstance(parent, ast.Subscript):
        return parent.slice is node
    if isinstance(parent, ast.Call):
        func = parent.func
        if isinstance(func, ast.Attribute) and func.attr in MAPPING_METHODS:  # mapping.get(key, ...)
            return parent.args[:1] == [node]
        if isinstance(func, ast.Name) and func.id in ATTRIBUTE_BUILTINS:  # getattr(obj, key, ...)
            return parent.args[1:2] == [node]
        return False
    if isinstance(parent, (ast.Tuple, ast.List, ast.Set)):
        others = [e for e in parent.elts if e is not node]
        return any(isinstance(e, ast.Constant) and e.value in PARALLEL_FIELDS for e in others)
    return False


def strategy_literals(root: Path = ROOT) -> list[tuple[str, int, str]]:
    """(file relative to the package, line, name) of each string constant equal to a registered strategy
    name outside that strategy's own files and the studies."""
    home = {name: Path(inspect.getfile(cls)).stem for name, cls in STRATEGY_SPECS.items()}
    hits = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith("studies/"):
            continue
        tree = ast.parse(path.read_text())
        parents = _parents(tree)
        folder = rel.rsplit("/", 1)[0] if "/" in rel else ""
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in home):
                continue
            if folder in OWN_DIRS and path.stem == home[node.value]:
                continue
            if _is_parallel_key(node, parents.get(node)):
                continue
            hits.append((rel, node.lineno, node.value))
    return sorted(hits)


def test_strategy_names_stay_in_their_own_files():
    hits = strategy_literals()
    listing = "\n".join(f"  src/ddlscope/{rel}:{line}: {name!r}" for rel, line, name in hits)
    assert len(hits) <= MOST, f"{len(hits)} strategy-name literals outside their strategy's files (at most {MOST}):\n" \
                              f"{listing}"


def test_the_count_sees_a_name_and_not_a_layout_key(tmp_path):
    """The counter itself: a strategy's name in a branch counts, in its own estimator it does not, and the
    tensor-parallel degree as a layout key does not."""
    (tmp_path / "predict" / "estimators").mkdir(parents=True)
    (tmp_path / "predict" / "estimators" / "ddp.py").write_text('NAME = "ddp"\n')
    (tmp_path / "predict" / "other.py").write_text(
        'def f(name, layout):\n'
        '    if name == "fsdp":\n'
        '        return layout["tp"] * layout.get("tp", 1)\n'
        '    return {"tp": 1, "pp": 2}, ("tp", "pp"), getattr(layout, "tp")\n'
        'ALL = ["tp"]\n')
    assert strategy_literals(tmp_path) == [("predict/other.py", 2, "fsdp"), ("predict/other.py", 5, "tp")]


# --------------------------------------------------------------------------- what stands in for the names
def test_memory_prices_the_families_through_their_traits():
    """The memory model reads `stages_model` (the pipeline family: each rank holds its stage), `splits_layers`
    (pipeline and tensor: each rank runs its share of the layers) and `single_process`, where it compared
    family names: one 10 x 100 fp32 weight (4,000 bytes) and 800 activation bytes at a traced batch of 8,
    on 2 ranks with a global batch of 8."""
    from ddlscope.predict.model_memory import MemoryQuery, price
    from ddlscope.specs import baseline_strategy
    from ddlscope.specs.model_table import LayerRow, ModelTable, ParamEntry

    table = ModelTable(model="one-linear", traced_batch=8, activation_bytes_recompute=800, layers=(
        LayerRow(name="fc", kind="Linear", params=(ParamEntry(numel=1000, dim0=10, element_bytes=4),),
                 activation_bytes=800),))

    def worker(name: str) -> dict[str, float]:
        spec = STRATEGY_SPECS.get(name)()
        return price(table, MemoryQuery(traits=spec.traits, world_size=2, global_batch=8, optimizer="sgd"))[0].bytes

    ddp, pipeline, tp, nodepar, partitioned = (worker(name) for name in ("ddp", "pipeline", "tp", "nodepar",
                                                                         "partitioned"))
    assert (ddp["parameters"], ddp["activations"], ddp["communication"]) == (4000, 400, 4000)  # 4 samples each
    # a stage per rank: half the weights, the whole batch through half the layers, no gradient buckets
    assert (pipeline["parameters"], pipeline["activations"], pipeline["communication"]) == (2000, 400, 0)
    # heads cut over the ranks: Shard(0) rows, the whole batch through half of every layer
    assert (tp["parameters"], tp["activations"]) == (2000, 400)
    assert (nodepar["parameters"], nodepar["activations"]) == (4000, 400)
    # parts trained apart: sharded states, but not FSDP's gathered units
    assert (partitioned["parameters"], partitioned["communication"]) == (2000, 0)
    baseline = STRATEGY_SPECS.get(baseline_strategy())
    assert baseline.traits.single_process and baseline.traits.simplicity == min(
        cls.traits.simplicity for _, cls in STRATEGY_SPECS.items())
