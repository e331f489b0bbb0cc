from functools import partial

import pytest
import torch
import yaml
from jsonargparse import ArgumentParser
from transformers import DynamicCache, LlamaForCausalLM, Qwen2ForCausalLM

from ada_modules.data import CharTokenizer, RecallDataModule
from ada_modules.kv import ADKVCache
from ada_modules.models import CausalLMModule
from ada_modules.models.causal_lm import Generation
from ada_modules.optim.lr_schedulers import WarmupCosineLR

TINY = {
    "hidden_size": 32,
    "num_layers": 1,
    "num_heads": 4,
    "num_kv_heads": 2,
    "intermediate_size": 64,
    "max_new_tokens": 4,
}


@pytest.fixture
def datamodule() -> RecallDataModule:
    dm = RecallDataModule(
        num_pairs=3, max_hops=2, num_train=32, num_val=16, num_test=16, batch_size=8
    )
    dm.setup("fit")
    return dm


@pytest.mark.parametrize(
    ("architecture", "model_class"), [("llama", LlamaForCausalLM), ("qwen2", Qwen2ForCausalLM)]
)
def test_builds_the_requested_architecture(architecture, model_class):
    module = CausalLMModule(architecture=architecture, **TINY)
    config = module.model.config
    assert type(module.model) is model_class
    assert config.vocab_size == CharTokenizer().vocab_size
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert config.eos_token_id == CharTokenizer.eos_id


def test_config_overrides_and_attn_implementation_reach_the_model():
    module = CausalLMModule(
        **TINY, attn_implementation="eager", config_overrides={"rope_theta": 123.0}
    )
    assert module.model.config._attn_implementation == "eager"
    assert module.model.config.rope_parameters["rope_theta"] == 123.0
    assert CausalLMModule(**TINY, attn_implementation="sdpa").model.config._attn_implementation == (
        "sdpa"
    )


@pytest.mark.filterwarnings(r"ignore:You are trying to `self.log\(\)`")
def test_overfits_one_batch(seed, datamodule):
    module = CausalLMModule(**TINY, optimizer=partial(torch.optim.AdamW, lr=1e-2))
    optimizer = module.configure_optimizers()
    batch = next(iter(datamodule.train_dataloader()))
    losses = []
    for step in range(15):
        loss = module.training_step(batch, step)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_weight_decay_groups_and_scheduler():
    module = CausalLMModule(
        **TINY,
        optimizer=partial(torch.optim.AdamW, lr=1e-3, weight_decay=0.1),
        lr_scheduler=partial(WarmupCosineLR, warmup_steps=4, total_steps=10),
    )
    config = module.configure_optimizers()
    decay, no_decay = config["optimizer"].param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim >= 2 for p in decay["params"]) and all(p.ndim < 2 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(module.parameters()))
    assert config["lr_scheduler"]["interval"] == "step"
    assert decay["lr"] == pytest.approx(1e-3 / 4)


def test_validation_logs_generation_metrics(seed, datamodule, tmp_path, cpu_trainer):
    module = CausalLMModule(**TINY)
    metrics = cpu_trainer(limit_val_batches=2).validate(module, datamodule, verbose=False)[0]
    expected = {"loss", "exact_match", "gen_length", "tokens_per_s", "exact_match_hop1"}
    assert {f"val/{name}" for name in expected | {"kv_bytes_per_token"}} <= set(metrics)
    # DynamicCache in fp32: keys + values of every layer, 4 bytes per element.
    config = module.model.config
    head_dim = config.hidden_size // config.num_attention_heads
    fp32_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4
    assert metrics["val/kv_bytes_per_token"] == pytest.approx(fp32_bytes)
    assert 0.0 <= metrics["val/exact_match"] <= 1.0
    assert 1.0 <= metrics["val/gen_length"] <= TINY["max_new_tokens"]
    assert metrics["val/tokens_per_s"] > 0


def test_metrics_accumulate_in_float32_under_bf16_true(seed, datamodule, cpu_trainer):
    module = CausalLMModule(**TINY)
    metrics = cpu_trainer(limit_val_batches=2, precision="bf16-true").validate(
        module, datamodule, verbose=False
    )[0]
    assert next(module.model.parameters()).dtype == torch.bfloat16
    for metric in [*module.eval_metrics.values(), *module.hop_metrics.values()]:
        assert metric.mean_value.dtype == torch.float32
    # bf16 caches: 2 bytes per element.
    config = module.model.config
    head_dim = config.hidden_size // config.num_attention_heads
    bf16_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 2
    assert metrics["val/kv_bytes_per_token"] == pytest.approx(bf16_bytes)


