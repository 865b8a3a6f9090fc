"""Validate a composed kvbench config against the signatures of its ``_target_``s.

Hydra catches a misspelt key on the command line (the config is in struct mode), but not one
in a YAML file, and a wrong type only surfaces deep inside a constructor, possibly after the
model is loaded. ``validate`` walks every ``_target_`` node before any work is done and checks
each key against the target's signature and type hints, so the error names the key and the
fix. The signatures are the schema: there is no second copy of each component's parameters.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import difflib
import inspect
import re
import types
import typing
from typing import Any, Literal, Union, get_args, get_origin

from hydra.utils import get_object
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

GROUPS = ("model", "allocator", "scheduler", "trace", "engine", "sampling", "kv_tier")
OPTIONAL = ("speculative",)  # groups with no default
# Top-level plain keys and the type each must have.
SETTINGS = {
    "experiment_name": str,
    "sweep_id": str,
    "sweep_wait": bool,
    "progress": bool,
    "warmup": int,
    "mlx_cache_limit": int,
}
# Arguments the harness passes when it builds a part, so the config must not set them.
RUNTIME_ARGS = {
    "allocator": {"num_blocks", "block_size", "kv_tier", "worth_loading"},
    "scheduler": {"allocator", "max_model_len", "num_lookahead_slots", "draft", "window"},
    "engine": {"model", "allocator", "scheduler", "speculative", "kv_tier"},
    "sampling": {"max_tokens", "ignore_eos"},
}
# Keys of nodes without a _target_ that the run reads itself (it builds the trace from this).
READ_BY_RUN = {"trace.generator"}
# A key an interpolation names: ${trace.rate}, ${.rate}; the first key of a resolver's arguments
# (${oc.select:trace.rate,1}) too.
_INTERPOLATION = re.compile(r"\$\{(?:[\w.]+:)?\s*(\.*[A-Za-z_][\w.]*)\s*[},]")
_RESERVED = {"_target_", "_partial_", "_recursive_", "_convert_", "_args_"}


class ConfigError(ValueError):
    """A config key is unknown, missing or of the wrong type; the message names key and fix."""


def validate(cfg: DictConfig) -> None:
    """Raise ``ConfigError`` for the first problem in ``cfg``; return quietly if it is sound."""
    expected = set(GROUPS) | set(OPTIONAL) | set(SETTINGS)
    for key in cfg:
        if key not in expected:
            raise ConfigError(f"{key} is not a kvbench setting{_did_you_mean(key, expected)}")
    for key in GROUPS:
        if key not in cfg or not isinstance(cfg[key], DictConfig):
            raise ConfigError(f"{key} is not set: choose an option, e.g. {key}=<conf/{key}/*.yaml>")
    for key, kind in SETTINGS.items():
        value = _value(cfg, key, key)
        if not _matches(value, kind):
            raise ConfigError(f"{key}={value!r} must be {kind.__name__}")
        if kind is int and value < 0:
            raise ConfigError(f"{key}={value!r} must be >= 0")
    if "generator" not in cfg.trace:
        raise ConfigError(
            "trace.generator is missing: a trace option sets its knobs at trace.* and the call "
            "that builds the trace at trace.generator (see conf/trace/poisson.yaml)"
        )
    check_plain(cfg.trace, "trace", _references(cfg))
    for group in ("model", "allocator", "scheduler", "engine", "sampling", "kv_tier"):
        check_node(cfg[group], group, RUNTIME_ARGS.get(group, set()))
    check_kv_tier(cfg)
    for group in OPTIONAL:
        if cfg.get(group) is not None:
            check_node(cfg[group], group, set())
    check_node(cfg.trace.generator, "trace.generator", set())
    engine = cfg.engine
    # The engine hands max_model_len to the scheduler, whose own check would name the
    # scheduler's key, which the config cannot set.
    max_model_len = engine.get("max_model_len")
    if max_model_len is not None and max_model_len < 1:
        raise ConfigError(
            f"engine.max_model_len={max_model_len} must be >= 1, or null (the model's "
            "max_position_embeddings)"
        )
    if (engine.get("num_blocks") is None) == (engine.get("kv_cache_bytes") is None):
        raise ConfigError(
            "engine.num_blocks and engine.kv_cache_bytes: set exactly one, e.g. "
            "engine.num_blocks=null engine.kv_cache_bytes=67108864"
        )


def check_kv_tier(cfg: DictConfig) -> None:
    """Lower KV tiers sit under a prefix cache: only an allocator that keeps one takes them,
    and a disk tier sits under a host tier."""
    tier = cfg.kv_tier
    host, disk = tier.get("host_blocks", 0), tier.get("disk_blocks", 0)
    if host < 0 or disk < 0:
        raise ConfigError(f"kv_tier.host_blocks={host}, kv_tier.disk_blocks={disk}: use >= 0")
    if not (host or disk):
        return
    target = cfg.allocator._target_
    if not getattr(get_object(target), "caches_prefixes", False):
        raise ConfigError(
            f"kv_tier keeps blocks the prefix cache evicts, and allocator {target} keeps no "
            "prefix cache: use allocator=radix, or kv_tier=none"
        )
    if disk and not host:
        raise ConfigError(
            f"kv_tier.disk_blocks={disk} with kv_tier.host_blocks=0: the disk tier sits under "
            "a host tier; set kv_tier.host_blocks >= 1"
        )
    ratio = tier.get("min_load_ratio", 1.0)
    if ratio < 0:
        raise ConfigError(f"kv_tier.min_load_ratio={ratio} must be >= 0")


def check_node(node: DictConfig, path: str, runtime: set[str]) -> None:
    """Check one ``_target_`` node (and nested ones) against its target's signature."""
    target = node.get("_target_")
    if not isinstance(target, str):
        raise ConfigError(f"{path}._target_ is missing: name the class or function to build")
    try:
        obj = get_object(target)
    except Exception as e:
        raise ConfigError(f"{path}._target_={target!r} cannot be imported: {e}") from None
    params, hints, takes_any = _signature(obj)
    settable = [n for n, p in params.items() if _is_keyword(p) and n not in runtime]
    for key in node:
        if key in _RESERVED:
            continue
        where = f"{path}.{key}"
        if key in runtime:
            source = "engine." + key if key == "max_model_len" else "the harness at run time"
            raise ConfigError(f"{where} is set from {source}: remove it")
        if key not in params and not takes_any:
            raise ConfigError(
                f"{where} is not a parameter of {target}{_did_you_mean(key, settable)}; "
                + (f"accepted: {', '.join(settable)}" if settable else "it takes no options")
            )
        value = _value(node, key, where)
        if isinstance(value, DictConfig) and "_target_" in value:
            check_node(value, where, set())
        elif key in hints and not _matches(value, hints[key]):
            raw = OmegaConf.to_container(node, resolve=False)[key]
            via = f" (from {raw})" if isinstance(raw, str) and "${" in raw else ""
            raise ConfigError(f"{where}={value!r}{via} must be {_type_name(hints[key])}")
    # A nested partial (e.g. speculative decoding's draft builder, or a trace's distribution) gets
    # its remaining arguments from the object that calls it, which the config cannot know.
    nested_partial = node.get("_partial_", False) and path.count(".") > 0
    for name, p in params.items():
        if nested_partial:
            break
        if _is_keyword(p) and p.default is p.empty and name not in node and name not in runtime:
            raise ConfigError(f"{path}.{name} is missing: {target} requires it; add it")


