"""The ``distributed`` convention: tests spawn gloo process groups on 127.0.0.1.

Later issues (the AdERA strategy) rely on CPU/gloo collectives; this checks the convention works
on the machine that runs the suite.
"""

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD_SIZE = 2


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _all_gather_ranks(rank: int, port: int, results: "mp.Queue") -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE
    )
    try:
        gathered = [torch.empty(3) for _ in range(WORLD_SIZE)]
        dist.all_gather(gathered, torch.full((3,), float(rank)))
        results.put((rank, [t.tolist() for t in gathered]))
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_gloo_all_gather_on_loopback():
    # fork: the test module is imported by path (importlib mode), so a spawned child could not
    # import the target function by name.
    context = mp.get_context("fork")
    results = context.Queue()
    port = _free_port()
    processes = [
        context.Process(target=_all_gather_ranks, args=(rank, port, results))
        for rank in range(WORLD_SIZE)
    ]
    for process in processes:
        process.start()
    outputs = dict(results.get(timeout=60) for _ in processes)
    for process in processes:
        process.join(timeout=60)
        assert process.exitcode == 0
    expected = [[float(rank)] * 3 for rank in range(WORLD_SIZE)]
    assert outputs == {rank: expected for rank in range(WORLD_SIZE)}
