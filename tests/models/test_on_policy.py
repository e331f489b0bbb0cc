"""OnPolicyModule: rollouts, the clipped loss and its aggregations, bad input, and short fits."""

import logging
import random

import pytest
import torch

from ada_modules.callbacks import BudgetProgressBar
from ada_modules.data import EnvTaskDataModule
from ada_modules.models import OnPolicyModule
from ada_modules.posttrain.envs import ArithmeticEnv, Episode, KeyDoorEnv, TextEnv

TINY = {
    "hidden_size": 32,
    "num_layers": 1,
    "num_heads": 2,
    "num_kv_heads": 1,
    "intermediate_size": 64,
    "max_position_embeddings": 256,
}


class _LetterEpisode(Episode):
    def __init__(self, bad_observation: object = None) -> None:
        self.observation = "pick:"
        self.bad_observation = bad_observation
        self.turns, self.done, self.reward, self.success = 0, False, 0.0, False

    def step(self, action: str) -> None:
        self._begin_step()
        if self.bad_observation is not None:
            self.observation = self.bad_observation
            return
        self.success = action in "abcdefghij" and action != ""
        self.reward = float(self.success)
        self.done = True


class LetterEnv(TextEnv):
    """One turn, one token: reward 1 for a letter a-j (about 12% under a random policy)."""

    def __init__(self, bad_observation: object = None) -> None:
        super().__init__(max_turns=2, max_action_tokens=1)
        self.bad_observation = bad_observation

    def task_id(self, seed: int) -> str:
        return str(seed)

    def reset(self, seed: int) -> Episode:
        return _LetterEpisode(self.bad_observation)

    def demonstrator_action(self, episode: Episode, rng: random.Random) -> str:
        return rng.choice("abcdefghijklmnopqrst")


def _attach(module: OnPolicyModule, env: TextEnv, cpu_trainer, **datamodule_kwargs):
    dm = EnvTaskDataModule(env, num_train=64, num_val=16, num_test=16, **datamodule_kwargs)
    trainer = cpu_trainer(max_epochs=-1, limit_val_batches=0, num_sanity_val_steps=0)
    return dm, trainer


def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="group_size"):
        OnPolicyModule(**TINY, group_size=1)
    with pytest.raises(ValueError, match="advantage"):
        OnPolicyModule(**TINY, advantage="ppo")
    with pytest.raises(ValueError, match="loss_type"):
        OnPolicyModule(**TINY, loss_type="bnpo")
    with pytest.raises(ValueError, match="clip_low"):
        OnPolicyModule(**TINY, clip_low=1.0)
    with pytest.raises(ValueError, match="max_sampled_tokens"):
        OnPolicyModule(**TINY, max_sampled_tokens=0)


def test_rollout_of_a_multi_turn_env_marks_one_action_token_per_turn(seed):
    module = OnPolicyModule(**TINY, group_size=3)
    rollout = module.rollout(KeyDoorEnv(), [11, 12], episodes_per_task=3)
    assert rollout.input_ids.shape[0] == 6
    assert torch.equal(rollout.action_mask.sum(1).float(), rollout.responses)
    assert (rollout.input_ids[:, 0] == module.tokenizer.bos_id).all()
    assert ((rollout.action_mask == 1) <= (rollout.attention_mask == 1)).all()
    assert set(rollout.rewards.tolist()) <= {0.0, 1.0}


def test_rollout_of_a_single_turn_env_ends_at_eos_or_the_token_limit(seed):
    module = OnPolicyModule(**TINY, group_size=2)
    env = ArithmeticEnv(max_action_tokens=5)
    rollout = module.rollout(env, [1, 2, 3], episodes_per_task=2)
    assert (rollout.responses == 1).all()
    for row, actions in zip(rollout.input_ids, rollout.action_mask, strict=True):
        response = row[actions.bool()].tolist()
        assert 1 <= len(response) <= 5
        assert len(response) == 5 or response[-1] == module.tokenizer.eos_id


@pytest.mark.parametrize("bad", [42, "", "nope\u00e9"])
def test_invalid_observation_is_an_error_naming_the_task(seed, bad):
    module = OnPolicyModule(**TINY, group_size=2)
    with pytest.raises(ValueError, match="invalid observation for task seed 7"):
        module.rollout(LetterEnv(bad_observation=bad), [7], episodes_per_task=2)


