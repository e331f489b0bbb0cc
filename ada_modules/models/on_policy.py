"""On-policy RL for a causal LM in text environments: GRPO-style clipped policy gradient."""

import copy
import math
import random
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import OptimizerCallable
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor

from ada_modules.data.tokenizer import CharTokenizer
from ada_modules.errors import InputError
from ada_modules.models.causal_lm import ARCHITECTURES, build_causal_lm
from ada_modules.optim.param_groups import weight_decay_param_groups
from ada_modules.posttrain.advantages import ADVANTAGE_ESTIMATORS, RolloutStats, clip_cov_mask
from ada_modules.posttrain.envs.base import TextEnv, Transcript
from ada_modules.strategies.sharding import is_sharded, shard_module, world_size

__all__ = ["OnPolicyModule", "Rollout"]

_LOSS_TYPES = ("token", "sequence", "dr_grpo")


@dataclass
class Rollout:
    """A batch of finished episodes as padded token tensors (all on the model's device).

    Attributes:
        input_ids: ``<bos>``, the first observation, then responses and observations,
            right-padded, shape ``(episodes, seq)``.
        attention_mask: 1 on real tokens, same shape.
        action_mask: 1 on the tokens the agent sampled (its responses), same shape.
        rewards: Outcome reward per episode, shape ``(episodes,)``.
        success: 1.0 for solved episodes, shape ``(episodes,)``.
        responses: Number of responses (turns) per episode, shape ``(episodes,)``.
    """

    input_ids: Tensor
    attention_mask: Tensor
    action_mask: Tensor
    rewards: Tensor
    success: Tensor
    responses: Tensor


