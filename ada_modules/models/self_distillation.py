"""On-policy self-distillation with several privileged teacher views (AVSD, OPSD, GRPO)."""

import copy
import random
import string
from typing import Any, Literal

import torch
from torch import Tensor

from ada_modules.errors import InputError
from ada_modules.models.on_policy import OnPolicyModule, Rollout
from ada_modules.posttrain.advantages import RolloutStats
from ada_modules.posttrain.avsd import (
    AVSDTarget,
    avsd_target,
    check_gate,
    generalized_jsd,
    sampled_token_advantages,
)
from ada_modules.posttrain.envs.base import TextEnv, Transcript
from ada_modules.strategies.sharding import is_sharded, shard_module, world_size

__all__ = ["SelfDistillationModule"]

_TEACHERS = ("live", "ema", "base")
_MODES = ("sampled_token", "full")


def _template_fields(name: str, template: str) -> list[str]:
    """The placeholder names of a view template; an error naming the view if it has none."""
    try:
        fields = [
            field for _, field, _, _ in string.Formatter().parse(template) if field is not None
        ]
    except ValueError as error:
        raise InputError(f"view {name!r}: template {template!r} is malformed ({error})") from None
    if not fields or any(not field.isidentifier() for field in fields):
        raise InputError(
            f"view {name!r}: template {template!r} must contain named placeholders such as "
            "'{solution}' (one per privileged text it shows)"
        )
    return fields


