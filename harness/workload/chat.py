"""Chat traces for a real model: kvbench's own prompt set, chat-templated, with the model's
EOS ending each answer (``TraceRequest.ignore_eos`` False, ``max_tokens`` a cap).

The prompt set (``data/chat_prompts.json``) was written for the project: short questions,
explanations, lists, rewriting, arithmetic, code, creative writing, and long prompts that
quote a passage. A trace draws prompts from it in a seeded order (each prompt once before
any repeats), sends first turns by ``arrival`` and, with ``turns`` > 1, follows each with
turns that ask one of the set's follow-up questions a think time after the answer before
it: the replay grows each follow-up's prompt by the model's actual answer
(harness/cli/replay.py), so a prefix cache sees the conversation a chat server would.
``shared_system_prompt`` puts the set's long system prompt (a library assistant's
instructions, about 190 tokens) in front of every conversation; without it the chat
template's own default applies (SmolLM2: a one-line system prompt).
"""

from __future__ import annotations

import json
from array import array
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from harness.workload.distributions import ArrivalProcess
from harness.workload.generators import check_count, describe_component, make_trace
from harness.workload.traces import Trace, TraceRequest, token_array

PROMPTS_FILE = Path(__file__).parent / "data" / "chat_prompts.json"
_MARK = "\x00answer\x00"  # stands for an answer not yet known when templating a follow-up


@cache
def prompt_set() -> dict[str, Any]:
    """The bundled prompt set, each prompt with its passage quoted in."""
    data = json.loads(PROMPTS_FILE.read_text())
    for item in data["prompts"]:
        if "passage" in item:
            item["prompt"] = item["prompt"].format(passage=data["passages"][item["passage"]])
    return data


def load_tokenizer(name: str):
    """``smollm2`` (built from the installed GGUF) or a folder with a Hugging Face
    tokenizer's files (a model in mlx_lm's format)."""
    if name == "smollm2":
        from harness.platform.smollm2 import tokenizer

        return tokenizer()
    from transformers import AutoTokenizer

    if not Path(name).is_dir():
        raise ValueError(
            f"trace.tokenizer={name!r} is neither smollm2 nor a folder: point it at the "
            "model's folder (its tokenizer.json and tokenizer_config.json)"
        )
    return AutoTokenizer.from_pretrained(name)


def chat(
    num_conversations: int,
    arrival: ArrivalProcess,
    seed: int,
    tokenizer: str = "smollm2",
    max_tokens: int = 256,
    turns: int = 1,
    think_time: float = 0.0,
    shared_system_prompt: bool = False,
) -> Trace:
    """``num_conversations`` chats of ``turns`` turns each (module docstring); a follow-up
    arrives an exponential think time (mean ``think_time`` s) after the turn before ends."""
    check_count("trace.num_requests", num_conversations)  # conf/trace/chat.yaml's knob
    if turns < 1 or think_time < 0 or max_tokens < 1:
        raise ValueError(
            f"trace: turns={turns}, think_time={think_time}, max_tokens={max_tokens}: need "
            "turns >= 1, think_time >= 0 and max_tokens >= 1"
        )
    data = prompt_set()
    tok = load_tokenizer(tokenizer)
    rng = np.random.default_rng(seed)
    starts = arrival.sample(num_conversations, rng)
    items = data["prompts"]
    order = np.concatenate(
        [rng.permutation(len(items)) for _ in range(-(-num_conversations // len(items)))]
    )
    system = [{"role": "system", "content": data["system_prompt"]}] if shared_system_prompt else []
    requests = []
    for c in range(num_conversations):
        messages = [*system, {"role": "user", "content": items[order[c]]["prompt"]}]
        first = _encode(tok, messages)
        requests.append(TraceRequest(f"chat{c}", float(starts[c]), first, max_tokens, **_EOS))
        for k in range(1, turns):
            question = data["follow_ups"][rng.integers(len(data["follow_ups"]))]
            suffix = _follow_up(tok, messages, question)
            messages += [
                {"role": "assistant", "content": _MARK},
                {"role": "user", "content": question},
            ]
            think = float(rng.exponential(think_time)) if think_time else 0.0
            after = f"chat{c}" if k == 1 else f"chat{c}-turn{k - 1}"
            requests.append(
                TraceRequest(f"chat{c}-turn{k}", think, suffix, max_tokens, after=after, **_EOS)
            )
    params = {
        "num_conversations": num_conversations,
        "arrival": describe_component(arrival),
        "tokenizer": tokenizer,
        "max_tokens": max_tokens,
        "turns": turns,
        "think_time": think_time,
        "shared_system_prompt": shared_system_prompt,
        "prompt_set": PROMPTS_FILE.name,
    }
    return make_trace(requests, "chat", params, seed, len(tok))


_EOS = {"ignore_eos": False}  # the model's own EOS ends each answer


def _encode(tok, messages: list[dict[str, str]]) -> array:
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return token_array(tok.encode(text, add_special_tokens=False))


def _follow_up(tok, messages: list[dict[str, str]], question: str) -> array:
    """The tokens between an answer and the model's next one: the template's text after the
    answer and its end-of-turn token (the EOS the model emits, part of its answer), the new
    user turn, then the generation prompt."""
    turn = [{"role": "assistant", "content": _MARK}, {"role": "user", "content": question}]
    text = tok.apply_chat_template(messages + turn, add_generation_prompt=True, tokenize=False)
    rest = text.rsplit(_MARK, 1)[1].removeprefix(tok.eos_token)
    return token_array(tok.encode(rest, add_special_tokens=False))
