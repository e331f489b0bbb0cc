import pytest
import torch

from ada_modules.data.rope_drift import RopeDriftDataModule
from ada_modules.errors import InputError
from ada_modules.kernels.adkv_decode import adkv_dequantize_reference
from ada_modules.kv.adkv import ADKVParams, adkv_encode, load_adkv_params
from ada_modules.kv.kv_study import attention_relative_mse
from ada_modules.models.adkv_calibration import (
    EVAL_ARMS,
    ADKVCalibrationModule,
    _relaxed_code,
    _relaxed_init,
)


def _drifting(seed: int, batch: int, tokens: int = 128, heads: int = 1) -> dict[str, torch.Tensor]:
    """Keys with three fast sinusoidal channels (fixed across sequences) over unit noise, values
    with per-channel scales, and random queries: 8 channels."""
    gen = torch.Generator().manual_seed(seed)
    t = torch.arange(tokens).float()[:, None]
    amplitude = torch.tensor([8.0, 8.0, 0, 0, 6.0, 0, 0, 0])
    frequency = torch.tensor([0.05, 0.03, 0, 0, 0.02, 0, 0, 0])
    phase = 6.28 * torch.rand(batch, heads, 1, 8, generator=gen)
    keys = amplitude * torch.sin(frequency * t + phase)
    keys = keys + torch.randn(batch, heads, tokens, 8, generator=gen)
    values = torch.randn(batch, heads, tokens, 8, generator=gen) * torch.linspace(0.5, 2, 8)
    queries = 0.5 * torch.randn(batch, heads, 4, 8, generator=gen)
    return {"keys": keys, "values": values, "queries": queries}


class _Steps:
    """Run ``training_step`` outside a Trainer (its optimizer, backward and log are stubbed)."""

    def __init__(self, module: ADKVCalibrationModule) -> None:
        self.optimizer = module.configure_optimizers()
        module.optimizers = lambda: self.optimizer
        module.manual_backward = lambda loss: loss.backward()
        module.log = lambda *args, **kwargs: None


def _codec_error(module: ADKVCalibrationModule, batch: dict, bits: int, calibrated: bool) -> float:
    queries, keys, values, layer = module._unpack(batch)
    params = module._codec_params(bits, calibrated)
    keys_hat = module._adkv(keys, params["keys"], layer)[0]
    values_hat = module._adkv(values, params["values"], layer)[0]
    return attention_relative_mse(queries, keys, values, keys_hat, values_hat).item()


@pytest.mark.parametrize("bits", [2, 4])
def test_relaxed_coder_tracks_the_codec_at_the_defaults(bits):
    x = _drifting(0, 2)["keys"]
    module = ADKVCalibrationModule(num_heads=1, head_dim=8, bits=bits, keyframe_period=32)
    real = adkv_dequantize_reference(adkv_encode(x, ADKVParams.default(bits), 32))
    layer = torch.zeros(2, dtype=torch.long)
    alpha, table = module._rounded(bits, "keys", layer)
    gain = module.calibration[f"b{bits}_keys_log2_init_gain"][layer]
    centre, log2_step = _relaxed_init(x[..., :32, :], gain)
    relaxed = _relaxed_code(x, centre, log2_step, alpha, table, torch.tensor(2.0 ** (bits - 1)))[0]
    norm = x.square().sum()
    codec_error = ((real - x).square().sum() / norm).item()
    # Not bitwise (fixed-point centre, step mantissas), but the same path: the two reconstructions
    # differ by a tenth of the quantization error and have the same error.
    assert (relaxed - real).square().sum() / norm < 0.1 * codec_error
    assert ((relaxed - x).square().sum() / norm).item() == pytest.approx(codec_error, rel=0.05)


