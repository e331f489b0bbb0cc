"""A tiny Hugging Face causal LM trained and evaluated on the library's sequence tasks."""

import time
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from torchmetrics import MeanMetric
from transformers import (
    Cache,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from ada_modules.data.tokenizer import CharTokenizer
from ada_modules.errors import InputError
from ada_modules.kv.memory import cache_nbytes
from ada_modules.optim.chain import OptimizerChain
from ada_modules.optim.param_groups import (
    check_param_coverage,
    check_radii,
    geometry_param_groups,
    split_param_groups,
    weight_decay_param_groups,
)
from ada_modules.strategies.sharding import is_sharded, shard_module, world_size

__all__ = ["CausalLMModule", "Generation", "build_causal_lm"]

ARCHITECTURES: dict[str, tuple[type[PreTrainedConfig], type[PreTrainedModel]]] = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
}
"""Model families built from a config: name -> (config class, model class)."""
_EVAL_METRICS = ("loss", "exact_match", "gen_length", "tokens_per_s", "kv_bytes_per_token")


class Generation(NamedTuple):
    """What :meth:`CausalLMModule.generate` returns."""

    completions: list[list[int]]
    """Per prompt, the generated ids up to and including the first end token."""
    seconds: float
    """Wall time of ``generate``."""
    cache: Cache
    """The KV cache as ``generate`` left it (prompt and generated tokens but the last)."""


def build_causal_lm(
    tokenizer: CharTokenizer,
    architecture: str = "llama",
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 4,
    intermediate_size: int = 512,
    max_position_embeddings: int = 4096,
    config_overrides: dict[str, Any] | None = None,
    attn_implementation: str | None = None,
    decoder_norms: bool = True,
) -> PreTrainedModel:
    """A randomly initialised Hugging Face causal LM of ``architecture`` for ``tokenizer``'s ids.

    The config gets the tokenizer's vocabulary size and pad/bos/eos ids, then
    ``config_overrides`` (any config keyword) and ``attn_implementation`` when given.
    ``decoder_norms=False`` replaces the two RMSNorms inside every decoder layer (before attention
    and before the MLP) with identities; the final norm before the output head stays.

    Examples:
        >>> model = build_causal_lm(CharTokenizer(), "qwen2", hidden_size=32, num_layers=1,
        ...                         num_heads=2, num_kv_heads=1, intermediate_size=64)
        >>> type(model).__name__, model.config.vocab_size == CharTokenizer().vocab_size
        ('Qwen2ForCausalLM', True)
    """
    config_class, model_class = ARCHITECTURES[architecture]
    config_kwargs: dict[str, Any] = {
        "vocab_size": tokenizer.vocab_size,
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "intermediate_size": intermediate_size,
        "max_position_embeddings": max_position_embeddings,
        "pad_token_id": tokenizer.pad_id,
        "bos_token_id": tokenizer.bos_id,
        "eos_token_id": tokenizer.eos_id,
    }
    config_kwargs.update(config_overrides or {})
    if attn_implementation is not None:
        config_kwargs["attn_implementation"] = attn_implementation
    if not isinstance(decoder_norms, bool):
        raise InputError(f"decoder_norms must be True or False, got {decoder_norms!r}")
    model = model_class(config_class(**config_kwargs))
    if not decoder_norms:
        for layer in model.model.layers:
            layer.input_layernorm = nn.Identity()
            layer.post_attention_layernorm = nn.Identity()
    return model


