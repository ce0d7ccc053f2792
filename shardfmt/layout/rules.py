"""Placement rules: FQN regexes -> how a tensor is laid out on a new mesh. Pure, no I/O but
``load_rules``.

A rules file is JSON::

    {"rules": [
      {"match": "\\\\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\\\\.weight$", "placements": {"tp": ["shard", 0]}},
      {"match": "\\\\.(o_proj|down_proj)\\\\.weight$", "placements": {"tp": ["shard", 1]}},
      {"match": "^optim\\\\.", "placements": {"dp": ["shard", 0]}, "stage": "auto"},
      {"match": "norm", "placements": {}}
    ]}

- ``match``: a Python regex, searched in the FQN (anchor it with ``^``/``$`` as needed). The
  first rule that matches a tensor wins; tensors no rule matches keep the placement their
  manifest records (mesh dims the new mesh lacks dropped), or are replicated when none is.
- ``placements``: mesh dim -> placement, in the manifest's spelling (spec section 4.3):
  ``["shard", d]``, ``["strided_shard", d, f]`` or ``["replicate"]``, applied in the order
  written, as DTensor does; ``{}`` replicates the tensor. Every dim named must be a dim of
  the new mesh.
- ``stage`` (optional): ``"auto"`` (default: the pipeline stage is derived from
  ``layers.<i>`` in the name when the mesh has ``pp``), ``null`` (every stage holds it) or an
  integer stage below the ``pp`` size.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from shardfmt.errors import ShardfmtError
from shardfmt.layout.topology import (
    Flat,
    Layout,
    Mesh,
    Replicate,
    TopologyError,
    count_layers,
    layout_from_record,
    placement_from_json,
    retarget,
)

AUTO = "auto"
MAX_RULES_BYTES = 16 << 20


class RulesError(ShardfmtError, ValueError):
    """A rules file is malformed, or a rule does not fit the mesh or a tensor it matches."""


@dataclass(frozen=True, slots=True)
class Rule:
    """One rule: tensors whose FQN ``pattern`` finds are laid out as ``layout`` (stage: ``stage``)."""

    index: int
    pattern: re.Pattern
    layout: Layout
    stage: int | str | None = AUTO

    def describe(self) -> str:
        return f"rule {self.index} ({self.pattern.pattern!r})"


@dataclass(frozen=True, slots=True)
class Rules:
    """Parsed rules, first match wins; ``source`` names the file for errors."""

    rules: tuple[Rule, ...]
    source: str = "<rules>"

    def match(self, fqn: str) -> Rule | None:
        for r in self.rules:
            if r.pattern.search(fqn):
                return r
        return None


def parse_rules(obj: Any, *, source: str = "<rules>") -> Rules:
    """Parse the JSON object of a rules file; raise RulesError naming the rule and field."""
    if isinstance(obj, list):
        obj = {"rules": obj}
    if not isinstance(obj, dict) or set(obj) != {"rules"} or not isinstance(obj["rules"], list):
        raise RulesError(f"{source}: expected an object {{\"rules\": [...]}}")
    out = []
    for i, r in enumerate(obj["rules"]):
        where = f"{source}: rule {i}"
        if not isinstance(r, dict):
            raise RulesError(f"{where}: expected an object with 'match' and 'placements'")
        unknown = set(r) - {"match", "placements", "stage"}
        if unknown or "match" not in r or "placements" not in r:
            raise RulesError(f"{where}: needs 'match' and 'placements' (and optionally 'stage'), "
                             f"got keys {sorted(r)}")
        if not isinstance(r["match"], str):
            raise RulesError(f"{where}: 'match' must be a string (a regex)")
        try:
            pattern = re.compile(r["match"])
        except re.error as e:
            raise RulesError(f"{where}: 'match' {r['match']!r} is not a valid regex ({e})") from None
        places = r["placements"]
        if places == "replicate":
            places = {}
        if not isinstance(places, dict):
            raise RulesError(f"{where}: 'placements' must be an object mesh dim -> placement")
        dims, kinds = [], []
        for dim, p in places.items():
            try:
                kind = placement_from_json(p)
                if isinstance(kind, Flat):  # a flat entry's offset is per tensor: no rule can give it
                    raise TopologyError("flat")
                kinds.append(kind)
            except TopologyError:
                raise RulesError(f"{where}: placement {p!r} for mesh dim {dim!r} is not [\"shard\", d], "
                                 "[\"strided_shard\", d, f] or [\"replicate\"]") from None
            dims.append(dim)
        stage = r.get("stage", AUTO)
        if not (stage is None or stage == AUTO or (isinstance(stage, int) and not isinstance(stage, bool)
                                                    and stage >= 0)):
            raise RulesError(f"{where}: 'stage' must be \"auto\", null or a non-negative integer, got {stage!r}")
        out.append(Rule(i, pattern, Layout(tuple(dims), tuple(kinds)), stage))
    return Rules(tuple(out), source)


def load_rules(path: str) -> Rules:
    """Read and parse a rules file (a local path)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_RULES_BYTES + 1)
    except OSError as e:
        raise RulesError(f"{path}: cannot read the rules file ({e.strerror or e})") from None
    if len(raw) > MAX_RULES_BYTES:
        raise RulesError(f"{path}: rules file is larger than {MAX_RULES_BYTES} bytes")
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise RulesError(f"{path}: not valid JSON ({e})") from None
    return parse_rules(obj, source=path)


