"""The global data cursor: same-size resumes continue exactly, resized resumes neither repeat nor skip."""

import pytest
import torch

from shardfmt.sampler import ResumableSampler


def _consume(samplers, steps, batch):
    seen = []
    iters = [iter(s) for s in samplers]
    for _ in range(steps):
        for it in iters:
            seen.extend(next(it) for _ in range(batch))
        for s in samplers:
            s.advance(batch)
    return seen


@pytest.mark.parametrize("new_world", [1, 2, 3, 4])
def test_resume_on_any_world_size_covers_the_epoch_exactly_once(new_world):
    n = 103
    old = [ResumableSampler(n, seed=7, num_replicas=2, rank=r) for r in range(2)]
    old[0].set_epoch(3), old[1].set_epoch(3)
    before = _consume(old, steps=10, batch=4)
    state = old[0].state_dict()
    assert state["consumed"] == 80
    new = [ResumableSampler(n, seed=7, num_replicas=new_world, rank=r) for r in range(new_world)]
    for s in new:
        s.load_state_dict(state)
    after = [i for s in new for i in s]
    assert len(before) + len(after) == n
    assert sorted(before + after) == list(range(n))


def test_same_world_size_resume_reads_the_same_batches():
    n = 64
    ref = [ResumableSampler(n, seed=1, num_replicas=4, rank=r) for r in range(4)]
    ref_order = [list(s) for s in ref]
    a = [ResumableSampler(n, seed=1, num_replicas=4, rank=r) for r in range(4)]
    _consume(a, steps=3, batch=2)
    b = [ResumableSampler(n, seed=1, num_replicas=4, rank=r) for r in range(4)]
    for s in b:
        s.load_state_dict(a[0].state_dict())
    for r in range(4):
        assert list(b[r]) == ref_order[r][6:]


def test_epochs_differ_and_drop_last_never_pads():
    s = ResumableSampler(10, seed=0, num_replicas=3, rank=0, drop_last=True)
    assert len(list(s)) == 3
    s2 = ResumableSampler(10, seed=0, num_replicas=3, rank=2)
    assert len(s2) == 3 and len(list(s2)) == 3  # 10 = 4 + 3 + 3: no repeats to pad
    e0 = list(ResumableSampler(50, seed=0))
    s3 = ResumableSampler(50, seed=0)
    s3.set_epoch(1)
    assert list(s3) != e0 and sorted(list(s3)) == sorted(e0)


def test_dataloader_prefetch_does_not_move_the_cursor():
    s = ResumableSampler(40, seed=2)
    loader = torch.utils.data.DataLoader(list(range(40)), batch_size=4, sampler=s, num_workers=2)
    it = iter(loader)
    first = next(it)
    s.advance(4)
    assert s.consumed == 4
    assert first.tolist() == list(ResumableSampler(40, seed=2))[:4]
    del it


def test_mismatched_dataset_is_refused():
    s = ResumableSampler(10, seed=0)
    with pytest.raises(Exception, match="dataset of 10"):
        ResumableSampler(11, seed=0).load_state_dict(s.state_dict())
