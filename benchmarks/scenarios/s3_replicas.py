"""Replicas loading from S3 (issue 19, part 3): 4 ranks each load the whole of a 256 MiB state
(replicated DTensors) from the loopback S3 server; the bytes it serves, counted at the server,
with the replicas sharing their reads (the default on object stores) and each reading alone."""

from benchmarks.harness.model import Phase, Ref, Scenario, StateSpec, ratio

LOADS = ("shardfmt.load@s3", "shardfmt.load@s3/alone", "dcp.load@s3")


SCENARIOS = (Scenario(
    name="s3-replicas",
    doc="4 replicas load a 256 MiB state from S3: bytes at the server and time, reads shared vs each rank alone vs DCP",
    state=StateSpec(builder="transformer", size_mib=256, replicated=True),
    ranks=2,
    phases=(
        Phase(name="source", kind="save", timed=False, candidates=("shardfmt.save@s3", "dcp.save@s3")),
        Phase(name="x4", kind="load", world=4, layout="full", candidates=LOADS),
    ),
    targets=(
        ratio("x4 on S3: bytes at the server <= 1.1x the state (the 4 ranks' bytes needed / 4)",
              Ref(phase="x4", candidate="shardfmt.load@s3", metric="server_bytes"), "<=", 1.1 / 4,
              Ref(phase="x4", candidate="shardfmt.load@s3", metric="bytes_needed")),
        ratio("x4 on S3: shared reads' time <= each rank reading alone",
              Ref(phase="x4", candidate="shardfmt.load@s3"), "<=", 1.0,
              Ref(phase="x4", candidate="shardfmt.load@s3/alone")),
    ),
),)
