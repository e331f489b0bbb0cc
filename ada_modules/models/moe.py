"""A tiny mixture-of-experts causal language model, sharded with FSDP2 under ModelParallelStrategy."""

from __future__ import annotations

from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import nn
from torch.nn import functional as F
from torchmetrics import MeanMetric

from ada_modules.data.tokenizer import CharTokenizer
from ada_modules.errors import InputError
from ada_modules.nn.moe import MoELayer
from ada_modules.optim.param_groups import check_param_coverage, weight_decay_param_groups
from ada_modules.strategies.sharding import sharding_mesh

__all__ = ["MoEBlock", "MoELMModule", "MoETransformer"]

_PARAM_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class MoEBlock(nn.Module):
    """Pre-norm decoder block: causal self-attention, then a :class:`~ada_modules.nn.MoELayer`.

    Args:
        d_model: Width of the residual stream.
        num_heads: Attention heads (must divide ``d_model``).
        d_ff: Hidden width of each expert.
        num_experts: Experts of the MoE layer.
        top_k: Experts per token.

    Examples:
        >>> block = MoEBlock(d_model=16, num_heads=2, d_ff=32, num_experts=4, top_k=2)
        >>> y, aux = block(torch.randn(2, 7, 16))
        >>> y.shape
        torch.Size([2, 7, 16])
    """

    def __init__(self, d_model: int, num_heads: int, d_ff: int, num_experts: int, top_k: int):
        super().__init__()
        if d_model % num_heads:
            raise InputError(f"d_model={d_model} must be divisible by num_heads={num_heads}")
        self.num_heads = num_heads
        self.attn_norm = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)
        self.moe_norm = nn.LayerNorm(d_model)
        self.moe = MoELayer(d_model, d_ff, num_experts=num_experts, top_k=top_k)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the block output and the MoE load-balancing loss."""
        batch, seq, width = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).split(width, dim=-1)
        q, k, v = (t.view(batch, seq, self.num_heads, -1).transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(batch, seq, width))
        out, aux = self.moe(self.moe_norm(x))
        return x + out, aux


class MoETransformer(nn.Module):
    """Token and learned position embeddings, ``num_layers`` :class:`MoEBlock`, a final norm and head.

    Args:
        vocab_size: Number of token ids.
        d_model: Width of the residual stream.
        num_layers: Number of blocks.
        num_heads: Attention heads per block.
        d_ff: Hidden width of each expert.
        num_experts: Experts per MoE layer.
        top_k: Experts per token.
        max_seq_len: Longest input the position embedding covers.

    Examples:
        >>> model = MoETransformer(vocab_size=11, d_model=16, num_layers=1, num_heads=2, d_ff=32,
        ...                        num_experts=4, top_k=2, max_seq_len=8)
        >>> logits, aux = model(torch.randint(0, 11, (3, 8)))
        >>> logits.shape
        torch.Size([3, 8, 11])
    """

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        num_layers: int,
        num_heads: int,
        d_ff: int,
        num_experts: int,
        top_k: int,
        max_seq_len: int,
    ) -> None:
        super().__init__()
        self.max_seq_len = max_seq_len
        self.embed = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(max_seq_len, d_model)
        self.blocks = nn.ModuleList(
            MoEBlock(d_model, num_heads, d_ff, num_experts, top_k) for _ in range(num_layers)
        )
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits ``(batch, seq, vocab)`` and the mean load-balancing loss over the blocks."""
        seq = input_ids.shape[1]
        if seq > self.max_seq_len:
            raise InputError(f"input length {seq} exceeds max_seq_len={self.max_seq_len}")
        x = self.embed(input_ids) + self.pos(torch.arange(seq, device=input_ids.device))
        aux_total = x.new_zeros((), dtype=torch.float32)
        for block in self.blocks:
            x, aux = block(x)
            aux_total = aux_total + aux
        return self.head(self.norm(x)), aux_total / len(self.blocks)


class MoELMModule(LightningModule):
    """Trains a tiny top-k MoE decoder on the library's sequence tasks; shards it with FSDP2.

    The model (:class:`MoETransformer`) reads the batches of every
    :class:`~ada_modules.data.SequenceTaskDataModule` (``input_ids``, ``attention_mask``,
    ``labels``; the vocabulary of :class:`~ada_modules.data.CharTokenizer`) and minimises the
    next-token loss on ``labels`` plus ``aux_loss_weight`` times the switch-style load-balancing
    loss. Logs ``train/loss`` (the LM loss), ``train/aux_loss``, ``val/loss`` and
    ``val/token_accuracy`` (greedy next-token accuracy on the labelled positions), and the same
    under ``test/``.

    Sharding: under Lightning's ``ModelParallelStrategy`` (or a subclass, such as AdERA's
    strategy), :meth:`configure_model` applies FSDP2 ``fully_shard`` to each block's stacked
    experts, to each block, and to the root, so the expert weights (``w_in``, ``w_out``) are
    gathered as a group of their own. The model has no tensor-parallel plan, so the sharding
    mesh is the strategy's ``data_parallel`` dimension when it has more than one rank, otherwise
    its ``tensor_parallel`` dimension (Lightning's default for one node is ``data_parallel=1`` and
    ``tensor_parallel=devices``, under which all ranks see the same batches). With any other
    strategy (e.g. a single CPU process) the model stays unsharded.

    Args:
        d_model: Width of the residual stream.
        num_layers: Number of MoE decoder blocks.
        num_heads: Attention heads per block.
        d_ff: Hidden width of each expert.
        num_experts: Experts per MoE layer.
        top_k: Experts per token.
        max_seq_len: Longest input sequence.
        aux_loss_weight: Weight of the load-balancing loss in the training loss.
        fsdp_param_dtype: Dtype in which FSDP2 all-gathers and computes with the parameters
            (``MixedPrecisionPolicy(param_dtype=...)``; the sharded master weights and the gradient
            reduction stay float32). ``None`` keeps the parameters' own dtype.
        reshard_after_forward: FSDP2's ``reshard_after_forward`` for the blocks (``True``: the
            backward pass gathers the parameters again).
        optimizer: Builds the optimizer from the parameters (two groups: weight decay off for
            vectors and norms).
        lr_scheduler: Builds a per-step learning-rate scheduler from the optimizer, if given.

    Raises:
        ValueError: If an argument is out of range, naming the argument.

    Examples:
        >>> module = MoELMModule(d_model=16, num_layers=1, num_heads=2, d_ff=32, num_experts=8)
        >>> tuple(module.model.blocks[0].moe.experts.w_in.shape)
        (8, 16, 32)
        >>> logits = module(torch.randint(0, module.tokenizer.vocab_size, (2, 6)))
        >>> logits.shape[-1] == module.tokenizer.vocab_size
        True

        In YAML::

            model:
              class_path: ada_modules.models.MoELMModule
              init_args:
                num_experts: 8
                top_k: 2
                fsdp_param_dtype: bfloat16
    """

    def __init__(
        self,
        d_model: int = 64,
        num_layers: int = 2,
        num_heads: int = 4,
        d_ff: int = 128,
        num_experts: int = 8,
        top_k: int = 2,
        max_seq_len: int = 256,
        aux_loss_weight: float = 0.01,
        fsdp_param_dtype: Literal["float32", "bfloat16"] | None = None,
        reshard_after_forward: bool = True,
        optimizer: OptimizerCallable = torch.optim.AdamW,
        lr_scheduler: LRSchedulerCallable | None = None,
    ) -> None:
        super().__init__()
        for name, value in (
            ("d_model", d_model),
            ("num_layers", num_layers),
            ("num_heads", num_heads),
            ("d_ff", d_ff),
            ("num_experts", num_experts),
            ("top_k", top_k),
            ("max_seq_len", max_seq_len),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"{name} must be a positive integer, got {value!r}")
        if top_k > num_experts:
            raise InputError(f"top_k={top_k} must not exceed num_experts={num_experts}")
        if d_model % num_heads:
            raise InputError(f"d_model={d_model} must be divisible by num_heads={num_heads}")
        if not (isinstance(aux_loss_weight, int | float) and aux_loss_weight >= 0):
            raise InputError(f"aux_loss_weight must be a number >= 0, got {aux_loss_weight!r}")
        if fsdp_param_dtype is not None and fsdp_param_dtype not in _PARAM_DTYPES:
            raise InputError(
                f"fsdp_param_dtype must be None or one of {sorted(_PARAM_DTYPES)}, "
                f"got {fsdp_param_dtype!r}"
            )
        self.save_hyperparameters(ignore=["optimizer", "lr_scheduler"])
        self.tokenizer = CharTokenizer()
        self.model = MoETransformer(
            self.tokenizer.vocab_size,
            d_model,
            num_layers,
            num_heads,
            d_ff,
            num_experts,
            top_k,
            max_seq_len,
        )
        self.aux_loss_weight = float(aux_loss_weight)
        self.fsdp_param_dtype = fsdp_param_dtype
        self.reshard_after_forward = reshard_after_forward
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.eval_metrics = nn.ModuleDict(
            {
                f"{stage}_{name}": MeanMetric()
                for stage in ("val", "test")
                for name in ("loss", "token_accuracy")
            }
        )

    def configure_model(self) -> None:
        """Apply FSDP2 to experts, blocks and root when the strategy provides a device mesh."""
        mesh = self.device_mesh
        if mesh is None:
            return
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

        if isinstance(self.model, FSDPModule):  # configure_model runs again for test after fit
            return
        shard_mesh = sharding_mesh(mesh)
        kwargs: dict[str, Any] = {"mesh": shard_mesh}
        if self.fsdp_param_dtype is not None:
            kwargs["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=_PARAM_DTYPES[self.fsdp_param_dtype], reduce_dtype=torch.float32
            )
        for block in self.model.blocks:
            fully_shard(
                block.moe.experts, reshard_after_forward=self.reshard_after_forward, **kwargs
            )
            fully_shard(block, reshard_after_forward=self.reshard_after_forward, **kwargs)
        fully_shard(self.model, **kwargs)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Next-token logits, shape ``(batch, seq, vocab)``."""
        return self.model(input_ids)[0]

    def _losses(self, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits, aux = self.model(batch["input_ids"])
        logits = logits[:, :-1].float()
        labels = batch["labels"][:, 1:]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        mask = labels != -100
        correct = (logits.argmax(-1) == labels)[mask].float()
        return loss, aux, correct

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        loss, aux, _ = self._losses(batch)
        batch_size = batch["input_ids"].shape[0]
        self.log("train/loss", loss, prog_bar=True, batch_size=batch_size)
        self.log("train/aux_loss", aux, batch_size=batch_size)
        return loss + self.aux_loss_weight * aux

    def _evaluate(self, batch: dict[str, Any], stage: str) -> None:
        loss, _, correct = self._losses(batch)
        batch_size = batch["input_ids"].shape[0]
        for name, (value, weight) in {
            "loss": (loss, batch_size),
            "token_accuracy": (correct, 1.0),
        }.items():
            metric = self.eval_metrics[f"{stage}_{name}"]
            metric.update(value, weight)
            self.log(f"{stage}/{name}", metric, prog_bar=name == "loss", batch_size=batch_size)

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def configure_optimizers(self) -> Any:
        optimizer = self.optimizer(weight_decay_param_groups(self))
        check_param_coverage(self, optimizer)
        if self.lr_scheduler is None:
            return optimizer
        scheduler = self.lr_scheduler(optimizer)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }
