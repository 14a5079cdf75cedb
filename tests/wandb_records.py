"""Read what an offline W&B run wrote (``run-<id>.wandb``), to test what ampddp logged to it.

The file is W&B's record log: a 7-byte header, then 32 KiB blocks of records (4-byte checksum,
2-byte length, 1-byte type: full, first, middle, last), each a ``wandb.proto`` ``Record``.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _payloads(data: bytes) -> list[bytes]:
    payloads, pending, offset = [], b"", HEADER
    while offset + HEADER <= len(data):
        room = BLOCK - offset % BLOCK
        if room < HEADER:
            offset += room
            continue
        length, kind = struct.unpack("<HB", data[offset + 4 : offset + 7])
        chunk = data[offset + 7 : offset + 7 + length]
        offset += 7 + length
        if kind == FULL:
            payloads.append(chunk)
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            payloads.append(pending + chunk)
        else:
            break
    return payloads


def wandb_history(run_file: Path) -> list[dict[str, Any]]:
    """Every ``run.log`` row of one offline run file, values decoded from JSON."""
    from wandb.proto import wandb_internal_pb2

    rows = []
    for payload in _payloads(Path(run_file).read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item})
    return rows
