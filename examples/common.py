"""Helpers the example runners share: emulated model entries, telemetry, per-request columns."""

from __future__ import annotations

import time


def emulated_models(time_scale: float, names: tuple[str, ...] = ("chat", "coder")) -> dict:
    """``agents.llm.models`` entries for EMULATED engines named ``names`` (byte tokenizer)."""
    entry = {"model": "emulated-llama-8b", "engine": "emulated", "tokenizer": "byte",
             "max-model-len": 16384, "kv-cache-memory-bytes": "16 GiB",
             "emulation": {"time_scale": time_scale}}
    return {name: dict(entry) for name in names}


def agents_page(client) -> str:
    """The address of the Agents page (Dask's dashboard address, ``/agents`` for ``/status``)."""
    link = client.dashboard_link
    return link[: -len("/status")] + "/agents" if link.endswith("/status") else link.rstrip("/") + "/agents"


def wait_for_telemetry(client, timeout: float = 10.0):
    """Telemetry once every call's exact start time has arrived (workers report in batches)."""
    import dask_agents as da

    deadline = time.time() + timeout
    df = da.telemetry(client)
    while df["started"].notna().sum() < len(df) and time.time() < deadline:
        time.sleep(0.1)  # polling for the workers' next report batch
        df = da.telemetry(client)
    return df


def call_columns(calls) -> dict:
    """Per-request columns from its telemetry rows: calls, LLM/tool calls, tokens, workers."""
    llm = calls[calls["kind"] == "llm"]
    return {
        "calls": len(calls), "llm_calls": len(llm), "tool_calls": int((calls["kind"] == "tool").sum()),
        "prompt_tokens": int(llm["prompt_tokens"].fillna(0).sum()),
        "cached_tokens": int(llm["cached_tokens"].fillna(0).sum()),
        "output_tokens": int(llm["output_tokens"].fillna(0).sum()),
        "workers": calls["worker"].nunique(),
    }
