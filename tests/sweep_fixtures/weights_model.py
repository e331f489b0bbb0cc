"""A ScoreModel that starts from the weights of another run, for the tests of ``fits``.

``weights`` names a Lightning checkpoint whose ``state_dict`` is loaded before fit or test, so
``test/steps`` adds up the steps of every fit in the chain that led to the tested weights.
"""

from typing import Any

import torch
from sweep_fixture_model import ScoreModel


class WeightsScoreModel(ScoreModel):
    """:class:`ScoreModel` that loads ``weights`` (a checkpoint path; ``""``: none) in ``setup``."""

    def __init__(self, weights: str = "", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.weights = weights

    def setup(self, stage: str) -> None:
        if self.weights:
            checkpoint = torch.load(self.weights, map_location="cpu", weights_only=False)
            self.load_state_dict(checkpoint["state_dict"])
