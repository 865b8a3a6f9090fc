"""Model shapes from config.json (harness/costmodel/shape.py): parameters counted by hand for
each architecture, sliding-window layers, active experts, quantized bytes per weight."""

from __future__ import annotations

import json

import pytest

from harness.costmodel.shape import (
    ShapeError,
    active_params,
    from_config,
    load,
    num_params,
    shape_of,
    weight_bytes,
)
from harness.platform.formats import bytes_per_value, stored_bytes

# Two layers of h=8, 2 query heads and 1 KV head of 4, MLP 16, vocabulary 32.
LLAMA = dict(
    model_type="llama",
    num_hidden_layers=2,
    hidden_size=8,
    num_attention_heads=2,
    num_key_value_heads=1,
    intermediate_size=16,
    vocab_size=32,
    torch_dtype="bfloat16",
)


def test_llama_parameters_counted_by_hand():
    shape = from_config(LLAMA, "toy")
    # a layer: q 8x8 = 64, k and v 8x4 = 32 each, o 64, gate/up/down 3 x 8 x 16 = 384,
    # two norms of 8: 592; two layers 1184; embedding and untied LM head 256 each; final
    # norm 8.
    assert shape["num_params"] == 1184 + 256 + 256 + 8 == 1704
    # a token's matmuls: the layers' projections (576 each) and the LM head
    assert active_params(shape) == 2 * 576 + 256
    assert (shape["head_dim"], shape["window_layers"], shape["window"]) == (4, [], None)
    assert "tie_word_embeddings" not in shape and "weight_bits" not in shape


def test_tied_embeddings_are_counted_once():
    assert from_config({**LLAMA, "tie_word_embeddings": True}, "t")["num_params"] == 1704 - 256


def test_qwen2_counts_its_qkv_biases():
    # biases of q (2 heads x 4), k and v (1 x 4 each): 16 a layer
    assert from_config({**LLAMA, "model_type": "qwen2"}, "q")["num_params"] == 1704 + 2 * 16


def test_gemma2_windows_every_even_layer_and_ties_its_embedding():
    config = {**LLAMA, "model_type": "gemma2", "num_hidden_layers": 4, "head_dim": 8}
    shape = from_config({**config, "sliding_window": 16}, "g")
    assert shape["window_layers"] == [0, 2] and shape["window"] == 16
    # a layer: q 8x16 = 128, k and v 8x8 = 64 each, o 128, MLP 384, four norms 32: 800;
    # four layers 3200, the embedding 256 (tied: no LM head), the final norm 8
    assert shape["num_params"] == 3200 + 256 + 8
    assert shape["tie_word_embeddings"] is True


def test_gemma3_multimodal_config_reads_its_text_model():
    text = {**LLAMA, "model_type": "gemma3_text", "num_hidden_layers": 6, "sliding_window": 8}
    shape = from_config({"model_type": "gemma3", "text_config": text}, "g3")
    # every sixth layer (the default sliding_window_pattern) full, the others windowed
    assert shape["window_layers"] == [0, 1, 2, 3, 4] and shape["model_type"] == "gemma3_text"


def test_layer_types_name_the_window_layers():
    types = ["sliding_attention", "full_attention"]
    shape = from_config({**LLAMA, "layer_types": types, "sliding_window": 4}, "s")
    assert shape["window_layers"] == [0]


def test_mixtral_counts_every_expert_and_prices_the_active_ones():
    config = {**LLAMA, "model_type": "mixtral", "num_hidden_layers": 1}
    shape = from_config({**config, "num_local_experts": 4, "num_experts_per_tok": 2}, "m")
    assert (shape["num_experts"], shape["experts_per_token"]) == (4, 2)
    # attention 192, router 8 x 4 = 32, four experts of 384, two norms 16; embedding and
    # LM head 256 each, final norm 8
    assert shape["num_params"] == 192 + 32 + 4 * 384 + 16 + 256 + 256 + 8
    # a token runs the router and 2 of the 4 experts, then the LM head
    assert active_params(shape) == 192 + 32 + 2 * 384 + 256


def test_qwen3_moe_experts_use_moe_intermediate_size():
    config = {**LLAMA, "model_type": "qwen3_moe", "num_hidden_layers": 1, "head_dim": 4}
    config |= {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 4}
    shape = from_config(config, "q3")
    assert shape["intermediate_size"] == 4
    # attention 192, router 8 x 8 = 64, 8 experts of 3 x 8 x 4 = 96, norms 16, q/k norms
    # 2 x 4; embedding, head 256 each, final norm 8
    assert shape["num_params"] == 192 + 64 + 8 * 96 + 16 + 8 + 256 + 256 + 8


def test_quantized_bytes_per_weight_count_scales_and_biases():
    # 64 float16 values at 4 bits: 32 bytes packed, a 2-byte scale and bias: 36
    assert stored_bytes(64, 2, bits=4, group_size=64) == 36
    assert bytes_per_value(2, 4, 64) == 0.5 + 4 / 64 == 0.5625
    assert bytes_per_value(2, 8, 64) == 1 + 4 / 64
    assert bytes_per_value(4, 4, 64) == 0.5 + 8 / 64  # float32 scales and biases
    assert bytes_per_value(2, 16) == 2


def test_weights_take_the_configs_mlx_quantization_or_model_bits():
    mlx = from_config({**LLAMA, "quantization": {"group_size": 8, "bits": 4}}, "q")
    assert (mlx["weight_bits"], mlx["weight_group_size"]) == (4, 8)
    assert weight_bytes(mlx) == 0.5 + 4 / 8
    assert weight_bytes(from_config(LLAMA, "q", bits=8, group_size=8)) == 1 + 4 / 8
    assert weight_bytes(from_config(LLAMA, "q")) == 2  # bfloat16 as is
    with pytest.raises(ShapeError, match="group_size=64 does not divide hidden_size 8"):
        from_config(LLAMA, "q", bits=4)


def test_load_reads_a_file_or_a_folder(tmp_path):
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps(LLAMA))
    assert load(tmp_path / "llama")["name"] == "llama"
    assert load(tmp_path / "llama" / "config.json")["num_params"] == 1704


@pytest.mark.parametrize(
    "config, match",
    [
        ({**LLAMA, "model_type": "mamba"}, "model_type 'mamba' is not a shape"),
        ({**LLAMA, "hidden_size": None}, "'hidden_size' is None"),
        ({**LLAMA, "torch_dtype": "int8"}, "torch_dtype 'int8'"),
        ({**LLAMA, "model_type": "qwen3_moe", "num_experts": 2}, "'moe_intermediate_size'"),
    ],
)
def test_bad_configs_name_the_key(config, match):
    with pytest.raises(ShapeError, match=match):
        from_config(config, "bad")


def test_missing_config_names_the_option(tmp_path):
    with pytest.raises(ShapeError, match="model.config="):
        load(tmp_path / "nothing")


def test_shape_of_counts_the_random_llamas():
    tiny = shape_of("tiny")
    # 4 layers of h=256: q, o 256^2, k, v 256 x 128, MLP 3 x 256 x 704, two norms; embedding
    # and LM head 256 x 1024 each; the final norm
    layer = 2 * 256**2 + 2 * 256 * 128 + 3 * 256 * 704 + 2 * 256
    assert num_params(tiny) == tiny["num_params"] == 4 * layer + 2 * 256 * 1024 + 256


def test_errors_name_the_option_they_came_from(tmp_path):
    with pytest.raises(ShapeError, match=r"^--model='nowhere': no such file"):
        load("nowhere", option="--model")
