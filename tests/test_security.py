"""Security: the plugins on a TLS-secured cluster, and what an outsider can reach.

The test makes its own PKI with ``cryptography``: a cluster CA and a certificate it signs (used
by scheduler, worker and client), plus an unrelated "attacker" CA with its own certificate.
Dask's TLS is mutual (``CERT_REQUIRED`` both ways), so:

- the plugins, a workflow on the EMULATED engine and its telemetry work over ``tls://``;
- the RPC handlers the plugins add (scheduler and worker) are reachable only through those
  authenticated comms: plain TCP, TLS without a client certificate and TLS with a certificate
  from another CA are all refused before any handler runs, while the same message with the
  cluster's credentials is answered;
- the plugins open no listener of their own; the HTTP additions (the Agents page, ``/metrics``)
  only read: the page's Bokeh document has exactly two server-side callbacks, both of which
  only choose what this page shows, and HTTP writes are refused;
- no code of ours deserializes data from outside (no pickle/yaml/eval on received bytes).
"""

from __future__ import annotations

import asyncio
import datetime
import re
import ssl
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import dask
import pytest
from distributed import Client, LocalCluster
from distributed.comm import connect
from distributed.security import Security

import dask_agents as da
from dask_agents import emulation
from dask_agents.scheduler_plugin.plugin import NAME
from tests.conftest import wait_for

cryptography = pytest.importorskip("cryptography")

REPO = Path(__file__).resolve().parents[1]
EMU = {"emu": {"model": "emulated-llama", "engine": "emulated", "tokenizer": "byte",
               "emulation": {"time_scale": 0.001}}}
SCALE = 0.001


# -- certificates ---------------------------------------------------------------------------------