class CausalLMModule(LightningModule):
    """Trains a small Llama or Qwen2 model from scratch and scores its greedy generations.

    The model is built from a config (no hub access) with the vocabulary of
    :class:`~ada_modules.data.CharTokenizer`, so it works with every sequence DataModule of the
    library. Training minimises next-token loss on the batch ``labels`` (the completion). Validation
    and test log ``loss``, and generate completions greedily from ``prompt_ids`` to log
    ``exact_match`` (generation equal to the batch ``targets``), ``gen_length`` (generated tokens,
    end token included), ``tokens_per_s`` and ``kv_bytes_per_token`` (bytes the KV cache holds
    per cached token of one sequence, metadata included, see :func:`~ada_modules.kv.cache_nbytes`);
    when the batch has ``hops``, also
    ``exact_match_hop{h}`` per hop count; when the cache has demand-driven block widths
    (:class:`~ada_modules.kv.AdaKVQCache` with dynamic layers), ``kv_dynamic_blocks_changed``,
    the share of the dynamic layers' flushed blocks stored at other than their static widths.

    Techniques plug in without code changes: ``cache_factory`` supplies the KV cache of each
    ``generate`` call and ``attn_implementation`` picks the attention function.

    Sharding: under Lightning's ``ModelParallelStrategy`` or
    :class:`~ada_modules.strategies.AdERAStrategy`, :meth:`configure_model` applies FSDP2 to each
    decoder layer and then to the model (:func:`~ada_modules.strategies.shard_module`), and
    ``generate`` keeps the ranks in step (``synced_gpus``).

    Args:
        architecture: Model family, ``"llama"`` or ``"qwen2"``.
        hidden_size: Width of the residual stream.
        num_layers: Number of decoder layers.
        num_heads: Attention heads per layer.
        num_kv_heads: Key/value heads per layer (grouped-query attention when fewer than heads).
        intermediate_size: Width of the MLP.
        max_position_embeddings: Longest sequence the rotary embedding is set up for.
        config_overrides: Further keyword arguments of the Hugging Face config (e.g.
            ``{"tie_word_embeddings": true, "rope_theta": 1000.0}``).
        attn_implementation: Attention function name for the Hugging Face config (``"eager"``,
            ``"sdpa"`` or one registered with ``transformers.AttentionInterface``); ``None`` keeps
            the transformers default.
        decoder_norms: ``False`` builds the decoder layers without their RMSNorms (the final norm
            before the output head stays), e.g. to study depth without normalisation.
        cache_factory: Called as ``cache_factory(config=model.config)`` to make a fresh
            ``transformers.Cache`` for each ``generate`` call; ``None`` lets ``generate`` choose.
            A cache with a ``mark_padding`` method (e.g. :class:`~ada_modules.kv.ADKVCache`) is
            given the prompts' attention mask first.
        optimizer: Builds the optimizer from parameter groups.
        param_groups: ``"weight_decay"``: two groups, with weight decay disabled for parameters
            with fewer than two dimensions (norms and biases). ``"geometry"``: one group per
            layer role with its norm, from
            :func:`~ada_modules.optim.param_groups.geometry_param_groups` (for
            :class:`~ada_modules.optim.AcceleGradSharp` and :class:`~ada_modules.optim.Scion`).
        radii: With ``param_groups="geometry"``, a ``radius`` per layer role (``"embedding"``,
            ``"hidden"``, ``"vector"``, ``"head"``), e.g. Scion's per-layer radii.
        aux_optimizer: If given, ``optimizer`` gets only the 2-D hidden matrices (attention and
            MLP projections) and ``aux_optimizer`` the embeddings, norms and output head; the two
            are chained into one optimizer (the "Muon for the matrices, AdamW for the rest"
            recipe; :func:`~ada_modules.optim.param_groups.split_param_groups`).
        lr_scheduler: Builds a per-step learning-rate scheduler from the optimizer, if given.
        max_new_tokens: Generation budget per completion.
        generation_kwargs: Further arguments of every ``generate`` call (greedy decoding stays),
            e.g. ``{"prefill_chunk_size": 16}`` to prefill prompts in chunks that attend to the
            cache, so that a quantized cache is read when the prompt's last tokens are processed
            and not only when decoding.
        model_wrapper: Called once as ``model_wrapper(model)`` on the built Hugging Face model to
            change it in place, e.g. :class:`~ada_modules.nn.ConnectivityWrapper` to learn the
            residual connectivity of the decoder layers; ``None`` keeps the model as built.

    The callables (``cache_factory``, ``optimizer``, ``aux_optimizer``, ``lr_scheduler``,
    ``model_wrapper``) are not saved as
    hyperparameters; ``load_from_checkpoint(path, cache_factory=...)`` sets them on reload.

    Raises:
        ValueError: If an argument is out of range, naming the argument.

    Examples:
        >>> from transformers import DynamicCache
        >>> module = CausalLMModule(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
        ...                         intermediate_size=64, cache_factory=DynamicCache)
        >>> module.model.config.num_hidden_layers
        1

        In YAML::

            model:
              class_path: ada_modules.models.CausalLMModule
              init_args:
                architecture: qwen2
                cache_factory:
                  class_path: transformers.DynamicCache
                optimizer:
                  class_path: torch.optim.AdamW
                  init_args: {lr: 0.003, weight_decay: 0.01}
    """

    def __init__(
        self,
        architecture: Literal["llama", "qwen2"] = "llama",
        hidden_size: int = 128,
        num_layers: int = 2,
        num_heads: int = 4,
        num_kv_heads: int = 4,
        intermediate_size: int = 512,
        max_position_embeddings: int = 4096,
        config_overrides: dict[str, Any] | None = None,
        attn_implementation: str | None = None,
        decoder_norms: bool = True,
        cache_factory: Callable[[PreTrainedConfig], Cache] | None = None,
        optimizer: OptimizerCallable = torch.optim.AdamW,
        lr_scheduler: LRSchedulerCallable | None = None,
        param_groups: Literal["weight_decay", "geometry"] = "weight_decay",
        radii: dict[str, float] | None = None,
        aux_optimizer: OptimizerCallable | None = None,
        max_new_tokens: int = 32,
        generation_kwargs: dict[str, Any] | None = None,
        model_wrapper: Callable[[PreTrainedModel], Any] | None = None,
    ) -> None:
        super().__init__()
        if param_groups not in ("weight_decay", "geometry"):
            raise InputError(
                f"param_groups must be 'weight_decay' or 'geometry', got {param_groups!r}"
            )
        if radii is not None and param_groups != "geometry":
            raise InputError("radii needs param_groups='geometry'")
        check_radii(radii)
        if architecture not in ARCHITECTURES:
            raise InputError(
                f"architecture must be one of {sorted(ARCHITECTURES)}, got {architecture!r}"
            )
        for name, value in (
            ("hidden_size", hidden_size),
            ("num_layers", num_layers),
            ("num_heads", num_heads),
            ("num_kv_heads", num_kv_heads),
            ("intermediate_size", intermediate_size),
            ("max_position_embeddings", max_position_embeddings),
            ("max_new_tokens", max_new_tokens),
        ):
            if not isinstance(value, int) or value < 1:
                raise InputError(f"{name} must be a positive integer, got {value!r}")
        if hidden_size % num_heads:
            raise InputError(
                f"hidden_size={hidden_size} must be divisible by num_heads={num_heads}"
            )
        if num_heads % num_kv_heads:
            raise InputError(
                f"num_heads={num_heads} must be divisible by num_kv_heads={num_kv_heads}"
            )
        # Callables are not stored: checkpoints stay loadable with ``weights_only=True``; pass them
        # again to ``load_from_checkpoint`` when needed.
        self.save_hyperparameters(
            ignore=[
                "cache_factory",
                "optimizer",
                "aux_optimizer",
                "lr_scheduler",
                "model_wrapper",
            ]
        )
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
            attn_implementation,
            decoder_norms,
        )
        if model_wrapper is not None:
            model_wrapper(self.model)
        generation_config = self.model.generation_config
        generation_config.do_sample = False
        generation_config.pad_token_id = self.tokenizer.pad_id
        generation_config.bos_token_id = self.tokenizer.bos_id
        generation_config.eos_token_id = self.tokenizer.eos_id
        self.cache_factory = cache_factory
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.param_groups = param_groups
        self.radii = radii
        self.aux_optimizer = aux_optimizer
        self.max_new_tokens = max_new_tokens
        reserved = {"input_ids", "attention_mask", "max_new_tokens", "cache", "do_sample"}
        if generation_kwargs and reserved & set(generation_kwargs):
            raise InputError(
                f"generation_kwargs may not set {sorted(reserved & set(generation_kwargs))}: "
                "the module sets them"
            )
        self.generation_kwargs = dict(generation_kwargs or {})
        self.eval_metrics = nn.ModuleDict(
            {f"{stage}_{name}": MeanMetric() for stage in ("val", "test") for name in _EVAL_METRICS}
        )
        # Per-hop accuracies are created on first sight of a hop count (see _evaluate).
        self.hop_metrics = nn.ModuleDict()
        # Cache statistics that only some caches report, created on first report.
        self.cache_metrics = nn.ModuleDict()
        self._generated = False  # whether generate ran (the cache factory was used)
        self._warned_unused_cache = False

    def configure_model(self) -> None:
        """Under ``ModelParallelStrategy`` or ``AdERAStrategy``: FSDP2 per decoder layer, then root.

        See :func:`~ada_modules.strategies.sharding.shard_module`; without a device mesh (any
        other strategy) the model stays as it is.
        """
        shard_module(self, self.device_mesh)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Next-token logits, shape ``(batch, seq, vocab)``."""
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits

    def _loss(self, batch: dict[str, Any]) -> torch.Tensor:
        return self.model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            labels=batch["labels"],
        ).loss

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train/loss", loss, prog_bar=True, batch_size=batch["input_ids"].shape[0])
        return loss

    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> Generation:
        """Greedily complete left-padded prompts.

        Returns:
            The completions (per prompt, the generated token ids up to and including the first end
            token; all of them when generation hit ``max_new_tokens`` first), the wall time of
            ``generate`` in seconds, and the KV cache it filled.
        """
        self._generated = True
        kwargs: dict[str, Any] = {}
        if self.cache_factory is not None:
            kwargs["cache"] = self.cache_factory(config=self.model.config)
            if hasattr(kwargs["cache"], "mark_padding"):
                kwargs["cache"].mark_padding(prompt_mask)
        if is_sharded(self.model) and world_size() > 1:
            # Sharded: every rank must run the same number of forward passes.
            kwargs["synced_gpus"] = True
        if prompt_ids.is_cuda:
            torch.cuda.synchronize(prompt_ids.device)
        start = time.perf_counter()
        output = self.model.generate(
            input_ids=prompt_ids,
            attention_mask=prompt_mask,
            max_new_tokens=self.max_new_tokens,
            return_dict_in_generate=True,
            **self.generation_kwargs,
            **kwargs,
        )
        if prompt_ids.is_cuda:
            torch.cuda.synchronize(prompt_ids.device)
        elapsed = time.perf_counter() - start
        completions = []
        for row in output.sequences[:, prompt_ids.shape[1] :].tolist():
            end = row.index(self.tokenizer.eos_id) + 1 if self.tokenizer.eos_id in row else len(row)
            completions.append(row[:end])
        return Generation(completions, elapsed, output.cache)

    def setup(self, stage: str) -> None:
        # Per-hop accuracies exist from the start (same metrics on every rank) when the
        # datamodule says how many hops its queries have.
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer else None
        for hops in range(1, getattr(datamodule, "max_hops", 0) + 1):
            for split in ("val", "test"):
                if f"{split}_{hops}" not in self.hop_metrics:
                    self.hop_metrics[f"{split}_{hops}"] = MeanMetric()

    def on_fit_end(self) -> None:
        # The cache is only used by generate (validation, test, predict): say so, once, when a
        # configured cache factory was never called.
        if self.cache_factory is not None and not self._generated and not self._warned_unused_cache:
            self._warned_unused_cache = True
            rank_zero_warn(
                "CausalLMModule: cache_factory is set but this fit never generated (no validation "
                "step ran), so the cache was not used; it applies to generate in validation, "
                "test and predict"
            )

    def _metrics_in_float32(self) -> None:
        # Under a half-precision trainer (``precision: bf16-true``) the model is converted, states
        # of the metrics included; accumulate in float32 so that means are not rounded to bf16.
        metrics = (self.eval_metrics, self.hop_metrics, self.cache_metrics)
        for metric in [m for group in metrics for m in group.values()]:
            metric.set_dtype(torch.float32)

    def on_validation_start(self) -> None:
        self._metrics_in_float32()

    def on_test_start(self) -> None:
        self._metrics_in_float32()

    def _evaluate(self, batch: dict[str, Any], stage: str) -> None:
        batch_size = batch["prompt_ids"].shape[0]
        completions, elapsed, cache = self.generate(batch["prompt_ids"], batch["prompt_mask"])
        # Exact match on token ids: the completion and its end token, nothing else (a stray
        # special token or a missing end token is wrong, which decoding to text would hide).
        targets = [self.tokenizer.encode(t, add_eos=True) for t in batch["targets"]]
        correct = torch.tensor(
            [float(c == t) for c, t in zip(completions, targets, strict=True)], device=self.device
        )
        lengths = torch.tensor([len(c) for c in completions], device=self.device)
        updates = {
            "loss": (self._loss(batch), batch_size),
            "exact_match": (correct, 1.0),
            "gen_length": (lengths.float(), 1.0),
            # Weighting each batch's rate by its time gives total tokens / total time.
            "tokens_per_s": (lengths.sum() / max(elapsed, 1e-9), elapsed),
            # Bytes the KV cache held per token of one sequence at the end of generation.
            "kv_bytes_per_token": (
                torch.tensor(cache_nbytes(cache) / (batch_size * max(cache.get_seq_length(), 1))),
                1.0,
            ),
        }
        for name, (value, weight) in updates.items():
            metric = self.eval_metrics[f"{stage}_{name}"]
            metric.update(value, weight)
            self.log(
                f"{stage}/{name}", metric, prog_bar=name == "exact_match", batch_size=batch_size
            )
        # Caches with demand-driven block widths (AdaKVQCache) say how many blocks they changed.
        block_changes = getattr(cache, "dynamic_block_changes", None)
        changed, blocks = block_changes() if block_changes is not None else (0, 0)
        if blocks:
            key = f"{stage}_kv_dynamic_blocks_changed"
            if key not in self.cache_metrics:
                self.cache_metrics[key] = MeanMetric().to(self.device)
            self.cache_metrics[key].update(torch.tensor(changed / blocks), blocks)
            self.log(
                f"{stage}/kv_dynamic_blocks_changed",
                self.cache_metrics[key],
                batch_size=batch_size,
                metric_attribute=f"cache_metrics.{key}",
            )
        if "hops" in batch:
            for hops in batch["hops"].unique().tolist():
                selected = batch["hops"] == hops
                key = f"{stage}_{hops}"
                if key not in self.hop_metrics:  # no datamodule told setup() the hop range
                    self.hop_metrics[key] = MeanMetric().to(self.device)
                self.hop_metrics[key].update(correct[selected].mean(), selected.sum())
                self.log(
                    f"{stage}/exact_match_hop{hops}",
                    self.hop_metrics[key],
                    batch_size=batch_size,
                    metric_attribute=f"hop_metrics.{key}",
                )

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def predict_step(self, batch: dict[str, Any], batch_idx: int) -> list[str]:
        completions = self.generate(batch["prompt_ids"], batch["prompt_mask"]).completions
        return [self.tokenizer.decode(ids) for ids in completions]

    def configure_optimizers(self) -> Any:
        roles = geometry_param_groups(self.model, radii=self.radii)
        if self.param_groups == "geometry":
            groups = roles
        else:
            groups = weight_decay_param_groups(self)
        if self.aux_optimizer is None:
            optimizer = self.optimizer(groups)
        else:
            hidden = [p for g in roles if g["role"] == "hidden" for p in g["params"]]
            main, aux = split_param_groups(groups, hidden)
            optimizer = OptimizerChain([self.optimizer(main), self.aux_optimizer(aux)])
        check_param_coverage(self, optimizer)
        if self.lr_scheduler is None:
            return optimizer
        scheduler = self.lr_scheduler(optimizer)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }
