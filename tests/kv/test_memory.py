"""KV memory: cache_nbytes on transformers' QuantizedCache, and kv_memory against real caches."""

import pytest
import torch
from helpers.tiny_kv_models import ARCHS, TINY, greedy_generate, left_padded_prompts, tiny_model
from transformers import DynamicCache, QuantizedCache, Qwen2Config
from transformers.cache_utils import QuantizedLayer

from ada_modules.errors import InputError
from ada_modules.kv import AdaKVQCache, KIVICache, cache_nbytes, kv_memory

QWEN2 = ARCHS[1]


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# ----------------------------------------------------------------------------------------------
# cache_nbytes on transformers' QuantizedCache
# ----------------------------------------------------------------------------------------------


def test_counts_a_real_fp8_quantized_cache_after_generate():
    # The fp8 backend needs no extra package: codes (1 byte each) + a per-tensor fp32 scale.
    model = tiny_model(QWEN2)
    ids, mask = left_padded_prompts(2, 12, seed=0)
    cache = QuantizedCache("fp8", model.config)
    greedy_generate(model, ids, mask, cache, max_new_tokens=4)
    tokens = cache.get_seq_length()  # 12 + 4 - 1: the last token is not cached
    codes = 2 * 2 * tokens * 16  # batch x kv heads x tokens x head dim, one byte each
    expected = TINY["num_hidden_layers"] * 2 * (codes + 4)
    assert tokens == 15 and cache_nbytes(cache) == expected
    for layer in cache.layers:  # nothing left in the full-precision attributes
        assert layer.keys.numel() == 0


def _quantize_2bit(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 2-bit codes over groups of ``group`` channels, four codes per uint8."""
    flat = x.reshape(-1, group).float()
    low, high = flat.amin(-1, keepdim=True), flat.amax(-1, keepdim=True)
    scale = ((high - low) / 3).clamp(min=1e-8)
    codes = ((flat - low) / scale).round().clamp(0, 3).to(torch.uint8).reshape(-1, 4)
    packed = codes[:, 0] | codes[:, 1] << 2 | codes[:, 2] << 4 | codes[:, 3] << 6
    return packed, scale.to(x.dtype), low.to(x.dtype)


def _dequantize_2bit(packed, scale, zero, shape, dtype):
    codes = torch.stack([(packed >> s) & 3 for s in (0, 2, 4, 6)], dim=-1).reshape(
        scale.shape[0], -1
    )
    return (codes.float() * scale.float() + zero.float()).reshape(shape).to(dtype)


class _PackedStub(torch.Tensor):
    """Stand-in for quanto's ``PackedTensor``: logical uint8 codes, stored four per byte."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, shape: torch.Size) -> "_PackedStub":
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=torch.uint8)

    def __init__(self, data: torch.Tensor, shape: torch.Size) -> None:
        self._data = data

    def __tensor_flatten__(self):
        return ["_data"], {"bits": 2}

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"stub: {func}")  # the test only reads attributes


class _QBitsStub(torch.Tensor):
    """Stand-in for quanto's ``WeightQBitsTensor``: the logical (float) shape of the states,
    held as ``_data`` (packed codes), ``_scale`` and ``_shift``, listed by ``__tensor_flatten__``
    as quanto's is (its ``numel() * element_size()`` is the unquantized size, not what it holds)."""

    @staticmethod
    def __new__(cls, x: torch.Tensor, group: int) -> "_QBitsStub":
        return torch.Tensor._make_wrapper_subclass(cls, x.shape, dtype=x.dtype)

    def __init__(self, x: torch.Tensor, group: int) -> None:
        packed, self._scale, self._shift = _quantize_2bit(x, group)
        self._data = _PackedStub(packed, x.shape)

    def __tensor_flatten__(self):
        return ["_data", "_scale", "_shift"], {"qtype": "qint2", "axis": 0}

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"stub: {func}")

    def dequantize(self) -> torch.Tensor:
        return _dequantize_2bit(self._data._data, self._scale, self._shift, self.shape, self.dtype)


class QuantoLikeLayer(QuantizedLayer):
    """transformers' ``QuantizedLayer`` (its real update and residual window) with a stub backend
    that stores what quanto's ``_quantize`` returns: a tensor subclass over packed codes."""

    def _quantize(self, tensor, axis):
        return _QBitsStub(tensor, self.q_group_size)

    def _dequantize(self, q_tensor):
        return q_tensor.dequantize()


class HQQLikeLayer(QuantizedLayer):
    """Likewise with what HQQ's ``_quantize`` returns: ``(codes, meta)`` with scale and zero in
    the meta dict beside plain entries (ints, a shape, a dtype, strings)."""

    def _quantize(self, tensor, axis):
        packed, scale, zero = _quantize_2bit(tensor, self.q_group_size)
        meta = {
            "nbits": 2,
            "group_size": self.q_group_size,
            "shape": tensor.shape,
            "scale": scale,
            "zero": zero,
            "axis": axis,
            "packing": "2bit_u8",
            "unpack_view_dtype": torch.uint8,
            "view_as_float": False,
            "compute_dtype": tensor.dtype,
        }
        return packed, meta

    def _dequantize(self, q_tensor):
        packed, meta = q_tensor
        return _dequantize_2bit(
            packed, meta["scale"], meta["zero"], meta["shape"], meta["compute_dtype"]
        )


@pytest.mark.parametrize("layer_class", [QuantoLikeLayer, HQQLikeLayer], ids=["quanto", "hqq"])
def test_counts_quantized_layers_of_the_quanto_and_hqq_layouts(layer_class):
    # Faithful stubs (optimum-quanto and hqq are not dependencies): transformers' QuantizedLayer
    # drives them, so the quantized part and the residual part are where transformers puts them.
    torch.manual_seed(0)
    cache = DynamicCache()
    cache.layers = [layer_class(nbits=2, q_group_size=16, residual_length=4) for _ in range(2)]
    states = torch.randn(1, 2, 10, 16, dtype=torch.float16)
    for layer in cache.layers:
        layer.update(states[..., :6, :], states[..., :6, :])  # prefill: all quantized
        for t in range(6, 10):  # decode: 3 tokens into the residual, the 4th flushes ...
            layer.update(states[..., t : t + 1, :], states[..., t : t + 1, :])
        layer.update(states[..., :2, :], states[..., :2, :])  # ... then 2 in the residual again
    # Per layer and tensor: 10 quantized tokens x 2 heads x 16 channels at 2 bits = 80 bytes, an
    # fp16 scale and zero per group of 16 (20 groups: 80 bytes), and 2 residual fp16 tokens.
    per_tensor = 80 + 80 + nbytes(torch.empty(1, 2, 2, 16, dtype=torch.float16))
    assert cache.get_seq_length() == 12
    assert cache_nbytes(cache) == 2 * 2 * per_tensor


@pytest.mark.parametrize("backend", ["quanto", "hqq"])
def test_counts_a_real_quanto_or_hqq_quantized_cache(backend):
    # Runs where the optional backend is installed (not a dependency of this project).
    pytest.importorskip("optimum.quanto" if backend == "quanto" else "hqq")
    model = tiny_model(QWEN2)
    ids, mask = left_padded_prompts(2, 20, seed=0)
    axis = 0 if backend == "quanto" else 1
    cache = QuantizedCache(
        backend, model.config, nbits=2, q_group_size=16, residual_length=8, axis_key=axis,
        axis_value=axis,
    )  # fmt: skip
    greedy_generate(model, ids, mask, cache, max_new_tokens=6)

    def quantized_bytes(q) -> int:
        if backend == "quanto":  # WeightQBitsTensor: packed codes, scale, shift
            return nbytes(q._data._data) + nbytes(q._scale) + nbytes(q._shift)
        return nbytes(q[0]) + nbytes(q[1]["scale"]) + nbytes(q[1]["zero"])  # (codes, meta)

    expected = sum(
        nbytes(layer.keys)
        + nbytes(layer.values)
        + quantized_bytes(layer._quantized_keys)
        + quantized_bytes(layer._quantized_values)
        for layer in cache.layers
    )
    fp32 = 2 * 2 * (2 * 2 * cache.get_seq_length() * 16 * 4)  # layers x (K, V) x states
    assert cache_nbytes(cache) == expected and 0 < expected < fp32 / 2


# ----------------------------------------------------------------------------------------------
# kv_memory
# ----------------------------------------------------------------------------------------------


def _fill(cache, tokens: int, heads: int, head_dim: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    for index in range(len(cache.layers)):
        for start, end in ((0, tokens // 2), (tokens // 2, tokens)):  # prefill, then a chunk
            k = torch.randn(1, heads, end - start, head_dim, generator=gen).to(dtype)
            cache.update(k, k.clone(), layer_idx=index)


@pytest.mark.parametrize(
    ("key_bits", "value_bits", "group", "value_group", "residual", "tokens", "dtype"),
    [
        (2, 2, 16, 16, 16, 75, torch.float16),
        ([2, 3], [4, 3], 8, 16, 16, 64, torch.bfloat16),  # 3 bits at head dim 16: two words
        ([8, 2], 4, 16, 8, 32, 50, torch.float32),
    ],
)
def test_kv_memory_equals_the_bytes_a_kivi_cache_holds(
    key_bits, value_bits, group, value_group, residual, tokens, dtype
):
    cache = KIVICache(
        key_bits=key_bits, value_bits=value_bits, key_group_size=group,
        value_group_size=value_group, residual_length=residual, num_layers=2, impl="torch",
    )  # fmt: skip
    _fill(cache, tokens, heads=2, head_dim=16, dtype=dtype)
    memory = kv_memory(
        key_bits, value_bits, group_size=group, value_group_size=value_group,
        residual_length=residual, seq_len=tokens, window="exact", scale_dtype=dtype,
        head_dim=16, num_kv_heads=2, num_layers=2,
    )  # fmt: skip
    assert memory.window_tokens == tokens % residual
    assert memory.nbytes == cache.nbytes()
    assert memory.fp16_bytes_per_token == 2 * 2 * 2 * 16 * 2


def test_average_bits_equal_an_adakvq_cache_with_that_mix_at_head_dim_128():
    # 2.5 average code bits as AdaKVQ stores them: keys [2, 3], values [3, 2] (no padding at 128).
    cache = AdaKVQCache(
        key_bits=[2, 3], value_bits=[3, 2], key_group_size=32, value_group_size=32,
        residual_length=64, dynamic_layers=[], impl="torch",
    )  # fmt: skip
    _fill(cache, 200, heads=1, head_dim=128, dtype=torch.float16)
    memory = kv_memory(
        2.5, group_size=32, residual_length=64, seq_len=200, window="exact", head_dim=128,
        num_kv_heads=1, num_layers=2,
    )  # fmt: skip
    assert memory.nbytes == cache.nbytes()
    assert memory.packed_bits_per_element == pytest.approx(cache.average_bits()) == 3.5


def test_full_window_is_the_cache_one_token_before_a_flush_plus_that_token():
    # "full": R tokens at full precision; the cache holds at most R - 1 and flushes on the R-th.
    full = kv_memory(2, group_size=32, residual_length=32, seq_len=2048)
    before = kv_memory(2, group_size=32, residual_length=32, seq_len=2047, window="exact")
    fp16_token = 32 * 8 * 2 * 128 * 2
    assert (full.window_tokens, before.window_tokens) == (32, 31)
    assert full.nbytes == before.nbytes + fp16_token


def test_the_issue_figures():
    # 2.5 code bits, G = 32, fp16 scale + zero, 2K tokens with the window: 0.231 x FP16.
    g32 = kv_memory(2.5, group_size=32, residual_length=32, seq_len=2048)
    assert round(g32.ratio, 3) == 0.231 and g32.packed_bits_per_element == 3.5
    assert g32.fp16_bytes_per_token == 131072  # Llama-3.1-8B: 32 layers, 8 KV heads, d = 128
    # G = 64 reaches <= 0.2 x FP16 without the window (0.1875), not with a 64-token one at 2K.
    assert kv_memory(2.5, group_size=64, residual_length=0).ratio == 0.1875
    assert round(kv_memory(2.5, group_size=64, residual_length=64).ratio, 4) == 0.2129
    # fp32 scales double the metadata: 2.5 + 64 / 32 bits.
    assert kv_memory(2.5, residual_length=0, scale_dtype=torch.float32).ratio == 4.5 / 16


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"bits": 2.0 + 1e-9, "head_dim": 16}, "bits=.* fractional average.*head_dim=16"),
        ({"bits": 5}, r"bits as an integer must be one of \(2, 3, 4, 8\), got 5"),
        ({"bits": 9.5}, r"bits as an average must be a finite number in \[2, 8\], got 9.5"),
        ({"bits": "2"}, "bits must be a number of bits .* got '2'"),
        ({"bits": [2, 5]}, r"bits\[1\] must be one of .* got 5"),
        ({"bits": [2, 2], "num_layers": 3}, r"one width per layer \(num_layers=3\), got 2"),
        ({"value_bits": float("nan")}, "value_bits as an average .* got nan"),
        ({"group_size": 48}, "group_size must be a positive power of two, got 48"),
        ({"value_group_size": 256}, "value_group_size=256 must divide head_dim=128"),
        ({"residual_length": 48}, "residual_length must be 0 or a multiple of group_size=32"),
        ({"seq_len": 0}, "seq_len must be an integer >= 1, got 0"),
        ({"window": "max"}, "window must be 'full' or 'exact', got 'max'"),
        ({"scale_dtype": torch.int8}, "scale_dtype must be a floating torch.dtype"),
        ({"num_kv_heads": 1.5}, "num_kv_heads must be an integer >= 1, got 1.5"),
    ],
)
def test_kv_memory_rejects_bad_arguments_naming_them(kwargs, match):
    with pytest.raises(InputError, match=match):
        kv_memory(**kwargs)


def test_cache_nbytes_still_counts_plain_and_packed_caches():
    config = Qwen2Config(**TINY)
    cache = KIVICache(config, value_group_size=16, residual_length=32, impl="torch")
    _fill(cache, 40, heads=2, head_dim=16, dtype=torch.float32)
    assert cache_nbytes(cache) == cache.nbytes() > 0