class SelfDistillationModule(OnPolicyModule):
    """On-policy self-distillation from privileged views of the task (AVSD; OPSD with one view).

    The student (the policy, as in :class:`~ada_modules.models.OnPolicyModule`) samples
    ``group_size`` responses per task. The teacher, the same network (``teacher``: ``"live"``
    the current policy, ``"ema"`` an exponential moving average of it, ``"base"`` the policy frozen
    when RL starts), reads each student episode once per privileged view: ``views`` maps a view
    name to a template filled with the environment's
    :meth:`~ada_modules.posttrain.envs.TextEnv.privileged_info` (e.g. ``"[{solution}]"``) and put
    before the task. All views of a rollout go through the teacher in one forward pass. The view
    distributions of the views in ``teacher_views`` are pooled per token by
    :func:`~ada_modules.posttrain.avsd.avsd_target` (consensus = normalised geometric mean,
    permissive = arithmetic mean, ``gate`` between them, token weight from the residual), and the
    student learns the pooled target:

    * ``distillation="sampled_token"``: the token-level advantage ``w * (log q(y) - log s(y))`` of
      the sampled tokens (OPSD / on-policy distillation; SDPO's ``"sampled_token"``) in the clipped
      policy-gradient objective of the base module;
    * ``distillation="full"``: ``w * JSD_beta(q || s)`` over the whole vocabulary at every response
      token (:func:`~ada_modules.posttrain.avsd.generalized_jsd`; GKD's loss on the student's own
      samples), averaged over the minibatch's response tokens whatever ``loss_type`` says, and
      without Clip-Cov (those apply to the outcome part).

    ``distillation_weight`` mixes in the outcome advantages of ``advantage`` (GRPO by default):
    1 is pure self-distillation, 0 pure RL (then the views only serve the warm start and the
    premise evaluation).

    Warm start: a fraction ``sft_view_prob`` of the supervised examples shows a privileged view (a
    random one of ``views``) before the task and a correct response after it (``env.solution``;
    the ``feedback`` of such a view comments on a demonstrator attempt), so that the small model
    learns to read its context. The rest are the base module's noisy demonstrations.

    Logged: ``val/teacher_success_<view>`` once, when RL starts (the success rate of the policy
    sampling with that view in its context, where the feedback comments on a student sample: the
    premise that the teacher knows more than the student, to compare with ``val/success_start``);
    per RL step ``train/gate``, ``train/disagreement`` (``D / log M``), ``train/token_weight``,
    ``train/distill_advantage`` (mean of ``log q(y) - log s(y)`` over response tokens, an estimate
    of ``-KL(s || q)``) and ``train/view_agreement_<view>`` (how often the view's most likely token
    is the consensus's). Mapping to TRL: ``teacher`` is SDPO's ``teacher_model_kind``,
    ``distillation`` its ``distillation_mode``, ``distillation_weight`` its
    ``distillation_weight``; ``beta`` is GKD's ``beta``; GKD's ``lmbda`` is 1 here (on-policy only).

    Needs a single-turn environment with privileged texts
    (:class:`~ada_modules.posttrain.envs.ArithmeticEnv`,
    :class:`~ada_modules.posttrain.envs.SortingEnv`).

    Args:
        views: View name to template, e.g. ``{"solution": "[{solution}]"}``.
        teacher_views: The views the teacher uses (``None``: all of ``views``).
        gate: ``"adaptive"`` or a constant in ``[0, 1]`` (0: geometric, 1: arithmetic).
        gate_threshold: Disagreement at which the adaptive gate is one half.
        gate_sharpness: Slope of the adaptive gate.
        residual_scale: Token weight ``max(0, 1 + residual_scale * D / log M)``.
        distillation: ``"sampled_token"`` or ``"full"``.
        beta: Interpolation of the generalised JSD (0 forward KL, 1 reverse KL), ``"full"`` only.
        distillation_weight: Weight of distillation against the outcome advantages, in ``[0, 1]``.
        teacher: ``"live"``, ``"ema"`` or ``"base"``.
        teacher_ema_decay: Decay of the ``"ema"`` teacher per RL step.
        sft_view_prob: Fraction of warm-start examples shown with a privileged view.
        **kwargs: Arguments of :class:`~ada_modules.models.OnPolicyModule`.

    Raises:
        ValueError: If an argument is out of range or a template has no placeholder, naming it.

    Examples:
        >>> module = SelfDistillationModule(
        ...     views={"solution": "[{solution}]", "noisy": "[{noisy}]"}, gate="adaptive",
        ...     hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)
        >>> module.teacher_views
        ['solution', 'noisy']

        In YAML (with ``data: EnvTaskDataModule`` holding an ``ArithmeticEnv``)::

            model:
              class_path: ada_modules.models.SelfDistillationModule
              init_args:
                views: {solution: "[{solution}]", partial: "[{partial}]", noisy: "[{noisy}]"}
                gate: adaptive
                sft_steps: 150
                max_sampled_tokens: 20000
    """

    def __init__(
        self,
        views: dict[str, str] | None = None,
        teacher_views: list[str] | None = None,
        gate: float | Literal["adaptive"] = "adaptive",
        gate_threshold: float = 0.1,
        gate_sharpness: float = 20.0,
        residual_scale: float = 0.0,
        distillation: Literal["sampled_token", "full"] = "sampled_token",
        beta: float = 0.5,
        distillation_weight: float = 1.0,
        teacher: Literal["live", "ema", "base"] = "base",
        teacher_ema_decay: float = 0.95,
        sft_view_prob: float = 0.5,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        views = dict(views or {})
        if not 0.0 <= distillation_weight <= 1.0:
            raise InputError(f"distillation_weight must be in [0, 1], got {distillation_weight!r}")
        if distillation_weight > 0 and not views:
            raise InputError(
                "views is empty: self-distillation needs at least one privileged view, e.g. "
                "views={'solution': '[{solution}]'} (or distillation_weight=0 for pure RL)"
            )
        self.view_fields = {name: _template_fields(name, t) for name, t in views.items()}
        for name, template in views.items():
            literal = "".join(text for text, *_ in string.Formatter().parse(template))
            try:
                self.tokenizer.encode(literal)
            except ValueError as error:
                raise InputError(f"view {name!r}: template {template!r}: {error}") from None
        teacher_views = list(views) if teacher_views is None else list(teacher_views)
        unknown = [name for name in teacher_views if name not in views]
        if unknown or (distillation_weight > 0 and not teacher_views):
            raise InputError(
                f"teacher_views must name some of the views {sorted(views)}, got {teacher_views!r}"
            )
        check_gate(gate, gate_threshold, gate_sharpness, residual_scale)
        if distillation not in _MODES:
            raise InputError(f"distillation must be one of {_MODES}, got {distillation!r}")
        if not 0.0 <= beta <= 1.0:
            raise InputError(f"beta must be in [0, 1], got {beta!r}")
        if teacher not in _TEACHERS:
            raise InputError(f"teacher must be one of {_TEACHERS}, got {teacher!r}")
        if not 0.0 <= teacher_ema_decay < 1.0:
            raise InputError(f"teacher_ema_decay must be in [0, 1), got {teacher_ema_decay!r}")
        if not 0.0 <= sft_view_prob <= 1.0:
            raise InputError(f"sft_view_prob must be in [0, 1], got {sft_view_prob!r}")
        self.views = views
        self.teacher_views = teacher_views
        self.gate = gate
        self.gate_threshold = gate_threshold
        self.gate_sharpness = gate_sharpness
        self.residual_scale = residual_scale
        self.distillation = distillation
        self.beta = beta
        self.distillation_weight = distillation_weight
        self.teacher = teacher
        self.teacher_ema_decay = teacher_ema_decay
        self.sft_view_prob = sft_view_prob
        self._teacher_model: list[torch.nn.Module] = []  # a list: not a registered submodule
        self._external_teacher = False  # set by use_teacher: frozen, never saved
        self._teacher_shell: list[torch.nn.Module] = []  # the frozen teacher-to-be when sharded
        self._restored_teacher: dict[str, Tensor] | None = None  # from a checkpoint, until RL
        self._target: AVSDTarget | None = None  # the rollout's target, for "full" minibatches

    # ------------------------------------------------------------------ teacher

    def use_teacher(self, model: torch.nn.Module) -> None:
        """Distil from ``model`` instead of a copy of the policy; it needs the same vocabulary.

        The model stays frozen whatever ``teacher`` says (no EMA), is moved to the module's
        device when RL starts (it is not sharded with the policy), and is not saved in
        checkpoints: ``fit(ckpt_path=...)`` keeps it, a module from ``load_from_checkpoint``
        needs this call again.

        Raises:
            ValueError: If ``model``'s vocabulary size differs from the student's.
        """
        ours = self.model.get_output_embeddings().weight.shape[0]
        theirs = model.get_output_embeddings().weight.shape[0]
        if theirs != ours:
            raise InputError(
                f"the teacher's vocabulary has {theirs} tokens and the student's {ours}: "
                "self-distillation compares their distributions token by token, so they must match"
            )
        self._teacher_model[:] = [model.eval().requires_grad_(False)]
        self._external_teacher = True

    def teacher_model(self) -> torch.nn.Module:
        """The teacher now: the policy (``"live"``), its EMA / start-of-RL copy, or ``use_teacher``'s."""
        return self._teacher_model[0] if self._teacher_model else self.model

    def _own_frozen_teacher(self) -> bool:
        """Whether RL keeps a copy of the policy as teacher (``"base"`` / ``"ema"``, not given)."""
        return (
            self.teacher != "live" and self.distillation_weight > 0 and not self._external_teacher
        )

    def prepare_data(self) -> None:
        """Checks that the environment can fill the views (before any callback writes a file)."""
        env = self.env
        if not self.views:
            return
        if env.max_turns != 1:
            raise InputError(
                f"SelfDistillationModule needs a single-turn environment for its views; "
                f"{type(env).__name__} has max_turns={env.max_turns}"
            )
        for name, fields in self.view_fields.items():
            missing = [field for field in fields if field not in env.privileged_fields]
            if missing:
                raise InputError(
                    f"view {name!r} uses {missing}, which {type(env).__name__} does not provide "
                    f"(its privileged texts: {list(env.privileged_fields)})"
                )

    def configure_model(self) -> None:
        """As the base; with a ``"base"`` / ``"ema"`` teacher also a teacher copy sharded alike."""
        mesh = self.device_mesh
        if mesh is not None and self._own_frozen_teacher() and not is_sharded(self.model):
            shell = copy.deepcopy(self.model).requires_grad_(False)
            shard_module(shell, mesh)
            self._teacher_shell[:] = [shell]
        super().configure_model()

    def _rl_step(self, task_seeds: list[int], optimizer: Any) -> None:
        if self._own_frozen_teacher() and not self._teacher_model:
            teacher = self._frozen_policy(self._teacher_shell[0] if self._teacher_shell else None)
            if self._restored_teacher is not None:  # resuming: the saved teacher, on our device
                teacher.load_state_dict(self._restored_teacher)
                self._restored_teacher = None
            self._teacher_model.append(teacher)
        elif self._external_teacher and not is_sharded(self.model):
            self._teacher_model[0].to(self.device)
        super()._rl_step(task_seeds, optimizer)
        self._target = None
        if self.teacher == "ema" and self._own_frozen_teacher():
            self._update_ema(self._teacher_model[0])

    @torch.no_grad()
    def _update_ema(self, teacher: torch.nn.Module) -> None:
        from torch.distributed.fsdp import FSDPModule

        for module in (*teacher.modules(), *self.model.modules()):
            if isinstance(module, FSDPModule):
                module.reshard()  # the registered parameters are the local shards again
        for ema, param in zip(teacher.parameters(), self.model.parameters(), strict=True):
            ema.lerp_(param, 1.0 - self.teacher_ema_decay)

    # ------------------------------------------------------------------ views

    def view_prefix(self, view: str, info: dict[str, str]) -> list[int]:
        """Tokens of ``view``'s template filled with the privileged texts ``info``."""
        return self.tokenizer.encode(self.views[view].format(**info))

    def demonstration(
        self, env: TextEnv, seed: int, rng: random.Random
    ) -> tuple[int, Transcript, list[int]]:
        """With probability ``sft_view_prob``: a view, then a correct response; else the base's."""
        if not self.views or self.sft_view_prob == 0 or rng.random() >= self.sft_view_prob:
            return super().demonstration(env, seed, rng)
        view = rng.choice(sorted(self.views))
        attempt = env.demonstrate(seed, rng)
        info = env.privileged_info(seed, attempt.actions[0])
        transcript = Transcript(attempt.observations[:1], (env.solution(seed),), 1.0, True)
        return seed, transcript, self.view_prefix(view, info)

    def _responses(self, rollout: Rollout) -> list[str]:
        texts = []
        for ids, act in zip(rollout.input_ids.tolist(), rollout.action_mask.tolist(), strict=True):
            tokens = [t for t, a in zip(ids, act, strict=True) if a]
            texts.append(self.tokenizer.decode([t for t in tokens if t != self.tokenizer.eos_id]))
        return texts

    @torch.no_grad()
    def view_logprobs(self, rollout: Rollout, seeds: list[int], views: list[str]) -> Tensor:
        """The teacher's next-token log-probabilities on the rollout, one row per view.

        Each episode is read with each view's text before it (one forward pass for all views);
        position ``t`` of the result scores token ``t + 1`` of the rollout, as in
        :meth:`token_logprobs`. Shape ``(views, episodes, seq - 1, vocab)``.
        """
        env = self.env
        infos = [
            env.privileged_info(seed, text)
            for seed, text in zip(seeds, self._responses(rollout), strict=True)
        ]
        prefixes = [self.view_prefix(view, info) for view in views for info in infos]
        lengths = rollout.attention_mask.sum(1).tolist() * len(views)
        ids = rollout.input_ids.repeat(len(views), 1)
        width = max(len(p) for p in prefixes) + ids.shape[1]
        batch = torch.full((len(prefixes), width), self.tokenizer.pad_id, dtype=torch.long)
        attention = torch.zeros_like(batch)
        for row, (prefix, length) in enumerate(zip(prefixes, lengths, strict=True)):
            sequence = [ids[row, 0].item(), *prefix, *ids[row, 1:length].tolist()]
            batch[row, : len(sequence)] = torch.tensor(sequence)
            attention[row, : len(sequence)] = 1
        teacher = self.teacher_model()
        was_training = teacher.training
        teacher.eval()
        logits = teacher(
            input_ids=batch.to(self.device), attention_mask=attention.to(self.device)
        ).logits
        teacher.train(was_training)
        if teacher is not self.model and is_sharded(teacher):
            teacher.reshard()  # FSDP2 keeps the root gathered after a forward: free it
        if logits.shape[-1] != self.tokenizer.vocab_size:
            raise InputError(
                f"the teacher's vocabulary has {logits.shape[-1]} tokens and the student's "
                f"{self.tokenizer.vocab_size}: they must match"
            )
        logp_all = torch.log_softmax(logits.float() / self.temperature, dim=-1)
        offsets = torch.tensor([len(p) for p in prefixes], device=self.device)
        positions = offsets[:, None] + torch.arange(ids.shape[1] - 1, device=self.device)
        index = positions[..., None].expand(-1, -1, logp_all.shape[-1])
        taken = logp_all.gather(1, index)
        return taken.view(len(views), rollout.input_ids.shape[0], ids.shape[1] - 1, -1)

    # ------------------------------------------------------------------ targets and losses

    def rollout_advantages(
        self,
        rollout: Rollout,
        task_seeds: list[int],
        stats: RolloutStats,
        old_logp: Tensor,
        mask: Tensor,
    ) -> Tensor:
        """Outcome advantages mixed with the pooled views' token-level distillation advantages."""
        outcome = super().rollout_advantages(rollout, task_seeds, stats, old_logp, mask)
        weight = self.distillation_weight
        if weight == 0:
            return outcome
        seeds = [seed for seed in task_seeds for _ in range(self.group_size)]
        view_logps = self.view_logprobs(rollout, seeds, self.teacher_views)
        target = avsd_target(
            view_logps,
            gate=self.gate,
            gate_threshold=self.gate_threshold,
            gate_sharpness=self.gate_sharpness,
            residual_scale=self.residual_scale,
        )
        tokens = rollout.input_ids[:, 1:]
        distill = sampled_token_advantages(target.logp, old_logp, tokens) * mask
        self._log_target(target, view_logps, distill, mask, len(task_seeds))
        if self.distillation == "full":
            self._target = target
            return (1.0 - weight) * outcome
        return weight * distill * target.weight + (1.0 - weight) * outcome[:, None] * mask

    def _log_target(
        self, target: AVSDTarget, view_logps: Tensor, distill: Tensor, mask: Tensor, tasks: int
    ) -> None:
        total = mask.sum().clamp(min=1.0)

        def mean(values: Tensor) -> Tensor:
            return (values * mask).sum() / total

        consensus = target.pool.consensus.argmax(-1)
        metrics = {
            "train/gate": mean(target.gate),
            "train/disagreement": mean(target.pool.disagreement),
            "train/token_weight": mean(target.weight),
            "train/distill_advantage": mean(distill),
        }
        for view, logp in zip(self.teacher_views, view_logps, strict=True):
            metrics[f"train/view_agreement_{view}"] = mean((logp.argmax(-1) == consensus).float())
        if self._trainer is not None:
            self.log_dict(metrics, batch_size=tasks)

    def minibatch_loss(
        self,
        rollout: Rollout,
        rows: Tensor,
        old_logp: Tensor,
        advantages: Tensor,
        mask: Tensor,
        ref_logp: Tensor | None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The base loss, plus ``distillation_weight`` times the weighted JSD in ``"full"`` mode."""
        if self.distillation != "full" or self._target is None:
            return super().minibatch_loss(rollout, rows, old_logp, advantages, mask, ref_logp)
        ids = rollout.input_ids[rows]
        logits = self.model(input_ids=ids, attention_mask=rollout.attention_mask[rows]).logits
        student = torch.log_softmax(logits[:, :-1].float() / self.temperature, dim=-1)
        logp = student.gather(-1, ids[:, 1:, None]).squeeze(-1)
        loss, stats = self.policy_loss(logp, old_logp, advantages, mask, ref_logp)
        target = self._target
        jsd = generalized_jsd(target.logp[rows], student, self.beta) * target.weight[rows]
        distill = (jsd * mask).sum() / mask.sum().clamp(min=1.0)
        stats["jsd"] = distill.detach()
        return loss + self.distillation_weight * distill, stats

    # ------------------------------------------------------------------ premise evaluation

    @torch.no_grad()
    def view_success(self, env: TextEnv, task_seeds: list[int], samples: int) -> dict[str, float]:
        """Success rate of the policy sampling with each view in its context.

        For each task, ``samples`` student responses are drawn first (the ``feedback`` view
        comments on them); then the policy answers again with each view before the task.
        """
        student = self.rollout(env, task_seeds, samples)
        seeds = [seed for seed in task_seeds for _ in range(samples)]
        infos = [
            env.privileged_info(seed, text)
            for seed, text in zip(seeds, self._responses(student), strict=True)
        ]
        was_training = self.model.training
        self.model.eval()
        success = {}
        for view in self.views:
            contexts, episodes = [], []
            for seed, info in zip(seeds, infos, strict=True):
                episode = env.reset(seed)
                observation = self._encode_observation(env, episode.observation, seed)
                contexts.append(
                    [self.tokenizer.bos_id, *self.view_prefix(view, info), *observation]
                )
                episodes.append(episode)
            responses = self._sample(contexts, env.max_action_tokens, greedy=False)
            for episode, response in zip(episodes, responses, strict=True):
                text = [t for t in response if t != self.tokenizer.eos_id]
                episode.step(self.tokenizer.decode(text))
            success[view] = sum(ep.success for ep in episodes) / len(episodes)
        self.model.train(was_training)
        return success

    def _evaluate_curve(self, env: TextEnv) -> None:
        first = not self.curve
        super()._evaluate_curve(env)
        if first and self.views:
            seeds = self.trainer.datamodule.tasks("val")[: self.eval_tasks]
            success = self.view_success(env, seeds, self.eval_samples)
            if self._lockstep():  # one premise on all ranks: the mean over their episodes
                means = self._all_reduce(list(success.values()))
                success = {
                    view: mean / world_size() for view, mean in zip(success, means, strict=True)
                }
            self.log_dict(
                {f"val/teacher_success_{v}": torch.tensor(s) for v, s in success.items()},
                batch_size=len(seeds),
            )

    # ------------------------------------------------------------------ state

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        if self._teacher_model and not self._external_teacher and not is_sharded(self.model):
            checkpoint["self_distillation_teacher"] = self._teacher_model[0].state_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Keeps the saved EMA / frozen teacher for the next RL step, if ``teacher`` still wants it.

        (A sharded run saves none: on resuming, its teacher is copied from the policy again.)
        """
        super().on_load_checkpoint(checkpoint)
        state = checkpoint.get("self_distillation_teacher")
        if not self._external_teacher:  # use_teacher's model is not in checkpoints: it stays
            self._teacher_model.clear()
        self._restored_teacher = state if state is not None and self._own_frozen_teacher() else None
