"""`crossfeed top DISPATCHER_OR_SERVER`: a live view of a fleet, refreshed every second.

It asks the address for its status (`crossfeed.net.status`: the request trainers' sockets
already reach, answered by `crossfeed dispatch` and by `crossfeed serve` in distribution mode);
pointed at a dispatcher it also asks each live server it lists. Shown: per server its batches/s
(pointed at a dispatcher: its batches claimed per second over the last seconds, as the dispatcher
measures them, and that rate's share of the fleet's; else between two frames, the first frame
averaging since the server started), batches delivered,
trainers, leases held and batches leased (from the dispatcher), its last heartbeat's age and,
while its Loader reports per-stage timing, how its time splits between stages; per trainer
what it claimed and holds and the share of its time its training loop waits for batches (its
last report, see `crossfeed.net.lease.client`; with its age once older than STALE s); and the
slowest server by name: the lowest rate among the servers that hold work (leased batches), never
an idle one (an idle fast server delivers nothing because it was given nothing). When some
trainer waits INPUT_BOUND or more of its time, a line says the fleet is input-bound and what to
do (`advice`): fix the slowest server when it delivers under SLOW of the others' median rate,
else add servers (each adds about that median).

Everything a peer names (endpoints, ids, stage names, verdicts) is shown as inert text
(`_inert`): rich `Text` objects, never markup (no `[link=...]` becomes a terminal hyperlink, no
`[/x]` breaks the frame), with control characters (an ESC sequence, a carriage return) left out.

`--once` prints one frame and exits (scripts, tests); Ctrl-C leaves the live view cleanly.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from crossfeed.errors import CrossfeedError, WireError

if TYPE_CHECKING:
    from rich.console import JustifyMethod

    from crossfeed.net.status import DispatcherStatus, ServerStatus

logger = logging.getLogger(__name__)
MAX_ASKED = 16  # servers asked at once
INPUT_BOUND = 0.10  # a trainer waiting this share of its time or more: the fleet is input-bound
SLOW = 0.5  # a server below this share of the others' median rate is the one to fix
STALE = 5.0  # seconds after which a trainer's wait report is shown with its age


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """One round of answers: the address's status, and (for a dispatcher) each listed server's by address."""

    at: float
    status: ServerStatus | DispatcherStatus
    servers: dict[str, ServerStatus | None]  # first endpoint -> its status, or None when it did not answer


def _ask(address: str, keys, timeout: float):
    from crossfeed.net.status import parse_status, query

    return parse_status(query(address, keys=keys, timeout=timeout))


def _ask_server(address: str, keys, timeout: float) -> ServerStatus | None:
    from crossfeed.net.status import ServerStatus

    try:
        status = _ask(address, keys, timeout)
    except CrossfeedError as e:  # WireError too: a server that answers nonsense shows as silent
        logger.debug("server %s: %s", address, e)
        return None
    return status if isinstance(status, ServerStatus) else None


def snapshot(address: str, keys, server_keys, timeout: float, pool) -> Snapshot:
    from crossfeed.net.status import DispatcherStatus

    status = _ask(address, keys, timeout)
    servers: dict[str, ServerStatus | None] = {}
    if isinstance(status, DispatcherStatus):
        endpoints = [s.address.split(" ")[0] for s in status.servers]
        answers = pool.map(lambda a: _ask_server(a, server_keys, min(timeout, 1.0)), endpoints)
        servers = dict(zip(endpoints, answers))
    return Snapshot(time.monotonic(), status, servers)


def _rate(now, before, dt: float, uptime: float) -> float | None:
    if before is not None and dt > 0 and now >= before:
        return (now - before) / dt
    return now / uptime if uptime > 0 else None


def _stage_split(status, before) -> str:
    from crossfeed.net.status import split_stats

    if status is None or status.loader is None:
        return "—"
    stages = split_stats(status.loader).stages
    if before is not None and before.loader is not None:
        old = split_stats(before.loader).stages
        delta = {k: v - old.get(k, 0.0) for k, v in stages.items()}
        if sum(delta.values()) > 0:
            stages = delta
    total = sum(stages.values())
    if total <= 0:
        return "—"
    return " ".join(f"{k} {100 * v / total:.0f}%" for k, v in sorted(stages.items(), key=lambda kv: -kv[1]))


def _verdict(status, before) -> str | None:
    """The server's Loader's verdict since the last frame (or over its life), or None."""
    from crossfeed.net.status import loader_verdict

    if status is None:
        return None
    return loader_verdict(status.loader, before.loader if before is not None else None)


def _inert(text: str):
    """`text` as rich `Text` (never parsed as markup) without its unprintable characters (ESC,
    CR, other control codes): what a peer names cannot style, link or move the operator's terminal."""
    from rich.text import Text

    return Text("".join(c for c in str(text) if c.isprintable()))


