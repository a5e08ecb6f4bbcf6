"""The tables ``lightning-megatron check`` prints, read back for the tests that run it."""

from __future__ import annotations

PARTS = ("tp", "cp", "ep", "pp", "dp")


def traffic_rows(out: str) -> dict[tuple[str, int], dict[str, tuple[float, float]]]:
    """``check --estimate-memory --estimate-time``'s table of what a rank sends: (layout, stage) -> part ->
    (predicted, counted) MiB."""
    table = out.split("MiB a rank sends in a step")[1]
    rows = {}
    for line in table.splitlines()[2:]:
        cells = line.split()
        if len(cells) != 3 + len(PARTS) or "/" not in cells[2]:
            break
        rows[(cells[0], int(cells[1]))] = {part: tuple(float(x) for x in cell.split("/"))
                                           for part, cell in zip(PARTS, cells[2:])}
    return rows


def assert_traffic(out: str, rows: list[tuple[str, int]], rel: float = 0.005, **looser: float) -> None:
    """Every part of every one of ``rows`` predicted within ``rel`` of what was counted (``looser``: a part's own
    bound), or within 0.01 MiB (the router's statistics, a handful of floats a layer)."""
    found = traffic_rows(out)
    assert list(found) == rows, out
    for row, parts in found.items():
        for part, (predicted, counted) in parts.items():
            bound = looser.get(part, rel) * max(predicted, counted) + 0.01
            assert abs(predicted - counted) <= bound, (row, part, predicted, counted, out)