def _pki(directory: Path, name: str) -> dict[str, str]:
    """A CA and a certificate+key it signs, as PEM files in ``directory``; returns their paths."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} member")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(__import__("ipaddress").ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    paths = {"ca": directory / f"{name}-ca.pem", "cert": directory / f"{name}-cert.pem",
             "key": directory / f"{name}-key.pem"}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths["key"].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
    for p in paths.values():
        p.chmod(0o600)
    return {k: str(v) for k, v in paths.items()}


def _security(pki: dict[str, str]) -> Security:
    return Security(tls_ca_file=pki["ca"], require_encryption=True,
                    **{f"tls_{role}_{part}": pki[part] for role in ("scheduler", "worker", "client")
                       for part in ("cert", "key")})


# -- the secured cluster --------------------------------------------------------------------------

@da.agent
class Triage:
    """Reads an issue (a tool call), then asks the model (an LLM call): nested calls over TLS."""

    def handle(self, issue: str) -> str:
        found = da.stub(emulation.emulated_tool("file_io", name="sec_file_io", time_scale=SCALE))(issue, seed=1)
        found.value(30)
        answer = da.llm("emu").generate(f"You are a careful engineer. Triage: {issue}", max_tokens=6)
        return answer.value(30).text


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, dict[str, str]]:
    d = tmp_path_factory.mktemp("pki")
    return {"cluster": _pki(d, "cluster"), "attacker": _pki(d, "attacker")}


@pytest.fixture(scope="module")
def secured(pki):
    """A TLS-only LocalCluster (one in-process worker, dashboard on) with dask-agents installed."""
    sec = _security(pki["cluster"])
    with dask.config.set({"agents.llm.models": EMU, "agents.emulation.time-scale": SCALE}):
        with LocalCluster(n_workers=1, processes=False, threads_per_worker=8, protocol="tls://", host="127.0.0.1",
                          security=sec, dashboard_address="127.0.0.1:0") as cluster:
            with Client(cluster, security=sec) as client:
                da.install(client, models=["emu"])
                yield cluster, client, sec


def _plugin(cluster: LocalCluster) -> Any:
    return cluster.scheduler.plugins[NAME]


def _worker(cluster: LocalCluster) -> Any:
    (w,) = cluster.workers.values()
    return w


def test_a_workflow_runs_and_is_recorded_on_a_tls_cluster(secured):
    """Scheduler, worker and client talk TLS only; the plugins route the agent, its tool and
    its LLM call; the session graph and the telemetry (worker-reported timings, tokens) arrive
    over the same encrypted comms."""
    cluster, client, _ = secured
    assert cluster.scheduler.address.startswith("tls://")
    assert _worker(cluster).address.startswith("tls://")
    wait_for(lambda: _worker(cluster).address in _plugin(cluster).ready_workers, timeout=30)
    with da.session(client, name="tls-req") as s:
        outs = [da.stub(Triage).handle(f"issue {i}") for i in range(3)]
        texts = [o.value(60) for o in outs]
    assert all(isinstance(t, str) for t in texts)

    def settled():
        df = da.telemetry(client, s.id)
        llm = df[df["kind"] == "llm"]
        done = len(df) == 9 and (df["state"] == "finished").all() and df["started"].notna().all()
        return (df,) if done and llm["output_tokens"].notna().all() else None

    (df,) = wait_for(settled, timeout=30)
    assert sorted(df["component"].value_counts().items()) == [("Triage", 3), ("llm.emu", 3), ("sec_file_io", 3)]
    llm = df[df["kind"] == "llm"]
    assert (llm["output_tokens"] == 6).all() and llm["emulated"].eq(True).all()
    assert (df["finished"] >= df["started"]).all()
    def completed():
        g = da.session_graph(client, s.id)
        return g if g.state == "completed" else None

    g = wait_for(completed, timeout=30)
    assert len(g.nodes) == 9 and {e.kind for e in g.edges} == {"created"}  # the agent created its tool and LLM calls


# -- unauthenticated peers --------------------------------------------------------------------------

async def _ask(address: str, msg: dict, **connection_args: Any) -> Any:
    """Send one RPC message over a fresh comm and return the reply."""
    comm = await connect(address, timeout=5, **connection_args)
    try:
        await comm.write({**msg, "reply": True})
        return await asyncio.wait_for(comm.read(), 5)
    finally:
        comm.abort()


def _refused(address: str, msg: dict, **connection_args: Any) -> bool:
    """True if the peer gets no reply (the connection fails or is closed before any handler runs)."""
    try:
        asyncio.run(_ask(address, msg, **connection_args))
    except (OSError, TimeoutError, ssl.SSLError, ValueError, TypeError):
        return True  # CommClosedError is an OSError; TLS without an ssl_context is a TypeError
    return False


def _tls_context(ca: str, cert: str | None = None, key: str | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
    ctx.check_hostname = False
    if cert is not None:
        ctx.load_cert_chain(cert, key)
    return ctx


def test_no_endpoint_of_ours_accepts_unauthenticated_commands(secured, pki):
    """Commands with side effects (stop the control loop, register a worker, end a session on
    a worker) never reach our handlers without the cluster's credentials, whether the peer
    speaks plain TCP, TLS without a certificate or TLS with another CA's certificate; with the
    credentials the same handlers answer (so the refusals are not a broken endpoint)."""
    cluster, _, sec = secured
    plugin = _plugin(cluster)
    sched, worker = cluster.scheduler.address, _worker(cluster).address
    host_port = sched.split("://", 1)[1]
    whost_port = worker.split("://", 1)[1]
    ours, theirs = pki["cluster"], pki["attacker"]
    assert plugin.control.running
    hello_before = dict(plugin.ready_workers)
    attempts = {
        "plain tcp": {"addr": f"tcp://{host_port}", "waddr": f"tcp://{whost_port}", "args": {}},
        "tls, no client certificate": {"addr": sched, "waddr": worker,
                                       "args": {"ssl_context": _tls_context(ours["ca"])}},
        "tls, another CA's certificate": {"addr": sched, "waddr": worker, "args": {
            "ssl_context": _tls_context(ours["ca"], theirs["cert"], theirs["key"])}},
        "tls, no ssl context": {"addr": sched, "waddr": worker, "args": {}},
    }
    stop = {"op": "agents_control", "action": "stop"}
    hello = {"op": "agents_worker_hello", "worker": "tls://10.0.0.66:1", "models": ["emu"]}
    end = {"op": "agents_end_session", "session": "tls-req"}
    for what, a in attempts.items():
        assert _refused(a["addr"], stop, **a["args"]), f"{what}: the scheduler answered"
        assert _refused(a["addr"], hello, **a["args"]), f"{what}: the scheduler answered"
        assert _refused(a["waddr"], {"op": "agents_worker_info"}, **a["args"]), f"{what}: the worker answered"
        assert _refused(a["waddr"], end, **a["args"]), f"{what}: the worker answered"
    assert plugin.control.running, "an unauthenticated peer stopped the control loop"
    assert plugin.ready_workers.keys() == hello_before.keys(), "an unauthenticated peer registered a worker"
    # a Client without the credentials cannot even connect
    with pytest.raises(TypeError, match="TLS expects a `ssl_context`"):
        Client(sched, timeout="3s")
    # ... and with them, the same handlers answer
    good = sec.get_connection_args("client")
    assert asyncio.run(_ask(sched, {"op": "agents_ping"}, **good))["ok"] is True
    assert asyncio.run(_ask(sched, {"op": "agents_control", "action": "stats"}, **good))["running"] is True
    info = asyncio.run(_ask(worker, {"op": "agents_worker_info"}, **good))
    assert list(info["models"]) == ["emu"]


def test_a_second_client_with_the_credentials_cannot_end_anothers_session(secured):
    """TLS authenticates every holder of the cluster's certificates alike: a second driver with
    them connects, and still cannot end or cancel another driver's session (as itself or
    naming the owner's client id), stop the control loop, or call a worker's handlers that
    change shared state (tests/test_ownership.py: the same on plain TCP)."""
    cluster, client, sec = secured
    plugin, worker = _plugin(cluster), _worker(cluster)
    refused_before = plugin.sessions.refused
    with da.session(client, name="owned-tls") as s:
        assert isinstance(da.stub(Triage).handle("first").value(60), str)
        with Client(cluster.scheduler.address, security=sec) as other:
            end = {"op": "agents-session-end", "session": s.id, "cancel": True}
            other._send_to_scheduler(dict(end))
            other._send_to_scheduler({**end, "client": client.id})
            wait_for(lambda: plugin.sessions.refused == refused_before + 2, timeout=30)
            with pytest.raises(da.NotAllowedError):
                da.control(other).stop()

            async def end_on_worker() -> Any:
                return await other.rpc(worker.address).agents_end_session(sessions=[s.id])

            with pytest.raises(PermissionError, match="only the scheduler"):
                other.sync(end_on_worker)
        assert plugin.state.sessions[s.id].state == "active" and plugin.control.running
        assert isinstance(da.stub(Triage).handle("second").value(60), str)
    wait_for(lambda: plugin.state.sessions[s.id].state == "completed", timeout=30)
    assert plugin.state.sessions[s.id].closed_reason is None


def test_our_handlers_live_only_on_the_schedulers_and_workers_tls_comms(secured):
    """The plugins register handlers on Dask's own servers (no listener of their own): every
    listening comm of the cluster is TLS, and our ops are among its handlers."""
    cluster, _, _ = secured
    s, w = cluster.scheduler, _worker(cluster)
    ours_s = {op for op in s.handlers if op.startswith("agents_")}
    ours_w = {op for op in w.handlers if op.startswith("agents_")}
    assert {"agents_control", "agents_worker_hello", "agents_telemetry", "agents_ping"} <= ours_s
    assert {"agents_kv", "agents_swap_model", "agents_end_session", "agents_worker_info", "agents_direct",
            "agents_direct_forget"} <= ours_w
    assert {op for op in s.stream_handlers if op.startswith("agents")} == {"agents-report", "agents-session-end",
                                                                          "agents-session-open", "agents-reattach",
                                                                          "agents-route"}
    for server in (s, w):
        assert server.listeners and all(lst.contact_address.startswith("tls://") for lst in server.listeners)


# -- the dashboard page is read-only ------------------------------------------------------------

def _http(url: str, method: str = "GET", data: bytes | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, method=method, data=data)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _snapshot(plugin: Any) -> tuple:
    st = plugin.state
    ctl = plugin.control
    return (len(st.sessions), len(st.calls), ctl.running, dict(ctl.enforcer.applied), dict(ctl.enforcer.rejected),
            dict(ctl.enforcer.routes),
            sorted(plugin.ready_workers), plugin.pending_add, list(plugin.pending_remove))


def test_http_writes_to_our_pages_are_refused(secured):
    """GET serves the Agents page and the metrics; POST, PUT and DELETE change nothing."""
    cluster, _, _ = secured
    plugin = _plugin(cluster)
    base = f"http://127.0.0.1:{cluster.scheduler.http_server.port}"
    status, body = _http(f"{base}/agents")
    assert status == 200 and b"bokeh" in body.lower()
    status, body = _http(f"{base}/metrics")
    assert status == 200 and b"dask_agents_" in body
    before = _snapshot(plugin)
    for path in ("/agents", "/agents?session=x", "/metrics", "/agents/ws"):
        for method in ("POST", "PUT", "DELETE", "PATCH"):
            status, _ = _http(f"{base}{path}", method, b'{"op": "agents_control", "action": "stop"}')
            assert status in (400, 403, 404, 405), (method, path, status)
    assert _snapshot(plugin) == before


def _page_callbacks(dask_scheduler: Any, hostile: list[str]) -> dict:
    """On the scheduler: open one Agents page, list the server-side callbacks of its Bokeh
    document, fire each with hostile values, and compare the plugin's state before and after."""
    from dask_agents.scheduler_plugin.dashboard import AgentsPage

    plugin = dask_scheduler.plugins[NAME]
    page = AgentsPage(plugin.dashboard)
    page.update()
    callbacks = []
    for model in page.root.references():
        for attr, cbs in model._callbacks.items():
            callbacks += [(type(model).__name__, attr, getattr(cb, "__name__", repr(cb))) for cb in cbs]
        for event, cbs in getattr(model, "_event_callbacks", {}).items():
            callbacks += [(type(model).__name__, event, getattr(cb, "__name__", repr(cb))) for cb in cbs]
    before = _snapshot(plugin)
    for value in hostile:
        page.select.value = value  # what a browser's websocket PATCH-DOC would do
        page.sessions_src.selected.indices = [0]
        page.sessions_src.selected.indices = [10**9]
        page.update()
    return {"callbacks": sorted(callbacks), "unchanged": _snapshot(plugin) == before}