@pytest.mark.parametrize("dynamic_layers", [[0], []])
def test_dynamic_cache_logs_the_share_of_blocks_it_changed(seed, cpu_trainer, dynamic_layers):
    from ada_modules.kv import QUANTIZED_KV_ATTENTION, AdaKVQCache

    dm = RecallDataModule(num_pairs=3, filler_segments=3, num_train=8, num_val=8, num_test=8)
    factory = partial(
        AdaKVQCache, key_bits=3, value_bits=3, key_group_size=16, residual_length=16,
        dynamic_layers=dynamic_layers,
    )  # fmt: skip
    module = CausalLMModule(
        **{**TINY, "num_heads": 2, "num_kv_heads": 1},  # head dim 16
        cache_factory=factory,
        attn_implementation=QUANTIZED_KV_ATTENTION,
    )
    metrics = cpu_trainer().test(module, dm, verbose=False)[0]
    assert dm.prompt_length > 48  # at least two flushed blocks per sequence
    if dynamic_layers:
        assert 0.0 <= metrics["test/kv_dynamic_blocks_changed"] <= 1.0
    else:
        assert "test/kv_dynamic_blocks_changed" not in metrics


def test_exact_match_compares_generations_with_targets(
    datamodule, tmp_path, monkeypatch, cpu_trainer
):
    module = CausalLMModule(**TINY)
    tokenizer = module.tokenizer
    batches = list(datamodule.test_dataloader())

    def fake_generate(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor):
        batch = next(b for b in batches if torch.equal(b["prompt_ids"], prompt_ids))
        # Right for one-hop queries; for two-hop ones a stray <pad> inside the answer (which
        # decoding to text would drop) or a missing end token.
        completions = []
        for target, hops in zip(batch["targets"], batch["hops"], strict=True):
            ids = tokenizer.encode(target, add_eos=True)
            if hops == 2:
                ids = [ids[0], tokenizer.pad_id, *ids[1:]] if len(completions) % 2 else ids[:-1]
            completions.append(ids)
        return Generation(completions, 0.5, DynamicCache())

    monkeypatch.setattr(module, "generate", fake_generate)
    metrics = cpu_trainer().test(module, datamodule, verbose=False)[0]
    hops = torch.cat([b["hops"] for b in batches])
    assert metrics["test/exact_match_hop1"] == 1.0
    assert metrics["test/exact_match_hop2"] == 0.0
    assert metrics["test/exact_match"] == pytest.approx((hops == 1).float().mean().item())


def test_left_padded_batch_generates_what_each_prompt_generates_alone():
    from ada_modules.data import ArithmeticDataModule

    dm = ArithmeticDataModule(min_digits=1, max_digits=3, num_train=8, num_val=8, num_test=8)
    dm.setup("test")
    batch = next(iter(dm.test_dataloader()))
    assert not batch["prompt_mask"].all(), "prompts of different lengths are needed"
    torch.manual_seed(0)
    module = CausalLMModule(**{**TINY, "max_new_tokens": 6}, attn_implementation="eager").eval()
    batched = module.generate(batch["prompt_ids"], batch["prompt_mask"]).completions
    for row in range(len(batched)):
        keep = batch["prompt_mask"][row].bool()
        alone = module.generate(
            batch["prompt_ids"][row, keep][None], batch["prompt_mask"][row, keep][None]
        ).completions
        assert batched[row] == alone[0], row


def test_chunked_prefill_through_generation_kwargs_gives_the_same_greedy_completions(datamodule):
    torch.manual_seed(0)
    plain = CausalLMModule(**{**TINY, "num_layers": 2, "max_new_tokens": 6}).eval()
    chunked = CausalLMModule(
        **{**TINY, "num_layers": 2, "max_new_tokens": 6},
        generation_kwargs={"prefill_chunk_size": 4},
    ).eval()
    chunked.load_state_dict(plain.state_dict())
    batch = next(iter(datamodule.test_dataloader()))
    assert batch["prompt_ids"].shape[1] > 8  # several chunks
    expected = plain.generate(batch["prompt_ids"], batch["prompt_mask"])
    got = chunked.generate(batch["prompt_ids"], batch["prompt_mask"])
    assert got.completions == expected.completions
    assert got.cache.get_seq_length() == expected.cache.get_seq_length()
    with pytest.raises(ValueError, match="max_new_tokens"):
        CausalLMModule(**TINY, generation_kwargs={"max_new_tokens": 3})


