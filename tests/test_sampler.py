"""The global data cursor: same-size resumes continue exactly, resized resumes neither repeat nor skip."""

import pytest
import torch

from shardfmt.errors import StateDictError
from shardfmt.training.sampler import ResumableSampler


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
    shares = [list(s) for s in new]
    assert len({len(x) for x in shares}) == 1  # the same number of batches on every rank
    after = [i for x in shares for i in x]
    fresh = [i for i in after if i not in set(before)]
    assert sorted(before + fresh) == list(range(n))  # every sample once: none repeated, none skipped
    assert len(after) - len(fresh) < new_world  # besides them, only the padding


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


def test_epochs_differ_and_every_rank_gets_the_same_count():
    s = ResumableSampler(10, seed=0, num_replicas=3, rank=0, drop_last=True)
    assert len(s) == len(list(s)) == 3  # drop_last: 9 of 10
    padded = [list(ResumableSampler(10, seed=0, num_replicas=3, rank=r)) for r in range(3)]
    assert [len(x) for x in padded] == [4, 4, 4]  # 10 + 2 from the epoch's start
    order = list(ResumableSampler(10, seed=0))
    assert padded[1][-1] == order[0] and padded[2][-1] == order[1]
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
    with pytest.raises(StateDictError, match="drop_last differs"):  # was silently replaced by the saved one
        ResumableSampler(10, seed=0, drop_last=True).load_state_dict(s.state_dict())


@pytest.mark.parametrize("n,world,batch", [(11, 2, 5), (103, 4, 5), (1001, 8, 25), (3, 4, 2), (64, 4, 8)])
def test_uneven_epochs_give_every_rank_the_same_batches_and_cursor(n, world, batch):
    """A rank with one batch fewer would hang the others in DDP's all-reduce; cursors that differ
    by one sample would make the epoch-end save fail. Padded: neither."""
    samplers = [ResumableSampler(n, seed=3, num_replicas=world, rank=r) for r in range(world)]
    loaders = [torch.utils.data.DataLoader(range(n), batch_size=batch, sampler=s) for s in samplers]
    batches = [list(dl) for dl in loaders]
    assert len({len(b) for b in batches}) == 1
    for step in zip(*batches):
        assert len({len(b) for b in step}) == 1
        for s, b in zip(samplers, step):
            s.advance(len(b))
        assert len({s.consumed for s in samplers}) == 1
    assert samplers[0].consumed == n  # the epoch is over, padding not counted
    seen = {int(i) for b in batches for x in b for i in x}
    assert seen == set(range(n))


def test_same_world_resume_of_a_padded_epoch_reads_what_the_uninterrupted_job_would():
    n, world = 11, 2
    ref = [list(ResumableSampler(n, seed=4, num_replicas=world, rank=r)) for r in range(world)]
    a = [ResumableSampler(n, seed=4, num_replicas=world, rank=r) for r in range(world)]
    _consume(a, steps=1, batch=5)
    b = [ResumableSampler(n, seed=4, num_replicas=world, rank=r) for r in range(world)]
    for s in b:
        s.load_state_dict(a[0].state_dict())
    assert [list(s) for s in b] == [x[5:] for x in ref]
