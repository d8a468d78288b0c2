"""Per-request records: what the locustfile measured for each request, one JSON object per line.

All times are seconds on the load generator's monotonic clock, counted from the start of dispatch.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import IO, Any

RECORDS_FILE = "records.jsonl"
META_FILE = "meta.json"


@dataclass(frozen=True)
class RequestRecord:
    """One request as the client saw it."""

    index: int
    target: str  # the host it was sent to
    scheduled_s: float | None  # None in closed-loop mode
    sent_s: float
    end_s: float
    ok: bool
    status: int = 0  # HTTP status, 0 when no response came
    error: str | None = None
    replica: str | None = None  # the gateway's x-gateway-replica header
    ttft_s: float | None = None
    itl_s: tuple[float, ...] = ()  # gaps between successive token chunks
    output_tokens: int = 0
    prompt_tokens: int | None = None  # the server's count, when it gave usage
    requested_prompt_tokens: int = 0
    max_tokens: int = 0
    conversation: int | None = None  # multi-turn: the conversation, and the turn in it (0-based)
    turn: int | None = None

    @property
    def lag_s(self) -> float | None:
        """How late the request went out compared with its scheduled time."""
        return None if self.scheduled_s is None else self.sent_s - self.scheduled_s

    @property
    def e2e_s(self) -> float:
        return self.end_s - self.sent_s

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first, as `vllm bench serve` defines it."""
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def token_times_s(self) -> list[float]:
        """When each token chunk arrived."""
        if self.ttft_s is None:
            return []
        times = [self.sent_s + self.ttft_s]
        for gap in self.itl_s:
            times.append(times[-1] + gap)
        return times

    def to_json(self) -> str:
        data = asdict(self)
        for key, value in data.items():
            if isinstance(value, float):
                data[key] = round(value, 6)
        data["itl_s"] = [round(g, 6) for g in self.itl_s]
        return json.dumps(data, separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RequestRecord:
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        values["itl_s"] = tuple(values.get("itl_s") or ())
        return cls(**values)


def write_records(stream: IO[str], records: Iterable[RequestRecord]) -> None:
    for record in records:
        stream.write(record.to_json() + "\n")


def read_records(path: Path) -> list[RequestRecord]:
    """Records from a JSONL file; a torn last line (a killed writer) is skipped."""
    return list(_parse_lines(path.read_text(encoding="utf-8").splitlines()))


def _parse_lines(lines: list[str]) -> Iterator[RequestRecord]:
    for n, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            yield RequestRecord.from_dict(json.loads(line))
        except json.JSONDecodeError:
            if n != len(lines) - 1:
                raise
