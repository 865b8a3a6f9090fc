"""Every option of every config group composes, validates and instantiates; bad configs fail
before any work with errors that name the key and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException
from hydra.utils import instantiate
from omegaconf import OmegaConf

from allocators.base import BlockAllocator
from allocators.free_list import FreeListAllocator
from harness.cli.config import ConfigError, validate
from harness.cli.run import CONFIG_DIR, UsageError, run
from harness.engine import LLMEngine, build_engine
from harness.platform.models import LoadedModel, random_model
from harness.workload.traces import Trace, TraceError, load, save
from schedulers.base import Scheduler
from schedulers.fcfs import FCFSScheduler

CONF = Path(CONFIG_DIR)


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def test_every_group_has_options() -> None:
    for group in ("model", "allocator", "scheduler", "trace", "engine", "sampling", "experiment"):
        assert options(group), f"conf/{group}/ is empty"
    assert {"ray", "submitit_slurm"} <= set(options("hydra/launcher"))


@pytest.mark.parametrize("name", [m for m in options("model") if m not in ("pretrained", "shape")])
def test_model_options_build(compose_cfg, name: str) -> None:
    cfg = compose_cfg([f"model={name}"])
    validate(cfg)
    model = instantiate(cfg.model)
    assert isinstance(model, LoadedModel)
    assert model.num_layers > 0 and model.vocab_size >= cfg.trace.vocab_size


def test_pretrained_model_needs_a_path(compose_cfg) -> None:
    with pytest.raises(ConfigError, match=r"model\.path is required.*model\.path="):
        validate(compose_cfg(["model=pretrained"]))
    validate(compose_cfg(["model=pretrained", "model.path=/models/any"]))  # shape is valid


def test_shape_model_needs_a_config_and_builds_no_weights(compose_cfg) -> None:
    with pytest.raises(ConfigError, match=r"model\.config is required.*model\.config="):
        validate(compose_cfg(["model=shape"]))
    config = Path(CONFIG_DIR).parent / "harness/costmodel/shapes/llama-3.2-1b.json"
    cfg = compose_cfg(["model=shape", f"model.config={config}", "model.bits=4"])
    validate(cfg)
    model = instantiate(cfg.model)
    assert model.model is None and model.shape()["weight_bits"] == 4
    assert model.num_layers == 16 and model.vocab_size >= cfg.trace.vocab_size


@pytest.mark.parametrize("name", options("allocator"))
def test_allocator_options_build(compose_cfg, name: str) -> None:
    cfg = compose_cfg([f"allocator={name}"])
    validate(cfg)
    allocator = instantiate(cfg.allocator)(num_blocks=64, block_size=16)
    assert isinstance(allocator, BlockAllocator)
    assert allocator.num_blocks == 64 and allocator.num_free_blocks() == 64
    allocator.check()


@pytest.mark.parametrize("name", options("kv_tier"))
def test_kv_tier_options_build_under_the_radix_allocator(compose_cfg, name: str) -> None:
    cfg = compose_cfg(["allocator=radix", f"kv_tier={name}"])
    validate(cfg)
    kv_tier = instantiate(cfg.kv_tier)
    assert kv_tier.enabled == (name != "none")
    allocator = instantiate(cfg.allocator)(num_blocks=8, block_size=16, kv_tier=kv_tier)
    assert allocator.drain_tier_moves() == []


@pytest.mark.parametrize("name", options("scheduler"))
def test_scheduler_options_build(compose_cfg, name: str) -> None:
    cfg = compose_cfg([f"scheduler={name}"])
    validate(cfg)
    allocator = instantiate(cfg.allocator)(num_blocks=64, block_size=16)
    scheduler = instantiate(cfg.scheduler)(allocator)
    assert isinstance(scheduler, Scheduler) and scheduler.allocator is allocator


def test_max_model_len_is_the_engines_and_reaches_every_part(compose_cfg, model) -> None:
    """One setting: a speculative run's scheduler and contiguous_max_len's reservation both
    follow engine.max_model_len (they once failed to compose)."""
    overrides = ["allocator=contiguous_max_len", "speculative=draft"]
    cfg = compose_cfg([*overrides, "engine.max_model_len=640"])
    validate(cfg)
    engine = instantiate(cfg.engine)(
        model,
        instantiate(cfg.allocator),
        instantiate(cfg.scheduler),
        speculative=instantiate(cfg.speculative),
    )
    assert engine.scheduler.max_model_len == 640
    assert engine.scheduler.num_lookahead_slots == 4
    assert engine.proposer.allocator.held_slots  # the draft's allocator is built alike
    assert type(engine.proposer.allocator) is type(engine.allocator)
    assert engine.allocator.allocate("a", 1) is not None
    assert engine.allocator.held_slots("a") == 640  # 40 blocks of 16 reserved


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_long_max_model_len_raises_the_default_token_budget(compose_cfg, policy) -> None:
    """As vLLM: without chunking the budget is max(max_model_len, 2048), so a 4096-token
    model length composes with the bundled policies."""
    cfg = compose_cfg([f"scheduler={policy}", "engine.max_model_len=4096"])
    allocator = instantiate(cfg.allocator)(num_blocks=64, block_size=16)
    scheduler = instantiate(cfg.scheduler)(allocator, max_model_len=4096)
    assert scheduler.max_num_batched_tokens == 4096


def test_max_model_len_defaults_to_and_stays_within_the_models_positions() -> None:
    short = random_model("llama", "tiny", max_position_embeddings=128)
    assert (
        build_engine(short, FreeListAllocator, FCFSScheduler, num_blocks=8).scheduler.max_model_len
        == 128
    )
    with pytest.raises(
        ValueError, match=r"engine\.max_model_len=256 exceeds .*max_position_embeddings=128"
    ):
        build_engine(short, FreeListAllocator, FCFSScheduler, num_blocks=8, max_model_len=256)


# Options that read a file the user names (trace.path=???): trace=file and the public traces.
FROM_FILES = [
    t
    for t in options("trace")
    if OmegaConf.is_missing(OmegaConf.load(CONF / "trace" / f"{t}.yaml"), "path")
]


@pytest.mark.parametrize("name", [t for t in options("trace") if t not in FROM_FILES])
def test_trace_options_build(compose_cfg, name: str) -> None:
    # At most 500 requests: a bench-sized option (mooncake_conversation: 12k) builds as well
    size = OmegaConf.load(CONF / "trace" / f"{name}.yaml").get("num_requests")
    big = isinstance(size, int) and size > 500
    cfg = compose_cfg([f"trace={name}", *(["trace.num_requests=500"] if big else [])])
    validate(cfg)
    trace = instantiate(cfg.trace.generator, _convert_="all")
    assert isinstance(trace, Trace) and len(trace) > 0
    assert max(max(r.prompt_token_ids) for r in trace) < trace.metadata["vocab_size"]
    firsts = [r for r in trace if r.after is None]  # follow-up turns: think times, known later
    bound = trace.metadata["max_prefix_hit_rate"]
    assert 0.0 <= bound <= 1.0 if len(firsts) == len(trace) else bound is None
    times = [r.arrival_time for r in firsts]
    assert times == sorted(times)


def test_trace_file_option_replays_the_file(compose_cfg, tmp_path: Path) -> None:
    smoke = instantiate(compose_cfg().trace.generator, _convert_="all")
    save(smoke, tmp_path / "t.jsonl")
    cfg = compose_cfg(["trace=file", f"trace.path={tmp_path / 't.jsonl'}"])
    validate(cfg)
    assert instantiate(cfg.trace.generator).requests == smoke.requests


def test_shared_prefix_trace_has_prefix_reuse(compose_cfg) -> None:
    trace = instantiate(compose_cfg(["trace=shared_prefix"]).trace.generator, _convert_="all")
    assert trace.metadata["max_prefix_hit_rate"] > 0.5


@pytest.mark.parametrize("clock", ["virtual", "wall"])
def test_engine_option_builds_with_either_clock(compose_cfg, clock: str) -> None:
    cfg = compose_cfg([f"engine.clock={clock}"])
    validate(cfg)
    engine = instantiate(cfg.engine)(
        random_model(), instantiate(cfg.allocator), instantiate(cfg.scheduler)
    )
    assert isinstance(engine, LLMEngine)
    assert engine.clock.name == clock and engine.allocator.num_blocks == 64


def test_engine_sized_by_bytes(compose_cfg) -> None:
    model = random_model()
    per_block = model.kv_bytes_per_token() * 16
    cfg = compose_cfg(["engine.num_blocks=null", f"engine.kv_cache_bytes={per_block * 10}"])
    validate(cfg)
    engine = instantiate(cfg.engine)(model, instantiate(cfg.allocator), instantiate(cfg.scheduler))
    assert engine.allocator.num_blocks == 10


@pytest.mark.parametrize("name", options("experiment"))
def test_experiment_bundles_compose(compose_cfg, name: str) -> None:
    cfg = compose_cfg([f"experiment={name}"], tiny=False)
    validate(cfg)
    assert cfg.experiment_name == name
    assert instantiate(cfg.trace.generator, _convert_="all")


@pytest.mark.parametrize("launcher", options("hydra/launcher"))
@pytest.mark.filterwarnings("ignore::UserWarning")  # Hydra: schema matched by name
def test_launcher_configs_name_an_importable_launcher(launcher: str) -> None:
    from hydra import compose, initialize_config_dir
    from hydra.utils import get_class

    plugin = {
        "ray": "hydra_plugins.hydra_ray_launcher",
        "submitit_slurm": "hydra_plugins.hydra_submitit_launcher",
    }[launcher]
    pytest.importorskip(plugin, reason=f"the {launcher} launcher's extra is not installed")
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("config", [f"hydra/launcher={launcher}"], return_hydra_config=True)
    assert get_class(cfg.hydra.launcher._target_)


# -- bad configs ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["+allocator.reserv=exact", "allocator=contiguous"], r"allocator\.reserv .*'reserve'"),
        (["+scheduler.max_num_seq=8"], r"scheduler\.max_num_seq .*'max_num_seqs'"),
        (["+trace.generator.prompt_len.hihg=9"], r"prompt_len\.hihg .*'high'"),
        (["+experiment_nam=x"], r"experiment_nam is not a kvbench setting.*'experiment_name'"),
        (["trace.rate=fast"], r"arrival\.rate='fast' \(from \$\{trace\.rate\}\) must be float"),
        (["scheduler.max_num_seqs=1.5"], r"scheduler\.max_num_seqs=1\.5 must be int"),
        (["engine.clock=sundial"], r"engine\.clock='sundial' must be one of 'virtual', 'wall'"),
        (["progress=maybe"], r"progress='maybe' must be bool"),
        (["sampling.temperature=hot"], r"sampling\.temperature='hot' must be float"),
        (["+sampling.max_tokens=3"], r"sampling\.max_tokens is set from the harness"),
        (["engine.kv_cache_bytes=1000000"], r"set exactly one.*engine\.num_blocks=null"),
        (["engine.kv_bits=2"], r"engine\.kv_bits=2 must be one of 16, 8, 4"),
        (["engine.kv_group_size=16"], r"engine\.kv_group_size=16 must be one of 32, 64, 128"),
        (["+allocator.num_blocks=4"], r"allocator\.num_blocks is set from the harness"),
        (["+scheduler.max_model_len=9"], r"scheduler\.max_model_len is set from engine\.max_m"),
        (["kv_tier=host"], r"allocator allocators\.free_list\.FreeListAllocator keeps no prefix"),
        (["allocator=radix", "+allocator.kv_tier=null"], r"allocator\.kv_tier is set from the h"),
        (
            ["allocator=radix", "kv_tier=host_disk", "kv_tier.host_blocks=0"],
            r"kv_tier\.disk_blocks=8192 with kv_tier\.host_blocks=0.*host_blocks >= 1",
        ),
        (
            ["allocator=radix", "kv_tier=host", "kv_tier.write_policy=later"],
            r"kv_tier\.write_policy='later' must be one of 'write_back', 'write_through'",
        ),
        (
            ["model._target_=harness.platform.models.no_such"],
            r"model\._target_=.*cannot be imported",
        ),
    ],
)
def test_bad_config_names_the_key(compose_cfg, overrides, message) -> None:
    with pytest.raises(ConfigError, match=message):
        validate(compose_cfg(overrides))


def test_max_model_len_below_1_names_the_engine_key(compose_cfg) -> None:
    # the engine passes it on to the scheduler, whose own check would name scheduler's key
    with pytest.raises(ConfigError, match=r"^engine\.max_model_len=0 must be >= 1"):
        validate(compose_cfg(["engine.max_model_len=0"]))


def test_a_key_no_component_reads_is_refused_naming_the_keys_there(compose_cfg) -> None:
    # Hydra's advice for an unknown key (+key=value) adds it where nothing reads it
    cfg = compose_cfg(["trace=shared_prefix", "+trace.num_requests=2"])
    unread = r"^trace\.num_requests is read by nothing: the keys at trace are rate, num_system_"
    with pytest.raises(ConfigError, match=unread + r"prompts, .*generator"):
        validate(cfg)


def test_a_knob_bypassed_by_its_builders_parameter_names_the_knob(compose_cfg) -> None:
    bypassed = r"^trace\.num_requests is read by nothing: trace\.generator\.num_requests is set"
    with pytest.raises(ConfigError, match=bypassed + r" directly.*set trace\.num_requests"):
        validate(compose_cfg(["trace.generator.num_requests=3"]))


def test_a_knob_read_by_interpolation_from_another_node_passes(compose_cfg) -> None:
    cfg = compose_cfg(["+trace.budget=640", "scheduler=chunked_prefill"])
    cfg.scheduler.max_num_batched_tokens = "${trace.budget}"
    validate(cfg)
    scheduler = instantiate(cfg.scheduler)(FreeListAllocator(num_blocks=8, block_size=16))
    assert scheduler.max_num_batched_tokens == 640  # the knob reached the scheduler


def test_misspelt_override_is_refused_by_hydra(compose_cfg) -> None:
    with pytest.raises(ConfigCompositionException, match=r"trace\.rat"):
        compose_cfg(["trace.rat=2"])


def test_bad_config_fails_before_any_work(compose_cfg, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="must be float") as error:
        run(compose_cfg(["trace.rate=fast"]), tmp_path / "out")
    assert isinstance(error.value.__cause__, ConfigError)
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["failed.txt"]  # nothing else


# -- bad trace files --------------------------------------------------------------------------


def test_bad_trace_file_names_line_and_field(compose_cfg, tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(
        '{"request_id": "a", "arrival_time": 0.0, "prompt_token_ids": [1, 2], "max_tokens": 4}\n'
        '{"request_id": "b", "arrival_time": 0.5, "prompt_token_ids": [3], "max_tokens": "x"}\n'
    )
    with pytest.raises(UsageError, match=r"bad\.jsonl line 2: field 'max_tokens'") as error:
        run(compose_cfg(["trace=file", f"trace.path={path}"]), tmp_path / "out")
    assert isinstance(error.value.__cause__, TraceError)
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["failed.txt"]  # nothing else


def test_untyped_trace_knob_fails_before_replay(compose_cfg, tmp_path: Path) -> None:
    cfg = compose_cfg(["trace=poisson", "trace.num_requests=6", "trace.tpot_slo=abc"])
    with pytest.raises(UsageError, match=r"field 'tpot_slo' is 'abc'.*trace\.tpot_slo"):
        run(cfg, tmp_path / "o")
    assert [p.name for p in (tmp_path / "o").iterdir()] == ["failed.txt"]


def test_trace_tokens_outside_the_vocabulary_fail_before_replay(compose_cfg, tmp_path) -> None:
    trace = instantiate(compose_cfg(["trace.vocab_size=5000"]).trace.generator, _convert_="all")
    save(trace, tmp_path / "big.parquet")
    assert load(tmp_path / "big.parquet").requests == trace.requests
    with pytest.raises(UsageError, match=r"'prompt_token_ids' holds id \d+, outside"):
        run(compose_cfg(["trace=file", f"trace.path={tmp_path / 'big.parquet'}"]), tmp_path / "o")
    assert [p.name for p in (tmp_path / "o").iterdir()] == ["failed.txt"]
