"""Step 2 of the distributed save: the ranks' agreement vector, reduced here as gloo's MAX would."""

import warnings

import pytest
import torch

from shardfmt.errors import StateDictError
from shardfmt.format import jsonvalue
from shardfmt.format.manifest import MAX_STEP
from shardfmt.saving.agreement import (
    AGREE_BUCKETS,
    Agreement,
    agreement_vector,
    check_agreement,
    value_bucket,
)


def _ranks(*states, step=1, url="/ck"):
    """Every rank's outcome of step 2: None, the warning it issued, or the error it raised."""
    vectors = [agreement_vector(failed=False, step=s.get("_step", step), url=s.get("_url", url),
                                values={k: jsonvalue.encode(v) for k, v in s.items() if not k.startswith("_")},
                                mesh=s.get("_mesh", "dp=2"))
               for s in states]
    assert len({v.shape for v in vectors}) == 1  # whatever a rank holds: no rank waits on a longer collective
    reduced = Agreement.from_reduced(torch.stack(vectors).amax(dim=0))
    out = []
    for rank, s in enumerate(states):
        values = {k: jsonvalue.encode(v) for k, v in s.items() if not k.startswith("_")}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                check_agreement(reduced, rank=rank, step=s.get("_step", step), url=s.get("_url", url),
                                values=values, check_replicas=False)
            except StateDictError as e:
                out.append(e)
                continue
        out.append(str(caught[0].message) if caught else None)
    return out


def test_equal_values_agree_whatever_their_order():
    a = {"cfg": {"lr": 0.1, "betas": (0.9, 0.95)}, "epoch": 3, "name": "run"}
    b = {"name": "run", "epoch": 3, "cfg": {"betas": (0.9, 0.95), "lr": 0.1}}
    assert _ranks(a, b, a) == [None, None, None]


def test_steps_at_the_ends_of_their_range_are_told_apart():
    for steps in ((MAX_STEP, MAX_STEP - 1), (None, 0)):
        errs = _ranks(*({"_step": s} for s in steps))
        assert all(isinstance(e, StateDictError) and "different steps" in str(e) for e in errs), errs


def test_ranks_laying_out_on_different_meshes_all_raise():
    """mesh={"dp": 2, "tp": 2} on one rank and {"dp": 4} on another: each rank would claim its
    boxes against another mesh than the one rank 0 records."""
    errs = _ranks({"_mesh": "dp=2,tp=2"}, {"_mesh": "dp=4"})
    assert all(isinstance(e, StateDictError) and "different meshes" in str(e) for e in errs), errs


def test_a_name_sharing_a_bucket_with_a_differing_value_is_named_as_such():
    other = next(f"v{i}" for i in range(10 * AGREE_BUCKETS) if value_bucket(f"v{i}") == value_bucket("loader"))
    out = _ranks({"loader": 0, other: 1}, {"loader": 1, other: 1})
    assert out[1] is None and "loader" in out[0] and other in out[0] and "sharing a digest bucket" in out[0]


def test_a_failed_rank_leaves_the_verdict_to_the_gather():
    ok = agreement_vector(failed=False, step=5, url="/a", values={})
    bad = agreement_vector(failed=True, step=None, url="", values={})
    reduced = Agreement.from_reduced(torch.maximum(ok, bad))
    assert reduced.failed
    check_agreement(reduced, rank=0, step=5, url="/a", values={}, check_replicas=True)  # no raise


@pytest.mark.parametrize("check_replicas", [False, True])
def test_only_rank_0_warns_and_check_replicas_raises_everywhere(check_replicas):
    reduced = Agreement.from_reduced(torch.maximum(
        agreement_vector(failed=False, step=1, url="/a", values={"pos": 0}),
        agreement_vector(failed=False, step=1, url="/a", values={"pos": 1})))
    for rank in (0, 1):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if check_replicas:
                with pytest.raises(StateDictError, match="pos.*check_replicas"):
                    check_agreement(reduced, rank=rank, step=1, url="/a", values={"pos": rank}, check_replicas=True)
            else:
                check_agreement(reduced, rank=rank, step=1, url="/a", values={"pos": rank}, check_replicas=False)
        assert len(caught) == (1 if rank == 0 and not check_replicas else 0)
