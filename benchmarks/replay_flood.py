"""KV events under a replay flood: do live batches still go out, and what does the engine's thread pay?

The engine side (this process) fills the publisher's replay buffer with ``--kept`` batches, then calls
``EventSink.stored`` (one request's 64 blocks and 1024 token ids) every millisecond, timing each call.
Two client processes: a SUB on the live socket notes when each batch arrives; ``--clients`` DEALERs on
the replay socket send ``--requests`` requests for a replay of everything kept, then read until every
one is answered or the socket goes quiet for ``--idle-s``. Three phases: ``baseline`` (live events
only: the ceiling, measured in the same run), ``flood`` (until the publisher has taken in every
request and has none pending) and ``after`` (until the sink's queue is empty). Reported per phase:
live batches published per second, the longest wait between two (seen from the engine's thread, to
its 1 ms step), the longest and 99th-percentile ``stored`` call and the most events waiting in the
sink's queue; for the flood, the live batches the subscriber received during it and the
longest wait between two, the answers the flooders got, and how long the backlog took to clear.
Prints a table and writes replay_flood.json next to this script.

    python benchmarks/replay_flood.py [--kept 2000] [--requests 800] [--clients 1] [--baseline-s 2]
                                      [--quick] [--out PATH]
"""

from __future__ import annotations

import hashlib
import json
import os
import select
import statistics
import subprocess
import sys
import time

import zmq
from common import arguments, parse, write_result

from tiercache.telemetry.events.config import EventsConfig
from tiercache.telemetry.events.sink import EventSink

BLOCKS_PER_STORE = 64
BLOCK_SIZE = 16
STEP_S = 0.001
"""The engine's step: one ``stored`` call per millisecond."""
FILL_TOKENS = 1600
"""Token ids per batch used to fill the replay buffer: about 5 KB of msgpack, the issue's batch size."""
CLEAR_LIMIT_S = 120.0
"""Longest the ``after`` phase waits for the backlog to clear."""
POLL_MS = 100
"""How long a client waits for a message before it looks at its stdin again."""
MS = 1e3
QUICK_ARGUMENTS = {"kept": 40, "requests": 20, "baseline_s": 0.2, "idle_s": 1.0}
"""The defaults ``--quick`` gives the options."""


def live_client(pub: str) -> None:
    """The subscriber: records when each live batch arrives until ``stop`` on stdin; prints them as JSON."""
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.connect(pub)
    sub.setsockopt_string(zmq.SUBSCRIBE, "")
    print("ready", flush=True)
    received = []
    while not select.select([sys.stdin], [], [], 0)[0]:
        if sub.poll(POLL_MS):
            received.append((int.from_bytes(sub.recv_multipart()[1], "big"), time.monotonic()))
    print(json.dumps(received), flush=True)
    context.destroy(linger=0)


def flood_client(replay: str, requests: int, clients: int, idle_s: float) -> None:
    """The flooders: wait for ``go`` on stdin, send the requests, read the answers; print what came as JSON."""
    context = zmq.Context()
    dealers = [context.socket(zmq.DEALER) for _ in range(clients)]
    poller = zmq.Poller()
    for dealer in dealers:
        dealer.setsockopt(zmq.RCVHWM, 0)
        dealer.connect(replay)
        poller.register(dealer, zmq.POLLIN)
    print("ready", flush=True)
    sys.stdin.readline()
    for index in range(requests):
        dealers[index % clients].send_multipart((b"", (0).to_bytes(8, "big")))
    replayed, ends, full, last_answer = 0, 0, 0, time.monotonic()
    in_replay = dict.fromkeys(dealers, False)
    while ends < requests and time.monotonic() - last_answer < idle_s:
        for socket, _ in poller.poll(POLL_MS):
            payload = socket.recv_multipart()[2]
            last_answer = time.monotonic()
            if payload:
                replayed += 1
                in_replay[socket] = True
            else:
                ends += 1
                full += in_replay[socket]
                in_replay[socket] = False
    print(json.dumps({"replayed": replayed, "answered": ends, "full_replays": full}), flush=True)
    context.destroy(linger=0)


def spawn(*arguments: str) -> subprocess.Popen:
    """A client process of this script, once it says it is connected."""
    command = [sys.executable, __file__, *arguments]
    child = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    return child


def live_during(received: list[tuple[int, float]], first_seq: int, start: float, end: float) -> dict[str, float]:
    """Live batches (seq >= ``first_seq``) that arrived in ``[start, end]``, and the longest wait between two."""
    times = sorted(at for seq, at in received if seq >= first_seq and start <= at <= end)
    gaps = [later - earlier for earlier, later in zip([start, *times], [*times, end], strict=True)]
    return {"received": len(times), "longest_gap_ms": max(gaps) * MS}


