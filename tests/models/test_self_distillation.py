"""SelfDistillationModule: teacher inputs, reductions to OPSD and GRPO, warm start, fits, bad input."""

import math
from pathlib import Path
from unittest import mock

import pytest
import torch

from ada_modules.data import EnvTaskDataModule
from ada_modules.models import OnPolicyModule, SelfDistillationModule
from ada_modules.models.causal_lm import build_causal_lm
from ada_modules.posttrain.advantages import RolloutStats
from ada_modules.posttrain.envs import ArithmeticEnv, KeyDoorEnv, SortingEnv

TINY = {
    "hidden_size": 32,
    "num_layers": 1,
    "num_heads": 2,
    "num_kv_heads": 1,
    "intermediate_size": 64,
    "max_position_embeddings": 128,
}
VIEWS = {"solution": "[{solution}]", "partial": "p{partial}|", "noisy": "[{noisy}]"}


def _module(**kwargs) -> SelfDistillationModule:
    return SelfDistillationModule(**{"views": VIEWS, "group_size": 2, **TINY, **kwargs})


def _advantages(module, env, seeds):
    rollout = module.rollout(env, seeds, module.group_size)
    old_logp, _ = module.token_logprobs(rollout)
    mask = rollout.action_mask[:, 1:].float()
    surprisal = -(old_logp * mask).sum(1) / mask.sum(1)
    stats = RolloutStats(surprisal=surprisal.view(len(seeds), -1), progress=0.0, entropy=1.0)
    with mock.patch.object(type(module), "env", env):
        advantages = module.rollout_advantages(rollout, seeds, stats, old_logp, mask)
    return rollout, old_logp, mask, stats, advantages


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"views": {}}, "views is empty"),
        ({"views": {"solution": "[solution]"}}, "view 'solution': template '\\[solution\\]' must"),
        ({"views": {"solution": "{}"}}, "view 'solution': template '{}' must contain named"),
        (
            {"views": {"solution": "{solution"}},
            "view 'solution': template '{solution' is malformed",
        ),
        ({"views": {"solution": "\u00e9{solution}"}}, "view 'solution'.*not in the CharTokenizer"),
        ({"teacher_views": ["hint"]}, "teacher_views must name some of the views"),
        ({"gate": 1.5}, "gate must be 'adaptive' or a number in \\[0, 1\\], got 1.5"),
        ({"temperature": 0.0}, "temperature must be > 0, got 0.0"),
        ({"teacher": "frozen"}, "teacher must be one of"),
        ({"gate_threshold": math.nan}, "gate_threshold must be a finite number, got nan"),
        ({"residual_scale": math.nan}, "residual_scale must be a finite number, got nan"),
        ({"distillation": "topk"}, "distillation must be one of"),
        ({"distillation_weight": 1.5}, "distillation_weight must be in \\[0, 1\\], got 1.5"),
        ({"beta": -0.5}, "beta must be in \\[0, 1\\], got -0.5"),
        ({"teacher_ema_decay": 1.0}, "teacher_ema_decay must be in \\[0, 1\\)"),
        ({"sft_view_prob": 2.0}, "sft_view_prob must be in \\[0, 1\\], got 2.0"),
    ],
)
def test_bad_arguments_name_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _module(**kwargs)


def test_pure_rl_needs_no_views():
    module = SelfDistillationModule(views=None, distillation_weight=0.0, **TINY)
    assert module.views == {} and module.teacher_views == []


def test_a_teacher_with_another_vocabulary_is_refused():
    module = _module()
    other = build_causal_lm(module.tokenizer, "llama", **{**TINY, "config_overrides": None})
    other.resize_token_embeddings(module.tokenizer.vocab_size + 5, mean_resizing=False)
    with pytest.raises(ValueError, match="teacher's vocabulary has 89 tokens and the student's 84"):
        module.use_teacher(other)


