"""Post-RoPE queries, keys and values of a Hugging Face causal LM, captured and served as data.

:func:`capture_kv` runs a model once with the attention function :func:`capture_attention`
(registered with transformers' ``AttentionInterface`` as :data:`CAPTURE_ATTENTION` when this module
is imported), which records the states every attention layer receives and then runs SDPA, so the
model's outputs do not change. :func:`save_captured_kv` writes a capture to a ``.pt`` file and
:class:`CapturedKVDataModule` serves it with the batch keys of
:class:`~ada_modules.data.rope_drift.RopeDriftDataModule`.
"""

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ada_modules.data.rope_drift import apply_rope
from ada_modules.data.split_datamodule import SplitDataModule
from ada_modules.errors import InputError

__all__ = [
    "CAPTURE_ATTENTION",
    "CapturedKV",
    "CapturedKVDataModule",
    "capture_attention",
    "capture_kv",
    "load_captured_kv",
    "save_captured_kv",
]

CAPTURE_ATTENTION = "adkv_capture"
"""``attn_implementation`` name of :func:`capture_attention`."""

_SPLITS = ("train", "val", "test")
# One list per running capture_kv call (innermost last); capture_attention appends to the last.
_RECORDERS: list[list["CapturedKV"]] = []


@dataclass(frozen=True)
class CapturedKV:
    """The attention inputs of one layer, float32, after RoPE.

    Attributes:
        keys: ``(B, Hkv, T, D)``.
        values: ``(B, Hkv, T, D)``.
        queries: ``(B, Hq, T, D)``; with grouped-query attention ``Hq`` is a multiple of ``Hkv``
            and query head ``h`` reads key/value head ``h // (Hq // Hkv)``.
    """

    keys: torch.Tensor
    values: torch.Tensor
    queries: torch.Tensor


def capture_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """SDPA attention that first records its inputs while :func:`capture_kv` runs.

    Arguments and result are those of transformers' ``sdpa_attention_forward``.
    """
    if _RECORDERS:
        _RECORDERS[-1].append(
            CapturedKV(
                keys=key.detach().to(torch.float32, copy=True),
                values=value.detach().to(torch.float32, copy=True),
                queries=query.detach().to(torch.float32, copy=True),
            )
        )
    return sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
    )


AttentionInterface.register(CAPTURE_ATTENTION, capture_attention)
AttentionMaskInterface.register(CAPTURE_ATTENTION, sdpa_mask)


