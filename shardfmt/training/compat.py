"""Is a checkpoint one of this training's? Its config, model signatures and optimizers, checked before loading.

A checkpoint records the config's hash (and the config), each model's tensor names with their
dtype and shape, and each optimizer's class and parameter groups. Restore refuses one that
differs (``CompatibilityError``, never quarantined: the checkpoint is not at fault) unless
``allow_mismatch``. A config whose typed JSON differs but compares equal (dict order, 1000 vs
1000.0) is the same config.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from shardfmt.errors import CompatibilityError
from shardfmt.format import hashing, jsonvalue
from shardfmt.format.manifest import Manifest


def config_hash(config: Any) -> str | None:
    """Return the digest of ``config``'s typed JSON (sorted keys), or None without a config."""
    if config is None:
        return None

    return hashing.digest_bytes(orjson.dumps(jsonvalue.encode(config, where="config"), option=orjson.OPT_SORT_KEYS))


def _equal(a: Any, b: Any) -> bool:
    """``a == b`` for configs whose typed JSON differs (dict order, 1000 vs 1000.0); False where
    comparing fails (arrays)."""
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - e.g. numpy's ambiguous truth value: not provably equal
        return False


def check_compat(path: str, manifest: Manifest, *, config: Any, signature: Mapping[str, dict],
                 optimizers: Mapping[str, dict], allow_mismatch: bool, data: Mapping[str, Any] | None = None) -> None:
    """Raise CompatibilityError when the checkpoint at ``path`` was saved for another config, model
    (``signature``: tensor name -> [dtype, shape] per model) or optimizer (class, parameter groups)."""
    meta = jsonvalue.decode_stored(manifest.metadata, where="metadata", source=path) or {}
    if allow_mismatch or not isinstance(meta, dict):
        return
    want = meta.get("config_hash")
    have = config_hash(config)
    if want is not None and have is not None and want != have and not _equal(meta.get("config"), config):
        raise CompatibilityError(f"{path}: saved with a different config (hash {want} != {have}); "
                                 f"saved config: {str(meta.get('config'))[:300]}; pass allow_mismatch=True")
    _check_models(path, meta.get("signature") or {}, signature)
    _check_optimizers(path, meta.get("optimizers") or {}, optimizers)
    _check_data(path, meta.get("data") or {}, data or {})


def _check_data(path: str, saved: Mapping[str, Any], now: Mapping[str, Any]) -> None:
    """A data entry's length or version, or the job's data fingerprint, that differs from what
    was saved: resuming the cursor over other data would silently skip or repeat samples."""
    for name, have in sorted(now.items()):
        old = saved.get(name)
        if not isinstance(old, dict) or not isinstance(have, dict):
            continue
        diff = [f"{k} {old.get(k)!r} -> {have.get(k)!r}" for k in sorted(set(old) | set(have))
                if old.get(k) is not None and have.get(k) is not None and old.get(k) != have.get(k)]
        if diff:
            what = "the data fingerprint" if name == "" else f"the data of entry {name!r}"
            raise CompatibilityError(f"{path}: {what} differs from the checkpoint's ({'; '.join(diff)}): its "
                                     "position in the data would point at other samples (pass allow_mismatch=True "
                                     "to resume anyway)")


def _check_models(path: str, saved: Mapping[str, Any], signature: Mapping[str, dict]) -> None:
    for name, sig in signature.items():
        old = saved.get(name)
        if old is None:
            continue
        missing = sorted(set(old) - set(sig))
        extra = sorted(set(sig) - set(old))
        changed = sorted(k for k in set(old) & set(sig) if list(old[k]) != list(sig[k]))
        if missing or extra or changed:
            detail = [f"not in the model: {missing[:5]}" if missing else "",
                      f"not in the checkpoint: {extra[:5]}" if extra else "",
                      "shape/dtype differ: " + ", ".join(f"{k} {old[k]} -> {sig[k]}" for k in changed[:5])
                      if changed else ""]
            raise CompatibilityError(f"{path}: model {name!r} differs from the checkpoint: "
                                     + "; ".join(d for d in detail if d) + " (pass allow_mismatch=True)")


def _check_optimizers(path: str, saved: Mapping[str, Any], optimizers: Mapping[str, dict]) -> None:
    for name, now in optimizers.items():  # a class or grouping change would load, then fail or train
        old = saved.get(name)  # differently (a group's weight decay dropped)
        if old is None:
            continue
        if old["class"] != now["class"]:
            raise CompatibilityError(f"{path}: optimizer {name!r} is a {now['class']}, the checkpoint holds a "
                                     f"{old['class']} (pass allow_mismatch=True to load what matches)")
        if old["groups"] != now["groups"]:
            raise CompatibilityError(
                f"{path}: optimizer {name!r} groups its parameters differently from the checkpoint: "
                f"{len(old['groups'])} group(s) saved, {len(now['groups'])} now; first saved groups: "
                f"{[g[:3] for g in old['groups'][:3]]} (pass allow_mismatch=True)")
