"""A KV-aware router's view of one engine, rebuilt from its KV events in a process of its own.

Run as ``python -m support.router_subscriber PUB_ENDPOINT REPLAY_ENDPOINT TOPIC``. It
decodes with vLLM's message structs (array form, as vLLM's example
subscriber declares them), subscribes, fills every gap in the sequence numbers from the
replay socket (a DEALER: one request streams every kept batch from there), and
keeps, per medium, the set of block hashes the engine said it holds. On stdin,
``view N`` waits until it has applied every batch up to sequence N and answers
one JSON line on stdout: ``{medium: [hashes...]}``. ``quit`` ends it.

It reads only what is on the wire, with the message structs ``vllm_kv_events``
declares the way vLLM does (not tiercache's own).
"""

from __future__ import annotations

import json
import select
import sys

import msgspec
import zmq

from support.vllm_kv_events import BlockRemoved, BlockStored, KVEventBatch

WAIT_MS = 50
"""Poll step while waiting for batches (the caller bounds the whole wait)."""


class Router:
    """The residency view: medium -> block hashes, applied in sequence order."""

    def __init__(self, pub: str, replay: str, topic: str) -> None:
        self.context = zmq.Context()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.connect(pub)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.dealer = self.context.socket(zmq.DEALER)
        self.dealer.connect(replay)
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.next_seq = 0
        self.early: dict[int, bytes] = {}
        self.view: dict[str, set[int]] = {}

    def apply(self, payload: bytes) -> None:
        for event in self.decoder.decode(payload).events:
            if isinstance(event, BlockStored):
                self.view.setdefault(event.medium, set()).update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self.view.setdefault(event.medium, set()).difference_update(event.block_hashes)
            else:
                self.view.clear()
        self.next_seq += 1

    def take(self, seq: int, payload: bytes) -> None:
        """A batch from either socket: applied in order, kept if early, ignored if seen."""
        if seq < self.next_seq:
            return
        self.early[seq] = payload
        while self.next_seq in self.early:
            self.apply(self.early.pop(self.next_seq))

    def replay(self) -> None:
        """Ask for every kept batch from the first one not applied yet, and take the stream."""
        self.dealer.send_multipart((b"", self.next_seq.to_bytes(8, "big")))
        while True:
            if not self.dealer.poll(10_000):
                raise RuntimeError("the replay stream stopped before its end marker")
            _, seq_bytes, payload = self.dealer.recv_multipart()
            if not payload:
                return
            self.take(int.from_bytes(seq_bytes, "big"), payload)

    def pump(self) -> None:
        while self.sub.poll(0):
            _, seq_bytes, payload = self.sub.recv_multipart()
            self.take(int.from_bytes(seq_bytes, "big"), payload)

    def view_through(self, last: int) -> dict[str, list[int]]:
        while self.next_seq <= last:
            self.pump()
            if self.next_seq <= last:
                self.replay()
            if self.next_seq <= last:
                self.sub.poll(WAIT_MS)
        return {medium: sorted(hashes) for medium, hashes in self.view.items()}


def main() -> None:
    router = Router(*sys.argv[1:4])
    print("ready", flush=True)
    while True:
        readable, _, _ = select.select([sys.stdin], [], [], WAIT_MS / 1000)
        router.pump()
        if not readable:
            continue
        command = sys.stdin.readline().split()
        if not command or command[0] == "quit":
            return
        print(json.dumps(router.view_through(int(command[1]))), flush=True)


if __name__ == "__main__":
    main()