HOSTILE = ["", "nope", "x" * 10_000, "'; DROP TABLE sessions; --", "\x00", "../../etc/passwd",
           "<img src=x onerror=alert(1)>"]


def test_the_agents_page_has_no_callbacks_that_change_state(secured):
    """The only Python callbacks of the page choose which session *this page* draws; fired
    with hostile values they leave the scheduler's state, the control loop and the cluster
    untouched."""
    _, client, _ = secured
    out = client.run_on_scheduler(_page_callbacks, hostile=HOSTILE)
    assert out["callbacks"] == [("Select", "value", "_on_select"), ("Selection", "indices", "_on_select_row")]
    assert out["unchanged"]


def _graph_title(dask_scheduler: Any, sid: str) -> str:
    from dask_agents.scheduler_plugin.dashboard import AgentsPage

    page = AgentsPage(dask_scheduler.plugins[NAME].dashboard, sid)
    page.update()
    return page.graph_title.text


def test_a_session_id_from_the_url_is_escaped_in_the_page(secured):
    """``/agents?session=<markup>`` must show the text, not inject the markup."""
    _, client, _ = secured
    text = client.run_on_scheduler(_graph_title, sid="<img src=x onerror=alert(1)>")
    assert "<img" not in text and "&lt;img" in text


# -- nothing deserializes outside data ------------------------------------------------------------