def _age(seconds: float | None) -> str:
    return "—" if seconds is None else f"{seconds:.1f}s"


def _wait(entry) -> str:
    """A trainer's wait share as the table shows it: "38%", "38% (12s ago)" or "not reported"."""
    if entry.wait is None:
        return "not reported"
    text = f"{100 * entry.wait:.0f}%"
    return text if entry.wait_age is None or entry.wait_age <= STALE else f"{text} ({entry.wait_age:.0f}s ago)"


def _num(value: float | None, fmt: str = "{:.1f}") -> str:
    return "—" if value is None else fmt.format(value)


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    endpoint: str
    rate: float | None
    delivered: int | None
    trainers: int | None
    leases: int | None
    leased: int | None
    beat: float | None
    stages: str
    verdict: str | None = None  # its Loader's, over the last frame's interval
    share: float | None = None  # its rate's share of the fleet's (from the dispatcher)

    @property
    def holds_work(self) -> bool:
        """Batches are leased to it (a plain server, which the dispatcher does not lease: True)."""
        return self.leased is None or self.leased > 0


def rows(snap: Snapshot, prev: Snapshot | None) -> list[Row]:
    from crossfeed.net.status import DispatcherStatus, ServerStatus

    dt = snap.at - prev.at if prev is not None else 0.0
    out = []
    s: ServerStatus | None
    if isinstance(snap.status, ServerStatus):
        s = snap.status
        before = prev.status if prev is not None and isinstance(prev.status, ServerStatus) else None
        if before is not None and before.server_id != s.server_id:
            before = None
        rate = _rate(s.delivered, before.delivered if before else None, dt, s.uptime)
        out.append(
            Row(
                s.server_id,
                "",
                rate,
                s.delivered,
                s.trainers,
                None,
                None,
                None,
                _stage_split(s, before),
                _verdict(s, before),
            )
        )
        return out
    for entry in snap.status.servers:
        endpoint = entry.address.split(" ")[0]
        s = snap.servers.get(endpoint)
        before = prev.servers.get(endpoint) if prev is not None else None
        if s is not None and before is not None and before.server_id != s.server_id:
            before = None
        if entry.rate is not None:  # the dispatcher's, over its last seconds (not one frame)
            rate = entry.rate
        elif s is not None:
            rate = _rate(s.delivered, before.delivered if before else None, dt, s.uptime)
        else:  # no answer from it: what the dispatcher saw of it, between two frames
            old = (
                {e.id: e.claimed for e in prev.status.servers}
                if prev and isinstance(prev.status, DispatcherStatus)
                else {}
            )
            rate = (entry.claimed - old[entry.id]) / dt if entry.id in old and dt > 0 else None
        out.append(
            Row(
                s.server_id if s is not None else entry.id,
                endpoint,
                rate,
                s.delivered if s is not None else None,
                s.trainers if s is not None else None,
                entry.leases,
                entry.leased,
                entry.age,
                _stage_split(s, before),
                _verdict(s, before),
                entry.share,
            )
        )
    return out