class Engine:
    """Calls ``stored`` every step and keeps, per phase, each call's time and the sink's queue length."""

    def __init__(self, sink: EventSink) -> None:
        self.sink = sink
        self.keys = [hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest() for i in range(BLOCKS_PER_STORE)]
        self.tokens = list(range(BLOCKS_PER_STORE * BLOCK_SIZE))

    def run(self, until) -> dict[str, float]:
        calls, queued, longest_gap = [], 0, 0.0
        published = last_count = self.sink.stats()["published"]
        begin = last_change = time.monotonic()
        while True:  # at least one call per phase
            start = time.perf_counter()
            self.sink.stored("gpu", self.keys, None, self.tokens, BLOCK_SIZE)
            calls.append(time.perf_counter() - start)
            stats, now = self.sink.stats(), time.monotonic()
            queued = max(queued, stats["queued"])
            if stats["published"] != last_count:
                longest_gap = max(longest_gap, now - last_change)
                last_count, last_change = stats["published"], now
            if until():
                break
            time.sleep(STEP_S)
        seconds = time.monotonic() - begin
        calls.sort()
        return {
            "seconds": seconds,
            "calls": len(calls),
            "api_max_ms": calls[-1] * MS,
            "api_p99_ms": calls[int(0.99 * (len(calls) - 1))] * MS,
            "api_median_ms": statistics.median(calls) * MS,
            "published": self.sink.stats()["published"] - published,
            "published_per_s": (self.sink.stats()["published"] - published) / seconds,
            "max_queued": queued,
            "longest_publish_gap_ms": max(longest_gap, time.monotonic() - last_change) * MS,
        }


def main() -> None:
    parser = arguments(__doc__.splitlines()[0])
    parser.add_argument("--kept", type=int, default=2000)
    parser.add_argument("--requests", type=int, default=800)
    parser.add_argument("--clients", type=int, default=1, help="DEALER connections the requests are spread over")
    parser.add_argument("--baseline-s", type=float, default=2.0)
    parser.add_argument("--idle-s", type=float, default=5.0)
    parser.add_argument("--live-client", metavar="PUB")
    parser.add_argument("--flood-client", metavar="REPLAY")
    args = parse(parser, **QUICK_ARGUMENTS)
    if args.live_client:
        live_client(args.live_client)
        return
    if args.flood_client:
        flood_client(args.flood_client, args.requests, args.clients, args.idle_s)
        return

    config = EventsConfig(
        enabled=True, endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", replay_batches=args.kept
    )
    sink = EventSink.from_config(config)
    sink.start()
    filler = list(range(FILL_TOKENS))
    for index in range(args.kept):
        sink.stored("gpu", [hashlib.blake2b(index.to_bytes(8, "little"), digest_size=16).digest()], None, filler, 1)
        assert sink.flush()
    publisher = sink._publisher
    live = spawn("--live-client", publisher.endpoint)
    flooder = spawn(
        "--flood-client", publisher.replay_endpoint, "--requests", str(args.requests), "--clients", str(args.clients)
    )
    engine = Engine(sink)
    phases = {}
    deadline = time.monotonic() + args.baseline_s
    phases["baseline"] = engine.run(lambda: time.monotonic() >= deadline)
    first_seq, flood_start = sink.stats()["published"], time.monotonic()
    flooder.stdin.write("go\n")
    flooder.stdin.flush()

    def flood_served() -> bool:
        stats = sink.stats()
        taken = stats["replay_requests"] + stats.get("replay_refused", 0)
        return taken >= args.requests and not stats.get("replays_pending", 0)

    phases["flood"] = engine.run(flood_served)
    flood_end = time.monotonic()
    limit = flood_end + CLEAR_LIMIT_S
    phases["after"] = engine.run(lambda: sink.stats()["queued"] <= 1 or time.monotonic() >= limit)
    clear_s = time.monotonic() - flood_end
    stats = sink.stats()
    flood_seen = json.loads(flooder.communicate()[0])
    received = json.loads(live.communicate("stop\n")[0])
    sink.close()
    seen = live_during(received, first_seq, flood_start, flood_end)

    print(
        f"{args.requests} replay requests from {args.clients} client(s) for {args.kept} kept batches;"
        f" engine stores every {STEP_S * MS:.0f} ms"
    )
    print(
        f"{'phase':<9} {'seconds':>8} {'published/s':>12} {'publish gap ms':>15} {'API max ms':>11} {'p99 ms':>8}"
        f" {'max queued':>11}"
    )
    for name, phase in phases.items():
        print(
            f"{name:<9} {phase['seconds']:8.2f} {phase['published_per_s']:12.1f}"
            f" {phase['longest_publish_gap_ms']:15.1f} {phase['api_max_ms']:11.2f} {phase['api_p99_ms']:8.3f}"
            f" {phase['max_queued']:11d}"
        )
    base, flood = phases["baseline"], phases["flood"]
    print(
        f"flood (until the publisher had taken in and served every request): {flood['seconds']:.2f} s;"
        f" {flood['published']} live batches published ({flood['published_per_s'] / base['published_per_s']:.2f}x"
        f" the baseline rate), {seen['received']} received by the subscriber, longest wait between two"
        f" {seen['longest_gap_ms']:.1f} ms; API max {flood['api_max_ms'] / base['api_max_ms']:.1f}x the baseline's"
    )
    print(
        f"flood client: {flood_seen['answered']} of {args.requests} requests answered"
        f" ({flood_seen['full_replays']} full replays, {flood_seen['replayed']} batches replayed);"
        f" backlog cleared {clear_s:.2f} s after the flood"
    )
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    path = write_result(
        __file__,
        {
            "kept": args.kept,
            "requests": args.requests,
            "clients": args.clients,
            "phases": phases,
            "flood_vs_baseline": {
                "published_per_s": flood["published_per_s"] / base["published_per_s"],
                "api_max": flood["api_max_ms"] / base["api_max_ms"],
            },
            "live_during_flood": seen,
            "flood_client": flood_seen,
            "clear_s": clear_s,
            "sink_stats": stats,
            "load_average_after": list(load),
        },
        args.out,
        args.quick,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
