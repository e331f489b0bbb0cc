"""A LightningModule whose test metrics are known exactly, for the sweep tests.

``test/score`` is ``10 * score + seed`` (the seed that ``seed_everything`` set), ``test/steps``
is the number of training steps in the weights it was tested with (so a test run shows which
checkpoint it loaded), ``fail_in`` makes a stage crash, and ``image`` makes fit write an image
into the run folder (as a callback such as ``ConnectivityMonitor`` would).
"""

import os
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.demos.boring_classes import BoringModel


class ScoreModel(BoringModel):
    """BoringModel with exact, argument-dependent test metrics.

    Args:
        score: Sets ``test/score`` to ``10 * score + seed``.
        fail_in: ``"fit"`` or ``"test"`` raises in that stage; ``""`` never fails.
        image: At the end of fit, write ``<default_root_dir>/images/steps_<n>.png`` (a 4x4 PNG).
    """

    def __init__(self, score: float = 0.0, fail_in: str = "", image: bool = False) -> None:
        super().__init__()
        self.score = score
        self.fail_in = fail_in
        self.image = image
        self.register_buffer("steps", torch.zeros(()))

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.fail_in == "fit":
            raise RuntimeError("ScoreModel was asked to fail in fit")
        self.steps += 1
        return super().training_step(batch, batch_idx)

    def on_train_end(self) -> None:
        if self.image:
            from PIL import Image

            folder = Path(self.trainer.default_root_dir) / "images"
            folder.mkdir(parents=True, exist_ok=True)
            Image.new("L", (4, 4)).save(folder / f"steps_{int(self.steps)}.png")

    def test_step(self, batch: Any, batch_idx: int) -> Any:
        if self.fail_in == "test":
            raise RuntimeError("ScoreModel was asked to fail in test")
        seed = int(os.environ["PL_GLOBAL_SEED"])
        self.log("test/score", 10 * self.score + seed)
        self.log("test/steps", self.steps)
        return super().test_step(batch, batch_idx)
