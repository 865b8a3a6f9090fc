"""Roofline profiles (harness/costmodel/roofline.py): hand-computed step times, the bound
each step is under, and a saved profile's predictions after load."""

from __future__ import annotations

import pytest

from harness.costmodel.profile import ProfileError, RooflineProfile, fingerprint, load, save
from harness.costmodel.roofline import (
    decode_step,
    derive,
    devices,
    main,
    prefill_step,
)
from harness.costmodel.shape import shape_of
from harness.costmodel.work import PRICED, StepWork
from harness.engine.modelled import ModelClock

A100_FP16, A100_FP32, A100_BW, A100_PCIE = 312.0e12, 19.5e12, 2.039e12, 32.0e9
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def toy(**sizes) -> dict:
    """A one-layer fp16 shape small enough to price by hand."""
    shape = dict(
        name="toy",
        num_layers=1,
        hidden_size=8,
        num_heads=2,
        num_kv_heads=1,
        head_dim=4,
        intermediate_size=16,
        vocab_size=32,
        dtype="float16",
        window_layers=[],
    )
    return {**shape, **sizes}


# Llama-2-7B's shape: 6,738,415,616 parameters, bf16.
LLAMA_7B = toy(
    name="llama-2-7b",
    num_layers=32,
    hidden_size=4096,
    num_heads=32,
    num_kv_heads=32,
    head_dim=128,
    intermediate_size=11008,
    vocab_size=32000,
    dtype="bfloat16",
    num_params=6_738_415_616,
)


def profile(shape: dict, device: str = "a100", **kw) -> RooflineProfile:
    return RooflineProfile("test", derive(shape, device, block_size=16, **kw))


def test_decode_of_one_row_costs_its_bytes_over_bandwidth():
    # bytes, at 2 per value, of one token through the toy layer at a 16-token context:
    #   q, o (8x8)          weights 128 + activations 32     = 160 each
    #   k, v (8x4)          64 + 24                          =  88 each
    #   gate, up, down      256 + 48                         = 304 each
    #   LM head (8x32)      512 + 80                         = 592
    #   attention           K, V 16 x 2 x 4 x 2 = 256, q, o, new k, v (2 + 2 + 1 + 1) x 4 x 2
    #                       = 48                             = 304
    #   elementwise         (10 x 8 + 3 x 16 + 2 x 3 x 4 + 4 x 8) x 2 = 368
    # The most FLOPs per byte is the attention's 512 / 304, far under the A100's ridge.
    total = 2 * 160 + 2 * 88 + 3 * 304 + 592 + 304 + 368
    assert profile(toy()).predict(decode_step(1, 16, 16)) == pytest.approx(total / A100_BW)


def test_long_prefill_costs_its_flops_over_peak():
    wide = toy(
        hidden_size=1024,
        num_heads=8,
        num_kv_heads=2,
        head_dim=128,
        intermediate_size=2048,
        vocab_size=1024,
    )
    tokens = 2048
    # per token: q, o 2 x 1024 x 1024; k, v 2 x 1024 x 256; gate, up, down 2 x 1024 x 2048
    linear = (2 * 2 * 1024 * 1024 + 2 * 2 * 1024 * 256 + 3 * 2 * 1024 * 2048) * tokens
    attention = 4 * 128 * 8 * tokens * tokens  # 4 d x heads x query-key pairs
    # memory-bound still: the LM head for one logit row, the elementwise traffic
    head = (1024 * 1024 + 1024 + 1024) * 2
    elementwise = (10 * 1024 + 3 * 2048 + 2 * 10 * 128 + 4 * 1024) * 2 * tokens
    expected = (linear + attention) / A100_FP16 + (head + elementwise) / A100_BW
    assert profile(wide).predict(prefill_step(tokens, 16)) == pytest.approx(expected)


def test_gqa_changes_attention_bytes_not_flops():
    mha, gqa = profile(toy(num_kv_heads=2)), profile(toy(num_kv_heads=1))
    work = decode_step(4, 64, 16)
    a, b = mha.times(work)["attention"], gqa.times(work)["attention"]
    assert a["compute"] == b["compute"]
    assert b["memory"] < a["memory"]


