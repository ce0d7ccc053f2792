import os
import sys
import time

import pytest
import torch
from hypothesis import settings

sys.path.insert(0, os.path.dirname(__file__))

from tiers import FAST_PROFILE  # noqa: E402  (tests/ is on the path from the line above)

# One I/O mode for the whole suite, in every process it starts (the direct path, the default where
# the two measure alike): which way a load or save goes must not depend on what this machine's
# disk measured today. tests/test_io_probe.py measures, with caches of its own.
os.environ.setdefault("SHARDFMT_DIRECT_IO", "1")
os.environ.setdefault("SHARDFMT_IO_MODES", "off")

FAST_BUDGET = 5.0  # seconds: a test not marked slow that takes longer is listed in the fast tier
_TOOK = pytest.StashKey[dict]()  # node id -> seconds, for the tests not marked slow


def _fast_tier(config: pytest.Config) -> bool:
    """Whether this run leaves the slow tests out (``-m "not slow"``, alone or with more)."""
    return "not slow" in " ".join((config.getoption("markexpr") or "").split())


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--fast-budget", type=float, default=None, metavar="SECONDS",
                     help=f"list the tests not marked slow that took longer than SECONDS, setup and "
                          f"teardown included (default: {FAST_BUDGET:g} in the fast tier, off otherwise; 0: off)")


def pytest_configure(config: pytest.Config) -> None:
    """In the fast tier, property tests draw fewer examples (tests/tiers.py) unless a
    ``--hypothesis-profile`` is named."""
    if _fast_tier(config) and not config.getoption("--hypothesis-profile", None):
        settings.load_profile(FAST_PROFILE)
    config.stash[_TOOK] = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    """Time each test not marked slow (setup, call and teardown) for the budget report."""
    if item.get_closest_marker("slow") is not None:
        yield
        return
    t = time.perf_counter()
    yield
    item.config.stash[_TOOK][item.nodeid] = time.perf_counter() - t


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    """Report, never fail: on a shared machine one test's time is noise; a list is a lead."""
    budget = config.getoption("--fast-budget")
    if budget is None:
        budget = FAST_BUDGET if _fast_tier(config) else 0
    over = sorted(((t, n) for n, t in config.stash[_TOOK].items() if t > budget), reverse=True) if budget else []
    if over:
        terminalreporter.section(f"tests not marked slow that took over {budget:g} s")
        for t, n in over:
            terminalreporter.write_line(f"{t:6.1f} s  {n}")
        terminalreporter.write_line("(a module-scoped fixture's setup counts in its first test; on a busy "
                                    "machine, time again before marking one slow)")


@pytest.fixture
def ckpt_dir(tmp_path):
    return str(tmp_path / "ckpt")


def flip_byte(path: str, offset: int, mask: int = 1) -> None:
    """Corrupt one byte of a file in place (XOR with ``mask``), as a failing disk would."""
    with open(path, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ mask]))


def bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (NaN-safe), same dtype and shape."""
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def as_next_format_version(path: str, where: str) -> None:
    """Make the committed checkpoint at ``path`` look as format version 3 might: its manifest
    says 3 (COMMITTED re-signed; the body still a valid version 2 one), or (``where`` =
    "COMMITTED") its COMMITTED carries ``format_version`` 3 and a field version 2 does not know."""
    import orjson

    from shardfmt.format import hashing

    with open(os.path.join(path, "manifest.json"), "rb") as f:
        raw = f.read()
    obj = orjson.loads(raw)
    commit = {"format": "shardfmt", "save_id": obj["save_id"]}
    if where == "manifest":
        obj["format_version"] = 3
        raw = orjson.dumps(obj, option=orjson.OPT_SORT_KEYS) + b"\n"
        with open(os.path.join(path, "manifest.json"), "wb") as f:
            f.write(raw)
    else:
        commit.update(format_version=3, manifest_index={"shards": 1})
    commit["manifest_digest"] = hashing.digest_bytes(raw)
    with open(os.path.join(path, "COMMITTED"), "wb") as f:
        f.write(orjson.dumps(commit, option=orjson.OPT_SORT_KEYS) + b"\n")
