"""ASAP and baseline attacks against robust rules with a ResNet-18 and 50 clients, on one GPU.

The CPU mini reproduction (``cli_configs/asap/repro.yaml``, an MLP on 8x8 digits, 20 clients) at a
larger scale, through the same library path (:class:`~ada_modules.data.FederatedDataModule`,
:class:`~ada_modules.models.FederatedSimulationModule`, clients vectorised with ``torch.func``): a
ResNet-18 (GroupNorm instead of BatchNorm, so clients vectorise; 11.2M parameters) on generated
32x32 colour images of 10 classes (a smooth random pattern per class plus pixel noise and a random
shift), 50 clients with Dirichlet(0.5) label skew, 10 of them malicious, FedSGD with 32 images per
client and round, 100 rounds, attacks from round 30, target half the accuracy at round 30
(band ±0.05). Rules: mean, coordinate median, Multi-Krum; attacks: none, LIE, Min-Max, ASAP
(direction mean, envelope 5); seed 0, in that order while the time guard allows (420 s).

Prints one table: per rule and attack, the clean accuracy at the attack's start, the final
accuracy, the rounds to reach the target band (5 rounds in a row; all 70 attacked rounds when
never), the deviation after reaching, the mean deviation over the last 10 rounds, the share of
the malicious updates the rule kept, and the wall time per round. Writes ``$OUT/asap.json`` when
``OUT`` is set.

``--device cpu --quick`` runs a tiny version in seconds (a smoke test, numbers meaningless).
Exits non-zero without CUDA unless ``--device cpu``.
"""

import argparse
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from _common import (  # bench/gpu/_common.py
    add_run_arguments,
    bench_device,
    finish_runs,
    quiet_trainer,
)
from lightning.pytorch import seed_everything
from torch import nn
from torch.utils.data import TensorDataset
from torchvision.models import resnet18

from ada_modules.data import FederatedDataModule, SplitDataModule
from ada_modules.fl import ASAP, LIE, MinMax
from ada_modules.models import FederatedSimulationModule

SLUG = "asap"
RULES = ("mean", "median", "multi_krum")
ATTACKS = {
    "none": lambda: None,
    "lie": LIE,
    "min_max": MinMax,
    "asap": lambda: ASAP(direction="mean", envelope=5.0),
}
METRICS = (
    "clean_accuracy",
    "accuracy_final",
    "rounds_to_target",
    "deviation_after_reach",
    "final_deviation",
    "malicious_kept",
)


@dataclass(frozen=True)
class Size:
    samples: int
    image: int
    clients: int
    malicious: int
    rounds: int
    attack_start: int
    batch: int
    small: bool  # a tiny CNN instead of the ResNet-18, and two rules x two attacks (smoke test)


FULL = Size(samples=24_000, image=32, clients=50, malicious=10, rounds=100, attack_start=30,
            batch=32, small=False)  # fmt: skip
QUICK = Size(samples=600, image=16, clients=6, malicious=1, rounds=5, attack_start=2, batch=4,
             small=True)  # fmt: skip


class GeneratedImages(SplitDataModule):
    """Colour images of 10 classes: a smooth random pattern per class, noise and a random shift."""

    def __init__(self, samples: int, image: int, seed: int = 0) -> None:
        super().__init__(seed=seed, batch_size=256)
        self.samples, self.image = samples, image

    def setup(self, stage: str) -> None:
        if self.datasets:
            return
        generator = torch.Generator().manual_seed(self.seed)
        patterns = torch.randn(10, 3, 4, 4, generator=generator)
        patterns = F.interpolate(patterns, size=self.image, mode="bilinear", align_corners=False)
        labels = torch.randint(10, (self.samples,), generator=generator)
        images = patterns[labels] + 1.5 * torch.randn(
            self.samples, 3, self.image, self.image, generator=generator
        )
        shifts = torch.randint(-3, 4, (self.samples, 2), generator=generator)
        for i, (dy, dx) in enumerate(shifts.tolist()):
            images[i] = images[i].roll((dy, dx), dims=(1, 2))
        val, test = self.samples // 10, self.samples // 10
        self.datasets = {
            "val": TensorDataset(images[:val], labels[:val]),
            "test": TensorDataset(images[val : val + test], labels[val : val + test]),
            "train": TensorDataset(images[val + test :], labels[val + test :]),
        }


def model(small: bool) -> nn.Module:
    """ResNet-18 for 10 classes with GroupNorm (no running statistics: clients vectorise)."""
    if small:
        return nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10),
        )  # fmt: skip
    return resnet18(num_classes=10, norm_layer=lambda channels: nn.GroupNorm(8, channels))


def run(rule: str, attack: str, size: Size, device: torch.device) -> dict[str, Any]:
    seed_everything(0, verbose=False)
    module = FederatedSimulationModule(
        model=model(size.small),
        aggregator=rule,
        attack=ATTACKS[attack](),
        num_malicious=size.malicious,
        client_lr=0.05,
        attack_start=size.attack_start,
    )
    data = FederatedDataModule(
        GeneratedImages(size.samples, size.image),
        num_clients=size.clients,
        rounds=size.rounds,
        batch_size=size.batch,
        root_size=100,
        auxiliary_size=200,
    )
    trainer = quiet_trainer(device, max_epochs=1, limit_val_batches=None)
    begin = time.perf_counter()
    trainer.fit(module, data)
    wall = time.perf_counter() - begin
    metrics = module.round_metrics()
    return {
        "rule": rule,
        "attack": attack,
        **{name: metrics.get(name) for name in METRICS},
        "curve": module.curve,
        "s_per_round": wall / size.rounds,
    }


def cell(value: float | None) -> str:
    return "–" if value is None else f"{value:.3g}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_run_arguments(parser)
    args = parser.parse_args(argv)
    found = bench_device(args.device)
    if found is None:
        return 1
    device, name = found
    size = QUICK if args.quick else FULL
    print(f"# ASAP GPU benchmark ({'quick' if args.quick else 'full'}) on {name}\n")
    begin = time.perf_counter()
    runs: list[dict[str, Any]] = []
    skipped: list[str] = []
    per_run = 0.0
    for rule in RULES[:2] if size.small else RULES:
        for attack in ("none", "asap") if size.small else ATTACKS:
            if runs and time.perf_counter() - begin + per_run * 1.2 > args.budget_s:
                skipped.append(f"{rule}/{attack}")
                continue
            tic = time.perf_counter()
            runs.append(run(rule, attack, size, device))
            per_run = max(per_run, time.perf_counter() - tic)
            print(f"{rule} / {attack}: final accuracy {cell(runs[-1]['accuracy_final'])}")
    print("\n| rule | attack | " + " | ".join(METRICS) + " | s / round |")
    print("| --- | --- |" + " ---: |" * (len(METRICS) + 1))
    for record in runs:
        cells = " | ".join(cell(record[m]) for m in METRICS)
        print(f"| {record['rule']} | {record['attack']} | {cells} | {record['s_per_round']:.3f} |")
    finish_runs(SLUG, name, args.quick, begin, skipped, runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
