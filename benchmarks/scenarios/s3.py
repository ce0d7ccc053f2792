"""Local disk and a loopback S3 server (moto, counting at the server): shardfmt vs DCP's fsspec layer."""

from benchmarks.candidates import s3_upload_bound
from benchmarks.harness.model import Phase, Ref, Scenario, StateSpec, ratio

LOADS = ("shardfmt.load", "dcp.load", "shardfmt.load@s3", "dcp.load@s3")


def _fewer_requests(phase: str) -> object:
    return ratio(f"{phase} on S3: shardfmt's requests <= DCP's",
                 Ref(phase=phase, candidate="shardfmt.load@s3", metric="server_requests"), "<=", 1.0,
                 Ref(phase=phase, candidate="dcp.load@s3", metric="server_requests"))


SCENARIOS = (Scenario(
    name="s3",
    doc="2 ranks save to local disk and S3; loads same topology, row -> column, 2 -> 4, 2 -> 1: shardfmt vs "
        "DCP (FileSystem / Fsspec writers and readers); requests and bytes at the server",
    state=StateSpec(builder="transformer", size_mib=512, replicated=True),
    ranks=2,
    phases=(
        Phase(name="save", kind="save", candidates=("shardfmt.save", "dcp.save", "shardfmt.save@s3", "dcp.save@s3")),
        Phase(name="load", kind="load", candidates=LOADS),
        Phase(name="row->col", kind="load", layout="cols", candidates=LOADS),
        Phase(name="2->4", kind="load", world=4, candidates=LOADS),
        Phase(name="2->1", kind="load", world=1, layout="full", candidates=LOADS),
    ),
    targets=(
        ratio("2->4 on S3: bytes at the server, shardfmt / DCP <= 0.6",
              Ref(phase="2->4", candidate="shardfmt.load@s3", metric="server_bytes"), "<=", 0.6,
              Ref(phase="2->4", candidate="dcp.load@s3", metric="server_bytes")),
        *[_fewer_requests(p) for p in ("row->col", "2->4", "2->1")],
        ratio("save on S3: shardfmt's peak RSS growth < 2 x part size x parts in flight",
              Ref(phase="save", candidate="shardfmt.save@s3", metric="rss_growth"), "<=", 1.0, s3_upload_bound()),
    ),
),)
