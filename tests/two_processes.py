"""Run a test body in two CPU processes joined by a gloo process group (torch.multiprocessing spawn)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run_two(body, tmp_path, *args) -> None:
    """body(rank, world, *args) in each of 2 processes; the first failure is raised here with its traceback."""
    mp.spawn(_entry, args=(str(tmp_path / "rendezvous"), body, args), nprocs=2, join=True)


def _entry(rank: int, path: str, body, args) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    try:
        body(rank, 2, *args)
    finally:
        dist.destroy_process_group()
