"""A Hugging Face causal LM sampled at a temperature, as a :class:`~ada_modules.reliability.channel.Channel`.

One :meth:`CausalLMChannel.sample` call generates ``n`` completions of an item's prompt in one
batch (``do_sample=True``), turns each into an answer (``extract_answer``, e.g. the text after
the scratchpad of :class:`~ada_modules.data.ArithmeticDataModule`) and costs the tokens generated
(each completion up to and including its end token), times ``cost_per_token``. The samples of a
call are independent given the prompt (no shared draw, unlike
:class:`~ada_modules.reliability.channel.SimulatedChannel`'s correlation): what correlates them is
the model itself. The channel draws a seed from the operator's generator for each call, so runs
are reproducible and the global RNG is left as it was.

Examples:
    >>> import torch
    >>> from ada_modules.models import CausalLMModule
    >>> lm = CausalLMModule(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2,
    ...                     intermediate_size=64, max_position_embeddings=64)
    >>> channel = CausalLMChannel(lm.model, lm.tokenizer, ["1+2="], max_new_tokens=4)
    >>> samples = channel.sample(0, 3, generator=torch.Generator().manual_seed(0))
    >>> len(samples.answers), 3 <= samples.cost <= 12
    (3, True)
"""

from collections.abc import Callable, Hashable, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from ada_modules.errors import InputError
from ada_modules.reliability.channel import Samples, _check_count, _check_item, _check_nonnegative

__all__ = ["CausalLMChannel"]


class _Tokenizer(Protocol):
    bos_id: int
    eos_id: int
    pad_id: int

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int], stop_at_eos: bool = True) -> str: ...


class CausalLMChannel:
    """Temperature sampling from a causal LM on a fixed list of prompts (items by index).

    Args:
        model: A Hugging Face causal LM (anything with ``generate``), e.g.
            ``CausalLMModule(...).model``; it is put in eval mode.
        tokenizer: Its tokenizer: ``encode(text, add_bos=...)``, ``decode(ids)`` and
            ``bos_id``/``eos_id``/``pad_id`` (e.g. :class:`~ada_modules.data.CharTokenizer`).
        prompts: The prompt of each item.
        extract_answer: Completion text -> answer (default: the stripped completion).
        temperature: Sampling temperature (> 0).
        max_new_tokens: Most tokens generated per sample.
        cost_per_token: Cost of one generated token.
        cache_factory: ``config -> Cache`` for ``generate`` (e.g. a quantized KV cache); ``None``:
            the model's default cache.
        name: Name of the channel (for reports).

    Raises:
        InputError: If an argument is out of range, naming it.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: _Tokenizer,
        prompts: Sequence[str],
        *,
        extract_answer: Callable[[str], Hashable] | None = None,
        temperature: float = 1.0,
        max_new_tokens: int = 64,
        cost_per_token: float = 1.0,
        cache_factory: Callable[..., Any] | None = None,
        name: str = "lm",
    ) -> None:
        if not hasattr(model, "generate"):
            raise InputError(f"model must have a generate method, got {type(model).__name__}")
        if isinstance(prompts, str) or not prompts:
            raise InputError(f"prompts must be a non-empty sequence of strings, got {prompts!r}")
        if not isinstance(temperature, int | float) or not temperature > 0:
            raise InputError(f"temperature must be a number > 0, got {temperature!r}")
        max_new_tokens = _check_count("max_new_tokens", max_new_tokens, 1)
        self.cost_per_token = _check_nonnegative("cost_per_token", cost_per_token)
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.prompts = list(prompts)
        self.extract_answer = extract_answer or (lambda text: text.strip())
        self.temperature = float(temperature)
        self.max_new_tokens = max_new_tokens
        self.cache_factory = cache_factory
        self.name = name

    def __len__(self) -> int:
        return len(self.prompts)

    @torch.no_grad()
    def sample(self, item: int, n: int, *, generator: torch.Generator) -> Samples:
        """``n`` sampled answers to ``item``'s prompt in one batch, and the tokens they cost."""
        item = _check_item(item, len(self))
        n = _check_count("n", n, 1)
        device = next(self.model.parameters()).device
        prompt = self.tokenizer.encode(self.prompts[item], add_bos=True)
        input_ids = torch.tensor([prompt] * n, device=device)
        kwargs: dict[str, Any] = {}
        if self.cache_factory is not None:
            kwargs["cache"] = self.cache_factory(config=self.model.config)
        seed = int(torch.randint(2**62, (), generator=generator))
        # torch.manual_seed reseeds every CUDA device too: fork (and restore) them all.
        cuda_devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
        with torch.random.fork_rng(devices=cuda_devices):
            torch.manual_seed(seed)
            output = self.model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                do_sample=True,
                temperature=self.temperature,
                top_k=0,
                top_p=1.0,
                max_new_tokens=self.max_new_tokens,
                pad_token_id=self.tokenizer.pad_id,
                eos_token_id=self.tokenizer.eos_id,
                **kwargs,
            )
        answers, tokens = [], 0
        eos = self.tokenizer.eos_id
        for row in output[:, len(prompt) :].tolist():
            end = row.index(eos) + 1 if eos in row else len(row)
            tokens += end
            answers.append(self.extract_answer(self.tokenizer.decode(row[:end])))
        return Samples(tuple(answers), tokens * self.cost_per_token)
