"""CausalLMChannel: a tiny causal LM sampled at a temperature, through the operators."""

import pytest
import torch

from ada_modules.data import ArithmeticDataModule, TaskItemsDataModule
from ada_modules.errors import InputError
from ada_modules.models import CausalLMModule
from ada_modules.reliability import DiversityCombining, HybridRetransmission, SimulatedVerifier
from ada_modules.reliability.lm_channel import CausalLMChannel


@pytest.fixture(scope="module")
def lm():
    torch.manual_seed(0)
    return CausalLMModule(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2,
                          intermediate_size=64, max_position_embeddings=64)  # fmt: skip


def _channel(lm, **kwargs):
    kwargs = {"max_new_tokens": 6, **kwargs}
    return CausalLMChannel(lm.model, lm.tokenizer, ["1+2=", "12+30="], **kwargs)


def test_samples_cost_their_generated_tokens_and_replay_from_the_generator(lm):
    channel = _channel(lm, cost_per_token=0.5)
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    first = channel.sample(1, 4, generator=torch.Generator().manual_seed(7))
    assert torch.rand(1) == before  # the global RNG is left where it was
    again = channel.sample(1, 4, generator=torch.Generator().manual_seed(7))
    other = channel.sample(1, 4, generator=torch.Generator().manual_seed(8))
    assert first == again and first != other
    assert len(first.answers) == 4 and all(isinstance(a, str) for a in first.answers)
    # 4 completions of 1..6 tokens each (up to and including the end token), 0.5 per token.
    assert 4 * 0.5 <= first.cost <= 4 * 6 * 0.5


class _ScriptedLM(torch.nn.Module):
    """``generate`` appends fixed completions (padded rows; the end token where the row says)."""

    def __init__(self, rows):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # the channel reads the device from it
        self.rows = torch.tensor(rows)

    def generate(self, input_ids, **kwargs):
        return torch.cat([input_ids, self.rows[: input_ids.shape[0]]], dim=1)


def test_cost_is_exactly_the_tokens_up_to_each_end_token(lm):
    tok = lm.tokenizer
    four, two, one = (tok.encode(c)[0] for c in "421")
    rows = [
        [four, two, tok.eos_id, tok.pad_id, tok.pad_id],  # 3 tokens, "42"
        [four, tok.eos_id, tok.pad_id, tok.pad_id, tok.pad_id],  # 2 tokens, "4"
        [one] * 5,  # no end token: all 5 count, "11111"
    ]
    channel = CausalLMChannel(_ScriptedLM(rows), tok, ["1+1="], cost_per_token=0.5)
    samples = channel.sample(0, 3, generator=torch.Generator().manual_seed(0))
    assert samples.answers == ("42", "4", "11111")
    assert samples.cost == 0.5 * (3 + 2 + 5)


def test_greedy_like_temperature_agrees_and_a_hot_one_spreads(lm):
    cold = _channel(lm, temperature=1e-4).sample(0, 6, generator=torch.Generator().manual_seed(0))
    hot = _channel(lm, temperature=5.0).sample(0, 6, generator=torch.Generator().manual_seed(0))
    assert len(set(cold.answers)) == 1
    assert len(set(hot.answers)) > 1


def test_operators_run_on_the_model_and_account_every_token(lm):
    task = ArithmeticDataModule(min_digits=1, max_digits=2, num_val=4, num_test=4, seed=0)
    items = TaskItemsDataModule(task)
    items.setup("test")
    test = items.datasets["test"]
    channel = CausalLMChannel(lm.model, lm.tokenizer, test.texts, max_new_tokens=5,
                              extract_answer=task.extract_answer)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    vote = DiversityCombining(3)(channel, 0, truth=test.answers[0], generator=g)
    assert vote.samples == 3 and 3 <= vote.cost <= 15
    harq = HybridRetransmission(max_rounds=2, verifier=SimulatedVerifier(1.0, 0.0, cost=0.0))
    outcome = harq(channel, 1, truth=test.answers[1], generator=g)
    assert outcome.rounds in (1, 2) and outcome.cost <= 2 * 5


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"temperature": 0.0}, "temperature must be a number > 0, got 0.0"),
        ({"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1, got 0"),
        ({"cost_per_token": -1.0}, "cost_per_token must be"),
    ],
)
def test_bad_arguments_name_the_value(lm, kwargs, match):
    with pytest.raises(InputError, match=match):
        _channel(lm, **kwargs)


def test_bad_prompts_items_and_bucket_keys(lm):
    with pytest.raises(InputError, match="prompts must be a non-empty sequence"):
        CausalLMChannel(lm.model, lm.tokenizer, "1+2=")
    with pytest.raises(InputError, match=r"item must be in \[0, 2\), got 5"):
        _channel(lm).sample(5, 1, generator=torch.Generator())
    task = ArithmeticDataModule(num_val=2, num_test=2, seed=0)
    with pytest.raises(
        InputError, match="bucket_key 'length' is not in the task's example metadata"
    ):
        TaskItemsDataModule(task, bucket_key="length").setup("test")
