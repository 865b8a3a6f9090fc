"""model=pretrained end to end on a checkpoint written offline (tests/checkpoint.py): text in,
detokenised text out, stop strings and EOS as vLLM, and a folder mlx_lm cannot load named."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from checkpoint import EOS_AT, PROMPT, Checkpoint, write_checkpoint
from reference import mlx_lm_tokens

from allocators.free_list import FreeListAllocator
from harness.engine import LLMEngine, build_engine
from harness.engine.sampling_params import SamplingParams
from harness.platform.models import LoadedModel, load_pretrained
from schedulers.fcfs import FCFSScheduler

GREEDY = SamplingParams(temperature=0, max_tokens=EOS_AT, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    return write_checkpoint(tmp_path_factory.mktemp("checkpoint"))


@pytest.fixture(scope="module")
def pretrained(checkpoint: Checkpoint) -> LoadedModel:
    return load_pretrained(str(checkpoint.path))


@pytest.fixture
def engine(pretrained: LoadedModel) -> LLMEngine:
    return build_engine(pretrained, FreeListAllocator, FCFSScheduler, block_size=8, num_blocks=32)


def test_the_checkpoint_loads_with_its_tokenizer_and_eos(checkpoint, pretrained):
    assert pretrained.vocab_size == checkpoint.vocab_size
    assert pretrained.eos_token_ids == (checkpoint.eos_token_id,)
    assert (pretrained.num_layers, pretrained.num_kv_heads, pretrained.head_dim) == (2, 2, 16)
    ids = pretrained.tokenizer.encode(PROMPT)
    assert ids[0] == checkpoint.bos_token_id and len(ids) < len(PROMPT)  # BOS, then merges
    assert pretrained.tokenizer.decode(ids[1:]) == PROMPT


def test_text_prompts_give_mlx_lm_tokens_and_their_decoded_text(pretrained, engine):
    prompts = [PROMPT, "ka lo mi ren"]
    for prompt, out in zip(prompts, engine.generate(prompts, GREEDY), strict=True):
        ids = pretrained.tokenizer.encode(prompt)
        completion = out.outputs[0]
        assert list(out.prompt_token_ids) == ids
        assert completion.token_ids == mlx_lm_tokens(pretrained, ids, EOS_AT)
        assert completion.finish_reason == "length"
        assert completion.text == pretrained.tokenizer.decode(completion.token_ids)


def test_logprobs_carry_each_tokens_text(pretrained, engine):
    """vLLM's ``Logprob.decoded_token``: the text of the token each entry scores."""
    params = dataclasses.replace(GREEDY, logprobs=2, prompt_logprobs=1)
    (out,) = engine.generate([PROMPT], params)
    entries = [*out.outputs[0].logprobs, *out.prompt_logprobs[1:]]
    assert len(entries) == EOS_AT + len(out.prompt_token_ids) - 1
    for entry in entries:
        for token, lp in entry.items():
            assert lp.decoded_token == pretrained.tokenizer.decode([token])


def test_generation_stops_at_the_eos_the_checkpoint_declares(checkpoint, pretrained, engine):
    params = SamplingParams(temperature=0, max_tokens=3 * EOS_AT)
    (ignored,) = engine.generate([PROMPT], dataclasses.replace(params, ignore_eos=True))
    assert ignored.outputs[0].finish_reason == "length"
    assert ignored.outputs[0].token_ids[EOS_AT] == checkpoint.eos_token_id

    (out,) = engine.generate([PROMPT], params)
    completion = out.outputs[0]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", None)
    assert completion.token_ids == ignored.outputs[0].token_ids[: EOS_AT + 1]
    # As vLLM: the EOS token ends token_ids but not the text.
    assert completion.text == pretrained.tokenizer.decode(completion.token_ids[:-1])


