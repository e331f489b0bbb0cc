"""Text environments and their task DataModule: determinism, rewards, demonstrators, bad input."""

import random

import pytest

from ada_modules.data import CharTokenizer, EnvTaskDataModule
from ada_modules.posttrain.envs import ArithmeticEnv, KeyDoorEnv


def _demo_success(env, n: int = 400) -> float:
    rng = random.Random(0)
    return sum(env.demonstrate(seed, rng).success for seed in range(n)) / n


def test_key_door_tasks_are_deterministic_and_varied():
    env = KeyDoorEnv()
    assert env.task_id(5) == env.task_id(5)
    assert env.reset(5).observation == env.reset(5).observation
    assert len({env.task_id(seed) for seed in range(200)}) > 190


def test_key_door_observations_are_in_the_tokenizer_vocabulary():
    env = KeyDoorEnv()
    tokenizer = CharTokenizer()
    transcript = env.demonstrate(3, random.Random(1))
    for observation in transcript.observations:
        assert tokenizer.decode(tokenizer.encode(observation)) == observation
        assert len(observation) == 8 and observation.endswith(":")


def test_key_door_noiseless_demonstrator_solves_every_task_and_noise_hurts():
    assert _demo_success(KeyDoorEnv(noise=0.0)) == 1.0
    noisy = _demo_success(KeyDoorEnv(noise=0.3), n=1000)
    assert 0.35 <= noisy <= 0.65  # the warm start should leave room for RL
    assert _demo_success(KeyDoorEnv(noise=1.0)) < 0.15


def test_key_door_budget_invalid_actions_and_step_after_end():
    env = KeyDoorEnv(size=4, num_walls=0, slack=0)
    episode = env.reset(0)
    for _ in range(episode.budget):
        episode.step("x")  # not a move: the turn is wasted
    assert episode.done and not episode.success and episode.reward == 0.0
    with pytest.raises(RuntimeError, match="has ended"):
        episode.step("u")


def test_arithmetic_reward_checks_the_final_answer_only():
    env = ArithmeticEnv(min_digits=2, max_digits=2, noise=0.0)
    episode = env.reset(0)
    a, b = (int(x) for x in episode.observation.rstrip("=").split("+"))
    episode.step(f"garbage>{a + b}")
    assert episode.done and episode.reward == 1.0
    for wrong in (f"{a + b}", f">{a + b + 1}", ""):
        episode = env.reset(0)
        episode.step(wrong)
        assert episode.reward == 0.0


def test_arithmetic_demonstrator_noise_sets_its_success_rate():
    assert _demo_success(ArithmeticEnv(noise=0.0)) == 1.0
    assert 0.4 <= _demo_success(ArithmeticEnv(noise=0.5)) <= 0.6


def test_arithmetic_views_reveal_the_solution_in_parts():
    env = ArithmeticEnv(min_digits=3, max_digits=3, view_noise=0.5)
    for seed in range(20):
        solution = env.solution(seed)
        views = env.privileged_info(seed, response="")
        assert views["solution"] == solution
        assert solution.startswith(views["partial"]) and len(views["partial"]) < len(solution)
        assert views["feedback"] == solution[:1]  # nothing right yet: the first character
        wrong = solution[:5] + ("0" if solution[5] != "0" else "1")
        assert env.privileged_info(seed, wrong)["feedback"] == solution[:6]
        assert env.privileged_info(seed, solution)["feedback"] == solution
        noisy = views["noisy"]
        assert len(noisy) == len(solution)
        assert all(a == b for a, b in zip(noisy, solution, strict=True) if not b.isdigit())
        assert env.privileged_info(seed, "x")["noisy"] == noisy  # fixed per task
    wrong_digits = sum(
        a != b
        for seed in range(20)
        for a, b in zip(env.privileged_info(seed, "")["noisy"], env.solution(seed), strict=True)
    )
    digits = sum(ch.isdigit() for seed in range(20) for ch in env.solution(seed))
    assert 0.35 <= wrong_digits / digits <= 0.65
    clean = ArithmeticEnv(min_digits=3, max_digits=3, view_noise=0.0)
    assert all(clean.privileged_info(s, "")["noisy"] == clean.solution(s) for s in range(20))


@pytest.mark.parametrize(
    ("factory", "match"),
    [
        (lambda: KeyDoorEnv(size=2), "size"),
        (lambda: KeyDoorEnv(num_walls=50), "num_walls"),
        (lambda: KeyDoorEnv(noise=1.5), "noise"),
        (lambda: KeyDoorEnv(slack=-1), "slack"),
        (lambda: ArithmeticEnv(min_digits=3, max_digits=2), "max_digits"),
        (lambda: ArithmeticEnv(max_action_tokens=0), "max_action_tokens"),
        (lambda: ArithmeticEnv(view_noise=1.5), "view_noise"),
        (lambda: ArithmeticEnv(view_noise=True), "view_noise"),
    ],
)
def test_bad_environment_arguments(factory, match):
    with pytest.raises(ValueError, match=match):
        factory()


def test_task_splits_are_disjoint_and_reproducible():
    env = KeyDoorEnv()
    dm = EnvTaskDataModule(env, seed=3, num_train=300, num_val=40, num_test=40, batch_size=5)
    dm.setup("fit")
    ids = {split: {env.task_id(s) for s in dm.tasks(split)} for split in ("train", "val", "test")}
    assert not ids["train"] & ids["val"] and not ids["train"] & ids["test"]
    assert not ids["val"] & ids["test"]
    again = EnvTaskDataModule(env, seed=3, num_train=300, num_val=40, num_test=40)
    assert again.tasks("test") == dm.tasks("test")
    batch = next(iter(dm.train_dataloader()))
    assert batch["task_seeds"].shape == (5,)


def test_task_datamodule_bad_input():
    with pytest.raises(TypeError, match="env must be a TextEnv"):
        EnvTaskDataModule(env="maze")
    with pytest.raises(ValueError, match="num_val"):
        EnvTaskDataModule(KeyDoorEnv(), num_val=0)
    tiny = EnvTaskDataModule(ArithmeticEnv(min_digits=1, max_digits=1), num_test=150)
    with pytest.raises(ValueError, match="too few distinct tasks"):
        tiny.setup("test")
