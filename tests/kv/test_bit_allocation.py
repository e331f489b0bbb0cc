"""Static AdaKVQ bit allocation: exact against brute force, budgets, baselines, JSON, bad input."""

import itertools
import random

import pytest
import torch

from ada_modules.kv import (
    AADProfile,
    BitAllocation,
    allocate_bits,
    bits_per_element,
    solve_allocation,
)


def total(distortion, choice):
    return sum(row[k] for row, k in zip(distortion, choice, strict=True))


def random_problem(rng: random.Random, slots: int, options: int):
    costs = sorted(rng.choice([1, 1.5, 2, 2.5, 3, 4, 5, 9]) for _ in range(options))
    distortion = [
        sorted((rng.random() for _ in range(options)), reverse=True) for _ in range(slots)
    ]
    budget = rng.uniform(costs[0], costs[-1])
    return distortion, costs, budget


@pytest.mark.parametrize("trial", range(40))
def test_dp_matches_brute_force_on_up_to_six_slots(trial):
    rng = random.Random(trial)
    distortion, costs, budget = random_problem(
        rng, slots=rng.randint(1, 6), options=rng.randint(2, 4)
    )
    exact = solve_allocation(distortion, costs, budget, method="brute_force")
    dp = solve_allocation(distortion, costs, budget, method="dp")
    greedy = solve_allocation(distortion, costs, budget, method="greedy")
    for choice in (dp, greedy):
        assert sum(costs[k] for k in choice) <= budget * len(distortion) + 1e-9
    assert total(distortion, dp) == pytest.approx(total(distortion, exact), abs=1e-12)
    assert total(distortion, greedy) >= total(distortion, exact) - 1e-12


def test_greedy_is_not_always_exact_but_dp_is():
    # One slot wants the expensive option, two cheap upgrades give less: greedy takes the best
    # ratio first and then cannot afford the big jump.
    distortion = [[10.0, 9.0, 0.0], [10.0, 4.0, 4.0]]
    costs = [0, 1, 3]
    exact = solve_allocation(distortion, costs, budget=1.5, method="brute_force")
    assert total(distortion, solve_allocation(distortion, costs, 1.5, "dp")) == total(
        distortion, exact
    )
    assert total(distortion, solve_allocation(distortion, costs, 1.5, "greedy")) > total(
        distortion, exact
    )


@pytest.mark.parametrize("separate_kv", [True, False])
@pytest.mark.parametrize("layers", [2, 3])
def test_allocation_is_optimal_for_the_documented_distortion_model(separate_kv, layers):
    rng = random.Random(layers)
    aad = [rng.uniform(0.05, 0.9) for _ in range(layers)]
    widths, budget = (2, 3, 4, 8), 4.4
    alloc = allocate_bits(
        aad, budget, bit_widths=widths, separate_kv=separate_kv, key_weight=2.0, value_weight=1.0
    )
    assert alloc.average_bits() <= budget + 1e-9
    weight = [a / sum(aad) for a in aad]

    def objective(keys, values):
        return sum(
            w * (2.0 * 2.0 ** (-2 * k) + 1.0 * 2.0 ** (-2 * v))
            for w, k, v in zip(weight, keys, values, strict=True)
        )

    best = None
    for keys in itertools.product(widths, repeat=layers):
        for values in itertools.product(widths, repeat=layers) if separate_kv else [keys]:
            cost = sum(bits_per_element(b) for b in keys + values) / (2 * layers)
            if cost <= budget + 1e-9:
                value = objective(keys, values)
                best = value if best is None else min(best, value)
    assert objective(alloc.key_bits, alloc.value_bits) == pytest.approx(best, rel=1e-12)
    if not separate_kv:
        assert alloc.key_bits == alloc.value_bits


def test_far_attending_layers_get_more_bits_and_key_weight_favours_keys():
    aad = [0.05, 0.1, 0.6, 0.7]
    alloc = allocate_bits(aad, budget=4.0)
    assert alloc.key_bits[0] <= alloc.key_bits[2] and alloc.key_bits[1] <= alloc.key_bits[3]
    assert min(alloc.key_bits[2:]) > max(alloc.key_bits[:2])
    keyed = allocate_bits([0.5, 0.5], budget=3.5, key_weight=4.0)
    assert keyed.key_bits == [3, 3] and keyed.value_bits == [2, 2]


def test_budget_counts_metadata_and_the_residual_window():
    assert bits_per_element(2, group_size=32, metadata_bits=32) == 3.0
    assert bits_per_element(3, group_size=64, metadata_bits=32) == 3.5
    # 1000 quantized tokens at 3 bits/element and 24 tokens at 16 bits.
    assert bits_per_element(2, 32, 32, residual_length=24, seq_len=1024) == pytest.approx(
        (1000 * 3 + 24 * 16) / 1024
    )
    with_residual = allocate_bits([0.2, 0.8], budget=4.0, residual_length=32, seq_len=1024)
    assert with_residual.average_bits() <= 4.0
    assert with_residual.to_dict()["seq_len"] == 1024
    # Larger groups mean less metadata, so the same budget buys more bits.
    small = allocate_bits([0.2, 0.8], budget=4.0, group_size=32)
    large = allocate_bits([0.2, 0.8], budget=4.0, group_size=128)
    assert sum(large.key_bits + large.value_bits) > sum(small.key_bits + small.value_bits)