def test_a_stop_string_cuts_the_text_before_it(pretrained, engine):
    (ref,) = engine.generate([PROMPT], GREEDY)
    tokens, text = ref.outputs[0].token_ids, ref.outputs[0].text
    stop = text[len(text) // 2 :][:3]  # a string the model writes mid-way
    # The engine checks the decoded text after each token: it stops at the first that ends it.
    n = next(
        n for n in range(1, len(tokens) + 1) if stop in pretrained.tokenizer.decode(tokens[:n])
    )
    assert n < len(tokens)

    params = SamplingParams(temperature=0, max_tokens=EOS_AT, stop=("never written", stop))
    (out,) = engine.generate([PROMPT], params)
    completion = out.outputs[0]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)
    assert completion.token_ids == tokens[:n]
    assert completion.text == text[: text.index(stop)]


def test_a_stop_token_id_ends_token_ids_but_not_the_text(pretrained, engine):
    (ref,) = engine.generate([PROMPT], GREEDY)
    tokens = ref.outputs[0].token_ids
    k = next(k for k in range(2, len(tokens)) if tokens[k] not in tokens[:k])
    params = dataclasses.replace(GREEDY, stop_token_ids=(tokens[k],))
    (out,) = engine.generate([PROMPT], params)
    completion = out.outputs[0]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", tokens[k])
    assert completion.token_ids == tokens[: k + 1]
    assert completion.text == pretrained.tokenizer.decode(tokens[:k])


def test_kvbench_runs_a_checkpoint_from_its_folder(checkpoint, kvbench, tmp_path: Path):
    kvbench(
        "model=pretrained",
        f"model.path={checkpoint.path}",
        f"trace.vocab_size={checkpoint.vocab_size}",
    )
    (summary_file,) = tmp_path.glob("results/default/runs/*/summary.json")
    summary = json.loads(summary_file.read_text())
    assert summary["model_name"] == str(checkpoint.path)
    assert summary["completed"] == summary["num_requests"] == 6


def without(pattern: str) -> Callable[[Path], Path]:
    def remove(folder: Path) -> Path:
        for file in folder.glob(pattern):
            file.unlink()
        return folder

    return remove


def with_config(**fields) -> Callable[[Path], Path]:
    def edit(folder: Path) -> Path:
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **fields}))
        return folder

    return edit


# A broken copy of the checkpoint folder -> the model.path to give, and the error it gets.
BROKEN = {
    "missing": (lambda f: f / "nothing", r"model\.path='[^']*' does not exist: point it at"),
    "a file": (lambda f: f / "config.json", r"config\.json' is a file: point it at the folder"),
    "no weights": (without("model*.safetensors"), r"has no weights \(model\*\.safetensors\)"),
    "no config": (without("config.json"), r"has no config\.json"),
    "unknown model_type": (
        with_config(model_type="gpt9"),
        r"mlx_lm cannot build a model from its config\.json and weights \(Model type gpt9 not "
        r"supported\.\); fix config\.json",
    ),
    "weights of other shapes": (
        with_config(hidden_size=128),
        r"mlx_lm cannot build a model .*Expected shape \(\d+, 128\)",
    ),
    "no tokenizer": (
        without("tokenizer.json"),
        r"its tokenizer does not load \(.*\); the folder needs the tokenizer's files",
    ),
}


def broken_copy(checkpoint: Checkpoint, tmp_path: Path, case: str) -> Path:
    folder = tmp_path / "checkpoint"
    shutil.copytree(checkpoint.path, folder)
    return BROKEN[case][0](folder)


@pytest.mark.parametrize("case", BROKEN)
def test_load_pretrained_names_what_is_wrong(checkpoint, tmp_path: Path, case: str):
    folder = broken_copy(checkpoint, tmp_path, case)
    with pytest.raises(ValueError, match=BROKEN[case][1]) as error:
        load_pretrained(str(folder))
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("case", ["missing", "no weights", "unknown model_type"])
def test_kvbench_names_what_is_wrong_in_one_line(checkpoint, kvbench, tmp_path: Path, case: str):
    folder = broken_copy(checkpoint, tmp_path, case)
    proc = kvbench("model=pretrained", f"model.path={folder}", check=False)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("kvbench: error:")]
    assert re.search(BROKEN[case][1], line), line