def test_gradients_reach_every_parameter_of_the_used_layer():
    module = ADKVCalibrationModule(
        num_heads=1, head_dim=8, bits=[2, 4], num_layers=2, keyframe_period=32, bptt_length=48
    )
    _Steps(module).optimizer.step = lambda: None  # keep the gradients, not the step
    batch = _drifting(0, 2)
    batch["queries"] = torch.cat([batch["queries"]] * 2, dim=1)  # grouped-query attention
    batch["layer"] = torch.tensor([1, 1])
    loss = module.training_step(batch, 0)
    assert torch.isfinite(loss)
    for name, parameter in module.calibration.items():
        grad = parameter.grad
        assert torch.isfinite(grad).all(), name
        assert grad[0].abs().sum() == 0, name  # layer 0 is not in the batch
        assert (grad[1].abs() > 0).float().mean() > 0.5, name


@pytest.mark.slow
def test_a_few_steps_lower_the_codec_error_on_held_out_streams(seed):
    module = ADKVCalibrationModule(
        num_heads=1, head_dim=8, bits=[2, 4], keyframe_period=32, bptt_length=32, lr=0.05
    )
    steps = _Steps(module)
    held_out = _drifting(100, 4)
    before = {bits: _codec_error(module, held_out, bits, calibrated=False) for bits in (2, 4)}
    for step in range(15):
        module.training_step(_drifting(step + 1, 2), step)
    assert steps.optimizer.state  # the optimizer stepped
    after = {bits: _codec_error(module, held_out, bits, calibrated=True) for bits in (2, 4)}
    assert after[2] < 0.95 * before[2]
    assert after[4] < 0.75 * before[4]
    # The fast-drifting key channels 0, 1, 4 learnt faster centres than the others.
    alpha = module.to_params(4, "keys").alpha.flatten()
    assert alpha[[0, 1, 4]].min() > alpha[[2, 3, 5, 6, 7]].max()


def test_to_params_rounds_to_a_valid_codec_table():
    module = ADKVCalibrationModule(num_heads=1, head_dim=3, bits=[2, 4])
    with torch.no_grad():
        p = module.calibration
        p["b4_keys_alpha_logit"][0] = torch.logit(torch.tensor([0.3, 0.999, 1e-4]))
        p["b4_keys_beta_logit"][0] = torch.logit(torch.tensor([0.5, 0.5, 0.9999]))
        p["b4_keys_log2_kappa"][0] = torch.tensor([0.0, 4.0, 200.0])
        p["b4_keys_log2_init_gain"][0] = torch.tensor([-1.0, 0.0, 1.0])
    params = module.to_params(4, "keys")
    assert params.alpha_code.dtype == torch.uint8 and params.multipliers.dtype == torch.int8
    assert params.alpha_code.tolist() == [[76, 255, 0]]  # round(256 alpha) - 1, clamped
    magnitudes = torch.arange(8) + 0.5
    expected = torch.round(8 * 0.5 * magnitudes.log2())  # [-4, 1, 5, 7, 9, 11, 12, 13]
    expected[0] = min(expected[0], -1)
    assert params.multipliers[0, 0].tolist() == expected.int().tolist()
    # kappa = 2**4: every entry > 0, so the first is forced to -1 (the step must shrink too).
    assert params.multipliers[0, 1, 0] == -1 and (params.multipliers[0, 1, 1:] > 0).all()
    # kappa = 2**200: clamped to the int8 range, first entry still forced to -1.
    assert params.multipliers[0, 2].tolist() == [-1] + [127] * 7
    assert params.init_gain.tolist() == [[0.5, 1.0, 2.0]]
    adkv_encode(torch.randn(1, 1, 16, 3), params, 8)  # the codec accepts them


