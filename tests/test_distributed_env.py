"""The ``distributed`` convention: tests spawn gloo process groups on 127.0.0.1.

Later issues (the AdERA strategy) rely on CPU/gloo collectives; this checks the convention works
on the machine that runs the suite.
"""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers.distributed import run_ranks

WORLD_SIZE = 2


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
    outputs, exit_codes = run_ranks(_all_gather_ranks, world_size=WORLD_SIZE, timeout=60)
    assert exit_codes == [0] * WORLD_SIZE
    expected = [[float(rank)] * 3 for rank in range(WORLD_SIZE)]
    assert outputs == {rank: expected for rank in range(WORLD_SIZE)}
