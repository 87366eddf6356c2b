"""The client's table of a server's regions (``KV.REGIONS``), kept in step with the handles it
receives: a handle naming a region or an instance the table lacks means the server restarted,
so the table is read again and the regions of the instance that is gone are unmapped."""

from __future__ import annotations

from collections.abc import Iterable

from kvstrata.clients.handles import RegionMapError, unmap_regions
from kvstrata.clients.results import Handle, RegionInfo

__all__ = ["regions_stale", "update_regions"]


def regions_stale(regions: dict[str, RegionInfo], handles: Iterable[Handle]) -> bool:
    """True when a handle names a region, or an instance of it, that ``regions`` lacks."""
    for h in handles:
        region = regions.get(h.region)
        if region is None or region.instance != h.instance:
            return True
    return False


def update_regions(
    old: dict[str, RegionInfo], new: list[RegionInfo], handles: Iterable[Handle] = ()
) -> dict[str, RegionInfo]:
    """The region table from a fresh ``KV.REGIONS`` reply. Regions of ``old`` that the server
    no longer lists (its instance is gone: restarted) are unmapped. Raises RegionMapError when
    ``handles`` still name regions the reply lacks."""
    table = {r.name: r for r in new}
    current = set(table.values())
    unmap_regions(r for r in old.values() if r not in current)
    for h in handles:
        region = table.get(h.region)
        if region is None:
            raise RegionMapError(f"unknown region {h.region!r} (not in KV.REGIONS)")
        if region.instance != h.instance:
            raise RegionMapError(
                f"handle of region {h.region!r} is of server instance {h.instance!r}, "
                f"KV.REGIONS lists instance {region.instance!r}"
            )
    return table