def test_a_cache_that_takes_the_padding_is_given_the_prompt_mask(datamodule):
    marked = []

    class RecordingCache(ADKVCache):
        def mark_padding(self, attention_mask):
            marked.append(attention_mask.clone())
            super().mark_padding(attention_mask)

    module = CausalLMModule(**TINY, cache_factory=partial(RecordingCache, key_bits=8))
    ids = next(iter(datamodule.test_dataloader()))["prompt_ids"]
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # the first prompt left-padded
    module.generate(ids, mask)
    assert len(marked) == 1 and torch.equal(marked[0], mask)


def test_cache_factory_is_called_for_every_generate(datamodule):
    calls = []

    def factory(config):
        calls.append(config)
        return DynamicCache(config=config)

    module = CausalLMModule(**TINY, cache_factory=factory)
    batch = next(iter(datamodule.test_dataloader()))
    texts = module.predict_step(batch, 0)
    module.predict_step(batch, 1)
    assert len(calls) == 2 and calls[0] is module.model.config
    assert len(texts) == len(batch["targets"]) and all(isinstance(t, str) for t in texts)


def test_yaml_class_paths_parse_and_instantiate(tmp_path):
    config = tmp_path / "model.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model": {
                    "architecture": "qwen2",
                    **TINY,
                    "cache_factory": {"class_path": "transformers.DynamicCache"},
                    "optimizer": {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.5}},
                    "lr_scheduler": {
                        "class_path": "ada_modules.optim.lr_schedulers.WarmupCosineLR",
                        "init_args": {"warmup_steps": 2, "total_steps": 8},
                    },
                }
            }
        )
    )
    parser = ArgumentParser()
    parser.add_argument("--config", action="config")
    parser.add_class_arguments(CausalLMModule, "model")
    module = parser.instantiate(parser.parse_args(["--config", str(config)])).model
    assert isinstance(module.cache_factory(config=module.model.config), DynamicCache)
    optimizers = module.configure_optimizers()
    assert isinstance(optimizers["optimizer"], torch.optim.SGD)
    assert isinstance(optimizers["lr_scheduler"]["scheduler"], WarmupCosineLR)
    assert optimizers["optimizer"].param_groups[0]["lr"] == pytest.approx(0.25)


def test_load_from_checkpoint_round_trip(seed, datamodule, tmp_path, cpu_trainer):
    module = CausalLMModule(architecture="qwen2", **TINY, attn_implementation="eager")
    trainer = cpu_trainer(max_steps=2, limit_val_batches=1)
    trainer.fit(module, datamodule)
    path = tmp_path / "tiny.ckpt"
    trainer.save_checkpoint(path)
    loaded = CausalLMModule.load_from_checkpoint(path, cache_factory=DynamicCache)
    assert loaded.hparams == module.hparams
    assert loaded.cache_factory is DynamicCache
    assert type(loaded.model) is Qwen2ForCausalLM
    assert loaded.model.config._attn_implementation == "eager"
    for (name, a), (_, b) in zip(
        module.state_dict().items(), loaded.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"architecture": "gpt2"}, "architecture"),
        ({"hidden_size": 30}, "hidden_size"),
        ({"num_kv_heads": 3}, "num_kv_heads"),
        ({"num_layers": 0}, "num_layers"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"decoder_norms": "no"}, "decoder_norms"),
    ],
)
def test_bad_arguments_raise_naming_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        CausalLMModule(**{**TINY, **kwargs})


def test_geometry_param_groups_give_each_layer_role_its_norm():
    from ada_modules.optim import Scion

    module = CausalLMModule(**TINY, optimizer=partial(Scion, lr=0.01), param_groups="geometry")
    optimizer = module.configure_optimizers()
    roles = {group["role"]: group for group in optimizer.param_groups}
    assert {"embedding", "hidden", "vector", "head"} <= set(roles)
    assert roles["head"]["norm"] == "sign"
    covered = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert covered == {id(p) for p in module.parameters()}