def test_params_file_round_trip(tmp_path):
    module = ADKVCalibrationModule(num_heads=2, head_dim=4, bits=[2, 8], num_layers=2)
    with torch.no_grad():
        for parameter in module.calibration.values():
            parameter.add_(0.3 * torch.randn_like(parameter))
    module.save_calibrated_params(tmp_path / "sub" / "adkv_params.pt")
    state = torch.load(tmp_path / "sub" / "adkv_params.pt", weights_only=True)
    assert state["bits"] == [2, 8] and state["keyframe_period"] == 512
    for bits in (2, 8):
        loaded = load_adkv_params(tmp_path / "sub" / "adkv_params.pt", bits)
        for kind in ("keys", "values"):
            assert len(loaded[kind]) == 2
            for layer, params in enumerate(loaded[kind]):
                expected = module.to_params(bits, kind, layer)
                assert params.bits == bits
                for name in ("alpha_code", "multipliers", "init_gain"):
                    assert torch.equal(getattr(params, name), getattr(expected, name)), name


def test_fit_validate_and_test_every_arm(tmp_path, cpu_trainer, seed):
    data = RopeDriftDataModule(
        num_tokens=64, num_heads=1, head_dim=16, outlier_pairs=1, num_queries=4,
        num_train=2, num_val=1, num_test=1, seed=0,
    )  # fmt: skip
    path = tmp_path / "params.pt"
    module = ADKVCalibrationModule(
        num_heads=1, head_dim=16, keyframe_period=32, bptt_length=32, params_path=str(path),
        kivi_group_size=16,
    )  # fmt: skip
    trainer = cpu_trainer(max_steps=2, num_sanity_val_steps=0)
    trainer.fit(module, data)
    assert trainer.global_step == 2
    metrics = trainer.callback_metrics
    for bits in (2, 4):
        for name in (f"val/rel_mse_b{bits}", f"val/rel_mse_uncalibrated_b{bits}"):
            assert 0 < metrics[name] < 1, name
    assert load_adkv_params(path, 4)["values"][0].multipliers.shape == (1, 16, 8)
    results = {}
    for arm in EVAL_ARMS:
        module.eval_arm, module.eval_bits = arm, 4
        results[arm] = trainer.test(module, data, verbose=False)[0]
    assert results["fp"]["test/rel_mse"] == 0 and results["fp"]["test/total_bits"] == 16
    for arm, result in results.items():
        assert 0 < result["test/key_rel_mse"] < 1 or arm == "fp", arm
        assert result["test/total_bits"] == pytest.approx(
            result["test/code_bits"] + result["test/metadata_bits"]
        )
    # fp16 scale and zero (the baselines quantize fp16 states) per group of 16: 2 bits per element.
    assert results["kivi"]["test/metadata_bits"] == 2
    # ADKV: keyframes (fp16 centre + int16 exponent per 32 tokens) and parameters per sequence.
    shared = (16 + 16) / 32 + 8 * (1 + 8) / (64 * 16)
    assert results["adkv_uncalibrated"]["test/metadata_bits"] == pytest.approx(shared)
    per_channel = (16 + 16) / 32 + 8 * 16 * (1 + 8) / (64 * 16)
    assert results["adkv"]["test/metadata_bits"] == pytest.approx(per_channel)


def test_bad_input_is_rejected_with_the_values():
    module = ADKVCalibrationModule(num_heads=1, head_dim=16, bits=[2])
    batch = _drifting(0, 1)  # head_dim 8
    with pytest.raises(InputError, match="head_dim 8.*head_dim is 16"):
        module.training_step(batch, 0)
    with pytest.raises(InputError, match="eval_arm.*'kv'"):
        ADKVCalibrationModule(num_heads=1, head_dim=8, eval_arm="kv")
    with pytest.raises(InputError, match=r"eval_bits must be one of bits=\[2, 4\], got 8"):
        ADKVCalibrationModule(num_heads=1, head_dim=8, eval_bits=8)
    with pytest.raises(InputError, match="bptt_length must be an int >= 1, got 0"):
        ADKVCalibrationModule(num_heads=1, head_dim=8, bptt_length=0)
    with pytest.raises(InputError, match="bits must be one of"):
        ADKVCalibrationModule(num_heads=1, head_dim=8, bits=[2, 5])
    with pytest.raises(InputError, match="keyframe_period"):
        ADKVCalibrationModule(num_heads=1, head_dim=8, keyframe_period=0)