@torch.no_grad()
def capture_kv(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> list[CapturedKV]:
    """Run ``model`` once on ``input_ids`` and return every attention layer's inputs.

    The model's attention implementation is switched to :data:`CAPTURE_ATTENTION` for the forward
    (``use_cache=False``, so each layer sees exactly the ``T`` new tokens) and restored afterwards,
    also on error. Put the model in eval mode first: in training mode attention dropout applies.
    Padded positions are captured like the others. Captures are collected in module state, so
    two ``capture_kv`` calls must not run in parallel threads.

    Args:
        model: A transformers model whose attention goes through ``AttentionInterface`` (Llama,
            Qwen2, Mistral, ...).
        input_ids: ``(B, T)`` token ids.
        attention_mask: ``(B, T)`` padding mask, or ``None``.

    Returns:
        One :class:`CapturedKV` per attention layer, in call order.

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> config = LlamaConfig(vocab_size=32, hidden_size=64, num_hidden_layers=2,
        ...     num_attention_heads=4, num_key_value_heads=2, intermediate_size=64)
        >>> captured = capture_kv(LlamaForCausalLM(config).eval(), torch.randint(0, 32, (1, 8)))
        >>> len(captured), captured[0].keys.shape, captured[0].queries.shape
        (2, torch.Size([1, 2, 8, 16]), torch.Size([1, 4, 8, 16]))
    """
    if not hasattr(model, "set_attn_implementation") or not hasattr(model, "config"):
        raise InputError(f"capture_kv needs a transformers model, got {type(model).__name__}")
    previous = model.config._attn_implementation
    records: list[CapturedKV] = []
    _RECORDERS.append(records)
    try:
        model.set_attn_implementation(CAPTURE_ATTENTION)
        model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    finally:
        model.set_attn_implementation(previous)
        _RECORDERS.pop()
    if not records:
        raise InputError(
            f"{type(model).__name__} does not call transformers' AttentionInterface; "
            "nothing was captured"
        )
    return records


def save_captured_kv(path: str | os.PathLike, captured: Sequence[CapturedKV]) -> None:
    """Write a capture to ``path``: per name, the layers stacked into ``(L, B, H, T, D)``.

    Example:
        >>> import tempfile, pathlib
        >>> kv = torch.zeros(1, 2, 8, 4)
        >>> layer = CapturedKV(keys=kv, values=kv, queries=torch.zeros(1, 4, 8, 4))
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "kv.pt"
        >>> save_captured_kv(path, [layer, layer])
        >>> load_captured_kv(path)[1].queries.shape
        torch.Size([1, 4, 8, 4])
    """
    if not captured:
        raise InputError("captured must hold at least one CapturedKV, got an empty sequence")
    for name in ("keys", "values", "queries"):
        shapes = {tuple(getattr(layer, name).shape) for layer in captured}
        if len(shapes) != 1:
            raise InputError(f"captured layers must share the {name} shape, got {sorted(shapes)}")
    torch.save(
        {
            name: torch.stack([getattr(layer, name).float() for layer in captured])
            for name in ("keys", "values", "queries")
        },
        path,
    )


def load_captured_kv(path: str | os.PathLike) -> list[CapturedKV]:
    """Read a file written by :func:`save_captured_kv`: one :class:`CapturedKV` per layer."""
    data = torch.load(path, map_location="cpu", weights_only=True)
    return [
        CapturedKV(keys, values, queries)
        for keys, values, queries in zip(data["keys"], data["values"], data["queries"], strict=True)
    ]


class CapturedKVDataModule(SplitDataModule):
    """A :func:`save_captured_kv` file served as ``(H, T, D)`` items, one per layer and sequence.

    Each item cuts a token range ``[start, end)`` of one sequence of one layer: ``keys`` and
    ``values`` are the tokens ``[start, end - num_queries)`` and ``queries`` the last
    ``num_queries`` positions ``[end - num_queries, end)``, so every query comes after every key
    (no causal mask is needed; the queries do not see each other's keys). Batches stack items
    into ``(B, H, T, D)`` (the file's layers and sequences are flattened into ``B``) with an
    int ``layer`` tensor ``(B,)``, and ``keys_pre_rope`` (inverse RoPE at the token indices
    ``start..``, which assumes no left padding) when ``rope_base`` is given. With grouped-query
    attention the queries keep all ``Hq`` heads; consumers repeat each key/value head
    ``Hq // Hkv`` times.

    Splits: by default the file's ``N`` sequences are cut in order by ``fractions``
    (train = calibration, then val and test held out), each using the whole sequence. With
    ``token_ranges`` every sequence serves all three splits through disjoint token ranges
    instead (for a capture of one long sequence).

    Args:
        path: A ``.pt`` file written by :func:`save_captured_kv`.
        num_queries: Query positions per item.
        fractions: ``(train, val, test)`` shares of the sequences, positive with sum <= 1.
        token_ranges: ``{"train": (start, end), "val": ..., "test": ...}``, disjoint.
        rope_base: RoPE base of the model, to add ``keys_pre_rope``; ``None`` omits it.
        seed: Seed of the training shuffle.
        batch_size: Batch size of the training loader.
        eval_batch_size: Batch size of the evaluation loaders (defaults to ``batch_size``).
        num_workers: Worker processes per loader.

    Raises:
        InputError: If an argument is out of range (in ``setup`` when it depends on the file).

    Example:
        >>> import tempfile, pathlib
        >>> layer = CapturedKV(torch.randn(4, 2, 16, 8), torch.randn(4, 2, 16, 8),
        ...     torch.randn(4, 2, 16, 8))
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "kv.pt"
        >>> save_captured_kv(path, [layer, layer])
        >>> dm = CapturedKVDataModule(path, num_queries=4, batch_size=4)
        >>> dm.setup("fit")
        >>> batch = next(iter(dm.train_dataloader()))
        >>> batch["keys"].shape, batch["queries"].shape, sorted(batch["layer"].tolist())
        (torch.Size([4, 2, 12, 8]), torch.Size([4, 2, 4, 8]), [0, 0, 1, 1])
    """

    def __init__(
        self,
        path: str | os.PathLike,
        num_queries: int = 64,
        fractions: tuple[float, float, float] = (0.5, 0.25, 0.25),
        token_ranges: dict[str, tuple[int, int]] | None = None,
        rope_base: float | None = None,
        seed: int | None = 0,
        batch_size: int = 1,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
    ) -> None:
        super().__init__(
            seed=seed,
            batch_size=batch_size,
            eval_batch_size=eval_batch_size,
            num_workers=num_workers,
        )
        if isinstance(num_queries, bool) or not isinstance(num_queries, int) or num_queries < 1:
            raise InputError(f"num_queries must be an integer >= 1, got {num_queries!r}")
        if (
            len(fractions) != 3
            or not all(isinstance(f, int | float) and f > 0 for f in fractions)
            or sum(fractions) > 1 + 1e-9
        ):
            raise InputError(
                f"fractions must be three positive (train, val, test) shares with sum <= 1, "
                f"got {fractions!r}"
            )
        if token_ranges is not None:
            if set(token_ranges) != set(_SPLITS):
                raise InputError(
                    f"token_ranges must have the keys {list(_SPLITS)}, got {sorted(token_ranges)}"
                )
            for split, (start, end) in token_ranges.items():
                if not 0 <= start < end - num_queries:
                    raise InputError(
                        f"token_ranges[{split!r}] must be (start, end) with 0 <= start and more "
                        f"than num_queries={num_queries} tokens, got {(start, end)!r}"
                    )
            ordered = sorted(token_ranges.values())
            if any(a[1] > b[0] for a, b in zip(ordered, ordered[1:], strict=False)):
                raise InputError(f"token_ranges must not overlap, got {token_ranges!r}")
        if rope_base is not None and not rope_base > 0:
            raise InputError(f"rope_base must be None or > 0, got {rope_base!r}")
        self.path = path
        self.num_queries = num_queries
        self.fractions = tuple(fractions)
        self.token_ranges = dict(token_ranges) if token_ranges is not None else None
        self.rope_base = rope_base

    def _split_plan(self, sequences: int, tokens: int) -> dict[str, tuple[range, tuple[int, int]]]:
        if self.token_ranges is not None:
            for split, (_, end) in self.token_ranges.items():
                if end > tokens:
                    raise InputError(
                        f"token_ranges[{split!r}] ends at {end}, past the {tokens} tokens of "
                        f"{self.path}"
                    )
            return {split: (range(sequences), self.token_ranges[split]) for split in _SPLITS}
        if tokens <= self.num_queries:
            raise InputError(
                f"num_queries={self.num_queries} leaves no keys in the {tokens} tokens of "
                f"{self.path}"
            )
        plan, start, total = {}, 0, 0.0
        for split, fraction in zip(_SPLITS, self.fractions, strict=True):
            total += fraction
            end = round(total * sequences)
            if end <= start:
                raise InputError(
                    f"fractions={self.fractions} leave the {split} split without any of the "
                    f"{sequences} sequences of {self.path}; use token_ranges for few sequences"
                )
            plan[split] = (range(start, end), (0, tokens))
            start = end
        return plan

    def _items(
        self, data: dict[str, torch.Tensor], rows: range, span: tuple[int, int]
    ) -> list[dict[str, Any]]:
        start, end = span
        middle = end - self.num_queries
        positions = torch.arange(start, middle)
        items = []
        for layer in range(data["keys"].shape[0]):
            for row in rows:
                keys = data["keys"][layer, row, :, start:middle]
                item = {
                    "keys": keys,
                    "values": data["values"][layer, row, :, start:middle],
                    "queries": data["queries"][layer, row, :, middle:end],
                    "layer": layer,
                }
                if self.rope_base is not None:
                    item["keys_pre_rope"] = apply_rope(keys, positions, self.rope_base, True)
                items.append(item)
        return items

    def setup(self, stage: str | None = None) -> None:
        if self.datasets:
            return
        data = torch.load(self.path, map_location="cpu", weights_only=True)
        _, sequences, _, tokens, _ = data["keys"].shape
        for split, (rows, span) in self._split_plan(sequences, tokens).items():
            self.datasets[split] = self._items(data, rows, span)