@pytest.mark.parametrize(
    ("env", "views", "message"),
    [
        (KeyDoorEnv(), VIEWS, "needs a single-turn environment.*KeyDoorEnv has max_turns="),
        (ArithmeticEnv(), {"hint": "[{hint}]"}, "view 'hint' uses \\['hint'\\], which Arith"),
    ],
)
def test_views_the_environment_cannot_fill_are_refused_when_fit_starts(
    env, views, message, cpu_trainer
):
    module = _module(views=views, sft_steps=1)
    trainer = cpu_trainer(max_steps=1, limit_val_batches=0, num_sanity_val_steps=0)
    with pytest.raises(ValueError, match=message):
        trainer.fit(module, EnvTaskDataModule(env, num_train=16, num_val=4, num_test=4))


def _teacher_logprobs_by_hand(module, env, rollout, seeds, template):
    """log p_teacher of every rollout position, from <bos> + view text + the sequence, one row at
    a time (the module batches all views and rows with per-row offsets)."""
    tok = module.tokenizer
    rows = []
    for row in range(rollout.input_ids.shape[0]):
        ids = rollout.input_ids[row][rollout.attention_mask[row].bool()].tolist()
        actions = rollout.action_mask[row][: len(ids)].tolist()
        response = tok.decode([t for t, a in zip(ids, actions, strict=True) if a and t > 2])
        prefix = tok.encode(template.format(**env.privileged_info(seeds[row], response)))
        logits = module.model(input_ids=torch.tensor([[ids[0], *prefix, *ids[1:]]])).logits[0]
        logp = torch.log_softmax(logits, -1)[len(prefix) : len(prefix) + len(ids) - 1]
        rows.append((logp, len(prefix)))
    return rows


def test_each_view_is_read_before_the_task_at_its_own_offset(seed):
    """Views whose texts differ in length (so the rows of the teacher's batch have different
    offsets): every view's row matches the teacher run by hand on that row."""
    views = {
        "solution": "[{solution}]",
        "feedback": "f{feedback}|",
        "partial": "{partial}",
        "both": "{partial}.{solution}|",
    }
    module = _module(views=views, teacher="live")
    env = SortingEnv(length=5)
    seeds = [3, 3, 4, 4]
    rollout = module.rollout(env, [3, 4], module.group_size)
    with mock.patch.object(SelfDistillationModule, "env", env):
        batched = module.view_logprobs(rollout, seeds, list(views))
    lengths = set()
    for v, template in enumerate(views.values()):
        for row, (logp, prefix) in enumerate(
            _teacher_logprobs_by_hand(module, env, rollout, seeds, template)
        ):
            lengths.add(prefix)
            torch.testing.assert_close(batched[v, row, : logp.shape[0]], logp, atol=1e-5, rtol=0)
    assert len(lengths) >= 3  # the offsets really differ


def test_one_view_gives_opsd_advantages_from_the_prefixed_teacher_sequence(seed):
    """The advantage of each response token is log p_teacher - log p_student of it."""
    module = _module(teacher_views=["partial"], teacher="live")
    env = SortingEnv(length=4)
    rollout, old_logp, mask, _, advantages = _advantages(module, env, [3, 4])
    by_hand = _teacher_logprobs_by_hand(module, env, rollout, [3, 3, 4, 4], VIEWS["partial"])
    for row, (logp, _) in enumerate(by_hand):
        for t in range(logp.shape[0]):
            if mask[row, t]:
                token = rollout.input_ids[row, t + 1]
                expected = logp[t, token] - old_logp[row, t]
                assert abs(advantages[row, t] - expected) < 1e-5
            else:
                assert advantages[row, t] == 0


def test_distillation_weight_zero_is_the_base_modules_outcome_advantages(seed):
    module = _module(distillation_weight=0.0)
    env = SortingEnv(length=4)
    rollout, old_logp, mask, stats, advantages = _advantages(module, env, [3, 4])
    expected = OnPolicyModule.rollout_advantages(module, rollout, [3, 4], stats, old_logp, mask)
    assert advantages.shape == (4,) and torch.equal(advantages, expected)


def test_half_weight_mixes_outcome_and_distillation_advantages(seed):
    env = SortingEnv(length=4)
    module = _module(distillation_weight=0.5, teacher="live")
    rollout, old_logp, mask, stats, mixed = _advantages(module, env, [3, 4])
    module.distillation_weight = 1.0
    with mock.patch.object(SelfDistillationModule, "env", env):
        distill = module.rollout_advantages(rollout, [3, 4], stats, old_logp, mask)
    outcome = OnPolicyModule.rollout_advantages(module, rollout, [3, 4], stats, old_logp, mask)
    torch.testing.assert_close(mixed, 0.5 * distill + 0.5 * outcome[:, None] * mask)


