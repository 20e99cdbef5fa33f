"""Choosing and running a Beam runner for crossfeed's jobs.

**The default is offline and in-process.** Beam 2.77's ``DirectRunner`` (``SwitchingDirectRunner``)
first tries the Prism runner, which downloads a Go binary from GitHub, and falls back to the
in-process runners when that fails: slow and network-dependent. crossfeed never lets it try:
no ``--runner``, ``DirectRunner`` and ``direct`` all mean Beam's in-process ``FnApiRunner``
(``apache_beam.runners.portability.fn_api_runner.FnApiRunner``, what DirectRunner itself uses for
batch jobs once Prism is out of the way). ``BundleBasedDirectRunner`` and ``PrismRunner`` can still
be asked for by name.

Other engines take their standard Beam options (after ``--`` on the ``crossfeed convert`` line);
the output directory must be a filesystem every worker mounts (the shard writers use local paths):

* Dask: ``--runner DaskRunner --dask_client_address tcp://scheduler:8786`` (``--dask_address`` is
  accepted as an alias); without an address DaskRunner starts a ``LocalCluster`` on this machine.
  Unless ``--dask_npartitions`` is given, crossfeed sets it to the cluster's worker threads (at
  most the number of work units): each of DaskRunner's GroupByKeys is a task shuffle whose cost
  grows with the square of the partitions. Tested here on a ``LocalCluster`` of several processes.
* Flink: ``--runner FlinkRunner --flink_master host:8081 --environment_type PROCESS|DOCKER ...``
* Spark: ``--runner SparkRunner --spark_master_url spark://host:7077 ...``
* Dataflow: ``--runner DataflowRunner --project P --region R --temp_location gs://…`` with a
  worker image that has crossfeed installed (``--sdk_container_image``).
Flink, Spark and Dataflow are documented, not exercised by the test suite.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Sequence

from crossfeed.errors import ConfigError

log = logging.getLogger(__name__)

LOCAL_NAMES = {None, "", "direct", "DirectRunner", "FnApiRunner", "local"}


def make_runner(name: str | None):
    """A runner instance (or a name Beam resolves itself) for ``--runner``."""
    if name in LOCAL_NAMES:
        from apache_beam.runners.portability.fn_api_runner import FnApiRunner

        return FnApiRunner()
    if name == "BundleBasedDirectRunner":
        from apache_beam.runners.direct.direct_runner import BundleBasedDirectRunner

        return BundleBasedDirectRunner()
    if name == "DaskRunner":
        try:
            from apache_beam.runners.dask.dask_runner import DaskRunner
        except ImportError as e:  # pragma: no cover - depends on the install
            raise ConfigError("DaskRunner needs apache-beam[dask] and dask[distributed]") from e
        return DaskRunner()
    return name


def in_process(runner: str | None, beam_args: Sequence[str] = ()) -> bool:
    """Whether ``runner`` with ``beam_args`` runs every step of a job in this process: the
    embedded runner, unless ``--direct_running_mode=multi_processing``."""
    from apache_beam.options.pipeline_options import DirectOptions, PipelineOptions

    known, rest = parse_runner_args(beam_args)
    if (runner or known.runner) not in LOCAL_NAMES:
        return False
    return PipelineOptions(rest).view_as(DirectOptions).direct_running_mode != "multi_processing"


def runner_name(runner) -> str:
    return runner if isinstance(runner, str) else type(runner).__name__


def beam_options(beam_args: Sequence[str] = (), *, runner_name: str = "", work_units: int | None = None):
    """PipelineOptions from the pass-through Beam arguments (``--dask_address`` → ``--dask_client_address``;
    DaskRunner gets ``--dask_npartitions`` = ``work_units`` unless given; the in-process ``FnApiRunner``
    gets ``--no_pipeline_type_check``: Beam's construction-time type inference, of crossfeed's own
    transforms, which declare no type hints, is ~10% of that runner's fixed cost of a job)."""
    from apache_beam.options.pipeline_options import PipelineOptions

    args = [
        "--dask_client_address" if a == "--dask_address" else a.replace("--dask_address=", "--dask_client_address=", 1)
        for a in beam_args
    ]
    if (
        runner_name == "DaskRunner"
        and work_units
        and not any(a.startswith(("--dask_npartitions", "--dask_partition_size")) for a in args)
    ):
        options = PipelineOptions(args)
        address = options.get_all_options().get("address")
        args.append(f"--dask_npartitions={max(1, min(work_units, _dask_threads(address)))}")
    if runner_name == "FnApiRunner" and "--no_pipeline_type_check" not in args:
        args.append("--no_pipeline_type_check")
    return PipelineOptions(args)


def _dask_threads(address: str | None) -> int:
    """Worker threads of the Dask cluster at ``address`` (this machine's CPUs for a new LocalCluster)."""
    import os

    if not address:
        return os.cpu_count() or 1
    from distributed import Client

    try:
        with Client(address, timeout=30) as client:
            return max(1, sum(w["nthreads"] for w in client.scheduler_info(n_workers=-1)["workers"].values()))
    except (ValueError, OSError, TimeoutError) as e:  # a malformed address, or nothing answering there
        raise ConfigError(
            f"--dask_client_address {address!r}: cannot reach a Dask scheduler there ({e}); "
            f"start one (dask scheduler) or fix the address, e.g. tcp://host:8786"
        ) from e


def run_pipeline(
    build: Callable, *, runner: str | None = None, beam_args: Sequence[str] = (), work_units: int | None = None
) -> None:
    """Build a pipeline with ``build(pipeline)`` and run it to completion on ``runner``.

    A DaskRunner client is closed afterwards (DaskRunner itself leaves it open)."""
    import apache_beam as beam

    known, beam_args = parse_runner_args(beam_args)  # a --runner among the Beam options counts too
    r = make_runner(runner or known.runner)
    options = beam_options(beam_args, runner_name=runner_name(r), work_units=work_units)
    pipeline = beam.Pipeline(runner=r, options=options)
    build(pipeline)
    result = pipeline.run()
    try:
        result.wait_until_finish()
    finally:
        client = getattr(result, "client", None)
        if client is not None:
            client.close()


def parse_runner_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """``--runner`` and the rest: crossfeed's own flags are parsed with ``parse_known_args``, what
    is left goes to Beam untouched."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--runner", default=None)
    return parser.parse_known_args(list(argv or []))
