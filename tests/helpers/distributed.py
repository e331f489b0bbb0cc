"""Run a test's worker in forked gloo processes on 127.0.0.1 (the ``distributed`` tests).

Fork, not spawn: test modules are imported by path (importlib mode), so a spawned child could not
import the worker by name.
"""

import os
import socket
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_ranks(
    target: Callable[..., None], *args: Any, world_size: int = 2, timeout: float = 120.0
) -> tuple[dict[int, Any], list[int | None]]:
    """Run ``target(rank, port, *args, queue)`` in ``world_size`` processes.

    Each worker puts ``(rank, result)`` on the queue. Returns the results by rank and the
    processes' exit codes (after joining them).
    """
    context = mp.get_context("fork")
    queue = context.Queue()
    port = free_port()
    processes = [
        context.Process(target=target, args=(rank, port, *args, queue))
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    outputs = dict(queue.get(timeout=timeout) for _ in processes)
    for process in processes:
        process.join(timeout=60)
    return outputs, [process.exitcode for process in processes]


def set_rank_env(rank: int, port: int, world_size: int) -> None:
    """The environment Lightning's strategies read to join a process group on 127.0.0.1."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world_size),
        NODE_RANK="0",
        LOCAL_RANK=str(rank),
        RANK=str(rank),
    )
