"""MergeModule on tiny Hugging Face causal LMs: statistics over token batches (padding left
out), the merged model written as a Hugging Face folder, and exact-match scores per task."""

import copy
import json

import pytest
import torch
from lightning.pytorch import Trainer
from transformers import AutoModelForCausalLM

from ada_modules.data import ArithmeticDataModule, TaskDomainsDataModule
from ada_modules.models import CausalLMModule, MergeModule


def _trainer(folder):
    return Trainer(accelerator="cpu", logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False,
                   default_root_dir=folder)  # fmt: skip


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied_embeddings"])
def test_amaris_merge_of_causal_lms_writes_a_hugging_face_folder(tmp_path, tied):
    torch.manual_seed(0)
    base = CausalLMModule(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2,
                          intermediate_size=64, max_position_embeddings=64,
                          config_overrides={"tie_word_embeddings": tied})  # fmt: skip
    specialist = copy.deepcopy(base)
    with torch.no_grad():
        for parameter in specialist.parameters():
            parameter.add_(0.02 * torch.randn_like(parameter))
    paths = {}
    for name, module in (("base", base), ("specialist", specialist)):
        trainer = _trainer(tmp_path)
        trainer.strategy.connect(module)
        paths[name] = str(tmp_path / f"{name}.ckpt")
        trainer.save_checkpoint(paths[name])
    tasks = {
        name: ArithmeticDataModule(min_digits=low, max_digits=high, num_train=32, num_val=4,
                                   num_test=8, seed=0)
        for name, low, high in (("short", 1, 2), ("long", 3, 3))
    }  # fmt: skip
    data = TaskDomainsDataModule(tasks, train_domains=["short"], eval_domains=["short", "long"],
                                 batch_size=16, eval_batch_size=8)  # fmt: skip
    merge = MergeModule(
        base_model=paths["base"], models=[{"model": paths["specialist"], "domain": "long"}],
        merge_method="amaris", parameters={"budget": 0.05, "ridge": 1e-6},
        model_class="ada_modules.models.CausalLMModule", core_domain="short",
        output_dir=str(tmp_path / "merged"),
    )  # fmt: skip
    metrics = _trainer(tmp_path).test(merge, datamodule=data, verbose=False)[0]
    assert 0 < metrics["test/calibration_budget_use"] <= 1 + 1e-6
    assert 0 <= metrics["test/short/accuracy"] <= 1 and 0 <= metrics["test/long/accuracy"] <= 1
    report = json.loads((tmp_path / "merged" / "merge_report.json").read_text())
    counts = report["statistics"]["base"]
    # 2 batches of 16 sequences; every non-padding position counts once per layer
    tokens = sum(int(b["attention_mask"].sum()) for b in data.domain_dataloader("short", "train"))
    assert {entry["count"] for entry in counts.values()} == {tokens}
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged" / "hf_model").eval()
    ids = torch.tensor([[1, 5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, merge.merged.model(ids).logits, atol=1e-6)
    assert not torch.equal(
        merge.merged.model.model.layers[0].mlp.up_proj.weight,
        merge.base.model.model.layers[0].mlp.up_proj.weight,
    )
    head, embedding = (
        merge.merged.model.lm_head.weight,
        merge.merged.model.model.embed_tokens.weight,
    )
    if tied:  # one tensor, merged once (as the embedding, without statistics), still shared
        assert report["tied"] == {"model.lm_head.weight": "model.model.embed_tokens.weight"}
        assert head is embedding and not torch.equal(embedding, merge.base.model.lm_head.weight)
    else:
        assert "tied" not in report and not torch.equal(head, embedding)