def test_policy_loss_aggregations_at_ratio_one():
    module = OnPolicyModule(**TINY)
    logp = torch.log(torch.full((2, 4), 0.5))
    mask = torch.tensor([[1.0, 1, 0, 0], [1, 1, 1, 1]])
    adv = torch.tensor([1.0, -2.0])
    # ratio 1: per-token loss is -A.
    token, stats = module.policy_loss(logp, logp, adv, mask)
    assert token.item() == pytest.approx((-1 * 2 + 2 * 4) / 6)
    assert stats["clip_fraction"].item() == 0.0 and stats["kl"].item() == 0.0
    module.loss_type = "sequence"
    sequence, _ = module.policy_loss(logp, logp, adv, mask)
    assert sequence.item() == pytest.approx((-1 + 2) / 2)
    module.loss_type = "dr_grpo"
    dr, _ = module.policy_loss(logp, logp, adv, mask)
    assert dr.item() == pytest.approx((-1 * 2 + 2 * 4) / (2 * 4))


def test_policy_loss_clips_the_ratio_and_has_no_gradient_beyond_the_clip():
    module = OnPolicyModule(**TINY, clip_low=0.2, clip_high=0.28)
    old = torch.zeros(1, 3)
    logp = torch.log(torch.tensor([[1.5, 1.1, 0.5]])).requires_grad_()
    loss, stats = module.policy_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 3))
    loss.backward()
    # Token 0 (ratio 1.5 > 1.28, A > 0) is clipped: no gradient; token 1 is inside; token 2
    # (ratio 0.5 < 0.8 but A > 0) keeps the unclipped, smaller objective.
    assert logp.grad[0, 0] == 0 and logp.grad[0, 1] != 0 and logp.grad[0, 2] != 0
    assert stats["clip_fraction"].item() == pytest.approx(1 / 3)


def test_policy_loss_kl_is_zero_at_the_reference_and_positive_elsewhere():
    module = OnPolicyModule(**TINY, kl_coef=0.1)
    logp = torch.log(torch.tensor([[0.5, 0.2]]))
    _, at_ref = module.policy_loss(logp, logp, torch.zeros(1), torch.ones(1, 2), ref_logp=logp)
    _, away = module.policy_loss(logp, logp, torch.zeros(1), torch.ones(1, 2), logp - 0.3)
    assert at_ref["kl"].item() == pytest.approx(0.0) and away["kl"].item() > 0


def test_policy_loss_rejects_mismatched_lengths():
    module = OnPolicyModule(**TINY)
    with pytest.raises(ValueError, match="same shape"):
        module.policy_loss(torch.zeros(2, 5), torch.zeros(2, 4), torch.zeros(2), torch.ones(2, 4))
    with pytest.raises(ValueError, match="one per sequence"):
        module.policy_loss(torch.zeros(2, 4), torch.zeros(2, 4), torch.zeros(3), torch.ones(2, 4))


def test_without_an_env_datamodule_the_error_says_what_is_missing():
    with pytest.raises(RuntimeError, match="DataModule with an `env`"):
        _ = OnPolicyModule(**TINY).env


@pytest.mark.parametrize("advantage", ["grpo", "aem"])
def test_fit_warm_starts_then_learns_and_stops_at_the_token_budget(seed, cpu_trainer, advantage):
    module = OnPolicyModule(
        **TINY,
        group_size=8,
        advantage=advantage,
        advantage_kwargs={"strength": 0.5} if advantage == "aem" else None,
        sft_steps=2,
        max_sampled_tokens=8 * 4 * 25,
        eval_tasks=16,
        eval_samples=8,
        success_threshold=0.5,
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2),
    )
    dm, trainer = _attach(module, LetterEnv(), cpu_trainer, batch_size=4)
    trainer.fit(module, dm)
    metrics = trainer.callback_metrics
    assert module.sft_done == 2 and module.rl_steps == 25
    assert module.sampled_tokens == 8 * 4 * 25
    start, final = metrics["val/success_start"].item(), metrics["val/success"].item()
    assert final >= start + 0.3, (start, final)
    assert metrics["val/success_best"].item() >= final
    assert metrics["val/tokens_to_threshold"].item() < module.sampled_tokens
    for name in ("train/token_entropy", "train/response_entropy", "train/clip_fraction"):
        assert torch.isfinite(metrics[name])
    trainer.test(module, dm)
    assert 0.0 <= trainer.callback_metrics["test/success"].item() <= 1.0


def test_fit_on_the_maze_with_minibatches_kl_and_clip_cov(seed, cpu_trainer):
    module = OnPolicyModule(
        **TINY,
        group_size=2,
        kl_coef=0.05,
        ppo_epochs=2,
        num_minibatches=2,
        clip_cov_ratio=0.05,
        loss_type="sequence",
        sft_steps=1,
        max_sampled_tokens=60,
        eval_tasks=4,
        eval_samples=1,
    )
    dm, trainer = _attach(module, KeyDoorEnv(size=4, num_walls=1), cpu_trainer, batch_size=2)
    trainer.fit(module, dm)
    assert module.rl_steps >= 1 and module.sampled_tokens >= 60
    assert trainer.callback_metrics["train/kl"].item() >= 0.0
    checkpoint: dict = {}
    module.on_save_checkpoint(checkpoint)
    fresh = OnPolicyModule(**TINY)
    fresh.on_load_checkpoint(checkpoint)
    assert fresh.sampled_tokens == module.sampled_tokens and fresh.curve == module.curve