class OnPolicyModule(LightningModule):
    """GRPO-style on-policy RL of a small Hugging Face causal LM in a text environment.

    Manual optimization (Lightning's documented route for RL). Each training step takes a batch
    of task seeds (see :class:`~ada_modules.data.EnvTaskDataModule`, whose ``env`` this module
    plays) and:

    1. samples ``group_size`` episodes per task with the current policy at ``temperature``
       (multi-turn: the agent's response, then the environment's observation, until the episode
       ends; single-turn tasks are one-turn episodes);
    2. scores them by the environment's outcome reward and computes advantages with the
       estimator ``advantage`` from :data:`~ada_modules.posttrain.advantages.ADVANTAGE_ESTIMATORS`
       (``"grpo"``, ``"dr_grpo"``, ``"aem"`` or a registered one) with ``advantage_kwargs``;
    3. runs ``ppo_epochs`` passes over ``num_minibatches`` minibatches of the clipped objective
       ``-min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)`` (``r`` the token probability ratio to
       the sampling policy), plus ``kl_coef`` times the k3 estimate of KL to the policy frozen at
       the start of RL, aggregated per ``loss_type``: ``"token"`` (mean over all response tokens
       of the minibatch, DAPO / TRL's ``"dapo"``), ``"sequence"`` (mean over each episode's
       tokens, then over episodes, TRL's ``"grpo"``), ``"dr_grpo"`` (sum over tokens divided by
       episodes times the longest possible response, TRL's ``"dr_grpo"``). With
       ``clip_cov_ratio > 0`` a Clip-Cov token selection
       (:func:`~ada_modules.posttrain.advantages.clip_cov_mask`) drops tokens from the loss.

    Supervised warm start: the first ``sft_steps`` steps instead imitate the environment's
    scripted demonstrator (``sft_demos_per_task`` demonstrations per task of the batch,
    cross-entropy on the response tokens, a second optimizer with learning rate ``sft_lr``).

    Budget: RL stops once ``max_sampled_tokens`` response tokens were sampled (``None``: the
    Trainer's limits decide), with one line saying so (``rank_zero_info``);
    :meth:`progress_budget` tells :class:`~ada_modules.callbacks.BudgetProgressBar` to count
    SFT steps, then sampled tokens, instead of the epoch's batches. Every ``eval_every_tokens``
    sampled tokens (and at the start and the end of RL) the policy plays the first
    ``eval_tasks`` validation tasks ``eval_samples`` times each at ``temperature``; the success
    curve against sampled tokens gives ``val/success``, ``val/success_start`` (before RL),
    ``val/success_best``, ``val/success_auc`` (area under the curve divided by its token span),
    ``val/tokens_to_threshold`` (first crossing of ``success_threshold``, interpolated; the
    tokens sampled so far while not reached) and ``val/success_greedy``. The Lightning
    validation loop (``ada validate``, or ``limit_val_batches > 0``) logs ``val/success``,
    ``val/success_greedy`` and ``val/response_length`` on its own tasks and the curve summary
    so far.

    Logged per RL step (``train/``): ``reward`` and ``success`` (also on the progress bar),
    ``token_entropy`` (mean entropy of the next-token distributions at response tokens),
    ``response_entropy`` (mean surprisal ``-log pi(response)`` of a response, an unbiased
    estimate of the response-level entropy), ``response_entropy_early`` / ``_late`` (its mean
    over the first / last third of the token budget), ``kl`` (k3 estimate to the frozen
    policy), ``clip_fraction``, ``response_length``, ``episode_turns``, ``sampled_tokens``,
    ``advantage_abs``, ``loss``.

    Sharding: under Lightning's ``ModelParallelStrategy`` or
    :class:`~ada_modules.strategies.AdERAStrategy`, :meth:`configure_model` applies FSDP2 to each
    decoder layer and then to the model (:func:`~ada_modules.strategies.shard_module`). Every
    forward pass then gathers parameters from all ranks, so with more than one rank the ranks run
    in lockstep: sampling continues until the responses of all ranks have ended, a rank whose
    episodes have all ended keeps sampling a discarded dummy response while another rank still
    plays, the number of PPO minibatches is the largest over the ranks, ``sampled_tokens`` (the
    budget, the evaluation schedule and the estimators' progress) counts the tokens of all
    data-parallel ranks, and the success-curve evaluations are averaged over the ranks. With
    ``kl_coef > 0`` the reference policy is a copy of the policy sharded alike in
    :meth:`configure_model` (FSDP2 modules cannot be deep-copied), given the policy's weights when
    RL starts.

    The policy is a Llama or Qwen2 model built from a config with the
    :class:`~ada_modules.data.CharTokenizer` vocabulary (as in
    :class:`~ada_modules.models.CausalLMModule`); any other Hugging Face causal LM with that
    vocabulary can be put in ``module.model`` before training.

    Args:
        architecture: ``"llama"`` or ``"qwen2"``.
        hidden_size: Width of the residual stream.
        num_layers: Decoder layers.
        num_heads: Attention heads.
        num_kv_heads: Key/value heads.
        intermediate_size: MLP width.
        max_position_embeddings: Longest sequence the rotary embedding is set up for.
        config_overrides: Further Hugging Face config keyword arguments.
        group_size: Episodes sampled per task (``G``), at least 2.
        temperature: Sampling temperature (the policy is ``softmax(logits / temperature)``).
        advantage: Name of the advantage estimator.
        advantage_kwargs: Keyword arguments of the estimator (e.g. ``{"strength": 0.5}``).
        loss_type: ``"token"``, ``"sequence"`` or ``"dr_grpo"``.
        clip_low: Lower ratio clip ``epsilon_low``.
        clip_high: Upper ratio clip ``epsilon_high`` (DAPO's clip-higher uses 0.28).
        kl_coef: Weight of the KL penalty to the frozen start-of-RL policy (0: no reference).
        ppo_epochs: Passes over each rollout.
        num_minibatches: Minibatches per pass (episodes are split evenly).
        max_grad_norm: Gradient-norm clip per update (``None``: no clipping).
        clip_cov_ratio: Fraction of response tokens Clip-Cov detaches (0: off).
        clip_cov_bounds: Covariance window of Clip-Cov.
        sft_steps: Supervised warm-start steps before RL.
        sft_demos_per_task: Demonstrations per task in a warm-start step.
        sft_lr: Learning rate of the warm start (``None``: the optimizer's).
        max_sampled_tokens: Budget of sampled response tokens for RL.
        eval_every_tokens: Tokens between evaluations (``None``: only at start and end).
        eval_tasks: Validation tasks per evaluation.
        eval_samples: Episodes per evaluation task.
        success_threshold: Success rate for ``val/tokens_to_threshold``.
        optimizer: Builds the optimizer(s) from parameter groups.

    Raises:
        ValueError: If an argument is out of range, naming it.

    Examples:
        >>> module = OnPolicyModule(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
        ...                         intermediate_size=64, group_size=4, advantage="aem",
        ...                         advantage_kwargs={"strength": 0.5})
        >>> module.group_size, module.automatic_optimization
        (4, False)

        In YAML (with ``data: EnvTaskDataModule`` giving the environment)::

            model:
              class_path: ada_modules.models.OnPolicyModule
              init_args:
                group_size: 8
                advantage: aem
                advantage_kwargs: {strength: 0.5, schedule: balance}
                sft_steps: 150
                max_sampled_tokens: 200000
    """

    def __init__(
        self,
        architecture: Literal["llama", "qwen2"] = "llama",
        hidden_size: int = 64,
        num_layers: int = 2,
        num_heads: int = 4,
        num_kv_heads: int = 4,
        intermediate_size: int = 256,
        max_position_embeddings: int = 512,
        config_overrides: dict[str, Any] | None = None,
        group_size: int = 8,
        temperature: float = 1.0,
        advantage: str = "grpo",
        advantage_kwargs: dict[str, Any] | None = None,
        loss_type: Literal["token", "sequence", "dr_grpo"] = "token",
        clip_low: float = 0.2,
        clip_high: float = 0.2,
        kl_coef: float = 0.0,
        ppo_epochs: int = 1,
        num_minibatches: int = 1,
        max_grad_norm: float | None = 1.0,
        clip_cov_ratio: float = 0.0,
        clip_cov_bounds: tuple[float, float] = (1.0, 5.0),
        sft_steps: int = 0,
        sft_demos_per_task: int = 4,
        sft_lr: float | None = None,
        max_sampled_tokens: int | None = None,
        eval_every_tokens: int | None = None,
        eval_tasks: int = 64,
        eval_samples: int = 2,
        success_threshold: float = 0.5,
        optimizer: OptimizerCallable = torch.optim.AdamW,
    ) -> None:
        super().__init__()
        if architecture not in ARCHITECTURES:
            raise InputError(
                f"architecture must be one of {sorted(ARCHITECTURES)}, got {architecture!r}"
            )
        positive = {
            "hidden_size": hidden_size,
            "num_layers": num_layers,
            "num_heads": num_heads,
            "num_kv_heads": num_kv_heads,
            "intermediate_size": intermediate_size,
            "max_position_embeddings": max_position_embeddings,
            "ppo_epochs": ppo_epochs,
            "num_minibatches": num_minibatches,
            "sft_demos_per_task": sft_demos_per_task,
            "eval_tasks": eval_tasks,
            "eval_samples": eval_samples,
        }
        for name, value in positive.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"{name} must be a positive integer, got {value!r}")
        if hidden_size % num_heads or num_heads % num_kv_heads:
            raise InputError(
                f"hidden_size={hidden_size} must be divisible by num_heads={num_heads}, and "
                f"num_heads by num_kv_heads={num_kv_heads}"
            )
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2:
            raise InputError(
                f"group_size must be an integer >= 2 (group-relative advantages need at least "
                f"two episodes per task), got {group_size!r}"
            )
        if not temperature > 0:
            raise InputError(f"temperature must be > 0, got {temperature!r}")
        if advantage not in ADVANTAGE_ESTIMATORS:
            raise InputError(
                f"advantage must be one of {sorted(ADVANTAGE_ESTIMATORS)}, got {advantage!r}"
            )
        if loss_type not in _LOSS_TYPES:
            raise InputError(f"loss_type must be one of {_LOSS_TYPES}, got {loss_type!r}")
        for name, value in (("clip_low", clip_low), ("clip_high", clip_high)):
            if not 0.0 <= value:
                raise InputError(f"{name} must be >= 0, got {value!r}")
        if clip_low >= 1.0:
            raise InputError(f"clip_low must be < 1, got {clip_low!r}")
        if not kl_coef >= 0.0:
            raise InputError(f"kl_coef must be >= 0, got {kl_coef!r}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise InputError(f"max_grad_norm must be None or > 0, got {max_grad_norm!r}")
        if not 0.0 <= clip_cov_ratio <= 1.0:
            raise InputError(f"clip_cov_ratio must be in [0, 1], got {clip_cov_ratio!r}")
        if isinstance(sft_steps, bool) or not isinstance(sft_steps, int) or sft_steps < 0:
            raise InputError(f"sft_steps must be an integer >= 0, got {sft_steps!r}")
        if sft_lr is not None and not sft_lr > 0:
            raise InputError(f"sft_lr must be None or > 0, got {sft_lr!r}")
        for name, value in (
            ("max_sampled_tokens", max_sampled_tokens),
            ("eval_every_tokens", eval_every_tokens),
        ):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise InputError(f"{name} must be None or a positive integer, got {value!r}")
        if not 0.0 < success_threshold <= 1.0:
            raise InputError(f"success_threshold must be in (0, 1], got {success_threshold!r}")
        self.save_hyperparameters(ignore=["optimizer"])
        self.automatic_optimization = False
        self.tokenizer = CharTokenizer()
        self.model = build_causal_lm(
            self.tokenizer,
            architecture,
            hidden_size,
            num_layers,
            num_heads,
            num_kv_heads,
            intermediate_size,
            max_position_embeddings,
            config_overrides,
        )
        self.group_size = group_size
        self.temperature = temperature
        self.advantage = advantage
        self.advantage_kwargs = dict(advantage_kwargs or {})
        self.loss_type = loss_type
        self.clip_low = clip_low
        self.clip_high = clip_high
        self.kl_coef = kl_coef
        self.ppo_epochs = ppo_epochs
        self.num_minibatches = num_minibatches
        self.max_grad_norm = max_grad_norm
        self.clip_cov_ratio = clip_cov_ratio
        self.clip_cov_bounds = tuple(clip_cov_bounds)
        self.sft_steps = sft_steps
        self.sft_demos_per_task = sft_demos_per_task
        self.sft_lr = sft_lr
        self.max_sampled_tokens = max_sampled_tokens
        self.eval_every_tokens = eval_every_tokens
        self.eval_tasks = eval_tasks
        self.eval_samples = eval_samples
        self.success_threshold = success_threshold
        self.optimizer = optimizer
        # Progress (saved in checkpoints, see on_save_checkpoint).
        self.sft_done = 0
        self.rl_steps = 0
        self.sampled_tokens = 0
        self.curve: list[tuple[int, float]] = []
        self.entropy_thirds = [[0.0, 0], [0.0, 0], [0.0, 0]]
        self._reference: list[torch.nn.Module] = []  # a list: not a registered submodule
        self._sharded_shell: list[torch.nn.Module] = []  # the reference-to-be when sharded
        self._budget_stopped = False  # set when the token budget ends a fit (see on_train_end)

    def configure_model(self) -> None:
        """Under ``ModelParallelStrategy`` or ``AdERAStrategy``: FSDP2 per decoder layer, then root.

        See :func:`~ada_modules.strategies.sharding.shard_module`; without a device mesh (any
        other strategy) the model stays as it is. With ``kl_coef > 0`` a copy of the policy is
        sharded the same way, to become the reference policy when RL starts (FSDP2 modules cannot
        be deep-copied then).
        """
        mesh = self.device_mesh
        if mesh is not None and self.kl_coef > 0 and not is_sharded(self.model):
            shell = copy.deepcopy(self.model).requires_grad_(False)
            shard_module(shell, mesh)
            self._sharded_shell[:] = [shell]
        shard_module(self, mesh)

    # ------------------------------------------------------------------ keeping ranks in step

    def _lockstep(self) -> bool:
        """Whether all ranks must run the same forward passes: the policy is sharded, > 1 rank."""
        return world_size() > 1 and is_sharded(self.model)

    def _all_reduce(self, values: list[float], op: str = "sum", group: Any = None) -> list[float]:
        """``values`` reduced over the ranks of ``group`` (all ranks by default)."""
        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor, op=ops[op], group=group)
        return tensor.tolist()

    def _frozen_policy(self, shell: torch.nn.Module | None = None) -> torch.nn.Module:
        """A frozen copy of the policy as it is now, sharded like it when it is sharded.

        When sharded, the copy is written into ``shell``, a copy sharded alike in
        :meth:`configure_model` (by default the KL reference's).
        """
        if not is_sharded(self.model):
            return copy.deepcopy(self.model).eval().requires_grad_(False)
        if shell is None and not self._sharded_shell:
            raise RuntimeError(
                "OnPolicyModule: the policy was sharded outside configure_model; the reference "
                "policy of kl_coef > 0 needs a copy sharded alike (made in configure_model)"
            )
        from torch.distributed.fsdp import FSDPModule

        shell = self._sharded_shell[0] if shell is None else shell
        for module in (*self.model.modules(), *shell.modules()):
            if isinstance(module, FSDPModule):
                module.reshard()  # the registered parameters are the local shards again
        with torch.no_grad():
            for ref, param in zip(shell.parameters(), self.model.parameters(), strict=True):
                ref.copy_(param)
        return shell.eval()

    def _tokens_of_all_ranks(self, tokens: int) -> int:
        """Tokens sampled by all data-parallel ranks in this step (the same on every rank).

        Summed over the mesh's ``data_parallel`` ranks (the ranks that play different tasks), then
        the largest such sum over all ranks, so that every rank counts the same.
        """
        mesh = self.device_mesh
        names = (mesh.mesh_dim_names or ()) if mesh is not None else ()
        if "data_parallel" in names and mesh["data_parallel"].size() < world_size():
            (tokens,) = self._all_reduce([tokens], group=mesh["data_parallel"].get_group())
            (tokens,) = self._all_reduce([tokens], op="max")
        else:
            (tokens,) = self._all_reduce([tokens])
        return int(tokens)

    # ------------------------------------------------------------------ environment and rollout

    @property
    def env(self) -> TextEnv:
        """The environment of the Trainer's DataModule."""
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer else None
        env = getattr(datamodule, "env", None)
        if not isinstance(env, TextEnv):
            raise RuntimeError(
                "OnPolicyModule needs a DataModule with an `env` attribute holding a TextEnv "
                "(e.g. ada_modules.data.EnvTaskDataModule)"
            )
        return env

    def _encode_observation(self, env: TextEnv, observation: object, seed: int) -> list[int]:
        if not isinstance(observation, str) or not observation:
            raise InputError(
                f"{type(env).__name__} returned an invalid observation for task seed {seed}: "
                f"expected a non-empty string, got {observation!r}"
            )
        try:
            return self.tokenizer.encode(observation)
        except ValueError as error:
            raise InputError(
                f"{type(env).__name__} returned an invalid observation for task seed {seed}: "
                f"{error}"
            ) from None

    @torch.no_grad()
    def _sample(self, contexts: list[list[int]], max_tokens: int, greedy: bool) -> list[list[int]]:
        """Sample one response per context: until ``<eos>`` (kept) or ``max_tokens`` tokens.

        In lockstep (sharded, > 1 rank) sampling goes on until the responses of all ranks have
        ended; the ended responses get no further tokens.
        """
        lockstep = self._lockstep()
        device = self.device
        length = max(len(c) for c in contexts)
        ids = torch.full((len(contexts), length), self.tokenizer.pad_id, dtype=torch.long)
        mask = torch.zeros((len(contexts), length), dtype=torch.long)
        for row, context in enumerate(contexts):
            ids[row, length - len(context) :] = torch.tensor(context)
            mask[row, length - len(context) :] = 1
        ids, mask = ids.to(device), mask.to(device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        responses: list[list[int]] = [[] for _ in contexts]
        finished = torch.zeros(len(contexts), dtype=torch.bool, device=device)
        for step in range(max_tokens):
            logits = out.logits[:, -1].float()
            if greedy:
                tokens = logits.argmax(-1)
            else:
                probs = torch.softmax(logits / self.temperature, dim=-1)
                tokens = torch.multinomial(probs, 1).squeeze(1)
            for row in (~finished).nonzero().squeeze(1).tolist():
                responses[row].append(int(tokens[row]))
            finished |= tokens == self.tokenizer.eos_id
            if step == max_tokens - 1:
                break
            done = bool(finished.all())
            if lockstep:
                done = self._all_reduce([float(done)], op="min")[0] == 1.0
            if done:
                break
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            positions = positions[:, -1:] + 1
            out = self.model(
                input_ids=tokens[:, None],
                attention_mask=mask,
                position_ids=positions,
                cache=out.cache,
                use_cache=True,
            )
        return responses

    @torch.no_grad()
    def rollout(
        self, env: TextEnv, task_seeds: list[int], episodes_per_task: int, greedy: bool = False
    ) -> Rollout:
        """Play ``episodes_per_task`` episodes of each task with the current policy.

        In lockstep (sharded, > 1 rank) a turn is played while any rank has an episode running;
        a rank without one samples a response to ``<bos>`` alone and discards it, so that it takes
        part in the same forward passes.

        Raises:
            ValueError: If the environment returns an invalid observation (naming the task
                seed), or an episode has not ended after ``env.max_turns`` responses.
        """
        was_training = self.model.training
        self.model.eval()
        seeds = [s for s in task_seeds for _ in range(episodes_per_task)]
        episodes = [env.reset(s) for s in seeds]
        tokens = [
            [self.tokenizer.bos_id, *self._encode_observation(env, ep.observation, s)]
            for ep, s in zip(episodes, seeds, strict=True)
        ]
        actions = [[0] * len(t) for t in tokens]
        lockstep = self._lockstep()
        for _ in range(env.max_turns):
            active = [i for i, ep in enumerate(episodes) if not ep.done]
            running = bool(active)
            if lockstep:
                running = self._all_reduce([float(running)], op="max")[0] == 1.0
            if not running:
                break
            if not active:  # another rank still plays: join its forward passes
                self._sample([[self.tokenizer.bos_id]], env.max_action_tokens, greedy)
                continue
            responses = self._sample([tokens[i] for i in active], env.max_action_tokens, greedy)
            for i, response in zip(active, responses, strict=True):
                tokens[i] += response
                actions[i] += [1] * len(response)
                episodes[i].step(self.tokenizer.decode(response))
                if not episodes[i].done:
                    observation = self._encode_observation(env, episodes[i].observation, seeds[i])
                    tokens[i] += observation
                    actions[i] += [0] * len(observation)
        for ep, seed in zip(episodes, seeds, strict=True):
            if not ep.done:
                raise InputError(
                    f"{type(env).__name__}: the episode of task seed {seed} has not ended after "
                    f"max_turns={env.max_turns} responses"
                )
        self.model.train(was_training)
        return self._pack(
            tokens,
            actions,
            [ep.reward for ep in episodes],
            [float(ep.success) for ep in episodes],
            [ep.turns for ep in episodes],
        )

    def _pack(
        self,
        tokens: list[list[int]],
        actions: list[list[int]],
        rewards: list[float],
        success: list[float],
        responses: list[int],
    ) -> Rollout:
        length = max(len(t) for t in tokens)
        ids = torch.full((len(tokens), length), self.tokenizer.pad_id, dtype=torch.long)
        attention = torch.zeros_like(ids)
        action_mask = torch.zeros_like(ids)
        for row, (seq, act) in enumerate(zip(tokens, actions, strict=True)):
            ids[row, : len(seq)] = torch.tensor(seq)
            attention[row, : len(seq)] = 1
            action_mask[row, : len(act)] = torch.tensor(act)
        device = self.device
        return Rollout(
            input_ids=ids.to(device),
            attention_mask=attention.to(device),
            action_mask=action_mask.to(device),
            rewards=torch.tensor(rewards, dtype=torch.float32, device=device),
            success=torch.tensor(success, dtype=torch.float32, device=device),
            responses=torch.tensor(responses, dtype=torch.float32, device=device),
        )

    def _demonstrations(self, env: TextEnv, task_seeds: list[int]) -> Rollout:
        demos = [
            self.demonstration(env, seed, random.Random(seed * 1_000_003 + k))
            for seed in task_seeds
            for k in range(self.sft_demos_per_task)
        ]
        tokens = [self._transcript_tokens(env, seed, t) for seed, t, _ in demos]
        prefixes = [prefix for _, _, prefix in demos]
        return self._pack(
            [
                [self.tokenizer.bos_id, *p, *seq]
                for p, (seq, _) in zip(prefixes, tokens, strict=True)
            ],
            [[0] * (1 + len(p)) + act for p, (_, act) in zip(prefixes, tokens, strict=True)],
            [t.reward for _, t, _ in demos],
            [float(t.success) for _, t, _ in demos],
            [len(t.actions) for _, t, _ in demos],
        )

    def demonstration(
        self, env: TextEnv, seed: int, rng: random.Random
    ) -> tuple[int, Transcript, list[int]]:
        """One warm-start example: the task seed, a transcript and context tokens put before it.

        Here the environment's scripted demonstrator with no context; a subclass may show some
        examples with a privileged context (see :class:`~ada_modules.models.SelfDistillationModule`).
        """
        return seed, env.demonstrate(seed, rng), []

    def _transcript_tokens(
        self, env: TextEnv, seed: int, transcript: Transcript
    ) -> tuple[list[int], list[int]]:
        """Tokens of a transcript (observations, then responses ended by ``<eos>``) and action mask."""
        seq: list[int] = []
        act: list[int] = []
        for t, action in enumerate(transcript.actions):
            observation = self._encode_observation(env, transcript.observations[t], seed)
            seq += observation
            act += [0] * len(observation)
            response = self.tokenizer.encode(action)
            if len(response) < env.max_action_tokens:
                response.append(self.tokenizer.eos_id)
            seq += response
            act += [1] * len(response)
        return seq, act

    # ------------------------------------------------------------------ losses

    def token_logprobs(
        self, rollout: Rollout, rows: Tensor | slice = slice(None)
    ) -> tuple[Tensor, Tensor]:
        """Log-probabilities of the sampled tokens and next-token entropies, shape ``(n, seq-1)``.

        Position ``t`` scores token ``t + 1`` under ``softmax(logits / temperature)``.
        """
        ids = rollout.input_ids[rows]
        logits = self.model(input_ids=ids, attention_mask=rollout.attention_mask[rows]).logits
        logp_all = torch.log_softmax(logits[:, :-1].float() / self.temperature, dim=-1)
        logp = logp_all.gather(-1, ids[:, 1:, None]).squeeze(-1)
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        return logp, entropy

    def policy_loss(
        self,
        logp: Tensor,
        old_logp: Tensor,
        advantages: Tensor,
        mask: Tensor,
        ref_logp: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Clipped surrogate (+ KL) over response tokens, aggregated per ``loss_type``.

        Args:
            logp: Current log-probabilities of the sampled tokens, ``(n, seq)``.
            old_logp: Their log-probabilities under the sampling policy, ``(n, seq)``.
            advantages: One advantage per episode, ``(n,)``, or per token, ``(n, seq)``.
            mask: 1 on response tokens, ``(n, seq)``.
            ref_logp: Log-probabilities under the reference policy (for the KL term).

        Returns:
            The loss and detached diagnostics (``clip_fraction``, ``kl``, ``clip_cov_fraction``).

        Raises:
            ValueError: If the shapes do not match.
        """
        if logp.shape != old_logp.shape or logp.shape != mask.shape:
            raise InputError(
                "logp, old_logp and mask must have the same shape, got "
                f"{tuple(logp.shape)}, {tuple(old_logp.shape)}, {tuple(mask.shape)}"
            )
        if advantages.shape not in (logp.shape[:1], logp.shape):
            raise InputError(
                f"advantages must have shape ({logp.shape[0]},) (one per sequence) or "
                f"{tuple(logp.shape)} (one per token), got {tuple(advantages.shape)}"
            )
        mask = mask.float()
        token_adv = advantages[:, None].expand_as(logp) if advantages.dim() == 1 else advantages
        ratio = torch.exp(logp - old_logp)
        unclipped = ratio * token_adv
        clipped = ratio.clamp(1.0 - self.clip_low, 1.0 + self.clip_high) * token_adv
        per_token = -torch.minimum(unclipped, clipped)
        kl = torch.zeros_like(per_token)
        if ref_logp is not None and self.kl_coef > 0:
            log_ratio = ref_logp - logp
            kl = torch.exp(log_ratio) - log_ratio - 1.0
            per_token = per_token + self.kl_coef * kl
        keep = mask
        if self.clip_cov_ratio > 0:
            keep = (
                mask
                * clip_cov_mask(
                    token_adv.detach(),
                    logp.detach(),
                    mask,
                    ratio=self.clip_cov_ratio,
                    bounds=self.clip_cov_bounds,
                ).float()
            )
        total = mask.sum().clamp(min=1.0)
        if self.loss_type == "token":
            loss = (per_token * keep).sum() / total
        elif self.loss_type == "sequence":
            loss = ((per_token * keep).sum(1) / mask.sum(1).clamp(min=1.0)).mean()
        else:
            env = self.env if self._trainer else None
            longest = env.max_turns * env.max_action_tokens if env else logp.shape[1]
            loss = (per_token * keep).sum() / (logp.shape[0] * longest)
        with torch.no_grad():
            is_clipped = ((ratio < 1.0 - self.clip_low) & (token_adv < 0)) | (
                (ratio > 1.0 + self.clip_high) & (token_adv > 0)
            )
            stats = {
                "clip_fraction": (is_clipped.float() * mask).sum() / total,
                "kl": (kl * mask).sum() / total,
                "clip_cov_fraction": ((mask - keep) * mask).sum() / total,
            }
        return loss, stats

    # ------------------------------------------------------------------ training

    def rollout_advantages(
        self,
        rollout: Rollout,
        task_seeds: list[int],
        stats: RolloutStats,
        old_logp: Tensor,
        mask: Tensor,
    ) -> Tensor:
        """Advantages of a rollout: one per episode ``(n,)`` or one per token ``(n, seq - 1)``.

        Here the outcome advantages of the estimator ``advantage``; a subclass may return
        token-level advantages (e.g. distillation targets, see
        :class:`~ada_modules.models.SelfDistillationModule`).

        Args:
            rollout: The episodes, ``group_size`` consecutive ones per task.
            task_seeds: The tasks of the rollout, one per group.
            stats: Surprisal and progress for the estimator.
            old_logp: Log-probabilities of the tokens under the sampling policy, ``(n, seq - 1)``.
            mask: 1 on response tokens, ``(n, seq - 1)``.

        Raises:
            ValueError: If the estimator returns a wrong shape.
        """
        rewards = rollout.rewards.view(len(task_seeds), self.group_size)
        estimator = ADVANTAGE_ESTIMATORS[self.advantage]
        advantages = estimator(rewards, stats, **self.advantage_kwargs).reshape(-1)
        if advantages.shape != rollout.rewards.shape:
            raise InputError(
                f"advantage estimator {self.advantage!r} returned shape "
                f"{tuple(advantages.shape)}, expected {tuple(rewards.shape)}"
            )
        return advantages

    def minibatch_loss(
        self,
        rollout: Rollout,
        rows: Tensor,
        old_logp: Tensor,
        advantages: Tensor,
        mask: Tensor,
        ref_logp: Tensor | None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The loss of one minibatch ``rows`` of the rollout: :meth:`policy_loss` of its tokens."""
        logp, _ = self.token_logprobs(rollout, rows)
        return self.policy_loss(logp, old_logp, advantages, mask, ref_logp)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        task_seeds = batch["task_seeds"].tolist()
        optimizers = self.optimizers()
        optimizers = optimizers if isinstance(optimizers, list) else [optimizers]
        if self.sft_done < self.sft_steps:
            self._sft_step(task_seeds, optimizers[-1])
            return
        if self.max_sampled_tokens and self.sampled_tokens >= self.max_sampled_tokens:
            # resumed from a checkpoint whose budget was spent: stop before sampling any more
            self._budget_stopped = True
            self.trainer.should_stop = True
            return
        self._rl_step(task_seeds, optimizers[0])

    def _step(self, optimizer: Any, loss: Tensor) -> None:
        optimizer.zero_grad()
        self.manual_backward(loss)
        if self.max_grad_norm is not None:
            self.clip_gradients(
                optimizer, gradient_clip_val=self.max_grad_norm, gradient_clip_algorithm="norm"
            )
        optimizer.step()

    def _sft_step(self, task_seeds: list[int], optimizer: Any) -> None:
        demos = self._demonstrations(self.env, task_seeds)
        logits = self.model(input_ids=demos.input_ids, attention_mask=demos.attention_mask).logits
        targets = demos.input_ids[:, 1:].masked_fill(demos.action_mask[:, 1:] == 0, -100)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), targets.flatten())
        self._step(optimizer, loss)
        self.sft_done += 1
        self.log("train/sft_loss", loss.detach(), prog_bar=True, batch_size=len(task_seeds))

    def _rl_step(self, task_seeds: list[int], optimizer: Any) -> None:
        env = self.env
        lockstep = self._lockstep()
        if not self.curve:
            self._evaluate_curve(env)
        if self.kl_coef > 0 and not self._reference:
            self._reference.append(self._frozen_policy())
        rollout = self.rollout(env, task_seeds, self.group_size)
        mask = rollout.action_mask[:, 1:].float()
        with torch.no_grad():
            old_logp, entropy = self.token_logprobs(rollout)
            ref_logp = None
            if self._reference:
                ref = self._reference[0]
                logits = ref(input_ids=rollout.input_ids, attention_mask=rollout.attention_mask)
                if is_sharded(ref):
                    ref.reshard()  # FSDP2 keeps the root gathered after a forward: free it
                ref_all = torch.log_softmax(logits.logits[:, :-1].float() / self.temperature, -1)
                ref_logp = ref_all.gather(-1, rollout.input_ids[:, 1:, None]).squeeze(-1)
        lengths = mask.sum(1)
        surprisal_sum = -(old_logp * mask).sum(1)
        surprisal = surprisal_sum / lengths.clamp(min=1.0)
        num_prompts = len(task_seeds)
        progress = (
            min(1.0, self.sampled_tokens / self.max_sampled_tokens)
            if self.max_sampled_tokens
            else 0.0
        )
        stats = RolloutStats(
            surprisal=surprisal.view(num_prompts, self.group_size),
            progress=progress,
            entropy=float(surprisal.mean()),
        )
        advantages = self.rollout_advantages(rollout, task_seeds, stats, old_logp, mask)

        num_episodes = rollout.rewards.numel()
        diagnostics: dict[str, list[Tensor]] = {}
        for _ in range(self.ppo_epochs):
            order = torch.randperm(num_episodes, device=self.device)
            minibatches = order.chunk(self.num_minibatches)
            missing = 0
            if lockstep:
                # Fewer episodes than another rank can mean fewer minibatches (chunk): make up
                # the difference with updates whose loss is zero on this rank.
                most = self._all_reduce([len(minibatches)], op="max")[0]
                missing = int(most) - len(minibatches)
            for rows in minibatches:
                loss, loss_stats = self.minibatch_loss(
                    rollout,
                    rows,
                    old_logp[rows],
                    advantages[rows],
                    mask[rows],
                    None if ref_logp is None else ref_logp[rows],
                )
                self._step(optimizer, loss)
                diagnostics.setdefault("loss", []).append(loss.detach())
                for key, value in loss_stats.items():
                    diagnostics.setdefault(key, []).append(value)
            for _ in range(missing):
                logp, _ = self.token_logprobs(rollout, minibatches[-1])
                self._step(optimizer, logp.sum() * 0.0)

        new_tokens = int(lengths.sum())
        if lockstep:  # the budget and the evaluation schedule must agree on all ranks
            new_tokens = self._tokens_of_all_ranks(new_tokens)
        self.sampled_tokens += new_tokens
        self.rl_steps += 1
        response_entropy = float(surprisal_sum.sum() / rollout.responses.sum())
        third = min(2, int(3 * progress))
        self.entropy_thirds[third][0] += response_entropy
        self.entropy_thirds[third][1] += 1
        metrics = {
            "train/reward": rollout.rewards.mean(),
            "train/success": rollout.success.mean(),
            "train/token_entropy": (entropy * mask).sum() / mask.sum(),
            "train/response_entropy": torch.tensor(response_entropy),
            "train/response_length": lengths.sum() / rollout.responses.sum(),
            "train/episode_turns": rollout.responses.mean(),
            "train/sampled_tokens": torch.tensor(float(self.sampled_tokens)),
            "train/advantage_abs": (
                advantages.abs().mean()
                if advantages.dim() == 1
                else (advantages.abs() * mask).sum() / mask.sum().clamp(min=1.0)
            ),
        }
        for key, values in diagnostics.items():
            metrics[f"train/{key}"] = torch.stack(values).mean()
        metrics.update(self._entropy_summary())
        shown = {name: metrics.pop(name) for name in ("train/reward", "train/success")}
        self.log_dict(shown, batch_size=num_prompts, prog_bar=True)
        self.log_dict(metrics, batch_size=num_prompts)
        budget_spent = self.max_sampled_tokens and self.sampled_tokens >= self.max_sampled_tokens
        last_eval = self.curve[-1][0] if self.curve else 0
        if budget_spent or (
            self.eval_every_tokens and self.sampled_tokens - last_eval >= self.eval_every_tokens
        ):
            self._evaluate_curve(env)
        if budget_spent:
            self._budget_stopped = True
            self.trainer.should_stop = True

    def progress_budget(self) -> tuple[int, int, str] | None:
        """``(done, total, label)`` of the budget now running, for a progress bar; ``None``: none.

        The warm start counts ``sft_steps`` (label ``"SFT step"``), RL the sampled response
        tokens against ``max_sampled_tokens`` (label ``"sampled tokens"``); see
        :class:`~ada_modules.callbacks.BudgetProgressBar`.
        """
        if self.sft_done < self.sft_steps:
            return self.sft_done, self.sft_steps, "SFT step"
        if self.max_sampled_tokens:
            return self.sampled_tokens, self.max_sampled_tokens, "sampled tokens"
        return None

    def on_train_end(self) -> None:
        # After the progress bar closed its line (callbacks' on_train_end run first).
        if self._budget_stopped:
            steps = f"{self.rl_steps:,} RL step{'s' if self.rl_steps != 1 else ''}"
            rank_zero_info(
                f"OnPolicyModule: token budget spent, training stopped: {self.sampled_tokens:,} "
                f"response tokens sampled (max_sampled_tokens={self.max_sampled_tokens:,}) in "
                f"{steps}."
            )
            self._budget_stopped = False

    def _entropy_summary(self) -> dict[str, Tensor]:
        values = {}
        for name, (total, count) in (
            ("early", self.entropy_thirds[0]),
            ("late", self.entropy_thirds[2]),
        ):
            values[f"train/response_entropy_{name}"] = torch.tensor(
                total / count if count else math.nan
            )
        return values

    # ------------------------------------------------------------------ evaluation

    def _success(self, env: TextEnv, task_seeds: list[int], greedy: bool) -> Rollout:
        return self.rollout(env, task_seeds, 1 if greedy else self.eval_samples, greedy=greedy)

    def _evaluate_curve(self, env: TextEnv) -> None:
        """Evaluate on the first ``eval_tasks`` validation tasks; log the success-curve metrics."""
        seeds = self.trainer.datamodule.tasks("val")[: self.eval_tasks]
        sampled = self._success(env, seeds, greedy=False).success
        greedy_runs = self._success(env, seeds, greedy=True).success
        if self._lockstep():  # one curve on all ranks: the mean over their episodes
            totals = [float(sampled.sum()), sampled.numel()]
            totals += [float(greedy_runs.sum()), greedy_runs.numel()]
            total, count, greedy_total, greedy_count = self._all_reduce(totals)
            success, greedy = total / count, greedy_total / greedy_count
        else:
            success, greedy = float(sampled.mean()), float(greedy_runs.mean())
        self.curve.append((self.sampled_tokens, success))
        self.log_dict(
            {"val/success": torch.tensor(success), "val/success_greedy": torch.tensor(greedy)},
            batch_size=len(seeds),
        )
        self._log_curve_summary()

    def curve_summary(self) -> dict[str, float]:
        """Start, best, area and tokens-to-threshold of the success curve (NaN while empty)."""
        if not self.curve:
            names = ("start", "best", "auc")
            return {**{f"success_{n}": math.nan for n in names}, "tokens_to_threshold": math.nan}
        tokens = [t for t, _ in self.curve]
        values = [s for _, s in self.curve]
        span = tokens[-1] - tokens[0]
        auc = values[0]
        if span > 0:
            area = sum(
                (tokens[i + 1] - tokens[i]) * (values[i + 1] + values[i]) / 2
                for i in range(len(tokens) - 1)
            )
            auc = area / span
        reached = float(tokens[-1])
        for i, value in enumerate(values):
            if value >= self.success_threshold:
                reached = float(tokens[0])
                if i > 0:
                    t0, t1, v0 = tokens[i - 1], tokens[i], values[i - 1]
                    reached = t0 + (t1 - t0) * (self.success_threshold - v0) / (value - v0)
                break
        return {
            "success_start": values[0],
            "success_best": max(values),
            "success_auc": auc,
            "tokens_to_threshold": reached,
        }

    def _log_curve_summary(self) -> None:
        summary = {f"val/{k}": torch.tensor(v) for k, v in self.curve_summary().items()}
        self.log_dict({**summary, **self._entropy_summary()}, batch_size=1)

    def _evaluate(self, batch: dict[str, Any], stage: str) -> None:
        env = self.env
        seeds = batch["task_seeds"].tolist()
        sampled = self._success(env, seeds, greedy=False)
        greedy = self._success(env, seeds, greedy=True)
        lengths = sampled.action_mask.sum(1).float()
        self.log_dict(
            {
                f"{stage}/success": sampled.success.mean(),
                f"{stage}/success_greedy": greedy.success.mean(),
                f"{stage}/response_length": lengths.sum() / sampled.responses.sum(),
            },
            batch_size=len(seeds),
            sync_dist=self._lockstep(),
        )

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def on_validation_epoch_end(self) -> None:
        self._log_curve_summary()

    def test_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self._evaluate(batch, "test")

    # ------------------------------------------------------------------ optimizers and state

    def configure_optimizers(self) -> Any:
        def build() -> torch.optim.Optimizer:
            return self.optimizer(weight_decay_param_groups(self.model))

        if self.sft_steps == 0:
            return build()
        sft = build()
        if self.sft_lr is not None:
            for group in sft.param_groups:
                group["lr"] = self.sft_lr
        return [build(), sft]

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["on_policy_progress"] = {
            "sft_done": self.sft_done,
            "rl_steps": self.rl_steps,
            "sampled_tokens": self.sampled_tokens,
            "curve": list(self.curve),
            "entropy_thirds": [list(x) for x in self.entropy_thirds],
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        progress = checkpoint.get("on_policy_progress")
        if progress:
            self.sft_done = progress["sft_done"]
            self.rl_steps = progress["rl_steps"]
            self.sampled_tokens = progress["sampled_tokens"]
            self.curve = [tuple(x) for x in progress["curve"]]
            self.entropy_thirds = [list(x) for x in progress["entropy_thirds"]]
