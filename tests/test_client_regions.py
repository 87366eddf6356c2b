"""Region identity on the client side (issue 10): a handle is resolved only through the mapping
of its own server instance; regions of a gone instance are unmapped, views into them stay
valid until freed."""

from __future__ import annotations

from multiprocessing import resource_tracker, shared_memory

import numpy as np
import pytest

from kvstrata.clients import handles
from kvstrata.clients.regions import regions_stale, update_regions
from kvstrata.clients.results import Handle, RegionInfo, parse_handle, parse_region


@pytest.fixture
def segment() -> shared_memory.SharedMemory:
    shm = shared_memory.SharedMemory(create=True, size=1 << 16)
    resource_tracker.unregister(f"/{shm.name}", "shared_memory")
    assert shm.buf is not None
    shm.buf[:4] = b"old!"
    yield shm
    shm.close()
    shm.unlink()


def test_wire_shapes_with_and_without_an_instance() -> None:
    assert parse_handle([b"dram0", 4096, 10, b"ab12"]) == Handle("dram0", 4096, 10, "ab12")
    assert parse_handle([b"dram0", 4096, 10]) == Handle("dram0", 4096, 10, "")
    region = parse_region({b"name": b"dram0", b"kind": b"shm", b"size": 8, b"path": b"p",
                           b"device": -1, b"instance": b"ab12"})  # fmt: skip
    assert region.instance == "ab12"
    assert parse_region([b"name", b"g", b"kind", b"cuda", b"size", 8]).instance == ""


def test_a_handle_of_another_instance_is_refused(segment: shared_memory.SharedMemory) -> None:
    old = RegionInfo("dram0", "shm", segment.size, segment.name, -1, instance="1111")
    assert handles.handle_view(old, Handle("dram0", 0, 4, "1111")).tobytes() == b"old!"
    with pytest.raises(handles.RegionMapError, match="server instance"):
        handles.handle_view(old, Handle("dram0", 0, 4, "2222"))
    handles.unmap_regions([old])


def test_refresh_unmaps_the_gone_instance_and_keeps_live_views(
    segment: shared_memory.SharedMemory,
) -> None:
    """The same shared-memory name now belongs to instance 2222 (a PID-named arena after a
    restart): the client's table switches, the 1111 mapping is dropped (an array made from it
    still reads), and a handle of 1111 is refused rather than read through 2222's mapping."""
    old = RegionInfo("dram0", "shm", segment.size, segment.name, -1, instance="1111")
    arr = handles.handle_array(old, Handle("dram0", 0, 4, "1111"))
    table = {"dram0": old}
    new = RegionInfo("dram0", "shm", segment.size, segment.name, -1, instance="2222")
    assert regions_stale(table, [Handle("dram0", 0, 4, "2222")])
    assert not regions_stale(table, [Handle("dram0", 0, 4, "1111")])
    table = update_regions(table, [new], [Handle("dram0", 0, 4, "2222")])
    assert table == {"dram0": new}
    assert ("1111", segment.name) not in handles._shm
    assert bytes(arr) == b"old!"  # the mapping lives as long as the array
    with pytest.raises(handles.RegionMapError, match="instance"):
        update_regions(table, [new], [Handle("dram0", 0, 4, "1111")])
    with pytest.raises(handles.RegionMapError, match="unknown region"):
        update_regions(table, [new], [Handle("gpu0", 0, 4, "2222")])
    del arr
    assert np.frombuffer(handles.map_shm(new), np.uint8, 4).tobytes() == b"old!"
    handles.unmap_regions([new])
