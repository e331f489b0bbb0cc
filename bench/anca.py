"""aNCA on CPU: the regime of the puzzles, what deformable perception costs, what was learned.

1. **Premise** (always): what the test puzzles ask of a rule that sees 3x3 per step. Mazes of
   side 9, 13, 17 and 25 (the sweep's train and test sides): the shortest path's length in cells
   (mean, 95th percentile, max), the fraction of mazes whose path is longer than the steps the
   rule gets (20 at side 9, in proportion to the side above), and how far the farthest corridor
   cell is from the nearer end of the path. 9x9 Sudoku with 36-45 givens: the fraction of blanks that are naked
   singles (one candidate left from the row, column and box) and how many such rounds solve the
   puzzle; the fraction of a cell's 20 peers inside its 3x3 window.
2. **Overhead** (always): parameters and forward+backward time of one training pass (batch 16,
   9x9 mazes, 20 steps, one thread) of the plain NCA and aNCA with both deformable backends.
3. **Learned models** (``--sweep DIR``, a finished ``ada sweep cli_configs/anca/repro.yaml``):
   ``exact_by_side.png`` (test/exact against the maze side, mean ± std over seeds, per arm),
   ``maze_steps.png`` (one 17x17 test maze: the seed-0 models' path probability after
   increasing numbers of steps) and the learned offsets of the seed-0 aNCA models (mean tap
   displacement in cells on test puzzles).

Writes ``anca.json`` (and the PNGs) to ``--out``. Reports only; no assertion on the numbers.

    python bench/anca.py --out /tmp/anca
    python bench/anca.py --sweep sweeps/anca --out docs/techniques/img/anca
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import deque
from pathlib import Path

import matplotlib
import numpy as np
import torch

from ada_modules.data.mazes import generate_maze, maze_tensors
from ada_modules.data.sudoku import generate_sudoku, sudoku_tensors
from ada_modules.models import MazeNCAModule, SudokuNCAModule
from ada_modules.nn.anca import NeuralCellularAutomaton

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

SIDES = (9, 13, 17, 25)  # the sides of cli_configs/anca/repro.yaml; it trains on the first
TRAIN_STEPS = 20  # at side 9; the sweep scales the test steps with the side


def _distances(open_cells: np.ndarray, source: tuple[int, int]) -> np.ndarray:
    """Corridor distance of every cell from ``source`` (-1: unreachable)."""
    dist = np.full(open_cells.shape, -1)
    dist[source] = 0
    queue = deque([source])
    while queue:
        r, c = queue.popleft()
        for nr, nc in ((r + 1, c), (r - 1, c), (r, c + 1), (r, c - 1)):
            if open_cells[nr, nc] and dist[nr, nc] < 0:
                dist[nr, nc] = dist[r, c] + 1
                queue.append((nr, nc))
    return dist


def maze_regime(count: int) -> list[dict]:
    rows = []
    for side in SIDES:
        rng = np.random.default_rng([0, side])
        steps = round(TRAIN_STEPS * side / SIDES[0])
        lengths, reach = [], []
        for _ in range(count):
            maze = generate_maze(side, rng)
            lengths.append(int(maze.path.sum()))
            # every corridor cell must learn whether it is on the path: how far is the farthest
            # one from the nearer end (information travels one cell per step in a plain NCA)
            nearer = np.minimum(_distances(maze.open, maze.start), _distances(maze.open, maze.end))
            reach.append(int(nearer[maze.open].max()))
        lengths_arr = np.array(lengths)
        rows.append(
            {
                "side": side,
                "steps": steps,
                "path_mean": float(lengths_arr.mean()),
                "path_p95": float(np.percentile(lengths_arr, 95)),
                "path_max": int(lengths_arr.max()),
                "path_longer_than_steps": float((lengths_arr > steps).mean()),
                "farthest_cell_mean": float(np.mean(reach)),
            }
        )
    return rows


def _candidates(board: np.ndarray, r: int, c: int, box: int) -> set[int]:
    n = box * box
    seen = set(board[r]) | set(board[:, c])
    br, bc = box * (r // box), box * (c // box)
    seen |= set(board[br : br + box, bc : bc + box].ravel())
    return set(range(1, n + 1)) - seen


def sudoku_regime(count: int) -> dict:
    rng = np.random.default_rng(0)
    singles, rounds, solved = [], [], 0
    for _ in range(count):
        puzzle, _ = generate_sudoku(3, int(rng.integers(36, 46)), rng)
        board = puzzle.copy()
        first = None
        for step in range(1, 82):
            blanks = list(zip(*np.nonzero(board == 0), strict=True))
            if not blanks:
                solved += 1
                rounds.append(step - 1)
                break
            moves = {}
            for r, c in blanks:
                options = _candidates(board, r, c, 3)
                if len(options) == 1:
                    moves[(r, c)] = options.pop()
            if first is None:
                first = len(moves) / len(blanks)
            if not moves:
                break
            for (r, c), digit in moves.items():
                board[r, c] = digit
        singles.append(first)
    return {
        "givens": "36-45",
        "naked_singles_first_round": statistics.mean(singles),
        "solved_by_naked_singles": solved / count,
        "rounds_mean": statistics.mean(rounds) if rounds else None,
        "peers_in_3x3_window": _peers_in_window(),
        "steps_to_see_all_peers": 8,  # a row's far end is 8 cells away; 3x3 moves 1 per step
    }


def _peers_in_window() -> float:
    """Mean fraction of a cell's 20 peers (row, column, box) inside its 3x3 window."""
    fractions = []
    for r in range(9):
        for c in range(9):
            inside = 0
            for dr in (-1, 0, 1):
                for dc in (-1, 0, 1):
                    pr, pc = r + dr, c + dc
                    if (dr, dc) == (0, 0) or not (0 <= pr < 9 and 0 <= pc < 9):
                        continue
                    same_box = (pr // 3, pc // 3) == (r // 3, c // 3)
                    inside += pr == r or pc == c or same_box
            fractions.append(inside / 20)
    return statistics.mean(fractions)


def _pass_time(nca: NeuralCellularAutomaton, inputs: torch.Tensor, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        nca(inputs, TRAIN_STEPS).square().mean().backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def overhead(rounds: int) -> list[dict]:
    torch.manual_seed(0)
    inputs = maze_tensors([generate_maze(SIDES[0], np.random.default_rng(i)) for i in range(16)])[0]
    arms = {
        "plain NCA": {"deformable": False},
        "aNCA (grid_sample)": {"backend": "grid_sample"},
        "aNCA (torchvision)": {"backend": "torchvision"},
    }
    nets = {name: NeuralCellularAutomaton(3, 2, **kwargs) for name, kwargs in arms.items()}
    for net in nets.values():
        _pass_time(net, inputs, 1)  # warm-up
    times = {name: _pass_time(net, inputs, rounds) for name, net in nets.items()}
    base = times["plain NCA"]
    return [
        {
            "arm": name,
            "params": sum(p.numel() for p in net.parameters()),
            "seconds": times[name],
            "relative": times[name] / base,
        }
        for name, net in nets.items()
    ]


def _load(sweep: Path, fit: str, cls: type) -> torch.nn.Module:
    path = sweep / "shared_fit" / fit / "seed_0" / "checkpoints" / "last.ckpt"
    return cls.load_from_checkpoint(path, map_location="cpu").eval()


def _offset_magnitude(module, inputs: torch.Tensor) -> float:
    """Mean tap displacement (cells) over the steps of a rollout on ``inputs``."""
    nca, sizes = module.nca, []

    def hook(perception, args):
        offset, _ = perception.sampling(args[0])
        sizes.append(offset.view(offset.shape[0], 9, 2, *offset.shape[2:]).norm(dim=2).mean())

    handle = nca.perception.register_forward_pre_hook(hook)
    with torch.no_grad():
        module(inputs)
    handle.remove()
    return float(torch.stack(sizes).mean())


def learned(sweep: Path, out: Path) -> dict:
    records = json.loads((sweep / "results.json").read_text())["runs"]
    by_variant: dict[str, list[float]] = {}
    for record in records:
        if record["status"] == "ok":
            by_variant.setdefault(record["variant"], []).append(record["metrics"]["test/exact"])
    missing = [
        f"maze_{arm}_{side}"
        for arm in ("nca", "anca")
        for side in SIDES
        if f"maze_{arm}_{side}" not in by_variant
    ]
    if missing:
        raise SystemExit(f"{sweep} has no successful run of {', '.join(missing)}")
    fig, ax = plt.subplots(figsize=(5, 3.2))
    for arm, label in (("nca", "plain NCA"), ("anca", "aNCA")):
        runs = [by_variant[f"maze_{arm}_{side}"] for side in SIDES]
        means = [statistics.mean(values) for values in runs]
        stds = [statistics.pstdev(values) for values in runs]
        ax.errorbar(SIDES, means, yerr=stds, marker="o", capsize=3, label=label)
    ax.set_xlabel(f"maze side (trained on {SIDES[0]}; steps in proportion)")
    ax.set_ylabel("test/exact (whole path right)")
    ax.set_xticks(SIDES)
    ax.set_ylim(-0.02, 1.02)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "exact_by_side.png", dpi=120)
    plt.close(fig)

    models = {arm: _load(sweep, f"maze_{arm}", MazeNCAModule) for arm in ("nca", "anca")}
    maze = generate_maze(SIDES[2], np.random.default_rng([7, SIDES[2]]))
    inputs, target = maze_tensors([maze])
    shown = (5, 10, 20, 38, 76)  # 38: the sweep's steps at side 17, 76: twice that
    fig, axes = plt.subplots(2, len(shown) + 1, figsize=(2.1 * (len(shown) + 1), 4.4))
    for row, (arm, module) in enumerate(models.items()):
        torch.manual_seed(0)
        with torch.no_grad():
            every = module.nca(inputs, max(shown), all_steps=True).softmax(dim=2)[:, 0, 1]
        axes[row, 0].imshow(maze.open + 2 * target[0].numpy(), cmap="gray_r")
        axes[row, 0].set_title("maze and path" if row == 0 else "", fontsize=8)
        for col, step in enumerate(shown, start=1):
            ax = axes[row, col]
            ax.imshow(every[step - 1].numpy(), vmin=0, vmax=1, cmap="magma")
            ax.contour(maze.open, levels=[0.5], colors="0.6", linewidths=0.3)
            ax.set_title(f"{'aNCA' if arm == 'anca' else 'plain'}: step {step}", fontsize=8)
        for ax in axes[row]:
            ax.set_xticks([])
            ax.set_yticks([])
    fig.tight_layout()
    fig.savefig(out / "maze_steps.png", dpi=120)
    plt.close(fig)

    report = {"exact_by_variant": {k: statistics.mean(v) for k, v in by_variant.items()}}
    test = maze_tensors(
        [generate_maze(SIDES[2], np.random.default_rng([8, i])) for i in range(32)]
    )[0]
    report["maze_anca_offset_cells"] = _offset_magnitude(models["anca"], test)
    sudoku = _load(sweep, "sudoku_anca", SudokuNCAModule)
    rng = np.random.default_rng(9)
    pairs = [generate_sudoku(3, 40, rng, unique=False) for _ in range(32)]
    sudoku_inputs = sudoku_tensors([p for p, _ in pairs], [s for _, s in pairs])[0]
    report["sudoku_anca_offset_cells"] = _offset_magnitude(sudoku, sudoku_inputs)
    return report


def _table(rows: list[dict]) -> str:
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for row in rows:
        cells = [f"{v:.3g}" if isinstance(v, float) else str(v) for v in row.values()]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench_out/anca"))
    parser.add_argument("--sweep", type=Path, default=None, help="a finished repro sweep folder")
    parser.add_argument("--quick", action="store_true", help="fewer puzzles and rounds")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    report = {
        "maze_regime": maze_regime(50 if args.quick else 1000),
        "sudoku_regime": sudoku_regime(10 if args.quick else 200),
        "overhead": overhead(1 if args.quick else 5),
    }
    print("## Premise: mazes\n\n" + _table(report["maze_regime"]) + "\n")
    print("## Premise: Sudoku\n\n" + _table([report["sudoku_regime"]]) + "\n")
    print("## Overhead (batch 16, 9x9, 20 steps, one thread)\n\n" + _table(report["overhead"]))
    if args.sweep is not None:
        report["learned"] = learned(args.sweep, args.out)
        print("\n## Learned\n\n" + json.dumps(report["learned"], indent=2))
    (args.out / "anca.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
