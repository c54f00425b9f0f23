"""One run on several processes: DistributedDataParallel over ``trainer.devices`` GPUs (NCCL) or CPU processes
(gloo), or inside ``torchrun --nproc_per_node=N -m lra ...``.

The global batch and the schedule stay the task's: every rank draws the same global batch of indices and trains on
its share (``indices[rank::world_size]``; shares differ by one where the ranks do not divide the batch, and each
rank's loss is weighted by its share), DDP averages the gradients, so the update equals the single-process one up
to floating-point order. The ranks share each evaluation (each its share of the batches, with rank 0's buffers);
rank 0 alone writes checkpoints, rows and logs, while the others wait at a barrier.
"""
from __future__ import annotations

import os
import signal
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lra.errors import EXIT_INTERRUPTED


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    def shard(self, indices: torch.Tensor) -> torch.Tensor:
        """This rank's share of a global batch of indices (``share`` of them)."""
        return indices[self.rank :: self.size]

    def share(self, batch_size: int) -> int:
        """How many of a global batch of ``batch_size`` this rank trains on: shares differ by one at most when the
        ranks do not divide it."""
        return len(range(self.rank, batch_size, self.size))

    def loss_weight(self, batch_size: int) -> float:
        """What this rank's mean loss is multiplied by before its backward, so that DDP's average of the ranks'
        gradients is the gradient of the global batch's mean loss with unequal shares too: size x share / batch
        (1 when the ranks divide the batch)."""
        return self.size * self.share(batch_size) / batch_size

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        """The sum of a per-rank count over the ranks (each rank evaluates its share of a split)."""
        if self.distributed:
            value = value.clone()
            dist.all_reduce(value, op=dist.ReduceOp.SUM)
        return value

    def mean(self, value: torch.Tensor, batch_size: int) -> torch.Tensor:
        """The global batch's mean of a per-rank mean over the rank's share (its training loss): the ranks' values
        weighted by their shares."""
        return self.sum(value * (self.share(batch_size) / batch_size))

    def broadcast_buffers(self, module: torch.nn.Module) -> None:
        """Rank 0's buffers to every rank, in place."""
        if self.distributed:
            for buffer in module.buffers():
                dist.broadcast(buffer, src=0)

    def any(self, flags: torch.Tensor) -> torch.Tensor:
        """Elementwise OR of a small flag tensor over the ranks (stop requested, non-finite loss)."""
        if self.distributed:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return flags


SINGLE = World()  # one process


def from_env() -> World:
    """The world torchrun (or our own launcher) describes in the environment; a single process otherwise."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return World(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0)))
    return World()


def init(world: World, device: torch.device) -> None:
    if world.distributed and not dist.is_initialized():
        # evaluation on rank 0 can take minutes (a pass over 25K 4K-byte reviews) while the others wait
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=world.rank,
                                world_size=world.size, timeout=timedelta(hours=2))


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, size: int, port: int, fn, args) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), LRA_LOCAL_JOBS=f"{size * float(os.environ.get('LRA_LOCAL_JOBS', '1')):g}")
    fn(*args)


def spawn(size: int, fn, *args) -> None:
    """Run ``fn(*args)`` in ``size`` fresh processes forming one world; SIGINT/SIGTERM/SIGUSR2 reach every rank
    (each finishes its step and rank 0 checkpoints). Raises ``SystemExit(EXIT_INTERRUPTED)`` when the ranks
    stopped on a signal, ``RuntimeError`` when one failed."""
    ctx = mp.start_processes(_worker, args=(size, free_port(), fn, args), nprocs=size, join=False,
                             start_method="spawn")

    def forward(signum, frame):
        for p in ctx.processes:
            if p.is_alive():
                os.kill(p.pid, signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR2)}
    try:
        while not ctx.join():
            pass
    except mp.ProcessExitedException as e:
        if e.exit_code == EXIT_INTERRUPTED:
            raise SystemExit(EXIT_INTERRUPTED) from None
        raise RuntimeError(f"rank {e.error_index} of the data-parallel run exited with code {e.exit_code}") from None
    finally:
        for s, h in old.items():
            signal.signal(s, h)
