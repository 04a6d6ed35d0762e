"""A benchmark's result rows: each printed as it comes (the device call's log shows progress)
and appended to a JSON-lines file, so the rows measured before a run is cut off survive."""
from __future__ import annotations

import json


def emit_row(path: str, row: dict, shown: dict | None = None) -> None:
    """Prints `shown` (the row itself where None) and appends the whole row to `path`."""
    print(json.dumps(row if shown is None else shown), flush=True)
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
