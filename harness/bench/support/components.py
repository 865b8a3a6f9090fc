"""The benchmarks' components come from conf/'s groups, as kvbench runs' do: ``_target_`` is the
one registry, so a benchmark names conf options (``allocator=buddy``, ``model=small``) and
builds what the composed config describes with ``harness.cli.run.build_component`` (kvbench's
instantiate: a component's own error, naming the setting, not Hydra's wrapper).

    cfg = compose_config(["allocator=buddy", "scheduler=fcfs", "scheduler.max_num_seqs=8"])
    build_engine(model, build_component(cfg.allocator), build_component(cfg.scheduler), ...)
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from harness.cli.run import CONFIG_DIR

# One conf/allocator/ option per allocator class (the other contiguous_* options are
# contiguous's reservation policies), in the order the benchmarks print them.
ALLOCATORS = ("free_list", "contiguous", "buddy", "radix")


def compose_config(overrides: Iterable[str] = ()) -> DictConfig:
    """conf/config.yaml composed with Hydra ``overrides`` (``group=option``, ``key=value``)."""
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3", job_name="bench"):
        return compose(config_name="config", overrides=list(overrides))


def options(group: str) -> list[str]:
    """The names of a conf/ group's options (its YAML files), sorted."""
    return sorted(p.stem for p in (Path(CONFIG_DIR) / group).glob("*.yaml"))