def test_decode_is_memory_bound_and_a_chunk_compute_bound_on_an_a100():
    """Sarathi-Serve's premise: a decode leaves an A100's compute idle; a 512-token
    prefill chunk saturates it."""
    a100 = profile(LLAMA_7B)
    decode = a100.times(decode_step(1, 512, 16))
    for name in (*PROJECTIONS, "lm_head", "attention"):
        assert decode[name]["compute"] < decode[name]["memory"] / 10, name
    chunk = a100.times(prefill_step(512, 16))
    for name in (*PROJECTIONS, "attention"):
        assert chunk[name]["compute"] > chunk[name]["memory"], name


def test_decode_of_7b_reads_its_weights_once():
    weights = (LLAMA_7B["num_params"] - 32000 * 4096 - 65 * 4096) * 2  # no embedding, norms
    seconds = profile(LLAMA_7B).predict(decode_step(1, 512, 16))
    assert weights / A100_BW < seconds < 1.05 * weights / A100_BW


@pytest.mark.parametrize("device", sorted(devices()))
@pytest.mark.parametrize("count", [*PRICED[:7], "draft_block_copies", "swap_in_blocks"])
def test_more_work_never_costs_less(device, count):
    small = profile(shape_of("small"), device)
    base = decode_step(8, 256, 16)
    more = base._replace(**{count: getattr(base, count) * 2 + 1})
    assert small.predict(more) >= small.predict(base)


@pytest.mark.parametrize("device", sorted(devices()))
def test_rows_and_tokens_cost_strictly_more(device):
    small = profile(shape_of("small"), device)
    decodes = [small.predict(decode_step(n, 512, 16)) for n in (1, 8, 32, 128)]
    prefills = [small.predict(prefill_step(n, 16)) for n in (16, 128, 512, 2048)]
    assert decodes == sorted(set(decodes))
    assert prefills == sorted(set(prefills))


def test_block_moves_cost_their_bytes():
    tiny = shape_of("tiny")  # fp32, 4 layers, 2 KV heads of 64
    block = 16 * 2 * 2 * 64 * 4 * 4
    idle = StepWork(block_copies=2, draft_block_copies=1, swap_out_blocks=2)
    assert profile(tiny).predict(idle) == pytest.approx(
        3 * 2 * block / A100_BW + 2 * block / A100_PCIE
    )
    m2 = devices()["m2-max"]
    assert profile(tiny, "m2-max").predict(StepWork(swap_in_blocks=1)) == pytest.approx(
        block / m2["host_link_bandwidth"]
    )


def test_verify_step_needs_a_draft_model():
    verify = decode_step(4, 512, 16)._replace(draft_rounds=3, draft_tokens=12)
    with pytest.raises(ProfileError, match="draft"):
        profile(shape_of("small")).predict(verify)
    speculative = profile(shape_of("small"), draft=shape_of("tiny"))
    draft_weights = (
        3_211_264 * 4
    )  # tiny: 4 x (2 x 256^2 + 2 x 256 x 128 + 3 x 256 x 704) + 256 x 1024
    plain = verify._replace(draft_rounds=0, draft_tokens=0)
    extra = speculative.predict(verify) - speculative.predict(plain)
    assert extra == pytest.approx(3 * draft_weights / A100_BW)


def test_efficiency_scales_the_peaks_and_is_saved():
    data = derive(LLAMA_7B, "a100", block_size=16, efficiency={"memory": 0.5})
    assert data["roofline"]["efficiency"] == {"compute": 1.0, "memory": 0.5, "host_link": 1.0}
    decode = decode_step(1, 512, 16)
    slowed = RooflineProfile("test", data).predict(decode)
    assert slowed == pytest.approx(2 * profile(LLAMA_7B).predict(decode))
    with pytest.raises(ValueError, match="compute, memory, host_link"):
        derive(LLAMA_7B, "a100", block_size=16, efficiency={"flops": 0.7})