def check_rules(rules: Rules, mesh: Mesh) -> None:
    """Raise RulesError for a rule naming a mesh dim or a stage the mesh does not have."""
    for r in rules.rules:
        for dim in r.layout.mesh_dims:
            if dim not in mesh.names:
                raise RulesError(f"{rules.source}: {r.describe()}: mesh dim {dim!r} is not in the mesh {mesh}")
        if isinstance(r.stage, int):
            pp = mesh.size("pp") if "pp" in mesh.names else None
            if pp is None or r.stage >= pp:
                raise RulesError(f"{rules.source}: {r.describe()}: stage {r.stage} needs a 'pp' mesh dim "
                                 f"larger than {r.stage} (mesh {mesh})")


def plan_layouts(records: Mapping[str, tuple[tuple[int, ...], Any]], mesh: Mesh,
                 rules: Rules | None = None) -> tuple[dict[str, Layout], tuple[int, ...]]:
    """Return the layout on ``mesh`` of every record (name -> (shape, manifest placement or
    None)) and the indices of rules that matched nothing.

    A matching rule decides; otherwise the recorded placement is retargeted (``retarget``).
    Raises RulesError when a matched rule shards a dim the tensor does not have.
    """
    if rules is not None:
        check_rules(rules, mesh)
    n_layers = count_layers(records)
    used: set[int] = set()
    out: dict[str, Layout] = {}
    for fqn in sorted(records):
        shape, placement = records[fqn]
        rule = rules.match(fqn) if rules is not None else None
        if rule is None:
            out[fqn] = retarget(fqn, layout_from_record(placement), mesh, num_layers=n_layers)
            continue
        used.add(rule.index)
        for dim, p in zip(rule.layout.mesh_dims, rule.layout.placements):
            if not isinstance(p, Replicate) and p.dim >= len(shape):
                raise RulesError(f"{rules.source}: {rule.describe()} shards dim {p.dim} over {dim!r}, but tensor "
                                 f"{fqn!r} has shape {list(shape)}")
        if rule.stage == AUTO:
            out[fqn] = retarget(fqn, rule.layout, mesh, num_layers=n_layers)
        else:
            kept = [(d, p) for d, p in zip(rule.layout.mesh_dims, rule.layout.placements)
                    if not isinstance(p, Replicate)]
            out[fqn] = Layout(tuple(d for d, _ in kept), tuple(p for _, p in kept), stage=rule.stage)
    unused = tuple(r.index for r in rules.rules if r.index not in used) if rules is not None else ()
    return out, unused
