"""The JSON Schema pass: each version's schema, run on a bounded sample of the manifest."""

from __future__ import annotations

import functools
import itertools
import json
from importlib import resources

from shardfmt.format.jsonscan import Lazy
from shardfmt.format.manifest import MANIFEST_NAME
from shardfmt.validation.report import Problem

SCHEMA_FILES = {1: "manifest.schema.json", 2: "manifest-v2.schema.json"}


@functools.lru_cache(maxsize=2)
def manifest_schema(version: int = 1) -> dict:
    """Return the JSON Schema of version ``version``'s manifest shipped with the package
    (spec/manifest.schema.json, spec/manifest-v2.schema.json)."""
    text = resources.files("shardfmt").joinpath(SCHEMA_FILES[version]).read_text(encoding="utf-8")
    return json.loads(text)


SCHEMA_SAMPLE = 32  # entries of each map (files, tensors, ...) and of each list the schema pass sees
SCHEMA_VALUE_NODES = 1000  # JSON nodes of one typed-JSON value (metadata, a value) the schema pass sees


def schema_sample(obj) -> dict:
    """A bounded sample of a manifest object (parsed, or Lazy) for the JSON Schema pass: the top
    level, the first ``SCHEMA_SAMPLE`` entries of ``files``, ``tensors``, ``storages`` and
    ``values``, of every record's ``shards`` and ``chunks`` and of ``topology.ranks``, and
    typed-JSON values of at most ``SCHEMA_VALUE_NODES`` nodes (a larger one is sampled as null).
    The schema has no minimum sizes above 3, so a sample of a conforming manifest conforms.
    jsonschema spends ~0.1 ms per node: run over a 490 MB manifest it took hours, and every entry
    is checked by the field parser and the typed-JSON decoder anyway."""
    out = dict(obj.items())
    for key in ("files", "tensors", "storages", "values", "extensions"):
        if _is_obj(out.get(key)):
            out[key] = {k: _sample_record(v) for k, v in itertools.islice(out[key].items(), SCHEMA_SAMPLE)}
    if "metadata" in out:
        out["metadata"] = _small_or_null(out["metadata"])
    if _is_list(out.get("ranks")):  # v2: the rank table's parts
        out["ranks"] = list(itertools.islice(out["ranks"], SCHEMA_SAMPLE))
    topo = out.get("topology")
    if _is_obj(topo):
        topo = dict(topo.items())
        if _is_list(topo.get("ranks")):
            topo["ranks"] = list(itertools.islice(topo["ranks"], SCHEMA_SAMPLE))
        out["topology"] = topo
    return out


def _is_obj(v) -> bool:
    return isinstance(v, dict) or isinstance(v, Lazy) and v.kind == "object"


def _is_list(v) -> bool:
    return isinstance(v, list) or isinstance(v, Lazy) and v.kind == "array"


def _sample_record(rec):
    if not _is_obj(rec):
        return rec
    out = dict(rec.items())
    for key in ("shards", "chunks"):
        if _is_list(out.get(key)):
            out[key] = list(itertools.islice(out[key], SCHEMA_SAMPLE))
    if "value" in out:
        out["value"] = _small_or_null(out["value"])
    if _is_obj(out.get("per_rank")):
        out["per_rank"] = {k: _small_or_null(v) for k, v in itertools.islice(out["per_rank"].items(), SCHEMA_SAMPLE)}
    return out


def _small_or_null(value):
    """``value`` if it has at most SCHEMA_VALUE_NODES JSON nodes, else None (counting stops there)."""
    if isinstance(value, Lazy):
        return None
    stack, seen = [value], 0
    while stack:
        v = stack.pop()
        seen += 1
        if seen > SCHEMA_VALUE_NODES:
            return None
        if isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return value


def schema_problems(obj, version: int) -> list[Problem]:
    import jsonschema

    validator = jsonschema.Draft202012Validator(manifest_schema(version))
    out = []
    for err in sorted(validator.iter_errors(schema_sample(obj)), key=lambda e: list(map(str, e.absolute_path)))[:50]:
        where = "/".join(str(p) for p in err.absolute_path) or "<root>"
        out.append(Problem(code="schema", message=f"{where}: {err.message[:300]}", file=MANIFEST_NAME))
    return out
