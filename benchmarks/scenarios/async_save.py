"""Async save: how long the caller is blocked, and the total, against memcpy, sync save and DCP."""

from benchmarks.harness.model import Phase, Ref, Scenario, StateSpec, ratio, throughput

ASYNC = "shardfmt.async_save"
MEMCPY = Ref(phase="save", candidate="memcpy", metric="local")

SCENARIOS = (Scenario(
    name="async",
    doc="2 ranks: async_save blocked/staged/total vs memcpy, sync save, the write floor and DCP's async_save",
    state=StateSpec(builder="transformer", size_mib=3072),
    ranks=2,
    phases=(
        Phase(name="save", kind="save",
              candidates=("memcpy", "floor.write", "shardfmt.save", ASYNC, f"{ASYNC}.bg", "dcp.save",
                          "dcp.async_save", "dcp.async_save.bg")),
    ),
    targets=(
        ratio("async save blocks the caller <= 1.5x the memcpy of the rank's state",
              Ref(phase="save", candidate=ASYNC, metric="blocked"), "<=", 1.5, MEMCPY),
        ratio("async save's total <= sync save + 1.0x memcpy", Ref(phase="save", candidate=ASYNC),
              "<=", 1.0, (Ref(phase="save", candidate="shardfmt.save"), MEMCPY)),
        throughput("save", "shardfmt.save", 0.9, "floor.write"),
    ),
),)
