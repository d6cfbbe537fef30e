"""The processes of one run: rank, world size and the three collectives `predict` needs.

One process: no process group at all (nothing to wait for). Under torchrun (WORLD_SIZE > 1):
accelerate's PartialState, which picks NCCL on GPUs (one per local rank) and gloo with
`cpu=True`. Without `cpu=True` on a CPU machine each rank would run alone and redo all the work.
"""

from __future__ import annotations

import datetime as dt
import os
from dataclasses import dataclass
from typing import Any, Protocol

import torch


class Group(Protocol):
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int

    @property
    def is_main(self) -> bool: ...

    def broadcast(self, obj: Any) -> Any: ...

    def all_gather(self, obj: Any) -> list[Any]: ...

    def close(self) -> None: ...


@dataclass
class Single:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1

    @property
    def is_main(self) -> bool:
        return True

    def broadcast(self, obj: Any) -> Any:
        return obj

    def all_gather(self, obj: Any) -> list[Any]:
        return [obj]

    def close(self) -> None:
        pass


class Distributed:
    """Rank 0 decides (the work plan) and broadcasts; everyone gathers the per-rank summaries."""

    def __init__(self, *, cpu: bool, timeout_s: float):
        from accelerate import PartialState

        # The timeout bounds every collective: the final gather waits for the slowest rank's whole share.
        self.state = PartialState(cpu=cpu, timeout=dt.timedelta(seconds=timeout_s))
        self.rank = self.state.process_index
        self.local_rank = self.state.local_process_index
        self.world_size = self.state.num_processes
        self.local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))
        self.device = self.state.device  # cuda:<local rank> under NCCL, cpu under gloo

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def broadcast(self, obj: Any) -> Any:
        box = [obj if self.is_main else None]
        torch.distributed.broadcast_object_list(box, src=0)  # NCCL: through the current CUDA device
        return box[0]

    def all_gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(out, obj)
        return out

    def close(self) -> None:
        self.state.destroy_process_group()


def under_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def start(*, cpu: bool, timeout_s: float) -> Group:
    return Distributed(cpu=cpu, timeout_s=timeout_s) if under_torchrun() else Single()