def check_plain(node: DictConfig, path: str, references: set[str]) -> None:
    """Check a node without ``_target_`` (a trace option's knobs): every key must resolve and
    be read, by the run (``READ_BY_RUN``) or through an interpolation (``${trace.rate}``).

    Hydra's advice for a key its struct mode refuses, ``+key=value``, adds it wherever asked:
    ``+trace.num_requests=2`` beside a generator that takes no such knob would be ignored and
    the run would replay a trace of another size.
    """
    for key in node:
        where = f"{path}.{key}"
        value = _value(node, key, where)
        if where in READ_BY_RUN:
            continue
        if not any(_reads(ref, where) for ref in references):
            for child, sub in node.items():  # the knob's parameter overridden directly
                if isinstance(sub, DictConfig) and "_target_" in sub and key in sub:
                    raise ConfigError(
                        f"{where} is read by nothing: {path}.{child}.{key} is set directly, "
                        f"bypassing it; set {where} instead"
                    )
            keys = [str(k) for k in node if k != key]
            raise ConfigError(
                f"{where} is read by nothing: the keys at {path} are {', '.join(keys)}"
                f"{_did_you_mean(str(key), keys)} (a builder's parameter goes under its "
                "_target_ node)"
            )
        if isinstance(value, DictConfig) and not any(ref == where for ref in references):
            check_plain(value, where, references)  # read key by key: each one must be