def test_warm_start_shows_views_before_correct_answers_or_the_plain_demonstrations():
    env = SortingEnv(length=5, noise=1.0)
    always = _module(sft_view_prob=1.0, sft_demos_per_task=8)
    demos = always._demonstrations(env, [1, 2])
    tok = always.tokenizer
    for ids, actions, success in zip(
        demos.input_ids.tolist(), demos.action_mask.tolist(), demos.success, strict=True
    ):
        text = tok.decode([t for t in ids if t > 2])
        answer = tok.decode([t for t, a in zip(ids, actions, strict=True) if a and t > 2])
        assert text[0] in "[p" and answer == "".join(sorted(text.split(":")[0][-5:]))
        assert success == 1.0
    never = _module(sft_view_prob=0.0)
    plain = OnPolicyModule(**TINY)._demonstrations(env, [1, 2])
    assert torch.equal(never._demonstrations(env, [1, 2]).input_ids, plain.input_ids)


def test_view_success_puts_each_view_before_the_task_and_grades_the_answers(seed):
    """With a "policy" that copies whatever stands between [ and ] before the task: the solution
    view always succeeds, the partial view (half the answer) never, the noisy view sometimes."""
    module = _module(views={**VIEWS, "partial": "[{partial}]"})
    tok = module.tokenizer

    def copy_the_view(contexts, max_tokens, greedy):
        texts = [tok.decode([t for t in c if t > 2]) for c in contexts]
        return [tok.encode(t[t.index("[") + 1 : t.index("]")] if "[" in t else "") for t in texts]

    env = SortingEnv(length=6, view_noise=0.3)
    with mock.patch.object(module, "_sample", copy_the_view):
        success = module.view_success(env, list(range(40)), samples=1)
    assert success["solution"] == 1.0 and success["partial"] == 0.0
    assert 0.0 < success["noisy"] < 1.0


@pytest.mark.parametrize(
    ("distillation", "teacher"), [("sampled_token", "ema"), ("full", "base"), ("full", "live")]
)
def test_short_fit_logs_the_target_and_checkpoints_the_teacher(
    seed, cpu_trainer, tmp_path, distillation, teacher
):
    module = _module(
        distillation=distillation,
        teacher=teacher,
        teacher_ema_decay=0.5,
        group_size=4,
        sft_steps=2,
        max_sampled_tokens=60,
        eval_tasks=4,
        eval_samples=2,
        residual_scale=-0.5,
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2),
    )
    data = EnvTaskDataModule(
        SortingEnv(length=3), num_train=64, num_val=8, num_test=8, batch_size=2
    )
    trainer = cpu_trainer(max_epochs=-1, limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(module, data)
    metrics = trainer.callback_metrics
    assert module.rl_steps >= 2
    for name in ("gate", "disagreement", "token_weight", "distill_advantage", "loss"):
        assert torch.isfinite(metrics[f"train/{name}"]), name
    for view in VIEWS:
        assert 0 <= metrics[f"train/view_agreement_{view}"] <= 1
        assert 0 <= metrics[f"val/teacher_success_{view}"] <= 1
    assert 0.5 <= metrics["train/token_weight"] <= 1.0
    if distillation == "full":
        assert torch.isfinite(metrics["train/jsd"])
    if teacher == "live":
        assert module.teacher_model() is module.model
        return
    frozen = module.teacher_model()
    assert frozen is not module.model
    moved = any(
        not torch.equal(a, b)
        for a, b in zip(frozen.parameters(), module.model.parameters(), strict=True)
    )
    assert moved  # the policy trained away from its (EMA / frozen) teacher
    path = tmp_path / "sd.ckpt"
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)["self_distillation_teacher"]
    assert saved.keys() == frozen.state_dict().keys()
    for name, value in frozen.state_dict().items():
        assert torch.equal(saved[name], value), name


