"""KV events: what a store or an eviction pays on the engine's thread, and how fast batches go out.

The engine-facing calls of tiercache.telemetry.events.sink.EventSink (``stored`` for one
request's 64 blocks, ``removed`` for one block) are timed on this thread while
the background thread drains, encodes and publishes to a ZeroMQ PUB socket on
loopback with a SUB connected. The ceiling measured in the same run is a bare
``deque.append`` of the same tuple (the least any queued hand-off can cost).
Then the background side: events encoded and published per second. Each figure
is the median of ``--repeat`` rounds. Prints a table and writes events.json next
to this script.

    python benchmarks/events.py [--calls 20000] [--repeat 3] [--quick] [--out PATH]
"""

from __future__ import annotations

import hashlib
import os
import statistics
import time
from collections import deque

import zmq
from common import arguments, parse, write_result

from tiercache.telemetry.events.config import EventsConfig
from tiercache.telemetry.events.sink import EventSink

BLOCKS_PER_STORE = 64
"""One 1024-token prompt of 16-token blocks."""
BLOCK_SIZE = 16
MICRO = 1e6
QUICK_ARGUMENTS = {"calls": 640, "repeat": 1}
"""The defaults ``--quick`` gives the options."""


def main() -> None:
    parser = arguments(__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parse(parser, **QUICK_ARGUMENTS)

    keys = [hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest() for i in range(BLOCKS_PER_STORE)]
    tokens = list(range(BLOCKS_PER_STORE * BLOCK_SIZE))
    config = EventsConfig(enabled=True, endpoint="tcp://127.0.0.1:*", max_queue=10 * args.calls)
    sink = EventSink.from_config(config)
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.connect(sink._publisher.endpoint)
    sub.setsockopt_string(zmq.SUBSCRIBE, "")
    sink.start()

    samples: dict[str, list[float]] = {"deque_append": [], "stored_64_blocks": [], "removed_1_block": []}
    throughput: list[float] = []
    for _ in range(args.repeat):
        ceiling: deque[tuple[object, ...]] = deque()
        start = time.perf_counter()
        for _ in range(args.calls):
            ceiling.append(("gpu", keys, None, tokens, BLOCK_SIZE, None))
        samples["deque_append"].append((time.perf_counter() - start) / args.calls * MICRO)

        events_before = sink.events
        begin = time.perf_counter()
        start = begin
        for _ in range(args.calls):
            sink.stored("gpu", keys, None, tokens, BLOCK_SIZE)
        samples["stored_64_blocks"].append((time.perf_counter() - start) / args.calls * MICRO)
        start = time.perf_counter()
        for key in keys * (args.calls // len(keys)):
            sink.removed("gpu", (key,))
        removals = len(keys) * (args.calls // len(keys))
        samples["removed_1_block"].append((time.perf_counter() - start) / removals * MICRO)
        assert sink.flush(timeout=60.0)
        throughput.append((sink.events - events_before) / (time.perf_counter() - begin))
        while sub.poll(0):
            sub.recv_multipart()
    sink.close()
    context.destroy(linger=0)

    medians = {name: statistics.median(values) for name, values in samples.items()}
    ceiling_us = medians["deque_append"]
    print(f"engine-thread cost per call (median of {args.repeat}, {args.calls:,} calls each)")
    for name, us in medians.items():
        print(f"  {name:<20} {us:8.3f} us   {us / ceiling_us:5.1f}x a bare deque.append")
    events_per_s = statistics.median(throughput)
    print(f"background: {events_per_s:,.0f} events/s queued, encoded and published (a stored event = 64 blocks)")
    stats = sink.stats()
    print(f"dropped {stats['dropped']}, batches {stats['batches']}, published {stats['published']}")
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    path = write_result(
        __file__,
        {
            "us_per_call": medians,
            "ratio_to_deque_append": {name: us / ceiling_us for name, us in medians.items()},
            "events_per_s_published": events_per_s,
            "sink_stats": stats,
            "calls": args.calls,
            "repeat": args.repeat,
            "load_average_after": list(load),
        },
        args.out,
        args.quick,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
