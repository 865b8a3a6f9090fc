"""A real checkpoint written offline: a BPE tokenizer trained here on made-up text, and
random weights, in the files ``mlx_lm.utils.save`` writes and ``mlx_lm.load`` reads
(config.json, model.safetensors, tokenizer.json, tokenizer_config.json).

The weights are random except one row: the LM-head row of the end-of-sequence token is set
so that greedy decoding of ``PROMPT`` emits EOS as output token ``EOS_AT`` (0-based) and never
before, so EOS stopping runs for real on the token the tokenizer and config.json declare.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.utils import save_config, save_model
from reference import mlx_lm_tokens
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from harness.platform.models import random_model

PROMPT = "the ship of"
EOS_AT = 10
MAX_VOCAB = 384  # the trainer's cap: the made-up text yields fewer merges (~325 tokens)
# Small enough for a test to load and run in a second or two.
DIMS = dict(
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
)
SYLLABLES = ("ka", "lo", "mi", "ren", "tus", "vo", "bel", "an", "dir", "sep", "ou", "zim")


@dataclass(frozen=True)
class Checkpoint:
    """Where ``write_checkpoint`` put the model, and the special tokens it declared."""

    path: Path
    vocab_size: int
    bos_token_id: int
    eos_token_id: int


def corpus(seed: int = 0) -> list[str]:
    """Sentences of made-up words (and PROMPT's), the tokenizer's training text."""
    rng = random.Random(seed)
    words = ["".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(200)]
    words += PROMPT.split()
    return [" ".join(rng.choice(words) for _ in range(12)) + "." for _ in range(400)]


def train_tokenizer(lines: list[str]) -> PreTrainedTokenizerFast:
    """A byte-level BPE (as GPT-2's and Llama 3's) trained on ``lines``; it adds BOS, as Llama's."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=MAX_VOCAB, special_tokens=["<s>", "</s>"])
    tokenizer.train_from_iterator(lines, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tokenizer.token_to_id("<s>"))]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")


def write_checkpoint(folder: Path, seed: int = 0) -> Checkpoint:
    """Train the tokenizer, build and steer the model, write both into ``folder``."""
    tokenizer = train_tokenizer(corpus(seed))
    eos = tokenizer.eos_token_id
    loaded = random_model("llama", "tiny", seed=seed, vocab_size=len(tokenizer), **DIMS)
    model = loaded.model
    head = model.lm_head.weight
    head[eos] = 0  # random logits of ~300 tokens have a positive maximum: EOS never wins
    prompt = tokenizer.encode(PROMPT)
    tokens = mlx_lm_tokens(loaded, prompt, EOS_AT)
    # The EOS row that gives logit 0 at every earlier position (below their positive maximum)
    # and outscores the greedy token by 2 at the one that predicts output EOS_AT.
    hidden = model.model(mx.array([prompt + tokens]))[0]
    target = np.zeros(hidden.shape[0], dtype=np.float32)
    target[-1] = mx.max(model.lm_head(hidden[-1])).item() + 2.0
    row = np.linalg.lstsq(np.array(hidden), target, rcond=None)[0]
    head[eos] = mx.array(row)
    mx.eval(model.parameters())

    save_model(folder, model)
    config = {k: v for k, v in asdict(model.args).items() if v is not None}
    config.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=eos)
    save_config(config, folder / "config.json")
    tokenizer.save_pretrained(folder)
    return Checkpoint(folder, len(tokenizer), tokenizer.bos_token_id, eos)
