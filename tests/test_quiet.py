"""silence_third_party_noise hides Lightning's notices about itself and keeps everything else."""

import warnings

import pytest

from ada_modules.quiet import silence_third_party_noise

CURVES = (
    "Be aware that when using `ckpt_path`, callbacks used to create the checkpoint need to be "
    "provided during `Trainer` instantiation. Please add the following callbacks: "
    "[\"TrainingCurves{'filename': 'curves.png'}\"]."
)


def _shown(messages: list[str], verbose: bool, monkeypatch) -> list[str]:
    if verbose:
        monkeypatch.setenv("ADA_VERBOSE", "1")
    else:
        monkeypatch.delenv("ADA_VERBOSE", raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        silence_third_party_noise()
        for message in messages:
            warnings.warn(message, stacklevel=1)
    return [str(w.message) for w in caught]


@pytest.mark.parametrize("verbose", [False, True])
def test_noise_is_hidden_unless_verbose_and_the_rest_is_kept(verbose, monkeypatch):
    noise = ["`isinstance(treespec, LeafSpec)` is deprecated, use ...", CURVES]
    kept = [
        CURVES.replace("TrainingCurves", "ModelCheckpoint"),  # the user's own callback
        "The number of training batches (2) is smaller than the logging interval",
    ]
    shown = _shown([*noise, *kept], verbose, monkeypatch)
    assert shown == ([*noise, *kept] if verbose else kept)
