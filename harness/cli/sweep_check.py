"""Every job of a multirun checked before the first one runs.

Hydra's sweeper composes a job's config only when it launches it, so a bad value in the last
job of a sweep (``kvbench -m sampling.top_p=0.9,2``) would fail after the others ran, and the
sweep would end without its table. ``SweepCheck`` (``hydra.callbacks`` in conf/config.yaml)
expands the sweep as Hydra's basic sweeper does, composes each job and runs the checks that
need no model (``harness.cli.run.check``) when the multirun starts, in the parent process, so
with any launcher.
"""

from __future__ import annotations

import sys
from typing import Any

from hydra import compose
from hydra.errors import HydraException
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from harness.analysis import results
from harness.cli.load_sweep import jobs
from harness.cli.run import check


class SweepCheck(Callback):
    """On multirun start: compose and ``check`` each job; the first problem is one line on
    stderr naming the setting and the job, exit status 2, before any job runs. Once all
    pass, the jobs are recorded in the sweep folder (``results.write_jobs``)."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        hc = config.hydra
        todo = jobs(list(hc.overrides.task), dict(hc.sweeper.params or {}))
        for i, job in enumerate(todo, 1):
            try:
                check(compose(config_name=hc.job.config_name, overrides=job))
            except (ValueError, OSError, HydraException) as e:
                # Hydra's own messages go on to name its search path on further lines
                message = " ".join(str(e).split("\nConfig search path")[0].split())
                where = " ".join(job) or "no overrides"
                print(
                    f"kvbench: error: {message} (job {i} of {len(todo)}: {where})", file=sys.stderr
                )
                sys.exit(2)
        # what kvbench-compare lists as not started until each job has a folder
        ignore = list(hc.job.config.override_dirname.exclude_keys)
        results.write_jobs(str(hc.sweep.dir), todo, ignore)
