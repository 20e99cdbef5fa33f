"""Serving and dispatching a dataset as library calls: what ``crossfeed serve`` and ``crossfeed
dispatch`` run (the CLI only parses its flags into these options and calls them).

    with serving("data/", LoaderOptions.of(batch_size=64), ServerOptions(("tcp://*:7860",))) as server:
        ...                                          # trainers: crossfeed.connect(server.endpoints)
    serve("data/", loader_options, server_options, stop=event)  # the same, until done or stopped

    dispatch("data/", loader_options, DispatcherOptions("tcp://*:7870", "run.journal", epochs=3))

`serving` / `dispatching` are context managers (for scripts and tests that want the bound
endpoints); `serve` / `dispatch` block until the stream ends or ``stop`` is set and raise if the
server or dispatcher failed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from collections.abc import Callable, Iterator

from crossfeed.errors import ConfigError
from crossfeed.net.keys import ClientKeys, ServerKeys
from crossfeed.net.lease.book import MAX_PACKED_EPOCHS, PACKED_STRIDE
from crossfeed.net.lease.dispatcher import DispatcherOptions, EpochCounts, LeaseDispatcher
from crossfeed.net.lease.source import LeaseSource
from crossfeed.net.stream.server import Server, ServerOptions
from crossfeed.read.options import LoaderOptions
from crossfeed.read.sources.mixture_file import source_of

logger = logging.getLogger(__name__)
__all__ = [
    "DispatchPlan",
    "LoaderEpochs",
    "dispatch",
    "dispatching",
    "plan_dispatch",
    "serve",
    "serving",
    "wait_until_done",
]


class LoaderEpochs:
    """factory(epoch) over one `crossfeed.Loader` with the given `LoaderOptions` (batches carry
    their sample indices, for provenance — not packed rows or token budgets, whose rows hold
    pieces of several records): `set_epoch(epoch)`, then its batches. ``dataset`` may be a
    mixture spec file (batches then also carry ``__source__``); ``filter``: the Loader's (a
    filtered sample leaves its batch shorter, counted in `Loader.filtered`)."""

    def __init__(self, dataset: str, options: LoaderOptions, *, transform=None, filter=None):
        from crossfeed.read.loader import Loader

        source, more = source_of(dataset)
        tokens = options.plan.pack is not None or options.plan.batch_by_tokens is not None
        opts = options.replace(return_index=not tokens, **more)
        self.loader = Loader(source, opts, transform=transform, filter=filter)

    def __call__(self, epoch: int):
        self.loader.set_epoch(epoch)
        return iter(self.loader)

    def close(self) -> None:
        self.loader.close()


def _dispatched_source(
    dataset, dispatcher: str, local: LoaderOptions, options: ServerOptions, transform, keys, filter=None
):
    """Server(source=...) building the leases of `dispatcher` from a Loader over `dataset` whose
    options are the dispatcher's plan (`LoaderOptions.plan_fields`, sent on joining), except how
    hard this server works and where it caches (`LOCAL_FIELDS`), its skip list (which the plan's
    identity must name) and its transform and filter: this server's own."""
    from crossfeed.read.loader import Loader

    def make_loader(plan: dict):
        opts = LoaderOptions.from_plan(plan, local)
        opts = opts.replace(return_index=opts.plan.pack is None)  # a packed row holds pieces of several records
        # a mixture spec file: its sources (the plan carries the dispatcher's samples_per_epoch)
        return Loader(source_of(dataset)[0], opts, transform=transform, filter=filter)

    def source(endpoints, wake):
        return LeaseSource(
            dispatcher,
            make_loader,
            endpoints,
            server_id=options.server_id,
            keys=keys,
            heartbeat=options.heartbeat,
            on_put=wake,
        ).start()

    return source