def slowest(found: list[Row]) -> Row | None:
    """The lowest rate among the servers that hold work (None: none has a rate yet)."""
    busy = [r for r in found if r.rate is not None and r.holds_work]
    return min(busy, key=lambda r: r.rate or 0.0) if busy else None  # every one rated


def advice(found: list[Row]) -> str:
    """What to do about an input-bound fleet: which server to fix, or add servers."""
    rated = sorted((r for r in found if r.rate is not None), key=lambda r: r.rate or 0.0)  # every one rated
    busy = [r for r in rated if r.holds_work]
    if not busy and len(rated) == 1:  # the one server, between two leases
        busy = rated
    if not busy:
        return "slowest server: — (none holds work, or no rates yet)"
    slow = busy[0]
    rate = slow.rate or 0.0
    named = f"{slow.name} ({slow.endpoint}) at {rate:.1f} batches/s"
    others = [r.rate or 0.0 for r in busy[1:]]
    if others:
        median = others[len(others) // 2]
        if rate < SLOW * median:
            why = f" (its Loader: {slow.verdict})" if slow.verdict else ""
            return f"slowest server: {named}, under {100 * SLOW:.0f}% of the others' {median:.1f}: fix it{why}"
        return f"slowest server: {named}; the servers run at about {median:.1f} batches/s each: add servers"
    return f"slowest server: {named}, the only one holding work: add servers"


def render(address: str, snap: Snapshot, prev: Snapshot | None):
    """The frame: a header, the servers, (for a dispatcher) the trainers, the slowest server."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    from crossfeed.net.status import DispatcherStatus

    st = snap.status
    parts: list = []
    if isinstance(st, DispatcherStatus):
        p, c = st.progress, st.counters
        epochs = "∞" if st.epochs is None else str(st.epochs)
        head = (
            f"dispatcher {address}  epoch {st.epoch + (not st.finished)}/{epochs}{'  finished' if st.finished else ''}  "
            f"batches done {p['done']} claimed {p['claimed']} leased {p['leased']} pending {p['pending']} "
            f"of {st.batches}\nservers {st.servers_total}  trainers {st.trainers_total}  "
            f"claims granted {c['granted']} refused {c['refused']}  leases {c['leases']} "
            f"expired {c['leases_revoked']} re-leased batches {c['batches_re_leased']}  "
            f"errors: malformed {c['dropped_messages']} servers lost {c['servers_lost']} "
            f"trainers lost {c['trainers_lost']}"
        )
    else:
        head = (
            f"server {st.server_id} at {address}  up {st.uptime:.0f}s  epochs {st.epochs}  "
            f"errors: malformed {st.dropped_messages} trainers fenced {st.fenced}"
        )
    parts.extend(_inert(line) for line in head.split("\n"))  # each line inert (a newline is not printable)
    table = Table(title=None, expand=False)
    columns: tuple[tuple[str, JustifyMethod], ...] = (
        ("server", "left"),
        ("endpoint", "left"),
        ("batches/s", "right"),
        ("share", "right"),
        ("batches", "right"),
        ("trainers", "right"),
        ("leases", "right"),
        ("leased", "right"),
        ("last beat", "right"),
        ("stages", "left"),
    )
    for name, justify in columns:
        table.add_column(name, justify=justify, no_wrap=name != "stages")
    found = rows(snap, prev)
    for r in found:
        cells = (
            r.name,
            r.endpoint,
            _num(r.rate),
            _num(None if r.share is None else 100 * r.share, "{:.0f}%"),
            _num(r.delivered, "{}"),
            _num(r.trainers, "{}"),
            _num(r.leases, "{}"),
            _num(r.leased, "{}"),
            _age(r.beat),
            r.stages,
        )
        table.add_row(*map(_inert, cells))
    parts.append(table)
    if isinstance(st, DispatcherStatus):
        if st.servers_total > len(st.servers):
            parts.append(Text(f"(showing {len(st.servers)} of {st.servers_total} servers)"))
        if st.trainers_total > len(st.trainers):
            parts.append(Text(f"(showing {len(st.trainers)} of {st.trainers_total} trainers)"))
        trainers = Table(expand=False)
        for name in ("trainer", "claimed (epoch)", "holding", "last beat", "wait"):
            trainers.add_column(name, justify="left" if name in ("trainer", "wait") else "right", no_wrap=True)
        for t in st.trainers:
            trainers.add_row(*map(_inert, (t.id, str(t.claimed), str(t.holding), _age(t.age), _wait(t))))
        parts.append(trainers)
    rated = [r for r in found if r.rate is not None]
    slow = slowest(found)
    if len(rated) > 1 and slow is not None:
        parts.append(_inert(f"slowest server: {slow.name} ({slow.endpoint}) at {slow.rate:.1f} batches/s"))
        if slow.verdict:
            parts.append(_inert(f"  its Loader: {slow.verdict}"))
    elif len(rated) > 1:
        parts.append(Text("slowest server: — (none holds work)"))
    elif found and not rated:
        parts.append(Text("slowest server: — (no rates yet)"))
    if len(found) == 1 and found[0].verdict:
        parts.append(_inert(f"verdict: {found[0].verdict}"))
    if isinstance(st, DispatcherStatus):
        waiting = [t for t in st.trainers if t.wait is not None and t.wait >= INPUT_BOUND]
        if waiting:
            worst = max(waiting, key=lambda t: t.wait or 0.0)  # `waiting`: every wait is a float
            parts.append(
                _inert(
                    f"input-bound: {len(waiting)} trainer(s) wait {100 * INPUT_BOUND:.0f}% or more of their time "
                    f"for batches (most: {worst.id} {100 * (worst.wait or 0.0):.0f}%); {advice(found)}"
                )
            )
    return Group(*parts)


def top(
    address: Annotated[str, typer.Argument(help="A `crossfeed dispatch` address, or a `crossfeed serve` one.")],
    once: Annotated[bool, typer.Option("--once", help="Print one frame and exit.")] = False,
    interval: Annotated[float, typer.Option("--interval", min=0.2, help="Seconds between frames.")] = 1.0,
    keys: Annotated[
        Path | None, typer.Option("--keys", help="Dir with client.key_secret and server.key (CURVE).")
    ] = None,
    server_keys: Annotated[
        Path | None,
        typer.Option("--server-keys", help="Like --keys, for the dispatcher's servers (default: --keys)."),
    ] = None,
    timeout: Annotated[float, typer.Option("--timeout", min=0.1, help="Give up on a silent address after S s.")] = 5.0,
) -> None:
    """Live fleet view: per server batches/s, stage split, leases, last heartbeat; per trainer its claims and wait share; the slowest server."""
    from rich.console import Console
    from rich.live import Live

    from crossfeed.net.keys import ClientKeys

    client_keys = ClientKeys.from_dir(keys) if keys else None
    other_keys = ClientKeys.from_dir(server_keys) if server_keys else client_keys
    console = Console()
    if not console.is_terminal:
        console = Console(width=200)
    with concurrent.futures.ThreadPoolExecutor(MAX_ASKED, thread_name_prefix="crossfeed-top") as pool:
        try:
            snap = snapshot(address, client_keys, other_keys, timeout, pool)
        except WireError as e:
            raise CrossfeedError(f"{address} answered a malformed status: {e}") from e
        if once:
            console.print(render(address, snap, None))
            return
        prev = None
        try:
            with Live(render(address, snap, prev), console=console, auto_refresh=False) as live:
                while True:
                    time.sleep(max(0.0, interval - (time.monotonic() - snap.at)))
                    try:
                        prev, snap = snap, snapshot(address, client_keys, other_keys, timeout, pool)
                    except CrossfeedError as e:  # gone for now: say so, keep trying
                        live.update(_inert(f"{address}: {e}"), refresh=True)
                        time.sleep(interval)
                        continue
                    live.update(render(address, snap, prev), refresh=True)
        except KeyboardInterrupt:
            return


def register(app: typer.Typer) -> None:
    app.command("top")(top)