def test_dtype_bytes_prices_another_width():
    fp32 = profile(shape_of("small"))
    fp16 = profile(shape_of("small"), dtype_bytes=2)
    chunk = prefill_step(512, 16)
    assert fp16.predict(chunk) < fp32.predict(chunk)
    assert fp16.data["roofline"]["peak"]["compute"] == A100_FP16
    assert fp32.data["roofline"]["peak"]["compute"] == A100_FP32


def test_saved_profile_predicts_identically_after_load(tmp_path):
    data = derive(shape_of("small"), "m3-ultra", block_size=16, draft=shape_of("tiny"))
    save(data, tmp_path / "roofline.json")
    loaded = load(tmp_path / "roofline.json")
    assert isinstance(loaded, RooflineProfile) and loaded.kind == "roofline"
    fresh = RooflineProfile("fresh", data)
    steps = [
        decode_step(7, 333, 16),
        prefill_step(1000, 16),
        StepWork(block_copies=2, swap_out_blocks=5),
        decode_step(3, 90, 16)._replace(draft_rounds=4, draft_tokens=16, row_groups=2),
    ]
    assert [loaded.predict(s) for s in steps] == [fresh.predict(s) for s in steps]


def test_profile_records_model_machine_and_schema():
    data = derive(shape_of("tiny"), "h100", block_size=32)
    assert (data["format"], data["version"], data["kind"]) == ("kvbench-profile", 1, "roofline")
    assert data["model"]["fingerprint"] == fingerprint(shape_of("tiny"))
    assert data["machine"]["name"] == "h100" and data["block_size"] == 32
    assert data["features"] == list(PRICED)


def test_shape_of_matches_the_built_model(model):
    assert shape_of("tiny") == {**model.shape(), "name": "llama-tiny"}


FIELDS = ("peak_flops", "memory_bandwidth", "host_link_bandwidth", "disk_bandwidth")


def test_every_device_has_every_figure_and_its_source():
    for name, sheet in devices().items():
        assert sheet["class"] in ("apple", "apple-ultra", "nvidia") and sheet["description"], name
        assert (sheet["class"] == "apple-ultra") == name.endswith("-ultra"), name
        figures = [*sheet["peak_flops"].values(), sheet["memory_bandwidth"]]
        figures += [sheet["host_link_bandwidth"], sheet["disk_bandwidth"]]
        assert all(isinstance(x, float) and x > 0 for x in figures), name
        assert isinstance(sheet["memory_capacity"], int) and sheet["memory_capacity"] > 0
        assert set(sheet["peak_flops"]) == {"fp16", "fp32"}, name
        sources = sheet["sources"]
        assert set(sources) == {*FIELDS, "memory_capacity"}, name
        assert all(isinstance(s, str) and len(s) >= 10 for s in sources.values()), name


def test_the_devices_users_have_are_all_there():
    apple = {f"m{n}{tier}" for n in range(1, 5) for tier in ("", "-pro", "-max")}
    apple |= {"m1-ultra", "m2-ultra", "m3-ultra"}
    nvidia = {"l4", "a10g", "rtx3090", "rtx4090", "a100-40gb", "a100", "h100-pcie", "h100", "h200"}
    assert apple | nvidia == set(devices())