@pytest.mark.slow
def test_self_distillation_improves_on_the_warm_start(seed, cpu_trainer):
    """End to end on CPU: a warm start on sorting four digits, then self-distillation from the
    solution view (frozen teacher) raises held-out success."""
    module = SelfDistillationModule(
        views={"solution": "[{solution}]"},
        **{**TINY, "hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 4},
        group_size=8,
        sft_steps=400,
        sft_lr=3e-3,
        max_sampled_tokens=8000,
        eval_tasks=64,
        eval_samples=4,
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
    )
    data = EnvTaskDataModule(SortingEnv(length=4), num_train=20000, num_val=64, num_test=64)
    trainer = cpu_trainer(max_epochs=-1, limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(module, data)
    metrics = trainer.callback_metrics
    start, final = metrics["val/success_start"].item(), metrics["val/success"].item()
    assert metrics["val/teacher_success_solution"].item() > start  # the premise
    assert final >= start + 0.1, (start, final)


def test_resuming_restores_the_frozen_teacher_unless_the_teacher_is_now_live(
    seed, cpu_trainer, tmp_path
):
    def build(teacher, tokens):
        return _module(
            teacher=teacher, group_size=4, sft_steps=2, max_sampled_tokens=tokens, eval_tasks=4,
            eval_samples=1, optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2),
        )  # fmt: skip

    data = EnvTaskDataModule(
        SortingEnv(length=3), num_train=64, num_val=8, num_test=8, batch_size=2
    )
    first = build("base", 40)
    trainer = cpu_trainer(max_epochs=-1, limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(first, data)
    path = tmp_path / "first.ckpt"
    trainer.save_checkpoint(path)
    saved = [p.clone() for p in first.teacher_model().parameters()]
    resumed = build("base", 80)
    trainer = cpu_trainer(max_epochs=-1, limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(resumed, data, ckpt_path=path)
    assert resumed.rl_steps > first.rl_steps
    for restored, kept in zip(resumed.teacher_model().parameters(), saved, strict=True):
        assert torch.equal(restored, kept)  # the start-of-RL teacher, not the resumed policy
    live = build("live", 80)
    trainer = cpu_trainer(max_epochs=-1, limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(live, data, ckpt_path=path)
    assert live.teacher_model() is live.model
    given = build("base", 80)  # a use_teacher model is not in the checkpoint: resuming keeps it
    other = build_causal_lm(given.tokenizer, "llama", **{**TINY, "config_overrides": None})
    given.use_teacher(other)
    trainer = cpu_trainer(max_epochs=-1, limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(given, data, ckpt_path=path)
    assert given.rl_steps > first.rl_steps and given.teacher_model() is other


def test_a_given_teacher_stays_frozen_even_with_ema_and_may_be_larger(seed, cpu_trainer):
    module = _module(teacher="ema", group_size=2, sft_steps=1, max_sampled_tokens=30,
                     eval_tasks=2, eval_samples=1)  # fmt: skip
    larger = build_causal_lm(module.tokenizer, "llama", 64, 2, 4, 2, 128, 128, None)
    before = [p.clone() for p in larger.parameters()]
    module.use_teacher(larger)
    data = EnvTaskDataModule(
        SortingEnv(length=3), num_train=64, num_val=8, num_test=8, batch_size=2
    )
    cpu_trainer(max_epochs=-1, limit_val_batches=0, num_sanity_val_steps=0).fit(module, data)
    assert module.rl_steps >= 1 and module.teacher_model() is larger
    assert all(torch.equal(a, b) for a, b in zip(larger.parameters(), before, strict=True))


def test_a_bad_environment_is_refused_before_the_cli_writes_anything(tmp_path):
    from ada_modules.cli import main

    config = Path(__file__).resolve().parents[2] / "cli_configs" / "avsd" / "sorting.yaml"
    args = ["fit", "-c", str(config), f"--trainer.default_root_dir={tmp_path}",
            f"--trainer.logger.init_args.save_dir={tmp_path}", "--trainer.callbacks=[]",
            "--data.init_args.env=ada_modules.posttrain.envs.KeyDoorEnv"]  # fmt: skip
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    assert list(tmp_path.rglob("*")) == []
