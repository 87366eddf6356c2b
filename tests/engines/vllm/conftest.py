"""Fixtures the vLLM engine tests share: a kvstrata server process, and vLLM tier instances
against it that are shut down after the test."""

from __future__ import annotations

import pytest

from tests.engines.vllm.harness import Instance


@pytest.fixture
def server(make_process_server):
    return make_process_server()


@pytest.fixture
def instances(server):
    made: list[Instance] = []

    def make(**kwargs) -> Instance:
        inst = Instance(server.port, **kwargs)
        made.append(inst)
        return inst

    yield make
    for inst in made:
        inst.tier.shutdown()
