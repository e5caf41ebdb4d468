"""The two text formats a vLLM OpenAI server answers in beyond JSON: Prometheus' exposition (``/metrics``) and
server-sent events (a streamed completion). Only the stdlib.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ServerMetrics:
    """A ``/metrics`` scrape: every sample as ``(name, labels) -> value``."""

    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float]

    def total(self, name: str, **labels: str) -> float:
        """The sum of ``name`` over the samples whose labels include ``labels`` (0.0 when there are none)."""
        want = set(labels.items())
        return sum(value for (key, have), value in self.samples.items() if key == name and want <= set(have))

    def since(self, earlier: ServerMetrics, name: str, **labels: str) -> float:
        """How much ``name`` (over the samples whose labels include ``labels``) grew since ``earlier``."""
        return self.total(name, **labels) - earlier.total(name, **labels)

    def names(self) -> set[str]:
        return {name for name, _ in self.samples}


def parse_prometheus(text: str) -> ServerMetrics:
    """Parse Prometheus' text exposition format (comments skipped; label values unescaped)."""
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        labels: list[tuple[str, str]] = []
        if "{" in line:
            name, rest = line.split("{", 1)
            rest = _parse_labels(rest, labels)
        else:
            name, _, rest = line.partition(" ")
        value = rest.split()[0]
        samples[(name.strip(), tuple(labels))] = float(value)
    return ServerMetrics(samples)


def _parse_labels(text: str, out: list[tuple[str, str]]) -> str:
    """Read ``k="v",...}`` from ``text`` into ``out``; return what follows the closing brace."""
    i = 0
    while True:
        while text[i] in " ,":
            i += 1
        if text[i] == "}":
            return text[i + 1 :]
        eq = text.index("=", i)
        key = text[i:eq].strip()
        i = eq + 2  # past '="'
        value = []
        while text[i] != '"':
            if text[i] == "\\":
                i += 1
                value.append({"n": "\n"}.get(text[i], text[i]))
            else:
                value.append(text[i])
            i += 1
        out.append((key, "".join(value)))
        i += 1


def sse_events(response: http.client.HTTPResponse) -> Iterator[dict[str, Any]]:
    """The JSON payloads of a server-sent-event stream, up to ``data: [DONE]``."""
    while True:
        line = response.readline()
        if not line:
            return
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            return
        yield json.loads(payload)
