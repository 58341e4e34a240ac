"""kv/runtime/connector.py's connector with every load corrupted (tests/test_kv_connector.py
loads it out of tree, as vLLM loads ours): the engine core runs in a spawned process, so a patch
in the test process would not reach it."""

from __future__ import annotations

from typing import Any

import torch

from dask_agents.kv.runtime import connector


class SessionKVConnector(connector.SessionKVConnector):
    """Writes random KV instead of the stored copy."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        write = connector.HostStore.write.__get__(self.store)

        def scrambled(block_id: int, data: list) -> None:
            gen = torch.Generator().manual_seed(block_id)
            write(block_id, [(torch.randn(x.shape, generator=gen) * 50).to(x.dtype) for x in data])

        self.store.write = scrambled
