"""Every method in one run (the old benchmarks/run.py): the GPU benchmark with --device cuda."""

from benchmarks.harness.model import Phase, Ref, Scenario, StateSpec, ratio, throughput

ASYNC = "shardfmt.async_save"
MEMCPY = Ref(phase="save", candidate="memcpy", metric="local")

SCENARIOS = (Scenario(
    name="all",
    doc="1 rank (--ranks 2: the old CPU default), every method: memcpy, floors, shardfmt sync/async, DCP "
        "sync/async, torch; loads same-layout and a column slice; with --device cuda the state is on the GPU",
    state=StateSpec(builder="transformer", size_mib=3072),
    ranks=1,
    phases=(
        Phase(name="save", kind="save",
              candidates=("memcpy", "floor.write", "raw.write", "shardfmt.save", ASYNC, f"{ASYNC}.bg", "dcp.save",
                          "dcp.async_save", "dcp.async_save.bg", "torch.save")),
        Phase(name="load", kind="load", candidates=("floor.read", "raw.read", "shardfmt.load", "dcp.load",
                                                    "torch.load")),
        Phase(name="cols", kind="load", layout="cols", candidates=("floor.read", "shardfmt.load", "dcp.load")),
    ),
    targets=(
        ratio("async save blocks the caller <= 1.5x the memcpy of the rank's state",
              Ref(phase="save", candidate=ASYNC, metric="blocked"), "<=", 1.5, MEMCPY),
        ratio("async save's total <= sync save + 1.0x memcpy", Ref(phase="save", candidate=ASYNC),
              "<=", 1.0, (Ref(phase="save", candidate="shardfmt.save"), MEMCPY)),
        throughput("save", "shardfmt.save", 0.9, "floor.write"),
        throughput("load", "shardfmt.load", 0.9, "floor.read"),
    ),
),)