@contextlib.contextmanager
def serving(
    dataset: str,
    options: LoaderOptions,
    server: ServerOptions,
    *,
    transform: Callable | None = None,
    keys: ServerKeys | None = None,
    dispatcher: str | None = None,
    dispatcher_keys: ClientKeys | None = None,
    filter: Callable | str | None = None,
) -> Iterator[Server]:
    """A started `Server` streaming ``dataset``'s batches (a Loader with ``options``, epochs
    ``server.start_epoch`` on, ``server.epochs`` of them or until stopped); closed, with its
    Loader, when the block ends. With ``dispatcher`` (a ``crossfeed dispatch`` address) it builds
    the batches the dispatcher leases instead: the dispatcher owns the plan, so ``options`` gives
    only how hard to work and where to cache, and ``server`` must not set epochs; ``options``'
    skip list must be the one the dispatcher plans (its identity says so, or the server is
    refused). ``transform`` and ``filter`` run here, on each sample this server builds."""
    if not isinstance(options, LoaderOptions):
        raise ConfigError(f"options must be a LoaderOptions, got {type(options).__name__}")
    if not isinstance(server, ServerOptions):
        raise ConfigError(f"server must be a ServerOptions, got {type(server).__name__}")
    if dispatcher is not None:
        if server.epochs is not None or server.start_epoch:
            raise ConfigError(
                "with a dispatcher (--dispatcher) the dispatcher owns the plan: drop epochs/start_epoch "
                "(--epochs/--start-epoch) and rank/world_size (--rank/--world-size)"
            )
        source = _dispatched_source(dataset, dispatcher, options, server, transform, dispatcher_keys, filter)
        with Server(None, server, keys=keys, source=source) as s:
            yield s
        return
    factory = LoaderEpochs(dataset, options, transform=transform, filter=filter)
    try:
        with Server(factory, server, keys=keys) as s:
            yield s
    finally:
        factory.close()


def serve(
    dataset: str,
    options: LoaderOptions,
    server: ServerOptions,
    *,
    stop: threading.Event | None = None,
    on_ready: Callable[[Server], None] | None = None,
    **kwargs,
) -> None:
    """`serving`, until the stream ends or ``stop`` is set; raises `CrossfeedError` if the server
    failed. ``on_ready(server)`` is called once it is bound. ``kwargs``: those of `serving`."""
    with serving(dataset, options, server, **kwargs) as s:
        if on_ready is not None:
            on_ready(s)
        wait_until_done(s, stop)
    s.raise_if_failed()


@dataclasses.dataclass(frozen=True)
class DispatchPlan:
    """What a dispatcher hands out: the plan every server's Loader takes (`plan`,
    `LoaderOptions.plan_fields`), the batches of an epoch (`batches`; for packed plans
    `PACKED_STRIDE`, each epoch's own count in `counts`, its kept steps where steps are skipped;
    unpacked with skipped steps every epoch's whole count, its kept batches in `counts`), each
    trainer's share of epoch 0 (`per_rank`) and the
    stream's identity (`identity`, `StreamIdentity.to_json`: its fingerprint journaled with the
    plan, its settings sent to every server, which refuses another stream naming what differs)."""

    plan: dict
    batches: int
    per_rank: int
    packed: bool
    counts: EpochCounts | Callable[[int], int] | None = None
    identity: dict | None = None


