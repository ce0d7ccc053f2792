"""Names between DCP's flattened state and shardfmt's (pure).

DCP (``torch.distributed.checkpoint``, ``flatten_state_dict``) walks every mapping, and every
list that holds a tensor, a mapping or such a list; each leaf it reaches is named by its path
joined with dots (a list item by its index; a mapping's key as ``str(key)``). Tuples, and lists
of plain values, are leaves. shardfmt (``layout.state.flatten``) walks a dict, list or tuple only
while it holds a tensor: every subtree without one is one value. Tensor names therefore agree;
value names differ. An optimizer's ``param_groups`` is one shardfmt value
(``optim.param_groups``: a list of dicts) and many DCP leaves (``optim.param_groups.0.lr``,
``optim.param_groups.0.params``, ...).

The writer stores values by shardfmt's rule (``regroup``), so ``shardfmt.load`` reads a
checkpoint DCP wrote; the reader lists stored values by DCP's rule (``dcp_leaves``), so
``dcp.load`` reads one ``shardfmt.save`` wrote. An empty mapping is no DCP leaf, so DCP never
saves one; inside a list, a gap it leaves before a later item is filled back with ``{}`` (one at
the end is lost). ``planner.SavePlanner`` keeps values whole instead.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from shardfmt.errors import StateDictError

Path = tuple  # the keys from the state dict's root to one leaf: str for a mapping's, int for a list's


@dataclass(frozen=True, slots=True)
class _Value:
    value: Any


_TENSOR = object()  # a tensor leaf in the tree ``regroup`` builds


def name_of(path: Path) -> str:
    """The dotted name of ``path``, as both DCP and shardfmt write it."""
    return ".".join(str(seg) for seg in path)


def regroup(tensor_paths: Iterable[Path], values: Mapping[Path, Any]) -> dict[str, Any]:
    """shardfmt's values (name -> value) from DCP's value leaves (path -> value), given the
    paths of the tensors beside them: each subtree holding no tensor becomes one value."""
    root: dict = {}
    holds_tensor: set[Path] = set()
    for path in tensor_paths:
        _insert(root, path, _TENSOR)
        holds_tensor.update(path[:i] for i in range(1, len(path)))
    for path, value in values.items():
        _insert(root, path, _Value(value))
    out: dict[str, Any] = {}
    pending = [((seg,), node) for seg, node in root.items()]
    while pending:
        path, node = pending.pop()
        if node is _TENSOR:
            continue
        if path in holds_tensor:
            pending.extend((path + (seg,), child) for seg, child in node.items())
        else:
            name = name_of(path)
            if name in out:  # e.g. {"x.y": {...}} beside {"x": {"y": {...}}}: shardfmt refuses it too
                raise StateDictError(f"{name}: two entries of the state have this name")
            out[name] = _build(node)
    return dict(sorted(out.items()))


def _insert(root: dict, path: Path, leaf: Any) -> None:
    if not path:
        raise StateDictError("a state dict entry with an empty name")
    node = root
    for i, seg in enumerate(path[:-1]):
        child = node.setdefault(seg, {})
        if not isinstance(child, dict):
            raise StateDictError(f"{name_of(path[:i + 1])}: a leaf and entries under it ({name_of(path)})")
        node = child
    if isinstance(node.get(path[-1]), dict):
        raise StateDictError(f"{name_of(path)}: a leaf and entries under it")
    if path[-1] in node:
        raise StateDictError(f"{name_of(path)}: two entries of the state have this name")
    node[path[-1]] = leaf


def _build(node: Any) -> Any:
    """The value a subtree without tensors stands for: a list where every key is an index."""
    if isinstance(node, _Value):
        return node.value
    if node and all(isinstance(k, int) for k in node):
        return [_build(node[i]) if i in node else {} for i in range(max(node) + 1)]
    return {k: _build(v) for k, v in node.items()}


def _terminal(value: Any) -> bool:
    """DCP's rule: a leaf unless a mapping, or a list holding a mapping or a non-leaf list."""
    if isinstance(value, Mapping):
        return False
    if not isinstance(value, list):
        return True
    return not any(isinstance(v, (Mapping, list)) and not _terminal(v) for v in value)


@dataclass(frozen=True, slots=True)
class Leaf:
    """One DCP leaf of a stored value: its DCP name, the keys from the value to it (``within``,
    for ``leaf_at``) and the same path as DCP records it (``path``: a mapping's key as ``str``)."""

    name: str
    within: Path
    path: Path


def dcp_leaves(name: str, value: Any) -> list[Leaf]:
    """The DCP leaves of the shardfmt value ``name``, in DCP's order; two that DCP would name
    alike (keys ``1`` and ``"1"``) are refused."""
    out: list[Leaf] = []
    pending: list[Leaf | tuple[Leaf, Any]] = [(Leaf(name, (), ()), value)]
    while pending:
        at, v = pending.pop()
        if isinstance(v, Mapping):
            items = [(k, str(k), x) for k, x in v.items()]
        elif not _terminal(v):
            items = [(i, i, x) for i, x in enumerate(v)]
        else:
            out.append(at)
            continue
        pending.extend((Leaf(f"{at.name}.{seg}", at.within + (k,), at.path + (seg,)), x)
                       for k, seg, x in reversed(items))
    names = [leaf.name for leaf in out]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise StateDictError(f"{dup}: two entries of the value {name} have this name in DCP's flattening")
    return out


def leaf_at(value: Any, within: Path) -> Any:
    """The part of ``value`` that ``within`` (from ``dcp_leaves``) names."""
    for key in within:
        value = value[key]
    return value
