"""A distributed sampler whose cursor is global, so it reshards with the data-parallel size.

The state is ``(seed, epoch, consumed)``: the epoch's order is a permutation drawn from
``seed + epoch``, and ``consumed`` counts samples the whole job has finished. The samples
not yet consumed are dealt round-robin over the current ranks (rank r takes positions
r, r + W, ...), so

- restored on the same world size, every rank continues with exactly the samples it
  would have read next;
- restored on another world size, the job continues with exactly the samples not yet
  consumed this epoch — none skipped, none repeated except the padding below.

Every rank gets the same number of samples, so the same number of batches (a rank with one
batch fewer would leave the others waiting in a collective): with ``drop_last=True`` the
tail that does not divide over the ranks is dropped; otherwise (as ``DistributedSampler``)
the epoch is padded with fewer than W samples from its start. The padding is always the
same samples (the epoch's first), so a same-size resume still reads exactly what the
uninterrupted job would have, and ``advance`` never counts it (``consumed`` stops at the
dataset's size).

The loop reports consumption itself with ``advance(n)`` after each optimizer step (n =
samples this rank consumed, the same on every rank), so DataLoader prefetching never
moves the cursor.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from shardfmt.errors import StateDictError


class ResumableSampler(torch.utils.data.Sampler[int]):
    """Yield this rank's sample indices from the global cursor onward."""

    def __init__(self, dataset_len: int, *, seed: int = 0, shuffle: bool = True, drop_last: bool = False,
                 num_replicas: int | None = None, rank: int | None = None) -> None:
        if dataset_len < 0:
            raise StateDictError(f"dataset_len must be >= 0, got {dataset_len}")
        dist = torch.distributed
        initialized = dist.is_available() and dist.is_initialized()
        self.num_replicas = num_replicas if num_replicas is not None else (dist.get_world_size() if initialized else 1)
        self.rank = rank if rank is not None else (dist.get_rank() if initialized else 0)
        if not 0 <= self.rank < self.num_replicas:
            raise StateDictError(f"rank {self.rank} is outside {self.num_replicas} replicas")
        self.dataset_len = dataset_len
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.epoch = 0
        self.consumed = 0

    # -- order
    def _order(self) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.dataset_len)
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return torch.randperm(self.dataset_len, generator=g)

    def _remaining(self) -> torch.Tensor:
        """This epoch's samples not yet consumed, a multiple of the world size long."""
        order = self._order()
        rest = order[self.consumed:]
        w = self.num_replicas
        if self.drop_last:
            return rest[: (len(rest) // w) * w]
        pad = -len(rest) % w
        if pad and len(rest):  # from the epoch's start (cyclically when there are fewer samples than ranks)
            rest = torch.cat([rest, order.repeat(-(-pad // len(order)))[:pad]])
        return rest

    def __iter__(self) -> Iterator[int]:
        return iter(self._remaining()[self.rank :: self.num_replicas].tolist())

    def __len__(self) -> int:
        return len(self._remaining()) // self.num_replicas

    # -- the cursor
    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` (as DistributedSampler.set_epoch); the cursor resets unless it is the current one."""
        if epoch != self.epoch:
            self.epoch = int(epoch)
            self.consumed = 0

    def advance(self, n: int) -> None:
        """Record that this rank finished ``n`` more samples (every rank the same ``n``)."""
        if n < 0:
            raise StateDictError(f"advance({n}): n must be >= 0")
        self.consumed = min(self.dataset_len, self.consumed + n * self.num_replicas)

    def state_dict(self) -> dict:
        return {"seed": self.seed, "epoch": self.epoch, "consumed": self.consumed,
                "dataset_len": self.dataset_len, "shuffle": self.shuffle, "drop_last": self.drop_last}

    def load_state_dict(self, state: dict) -> None:
        if state.get("dataset_len") != self.dataset_len:
            raise StateDictError(f"sampler was saved for a dataset of {state.get('dataset_len')} samples, "
                                 f"this one has {self.dataset_len}")
        if (state.get("seed"), state.get("shuffle")) != (self.seed, self.shuffle):
            raise StateDictError("sampler seed/shuffle differ from the saved ones "
                                 f"({state.get('seed')}, {state.get('shuffle')}) != ({self.seed}, {self.shuffle})")
        saved_drop = bool(state.get("drop_last", self.drop_last))
        if saved_drop != self.drop_last:  # which samples the epoch holds: another value changes the run
            raise StateDictError(f"sampler drop_last differs from the saved one ({saved_drop} != {self.drop_last}); "
                                 "construct it with the saved value to resume")
        self.epoch = int(state["epoch"])
        self.consumed = int(state["consumed"])