def test_unknown_device_names_the_known_ones(tmp_path, capsys):
    known = ", ".join(devices())
    with pytest.raises(ValueError, match=known):
        derive(shape_of("tiny"), "tpu-v5", block_size=16)
    assert main(["--device", "tpu-v5", "--model", "tiny", "--out", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and known in err
    assert not (tmp_path / "p").exists()


def test_command_writes_a_loadable_profile(tmp_path, capsys):
    out = tmp_path / "h100.json"
    assert main(["--device", "h100", "--model", "small", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.splitlines()[0] == str(out) and "prefill, 512 tokens" in printed
    # the file is the profile its options ask for: small, float32 (the default), block 16
    asked = profile(shape_of("small", "float32"), "h100")
    other = profile(shape_of("small", "bfloat16"), "h100")
    for step in (decode_step(1, 512, 16), prefill_step(512, 16)):
        assert load(out).predict(step) == asked.predict(step) != other.predict(step)


@pytest.mark.parametrize(
    "shape, match",
    [
        (toy(num_params=10**6), "mixture of experts"),
        (toy(dtype="int4"), "dtype_bytes"),
        ({**toy(), "head_dim": None}, "head_dim"),
    ],
)
def test_shapes_a_roofline_cannot_price_are_refused(shape, match):
    with pytest.raises(ValueError, match=match):
        derive(shape, "a100", block_size=16)


def test_malformed_roofline_section_is_a_profile_error(tmp_path):
    data = derive(shape_of("tiny"), "a100", block_size=16)
    del data["roofline"]["peak"]
    save(data, tmp_path / "bad.json")
    with pytest.raises(ProfileError, match="'roofline'"):
        load(tmp_path / "bad.json")


def test_the_model_clock_prices_copies_and_swaps_over_both_columns():
    """A roofline prices block copies in the target's and the draft's arena alike, and swaps
    out and in alike (their sums), and the model clock charges that price."""
    data = derive(shape_of("small"), "m3-ultra", block_size=16, draft=shape_of("tiny"))
    roofline = RooflineProfile("test", data)
    work = StepWork(
        batch_size=3,
        row_groups=2,
        query_tokens_padded=40,
        attention_pairs=900,
        kv_slots_read=96,
        logit_rows=3,
        single_token_rows=2,
        block_copies=1,
        draft_block_copies=2,
        swap_out_blocks=4,
        swap_in_blocks=1,
        draft_rounds=4,
        draft_tokens=9,
    )
    summed = work._replace(
        block_copies=3, draft_block_copies=0, swap_out_blocks=5, swap_in_blocks=0
    )
    clock = ModelClock(roofline)
    clock.charge(work)
    assert clock.advance(0.0) == roofline.predict(summed) > 0


def test_a_block_tail_is_read_in_full():
    # 17 tokens of context take two blocks of 16: the gather reads 32 slots, 15 of them
    # padding, each K and V of one head of 4 values of 2 bytes: 16 more slots x 16 bytes
    toy_profile = profile(toy())
    tail = toy_profile.predict(decode_step(1, 17, 16)) - toy_profile.predict(decode_step(1, 16, 16))
    assert tail == pytest.approx(16 * 2 * 4 * 2 / A100_BW)


def test_batched_decode_turns_compute_bound_between_32_and_64_rows_on_an_m2_max():
    m2 = profile(LLAMA_7B, "m2-max")
    peak, bandwidth = 13.6e12, 400.0e9
    for rows, bound in ((32, "memory"), (64, "compute")):
        q_proj = m2.times(decode_step(rows, 512, 16))["q_proj"]
        flops = 2 * 4096 * 4096 * rows * 32  # 2 x in x out a row, 32 layers
        # the weights once, each row's input and output, at 2 bytes, 32 layers
        traffic = (4096 * 4096 + 2 * 4096 * rows) * 2 * 32
        assert q_proj == pytest.approx({"compute": flops / peak, "memory": traffic / bandwidth})
        assert max(q_proj, key=q_proj.get) == bound


def test_quantized_weights_cost_mx_quantize_bytes():
    quantized = derive(toy(weight_bits=4, weight_group_size=8), "a100", block_size=16)
    # 8 x 8 weights at 4 bits and a float16 scale and bias per 8: 0.5 + 4 / 8 bytes each
    assert quantized["roofline"]["operators"]["q_proj"]["memory"]["row_groups"] == 64 * 1.0


def test_quantized_kv_is_read_as_the_arena_stores_it():
    wide = toy(head_dim=64, num_heads=1, hidden_size=64)
    data = derive(wide, "a100", block_size=16, kv_bits=4, kv_group_size=64)
    # a head's K (or V) of a token at 4 bits: 32 bytes and a 2-byte scale and bias: 36
    assert data["roofline"]["operators"]["attention"]["memory"]["kv_slots_read"] == 2 * 36
    assert data["roofline"]["kv_format"] == {"bits": 4, "group_size": 64}


def test_a_mixture_reads_the_experts_its_tokens_reach():
    moe = profile(toy(num_experts=4, experts_per_token=2, num_params=0))
    one = moe.times(decode_step(1, 16, 16))["experts"]
    # one token reaches 2 experts: gate, up and down of 8 x 16 at 2 bytes each, and per
    # expert the activations in and out of its three projections (8 + 16) x 2 bytes x 3
    assert one["memory"] == pytest.approx((2 * 3 * 8 * 16 * 2 + 2 * 3 * (8 + 16) * 2) / A100_BW)
    # 32 tokens each pick 2 of 4: all but (1/2)^32 of the 4 experts' weights are read
    many = moe.times(decode_step(32, 16, 16))["experts"]
    weights = 4 * (1 - 0.5**32) * 3 * 8 * 16 * 2
    assert many["memory"] == pytest.approx((weights + 32 * 2 * 3 * (8 + 16) * 2) / A100_BW)


def test_a_window_layers_attention_is_priced_over_its_ring_not_the_context():
    """Two layers of the toy shape, layer 0 a 16-token window (a ring of ceil(16/16) + 1 = 2
    blocks of 16). A decode at a 1,000-token context: the full layer reads ceil(1000/16) =
    63 blocks, 1008 slots, and scores 1008 pairs; the window layer reads the blocks holding
    positions 984..998 (the window before the new token): 984 // 16 = 61 to 998 // 16 = 62,
    2 blocks, 32 slots, and scores 32 + 1 = 33 pairs (the ring's slots and the new key).

    Per layer and pair 4 d x heads = 32 FLOPs; per slot K and V, 2 x 4 x 2 = 16 bytes; per
    query token Q read and the output written (2 x 2 x 4 x 2 = 32 bytes) and the new K and V
    written (2 x 4 x 2 = 16): 48 bytes. The window layer's bytes: 32 x 16 + 48 = 560, at the
    A100's bandwidth; priced as a full layer it would be 1008 x 16 + 48 = 16,176."""
    shape = toy(num_layers=2, window_layers=[0], window=16)
    work = decode_step(1, 1000, 16, window=16)
    assert (work.kv_slots_read, work.attention_pairs) == (1008, 1008)
    assert (work.window_kv_slots_read, work.window_attention_pairs) == (32, 33)
    bars = profile(shape).times(work)
    assert bars["window_attention"] == pytest.approx(
        {"compute": 33 * 32 / A100_FP16, "memory": 560 / A100_BW}
    )
    assert bars["attention"] == pytest.approx(
        {"compute": 1008 * 32 / A100_FP16, "memory": (1008 * 16 + 48) / A100_BW}
    )
    # The same shape with both layers full prices two full layers' attention.
    full = profile(toy(num_layers=2)).times(decode_step(1, 1000, 16))
    assert "window_attention" not in full
    assert full["attention"]["memory"] == pytest.approx(2 * (1008 * 16 + 48) / A100_BW)


def test_a_shape_without_window_layers_derives_as_before_the_window_counts():
    """No window_attention operator, and the attention's per-unit figures over every layer:
    the profiles of models without sliding windows are unchanged."""
    ops = derive(toy(num_layers=3), "a100", block_size=16)["roofline"]["operators"]
    assert "window_attention" not in ops
    assert ops["attention"] == {
        "compute": {"attention_pairs": 32 * 3},
        "memory": {"kv_slots_read": 16 * 3, "query_tokens_padded": 48 * 3},
    }


def test_a_swapped_ring_is_priced_over_the_host_link():
    """The toy's window layer (1 of 2): a ring block holds 16 tokens x K and V x 1 KV head x
    4 values x 2 bytes = 256 bytes; 3 of them moved cost 768 bytes over the A100's PCIe.
    The full layer's blocks are the ``swaps`` operator's, as before."""
    shape = toy(num_layers=2, window_layers=[0], window=16)
    bars = profile(shape).times(StepWork(swap_out_blocks=2, window_swap_blocks=3))
    assert bars["window_swaps"] == pytest.approx({"host_link": 3 * 256 / A100_PCIE})
    assert bars["swaps"] == pytest.approx({"host_link": 2 * 256 / A100_PCIE})
