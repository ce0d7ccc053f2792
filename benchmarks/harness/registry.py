"""The scenarios: every ``SCENARIOS`` tuple of a module in ``benchmarks/scenarios/``, by name."""

from __future__ import annotations

import importlib
import pkgutil

from .model import Scenario


def all_scenarios() -> dict[str, Scenario]:
    from .. import scenarios as pkg

    out: dict[str, Scenario] = {}
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name):
        mod = importlib.import_module(f"{pkg.__name__}.{info.name}")
        for sc in getattr(mod, "SCENARIOS", ()):
            if sc.name in out:
                raise ValueError(f"scenario {sc.name!r} is declared twice")
            out[sc.name] = sc
    return out


def scenario_by_name(name: str) -> Scenario:
    scenarios = all_scenarios()
    if name not in scenarios:
        raise KeyError(f"unknown scenario {name!r} (known: {', '.join(scenarios)})")
    return scenarios[name]
