"""Text environments for on-policy RL: tasks drawn from a seed, sparse outcome reward, and a
scripted noisy demonstrator for a supervised warm start."""

from ada_modules.posttrain.envs.arithmetic import ArithmeticEnv
from ada_modules.posttrain.envs.base import Episode, TextEnv, Transcript
from ada_modules.posttrain.envs.key_door import KeyDoorEnv
from ada_modules.posttrain.envs.sorting import SortingEnv

__all__ = ["ArithmeticEnv", "Episode", "KeyDoorEnv", "SortingEnv", "TextEnv", "Transcript"]