@pytest.mark.parametrize("seed", range(3))
def test_reverse_and_random_keep_the_same_bits_on_other_layers(seed):
    aad = [0.1, 0.3, 0.2, 0.7, 0.5, 0.05]
    exact = allocate_bits(aad, budget=4.2)
    reverse = allocate_bits(aad, budget=4.2, method="reverse")
    shuffled = allocate_bits(aad, budget=4.2, method="random", seed=seed)
    for other in (reverse, shuffled):
        assert sorted(other.key_bits) == sorted(exact.key_bits)
        assert sorted(other.value_bits) == sorted(exact.value_bits)
        assert other.average_bits() == exact.average_bits()
    # Reverse: the most important layer gets what the least important had, and so on.
    order = sorted(range(len(aad)), key=lambda i: -aad[i])
    for rank, layer in enumerate(order):
        assert reverse.key_bits[layer] == exact.key_bits[order[-1 - rank]]
    again = allocate_bits(aad, budget=4.2, method="random", seed=seed)
    assert again == shuffled


def test_profile_input_uses_layer_mean_and_optionally_sigma():
    naad = torch.tensor([[[0.1, 0.1, 0.1]], [[0.2, 0.2, 0.2]], [[0.1, 0.5, 0.9]]])
    profile = AADProfile(aad=naad, naad=naad, counts=torch.ones(3, dtype=torch.long))
    plain = allocate_bits(profile, budget=4.0, num_layers=3)
    assert plain.importance == pytest.approx([0.1 / 0.8, 0.2 / 0.8, 0.5 / 0.8])
    with_std = allocate_bits(profile, budget=4.0, std_weight=1.0)
    sigma = torch.tensor([0.1, 0.5, 0.9]).std(unbiased=False).item()
    assert with_std.importance[2] == pytest.approx((0.5 + sigma) / (0.8 + sigma))


def test_json_round_trip(tmp_path):
    alloc = allocate_bits([0.3, 0.1, 0.9], budget=3.7, method="greedy", group_size=64)
    path = tmp_path / "alloc.json"
    alloc.to_json(path)
    loaded = BitAllocation.from_json(path)
    assert loaded == alloc
    assert loaded.to_dict()["average_bits"] == alloc.average_bits()


def test_bad_input_raises_naming_the_value():
    with pytest.raises(ValueError, match=r"bit_widths .* got \[2, 5\]"):
        allocate_bits([0.1, 0.2], budget=4.0, bit_widths=(2, 5))
    with pytest.raises(ValueError, match="budget=2.5 is below"):
        allocate_bits([0.1, 0.2], budget=2.5)
    with pytest.raises(ValueError, match="3 layers but the model has num_layers=4"):
        allocate_bits([0.1, 0.2, 0.3], budget=4.0, num_layers=4)
    with pytest.raises(ValueError, match="method"):
        allocate_bits([0.1, 0.2], budget=4.0, method="optimal")
    with pytest.raises(ValueError, match="key_weight"):
        allocate_bits([0.1, 0.2], budget=4.0, key_weight=0.0)
    with pytest.raises(ValueError, match="finite"):
        allocate_bits([0.1, float("nan")], budget=4.0)
    with pytest.raises(ValueError, match="bits"):
        bits_per_element(1)
    with pytest.raises(ValueError, match="group_size"):
        bits_per_element(2, group_size=0)
    with pytest.raises(ValueError, match="key_bits"):
        BitAllocation(key_bits=[2, 6], value_bits=[2, 2])
    with pytest.raises(ValueError, match="one entry per layer"):
        BitAllocation(key_bits=[2, 2], value_bits=[2])
    with pytest.raises(ValueError, match="num_layers=3"):
        BitAllocation.uniform(2, 4).check_num_layers(3)
    with pytest.raises(ValueError, match="budget"):
        solve_allocation([[1.0, 0.5]], costs=[2, 3], budget=1.0)


def test_head_dim_costs_widths_as_packed():
    # 16 channels: 2 bits fill one int32 word, 3 bits two words (a 2-bit and a 1-bit plane), 4 bits
    # two words: so 3 bits store as much as 4 and an allocator that knows it never picks 3.
    assert bits_per_element(2, group_size=16, head_dim=16) == 2 + 2
    assert bits_per_element(3, group_size=16, head_dim=16) == 4 + 2
    assert bits_per_element(4, group_size=16, head_dim=16) == 4 + 2
    assert bits_per_element(3, group_size=32, head_dim=128) == bits_per_element(3, group_size=32)
    aad = [0.1, 0.3, 0.5, 0.7]
    naive = allocate_bits(aad, budget=5.0, group_size=16)
    packed = allocate_bits(aad, budget=5.0, group_size=16, head_dim=16)
    assert 3 in naive.key_bits + naive.value_bits
    assert 3 not in packed.key_bits + packed.value_bits
    assert packed.average_bits() <= 5.0
    assert BitAllocation.from_dict(packed.to_dict()) == packed
    with pytest.raises(ValueError, match="head_dim"):
        bits_per_element(2, head_dim=0)