UNSAFE = re.compile(r"\b(?:c?pickle|cloudpickle|dill|marshal|shelve|jsonpickle)\.(?:loads?|Unpickler|open)\b"
                    r"|\byaml\.(?:unsafe_load|full_load|load)\s*\(|\b(?:eval|exec)\s*\(|\bpandas\.read_pickle\b"
                    r"|\bpd\.read_pickle\b|\bnp\.load\s*\(.*allow_pickle\s*=\s*True")


def test_no_code_of_ours_deserializes_outside_data():
    """Our packages never unpickle, ``yaml.load``, ``eval`` or ``exec`` anything: data from
    outside the cluster's authenticated comms is parsed as JSON/CSV/YAML-safe only. (Dask's own
    comms deserialize, inside TLS, what authenticated peers send.) The disk tier's
    ``torch.load`` reads only files the engine wrote itself, with torch's weights-only
    unpickler (the default since torch 2.6), never ``weights_only=False``."""
    found = []
    for pkg in ("dask_agents", "scheduler_plugin", "worker_plugin", "kv", "examples"):
        for path in sorted((REPO / pkg).rglob("*.py")):
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                code = line.split("#", 1)[0]
                if UNSAFE.search(code):
                    found.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
                if "torch.load(" in code and "weights_only=False" in code:
                    found.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert found == []
    import torch

    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    assert (major, minor) >= (2, 6), "torch.load must default to weights_only=True"