def test_any_hugging_face_causal_lm_can_be_the_policy(seed):
    from transformers import GPT2Config, GPT2LMHeadModel

    module = OnPolicyModule(**{**TINY, "num_kv_heads": 2}, architecture="qwen2", group_size=2)
    assert type(module.model).__name__ == "Qwen2ForCausalLM"
    tok = module.tokenizer
    module.model = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=tok.vocab_size,
            n_layer=1,
            n_head=2,
            n_embd=32,
            n_positions=256,
            bos_token_id=tok.bos_id,
            eos_token_id=tok.eos_id,
        )
    )
    rollout = module.rollout(ArithmeticEnv(max_action_tokens=6), [1, 2], episodes_per_task=2)
    logp, entropy = module.token_logprobs(rollout)
    assert logp.shape == entropy.shape == (4, rollout.input_ids.shape[1] - 1)
    assert (logp <= 0).all() and (entropy >= 0).all()


def test_curve_summary_area_best_and_interpolated_threshold():
    module = OnPolicyModule(**TINY, success_threshold=0.5)
    assert all(v != v for v in module.curve_summary().values())  # NaN while empty
    module.curve = [(0, 0.2), (100, 0.4), (200, 0.8)]
    summary = module.curve_summary()
    assert summary["success_start"] == 0.2 and summary["success_best"] == 0.8
    assert summary["success_auc"] == pytest.approx((100 * 0.3 + 100 * 0.6) / 200)
    assert summary["tokens_to_threshold"] == pytest.approx(125.0)
    module.curve = [(0, 0.2), (100, 0.3)]  # never reached: censored at the tokens sampled
    assert module.curve_summary()["tokens_to_threshold"] == 100.0


def test_the_token_budget_drives_the_progress_bar_and_a_line_says_it_stopped_the_fit(
    seed, cpu_trainer, capsys
):
    module = OnPolicyModule(
        **TINY, group_size=2, sft_steps=1, max_sampled_tokens=4, eval_tasks=2, eval_samples=1
    )
    assert module.progress_budget() == (0, 1, "SFT step")
    dm = EnvTaskDataModule(LetterEnv(), num_train=64, num_val=16, num_test=16, batch_size=2)
    bar = BudgetProgressBar()
    trainer = cpu_trainer(
        max_epochs=-1,  # 32 batches an epoch: only the token budget ends the fit
        limit_val_batches=0,
        num_sanity_val_steps=0,
        enable_progress_bar=True,
        callbacks=[bar],
    )
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    rank_zero_log = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    rank_zero_log.addHandler(handler)
    try:
        trainer.fit(module, dm)
    finally:
        rank_zero_log.removeHandler(handler)
    assert module.sft_done == 1 and module.rl_steps == 1  # 4 one-token episodes: 4 tokens
    assert module.progress_budget() == (4, 4, "sampled tokens")
    assert [m for m in messages if "budget" in m] == [
        "OnPolicyModule: token budget spent, training stopped: 4 response tokens sampled "
        "(max_sampled_tokens=4) in 1 RL step."
    ]
    out = capsys.readouterr().out
    assert "SFT step 1/1: 100%" in out and "sampled tokens 4/4: 100%" in out
    assert bar.train_progress_bar.desc == "sampled tokens 4/4"


def test_resuming_a_run_whose_budget_is_spent_trains_no_further(seed, cpu_trainer, tmp_path):
    """The budget was checked after a step only: a resume sampled one more rollout and added a
    curve point past the budget (changing success_auc and tokens_to_threshold)."""

    def build() -> OnPolicyModule:
        return OnPolicyModule(
            **TINY, group_size=2, sft_steps=1, max_sampled_tokens=4, eval_tasks=2, eval_samples=1
        )

    def fit(module, **kwargs):
        dm = EnvTaskDataModule(LetterEnv(), num_train=64, num_val=16, num_test=16, batch_size=2)
        trainer = cpu_trainer(max_epochs=-1, limit_val_batches=0, num_sanity_val_steps=0)
        trainer.fit(module, dm, **kwargs)
        return trainer

    first = build()
    fit(first).save_checkpoint(tmp_path / "spent.ckpt")
    resumed = build()
    fit(resumed, ckpt_path=tmp_path / "spent.ckpt")
    assert (resumed.rl_steps, resumed.sampled_tokens) == (first.rl_steps, first.sampled_tokens)
    assert resumed.curve == first.curve
