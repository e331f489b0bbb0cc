import pytest
import torch

from ada_modules.fl.asap import ASAP
from ada_modules.fl.attack import AttackContext
from ada_modules.fl.round_metrics import deviation_after, rounds_to_reach_and_stay


def _context(metric, round_=0, target=0.45):
    return AttackContext(
        num_clients=20, num_malicious=4, round=round_, metric=metric, target=target
    )


def test_crafts_identical_rows_along_the_benign_mean_within_the_envelope(seed):
    attack = ASAP(envelope=1.5)
    benign = torch.randn(16, 50) * 0.1 + 0.2
    malicious = attack.craft(benign, _context(0.9))
    assert malicious.shape == (4, 50)
    assert torch.equal(malicious, malicious[:1].expand(4, -1))  # one cluster: Krum's tactic
    mu = benign.mean(0)
    p = torch.sign(mu) * benign.std(0, correction=0)  # the default direction, signed_std
    torch.testing.assert_close(malicious[0], mu - attack.last_input * p)
    assert attack.last_input > 0  # far above the target: pushes against the benign direction
    radius = (benign - mu).norm(dim=1).max()
    assert (malicious[0] - mu).norm() <= 1.5 * radius * (1 + 1e-5)
    assert attack.saturated  # a push of 0.45 accuracy needs more than the envelope allows here


def test_reset_forgets_the_estimates():
    attack = ASAP(envelope=None)
    benign = torch.ones(3, 2)
    first = attack.craft(benign, _context(0.8))
    attack.craft(benign, _context(0.7, round_=1))
    attack.reset()
    torch.testing.assert_close(attack.craft(benign, _context(0.8)), first)


def test_below_the_target_it_helps_training():
    attack = ASAP(envelope=None, direction="mean")
    benign = torch.ones(3, 2)
    attack.craft(benign, _context(0.9))
    attack.craft(benign, _context(0.2, round_=1))  # overshot below 0.45
    assert attack.last_input < 0  # m = (1 - u) mu amplifies the benign direction


def test_closed_loop_on_a_plant_whose_gain_depends_on_the_rule():
    """A stand-in for a federated run: accuracy climbs by benign training and falls with the
    attack's input through an unknown rule gain (a robust rule passes a tenth of it)."""
    for rule_gain in (1.0, 0.1):
        attack = ASAP(envelope=None, direction="mean", max_input=50.0)
        accuracy, trace = 0.9, []
        for t in range(80):
            malicious = attack.craft(torch.ones(4, 3), _context(accuracy, t))
            u = 1 - float(malicious[0, 0])
            accuracy = min(1.0, max(0.0, accuracy + 0.01 * (1 - accuracy) - 0.02 * rule_gain * u))
            trace.append(accuracy)
        reached = rounds_to_reach_and_stay(trace, target=0.45, band=0.05)
        assert reached is not None and reached <= 40, (rule_gain, trace[:40])
        assert deviation_after(trace, 0.45, reached) <= 0.02


def test_round_metrics():
    assert rounds_to_reach_and_stay([0.9, 0.6, 0.45, 0.44], 0.45, 0.05, window=2) == 2
    assert rounds_to_reach_and_stay([0.45, 0.45], 0.45, 0.05, window=2) == 0
    assert rounds_to_reach_and_stay([0.45, 0.9, 0.45, 0.45], 0.45, 0.05, window=2) == 2
    assert rounds_to_reach_and_stay([0.45, 0.9], 0.45, 0.05, window=2) is None
    assert rounds_to_reach_and_stay([0.9, 0.45], 0.45, 0.05, window=1) == 1
    with pytest.raises(ValueError, match="window"):
        rounds_to_reach_and_stay([0.5], 0.45, 0.05, window=0)
    assert deviation_after([0.9, 0.5, 0.4], 0.45, 1) == pytest.approx(0.05)
    assert deviation_after([0.9], 0.45, None) is None
    with pytest.raises(ValueError, match="band"):
        rounds_to_reach_and_stay([0.5], 0.45, 0.0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"envelope": 0.0}, "envelope"),
        ({"gain": 0.1}, "gain"),
        ({"max_input": -1.0}, "max_input"),
    ],
)
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ASAP(**kwargs)


def test_craft_needs_a_measurement_and_two_benign_updates():
    with pytest.raises(ValueError, match="metric"):
        ASAP().craft(torch.ones(3, 2), _context(None))
    with pytest.raises(ValueError, match="target"):
        ASAP().craft(torch.ones(3, 2), _context(0.9, target=None))
    with pytest.raises(ValueError, match="benign"):
        ASAP().craft(torch.ones(1, 2), _context(0.9))


def test_pass_through_is_read_from_the_new_global_model_and_the_envelope_finds_krums_region():
    """Under the mean f/n of the deviation passes; Krum drops far updates, so the envelope shrinks
    until the copies are selected (the attack never calls the rule)."""
    from ada_modules.fl.aggregators import krum, mean

    for rule in (mean, krum):
        generator = torch.Generator().manual_seed(0)
        attack = ASAP(envelope=5.0)
        params, passed, selected = torch.zeros(500), [], []
        for round_ in range(30):
            benign = torch.randn(16, 500, generator=generator) * 0.5 + 1.0
            context = _context(0.9, round_)  # far above the target: always pushing
            context.global_params = params
            malicious = attack.craft(benign, context)
            result = rule(torch.cat([benign, malicious]), 4)
            params = params + result.update
            selected.append(bool(result.kept[16:].sum() > 0))
            if attack.pass_through is not None:
                passed.append(attack.pass_through)
        if rule is mean:
            assert passed == pytest.approx([4 / 20] * len(passed), abs=1e-4)
            assert attack.envelope_scale == 1.0
        else:
            assert not any(selected[:2])  # at 5 benign radii Krum drops the copies
            assert sum(selected[6:]) >= 16  # after shrinking it mostly selects them
            assert 0.1 < attack.envelope_scale < 0.5