def _reads(ref: str, key: str) -> bool:
    """Whether an interpolation of ``ref`` reads ``key``: the key itself, a node holding it,
    or a key inside it."""
    return ref == key or key.startswith(ref + ".") or ref.startswith(key + ".")


def _references(cfg: DictConfig) -> set[str]:
    """Every absolute key an interpolation in ``cfg`` names (``${trace.rate}`` -> trace.rate);
    relative ones (``${.rate}``) made absolute from where they are written."""
    out: set[str] = set()

    def walk(value: Any, path: list[str]) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, [*path, str(k)])
        elif isinstance(value, list):
            for i, v in enumerate(value):
                walk(v, [*path, str(i)])
        elif isinstance(value, str):
            for ref in _INTERPOLATION.findall(value):
                if ref.startswith("."):
                    dots = len(ref) - len(ref.lstrip("."))
                    ref = ".".join([*path[: len(path) - dots], ref.lstrip(".")])
                out.add(ref)

    walk(OmegaConf.to_container(cfg, resolve=False), [])
    return out


def _value(node: DictConfig, key: str, where: str) -> Any:
    if OmegaConf.is_missing(node, key):
        raise ConfigError(f"{where} is required and not set (???): set it, e.g. {where}=...")
    try:
        return node[key]
    except OmegaConfBaseException as e:
        raise ConfigError(f"{where} cannot be resolved: {e}") from None


def _is_keyword(p: inspect.Parameter) -> bool:
    return p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self"


def _signature(obj: Any) -> tuple[dict[str, inspect.Parameter], dict[str, Any], bool]:
    """Parameters, type hints, and whether any keyword is accepted.

    A class whose ``__init__`` forwards ``**kwargs`` to its base (as the schedulers do)
    accepts the base's parameters too, so the walk follows the MRO until an ``__init__``
    without ``**kwargs``; only a chain that ends in ``**kwargs`` accepts any key.
    """
    if not inspect.isclass(obj) or dataclasses.is_dataclass(obj):
        params = dict(inspect.signature(obj).parameters)
        forwards = any(p.kind is p.VAR_KEYWORD for p in params.values())
        return params, _hints(obj), forwards
    params: dict[str, inspect.Parameter] = {}
    hints: dict[str, Any] = {}
    for klass in obj.__mro__:
        if "__init__" not in vars(klass) or klass is object:
            continue
        own = inspect.signature(klass.__init__).parameters
        for name, p in own.items():
            if p.kind is not p.VAR_KEYWORD and name != "self":
                params.setdefault(name, p)
        hints = {**_hints(klass.__init__), **hints}
        if not any(p.kind is p.VAR_KEYWORD for p in own.values()):
            return params, hints, False
    return params, hints, True


def _hints(obj: Any) -> dict[str, Any]:
    try:
        return typing.get_type_hints(obj)
    except Exception:  # unresolvable annotations: check names only
        return {}


def _matches(value: Any, hint: Any) -> bool:
    """Whether a config value can be passed where ``hint`` is expected (shallow)."""
    origin = get_origin(hint)
    if hint is Any:
        return True
    if origin in (Union, types.UnionType):
        return any(_matches(value, arg) for arg in get_args(hint))
    if hint is type(None):
        return value is None
    if origin is Literal:
        return value in get_args(hint)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    container = origin or hint
    if container in (list, tuple, collections.abc.Sequence):
        return isinstance(value, (ListConfig, list, tuple))
    if container in (dict, collections.abc.Mapping):
        return isinstance(value, (DictConfig, dict))
    return True  # classes and protocols: built from nested _target_ nodes, checked there


def _type_name(hint: Any) -> str:
    if get_origin(hint) is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(hint))
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def _did_you_mean(key: str, choices: collections.abc.Iterable[str]) -> str:
    close = difflib.get_close_matches(key, list(choices), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""
