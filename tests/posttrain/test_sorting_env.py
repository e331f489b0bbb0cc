"""The sorting environment: determinism, rewards, demonstrator, privileged views, bad input."""

import random

import pytest

from ada_modules.data import CharTokenizer
from ada_modules.posttrain.envs.sorting import SortingEnv


def _demo_success(env, n: int = 400) -> float:
    rng = random.Random(0)
    return sum(env.demonstrate(seed, rng).success for seed in range(n)) / n


def test_tasks_are_deterministic_and_varied():
    env = SortingEnv()
    assert env.reset(5).observation == env.reset(5).observation == env.task_id(5)
    observation = env.reset(5).observation
    assert len(observation) == 6 and observation.endswith(":") and observation[:-1].isdigit()
    assert len({env.task_id(seed) for seed in range(200)}) > 150


def test_reward_only_for_the_exact_sorted_string():
    env = SortingEnv(length=6)
    digits = env.reset(3).observation[:-1]
    answer = "".join(sorted(digits))
    episode = env.reset(3)
    episode.step(answer)
    assert episode.done and episode.success and episode.reward == 1.0
    assert episode.observation == ""
    for wrong in sorted({digits, answer[:-1], answer + "0", "", answer[::-1]} - {answer}):
        episode = env.reset(3)
        episode.step(wrong)
        assert episode.done and not episode.success and episode.reward == 0.0
    with pytest.raises(RuntimeError, match="has ended"):
        episode.step(answer)


def test_demonstrator_noise_controls_success():
    assert _demo_success(SortingEnv(noise=0.0)) == 1.0
    assert 0.4 <= _demo_success(SortingEnv(noise=0.5)) <= 0.6
    assert _demo_success(SortingEnv(noise=1.0)) == 0.0
    assert _demo_success(SortingEnv(length=2, noise=1.0), n=200) == 0.0  # includes equal digits


def test_privileged_info_views():
    env = SortingEnv(length=7)
    for seed in range(50):
        answer = "".join(sorted(env.reset(seed).observation[:-1]))
        info = env.privileged_info(seed, "")
        assert tuple(info) == env.privileged_fields
        assert env.solution(seed) == info["solution"] == answer
        assert info["partial"] == answer[:4]
        assert info["feedback"] == answer[:1]
        assert env.privileged_info(seed, answer)["feedback"] == answer
        assert env.privileged_info(seed, answer + "9")["feedback"] == answer
        assert env.privileged_info(seed, answer[:3])["feedback"] == answer[:4]
        for k in range(len(answer)):
            wrong = answer[:k] + ("x" if answer[k] != "x" else "y") + answer[k + 1 :]
            assert env.privileged_info(seed, wrong)["feedback"] == answer[: k + 1]


def test_noisy_view_is_deterministic_and_corrupts_about_view_noise():
    env = SortingEnv(length=10, view_noise=0.3)
    assert env.privileged_info(1, "a")["noisy"] == env.privileged_info(1, "b")["noisy"]
    changed = total = 0
    for seed in range(300):
        answer, noisy = env.solution(seed), env.privileged_info(seed, "")["noisy"]
        assert len(noisy) == len(answer) and noisy.isdigit()
        changed += sum(a != b for a, b in zip(answer, noisy, strict=True))
        total += len(answer)
    assert 0.25 <= changed / total <= 0.35
    clean = SortingEnv(length=10, view_noise=0.0)
    assert all(clean.privileged_info(s, "")["noisy"] == clean.solution(s) for s in range(50))


def test_texts_are_in_the_tokenizer_vocabulary():
    tokenizer = CharTokenizer()
    for length in (2, 5, 12):
        env = SortingEnv(length=length, view_noise=0.5)
        assert env.max_action_tokens == length + 2
        for seed in range(20):
            transcript = env.demonstrate(seed, random.Random(seed))
            texts = [*transcript.observations, *transcript.actions]
            texts += env.privileged_info(seed, transcript.actions[0]).values()
            for text in texts:
                assert text and tokenizer.decode(tokenizer.encode(text)) == text


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"length": 1}, "length"),
        ({"length": 13}, "length"),
        ({"length": 5.0}, "length"),
        ({"noise": 1.5}, "noise"),
        ({"view_noise": -0.1}, "view_noise"),
        ({"max_action_tokens": 0}, "max_action_tokens"),
    ],
)
def test_bad_arguments_are_rejected(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SortingEnv(**kwargs)