def test_unknown_param_groups_mode_is_named():
    with pytest.raises(ValueError, match="param_groups"):
        CausalLMModule(**TINY, param_groups="layers")


def test_aux_optimizer_takes_all_but_the_hidden_matrices(seed, datamodule):
    module = CausalLMModule(
        **TINY,
        optimizer=partial(torch.optim.Muon, lr=0.02),
        aux_optimizer=partial(torch.optim.AdamW, lr=1e-3),
    )
    muon, adamw = module.configure_optimizers().optimizers
    in_muon = {id(p) for g in muon.param_groups for p in g["params"]}
    in_adamw = {id(p) for g in adamw.param_groups for p in g["params"]}
    names = {id(p): n for n, p in module.model.named_parameters()}
    # One layer: q, k, v, o, gate, up, down projections; embeddings, norms and lm_head to AdamW.
    assert sorted(names[i].rsplit(".", 2)[-2] for i in in_muon) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    assert in_muon.isdisjoint(in_adamw)
    assert in_muon | in_adamw == set(names)
    assert any(names[i] == "lm_head.weight" for i in in_adamw)


def test_radii_reach_the_geometry_groups_and_are_validated():
    from ada_modules.optim import Scion

    module = CausalLMModule(
        **TINY,
        optimizer=partial(Scion, lr=0.01),
        param_groups="geometry",
        radii={"hidden": 3.0, "head": 10.0},
    )
    radius = {g["role"]: g["radius"] for g in module.configure_optimizers().param_groups}
    assert radius["hidden"] == 3.0 and radius["head"] == 10.0
    with pytest.raises(ValueError, match="radii needs param_groups"):
        CausalLMModule(**TINY, radii={"hidden": 3.0})
    with pytest.raises(ValueError, match="'convolution'"):
        CausalLMModule(**TINY, param_groups="geometry", radii={"convolution": 1.0})
    with pytest.raises(ValueError, match=r"radii\['head'\]"):
        CausalLMModule(**TINY, param_groups="geometry", radii={"head": 0})


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_decoder_norms_false_drops_the_layer_norms_and_keeps_the_final_one(architecture):
    kwargs = {**TINY, "architecture": architecture, "num_layers": 2}
    torch.manual_seed(0)
    normed = CausalLMModule(**kwargs)
    torch.manual_seed(0)
    bare = CausalLMModule(**kwargs, decoder_norms=False)
    for layer in bare.model.model.layers:
        assert isinstance(layer.input_layernorm, torch.nn.Identity)
        assert isinstance(layer.post_attention_layernorm, torch.nn.Identity)
    assert type(bare.model.model.norm) is type(normed.model.model.norm)
    assert bare.hparams.decoder_norms is False  # a checkpoint rebuilds the same model
    n_params = sum(p.numel() for p in normed.parameters())
    assert sum(p.numel() for p in bare.parameters()) == n_params - 2 * 2 * TINY["hidden_size"]
    # Same weights otherwise: putting the norms back gives the normed model's logits.
    ids = torch.randint(3, 20, (2, 6))
    assert not torch.allclose(bare(ids), normed(ids))
    for layer, normed_layer in zip(bare.model.model.layers, normed.model.model.layers, strict=True):
        layer.input_layernorm = normed_layer.input_layernorm
        layer.post_attention_layernorm = normed_layer.post_attention_layernorm
    assert torch.equal(bare(ids), normed(ids))


def test_model_wrapper_changes_the_built_model_in_place(seed):
    from ada_modules.nn import ConnectivityWrapper, RoutedBlock

    kwargs = {"hidden_size": 32, "num_layers": 3, "num_heads": 2, "num_kv_heads": 1}
    torch.manual_seed(0)
    plain = CausalLMModule(**kwargs)
    torch.manual_seed(0)
    routed = CausalLMModule(**kwargs, model_wrapper=ConnectivityWrapper(mode="source"))
    assert all(isinstance(layer, RoutedBlock) for layer in routed.model.model.layers)
    assert "model_wrapper" not in routed.hparams
    ids = torch.randint(3, 20, (2, 6))
    assert torch.equal(routed(ids), plain(ids))  # identity at init
