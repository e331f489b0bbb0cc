"""A LightningModule whose test metrics are known exactly, for the sweep tests.

``test/score`` is ``10 * score + seed`` (the seed that ``seed_everything`` set), ``test/steps``
is the number of training steps in the weights it was tested with (so a test run shows which
checkpoint it loaded), and ``fail_in`` makes a stage crash.
"""

import os
from typing import Any

import torch
from lightning.pytorch.demos.boring_classes import BoringModel


class ScoreModel(BoringModel):
    """BoringModel with exact, argument-dependent test metrics.

    Args:
        score: Sets ``test/score`` to ``10 * score + seed``.
        fail_in: ``"fit"`` or ``"test"`` raises in that stage; ``""`` never fails.
    """

    def __init__(self, score: float = 0.0, fail_in: str = "") -> None:
        super().__init__()
        self.score = score
        self.fail_in = fail_in
        self.register_buffer("steps", torch.zeros(()))

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.fail_in == "fit":
            raise RuntimeError("ScoreModel was asked to fail in fit")
        self.steps += 1
        return super().training_step(batch, batch_idx)

    def test_step(self, batch: Any, batch_idx: int) -> Any:
        if self.fail_in == "test":
            raise RuntimeError("ScoreModel was asked to fail in test")
        seed = int(os.environ["PL_GLOBAL_SEED"])
        self.log("test/score", 10 * self.score + seed)
        self.log("test/steps", self.steps)
        return super().test_step(batch, batch_idx)
