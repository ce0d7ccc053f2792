"""A distributed sampler whose cursor is global, so it reshards with the data-parallel size.

The state is ``(seed, epoch, consumed)``: the epoch's order is a permutation drawn from
``seed + epoch``, and ``consumed`` counts samples the whole job has finished. The samples
not yet consumed are dealt round-robin over the current ranks (rank r takes positions
r, r + W, ...), so

- restored on the same world size, every rank continues with exactly the samples it
  would have read next;
- restored on another world size, the job continues with exactly the samples not yet
  consumed this epoch — none repeated, none skipped, never padded with repeats (with
  ``drop_last=False`` the last ranks may get one sample fewer).

The loop reports consumption itself with ``advance(n)`` after each optimizer step (n =
samples this rank consumed, the same on every rank), so DataLoader prefetching never
moves the cursor.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .errors import StateDictError


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
        rest = self._order()[self.consumed:]
        if self.drop_last:
            rest = rest[: (len(rest) // self.num_replicas) * self.num_replicas]
        return rest

    def __iter__(self) -> Iterator[int]:
        return iter(self._remaining()[self.rank :: self.num_replicas].tolist())

    def __len__(self) -> int:
        n = len(self._remaining())
        return max(0, (n - self.rank + self.num_replicas - 1) // self.num_replicas)

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
        self.epoch = int(state["epoch"])
        self.consumed = int(state["consumed"])
        self.drop_last = bool(state.get("drop_last", self.drop_last))