@contextlib.contextmanager
def plan_dispatch(
    dataset: str, options: LoaderOptions, *, epochs: int | None, world_size: int = 1
) -> Iterator[DispatchPlan]:
    """The `DispatchPlan` of ``dataset`` under ``options`` for ``world_size`` lockstep trainers;
    a packed plan keeps the dataset open (its epochs' counts are walked lazily) until the block
    ends. Refuses what a dispatcher cannot lease (token budgets; packed plans in lockstep DDP or
    past `MAX_PACKED_EPOCHS` epochs), saying what to do instead."""
    from crossfeed.read.loader import Loader

    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size must be an integer >= 1, got {world_size!r}")
    options = options.replace(rank=0, world_size=world_size)
    packed = options.plan.pack is not None
    if options.plan.batch_by_tokens is not None:
        raise ConfigError(
            "token-budget (batch_by_tokens, --batch-by-tokens) batches are not leased by a dispatcher yet: "
            "use crossfeed serve (one server per rank) instead"
        )
    if packed and world_size > 1:
        raise ConfigError(
            "with pack (--pack-length) the dispatcher leases the packed plan's global batches, whose number "
            "changes from epoch to epoch; lockstep DDP needs equal per-rank counts: drop world_size "
            "(--world-size), or use crossfeed serve --rank/--world-size"
        )
    if packed and (epochs is None or epochs > MAX_PACKED_EPOCHS):
        raise ConfigError(f"at most {MAX_PACKED_EPOCHS} epochs (--epochs) with pack (--pack-length), got {epochs}")
    source, more = source_of(dataset)  # a mixture spec file: its sources and samples_per_epoch
    options = options.replace(**more)
    loader = Loader(source, options.replace(num_threads=1))
    identity = loader.pipeline.identity.to_json()
    steps = options.plan.skip.steps if options.plan.skip is not None else ()
    try:
        if packed:  # epoch e has its own count (skipped steps left out), one walk over its lengths (kept open)
            counts = EpochCounts(lambda e: loader.rank_batch_count(0, epoch=e), epochs)
            plan = DispatchPlan(options.plan_fields(), PACKED_STRIDE, counts(0), True, counts, identity)
        elif steps:  # skipped steps are never leased: epoch e has its kept steps (O(ranges) each), W batches each
            whole = loader.pipeline.rank_sampler(0, world_size).rank_batch_count()  # steps a rank, skipped or not

            def kept(e: int) -> int:
                return world_size * loader.rank_batch_count(0, epoch=e)

            plan = DispatchPlan(options.plan_fields(), whole * world_size, kept(0) // world_size, False, kept, identity)
        else:
            per_rank = loader.batch_count()
            plan = DispatchPlan(options.plan_fields(), per_rank * world_size, per_rank, False, identity=identity)
            loader.close()
        yield plan
    finally:
        loader.close()


@contextlib.contextmanager
def dispatching(
    dataset: str,
    options: LoaderOptions,
    dispatcher: DispatcherOptions,
    *,
    world_size: int = 1,
    keys: ServerKeys | None = None,
) -> Iterator[LeaseDispatcher]:
    """A started `LeaseDispatcher` owning ``dataset``'s epoch plan under ``options``
    (`plan_dispatch`) and leasing its batches to ``crossfeed serve --dispatcher`` servers, for
    ``world_size`` lockstep trainers (each gets the Loader's per-rank count per epoch)."""
    with _dispatching(dataset, options, dispatcher, world_size=world_size, keys=keys) as (d, _):
        yield d


@contextlib.contextmanager
def _dispatching(dataset, options, dispatcher, *, world_size=1, keys=None):
    if not isinstance(dispatcher, DispatcherOptions):
        raise ConfigError(f"dispatcher must be a DispatcherOptions, got {type(dispatcher).__name__}")
    with plan_dispatch(dataset, options, epochs=dispatcher.epochs, world_size=world_size) as plan:
        if world_size > 1:  # each rank's count; with skipped steps the book scales it to each epoch's
            dispatcher = dataclasses.replace(dispatcher, quota=plan.batches // world_size)
        with LeaseDispatcher(
            plan.plan, plan.batches, dispatcher, keys=keys, counts=plan.counts, identity=plan.identity
        ) as d:
            yield d, plan


def dispatch(
    dataset: str,
    options: LoaderOptions,
    dispatcher: DispatcherOptions,
    *,
    stop: threading.Event | None = None,
    on_ready: Callable[[LeaseDispatcher, DispatchPlan], None] | None = None,
    around: Callable[[LeaseDispatcher], contextlib.AbstractContextManager] | None = None,
    **kwargs,
) -> None:
    """`dispatching`, until the last epoch is done (and lingered) or ``stop`` is set; raises
    `ConfigError` if the dispatcher failed. ``on_ready(dispatcher, plan)`` is called once it is
    bound, with the `DispatchPlan` it hands out; ``around(dispatcher)``, a context manager held
    while it runs (e.g. a metrics endpoint)."""
    with _dispatching(dataset, options, dispatcher, **kwargs) as (d, plan):
        with around(d) if around is not None else contextlib.nullcontext():
            if on_ready is not None:
                on_ready(d, plan)
            wait_until_done(d, stop)
    if d.error is not None:
        raise ConfigError(f"the dispatcher failed: {d.error}") from d.error


def wait_until_done(running, stop: threading.Event | None = None) -> None:
    """Until ``running`` (a `Server` or `LeaseDispatcher`) is done or ``stop`` is set."""
    stop = stop or threading.Event()
    while not stop.is_set() and not running.wait(0.2):
        pass
