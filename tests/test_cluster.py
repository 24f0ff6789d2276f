"""The engine on a real three-master Redis Cluster (redis-py ``RedisCluster``).

Pins the design's claim that every key of a namespace shares the ``{ns}``
hash tag, so every script is single-slot and runs unchanged on a cluster:
acquire/release between managers seeded from different nodes, the hand-off
to a blocked waiter (BLPOP routed by its key), the heartbeat on its cloned
cluster client, owner cleanup and the lost-owner watch, the inspector, the
worker node's scripts, NOSCRIPT after SCRIPT FLUSH, and the eviction check
that asks every primary.

The module fixture starts three ``redis-server --cluster-enabled yes``
processes (no persistence), assigns the 16384 slots with CLUSTER
ADDSLOTS, joins them with CLUSTER MEET and waits for
``cluster_state:ok``. It skips only when the binary cannot run in cluster
mode.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import redis
from celery import Celery
from celery.bin.base import CLIContext
from click.testing import CliRunner, Result
from redis.cluster import RedisCluster

import acl_helpers
import test_acl as acl_test
from celery_redislock import LockManager, RedisLock, ShuttingDown
from celery_redislock.engine.lease import Lease
from celery_redislock.exceptions import ConfigurationError, LockTimeout, RedisUnavailable
from celery_redislock.integration.cli import redislock
from celery_redislock.ops.inspector import Inspector
from celery_redislock.store.checks import check_eviction
from celery_redislock.store.connect import describe_client
from celery_redislock.worker.node import Node, group_key, new_incarnation
from engine_helpers import wait_until
from redis_server import (
    LOOPBACK,
    RedisServer,
    RedisServerError,
    free_port,
    make_tls_files,
    resolve_binary,
    supports_tls,
)

SLOTS = 16384
MASTERS = 3
#: Seconds for a freshly MEET cluster to report cluster_state:ok (about 4 s here).
CLUSTER_OK_DEADLINE = 20.0


def _info_text(reply: Any) -> str:
    return reply.decode() if isinstance(reply, bytes) else str(reply)


def _port_with_free_bus() -> int:
    """A free loopback port P whose cluster bus port P + 10000 is free too."""
    for _ in range(200):
        port = free_port()
        if port + 10000 > 65535:
            continue
        try:
            with socket.socket() as probe:
                probe.bind((LOOPBACK, port + 10000))
        except OSError:
            continue
        return port
    raise RuntimeError("no loopback port with a free cluster bus port")


def _cluster_server(
    extra: tuple[str, ...], tls_files: Path | None
) -> tuple[RedisServer, int | None]:
    """A cluster-mode redis-server (not started) and its bus port if set (Redis >= 7)."""
    args = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", *extra]
    tls = tls_files is not None
    server = RedisServer(extra_args=args, tls=tls)
    bus: int | None = None
    if server.version >= (7, 0, 0):
        # The bus port defaults to port + 10000, which may exceed 65535.
        bus = free_port()
        server.extra_args += ["--cluster-port", str(bus)]
    else:
        # Redis 6.2 has no --cluster-port: pick a port whose bus port (port +
        # 10000) exists and is free.
        server = RedisServer(extra_args=args, port=_port_with_free_bus(), tls=tls)
    if tls_files is not None:
        # One CA for every node: they verify each other on the cluster bus.
        for name in ("ca.crt", "server.crt", "server.key"):
            shutil.copy(tls_files / name, server.workdir / name)
    return server, bus


def cluster_tls_files(folder: Path) -> Path:
    """``make_tls_files`` in ``folder``, the node certificate re-signed for both
    server and client use (nodes authenticate each other on the TLS cluster
    bus, whatever ``tls-auth-clients`` says); returns the CA certificate."""
    ca, _, _ = make_tls_files(folder)
    ext = folder / "node.ext"
    ext.write_text(
        f"subjectAltName = IP:{LOOPBACK}\n"
        "basicConstraints = critical, CA:FALSE\n"
        "keyUsage = critical, digitalSignature, keyEncipherment\n"
        "extendedKeyUsage = serverAuth, clientAuth\n"
    )
    openssl = shutil.which("openssl")
    assert openssl is not None  # make_tls_files needed it too
    subprocess.run(
        [openssl, "x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
         "-CAcreateserial", "-out", "server.crt", "-days", "7", "-extfile", ext.name],
        cwd=folder, check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return ca


@contextmanager
def running_cluster(
    *extra: str, replicas: bool = False, tls_files: Path | None = None
) -> Iterator[list[RedisServer]]:
    """Three cluster-mode redis-servers sharing all slots, cluster_state:ok.

    With ``replicas``, three more servers follow in the list, the i-th
    (``servers[MASTERS + i]``) a replica of master i, in sync when this yields.
    With ``tls_files`` (a folder made by :func:`cluster_tls_files`), every node
    speaks TLS only, to clients and on the cluster bus.
    """
    servers: list[RedisServer] = []
    bus_ports: list[int | None] = []
    if tls_files is not None:
        extra = (*extra, "--tls-cluster", "yes", "--tls-replication", "yes")
    try:
        for _ in range(2 * MASTERS if replicas else MASTERS):
            server, bus = _cluster_server(extra, tls_files)
            servers.append(server)
            bus_ports.append(bus)
            try:
                server.start()
            except RedisServerError as exc:
                pytest.skip(f"redis-server cannot run in cluster mode: {exc}")
        clients = [s.client() for s in servers]
        per = SLOTS // MASTERS
        for i, client in enumerate(clients[:MASTERS]):
            last = SLOTS - 1 if i == MASTERS - 1 else (i + 1) * per - 1
            # ADDSLOTS (not 7.0's ADDSLOTSRANGE) so Redis 6.2 runs it too.
            client.execute_command("CLUSTER", "ADDSLOTS", *range(i * per, last + 1))
        meet = [servers[0].host, servers[0].port, *[b for b in bus_ports[:1] if b]]
        for client in clients[1:]:
            client.execute_command("CLUSTER", "MEET", *meet)
        if replicas:
            ids = [_info_text(c.execute_command("CLUSTER", "MYID")) for c in clients[:MASTERS]]
            for i, client in enumerate(clients[MASTERS:]):
                # REPLICATE needs the master known to the replica (gossip).
                wait_until(
                    lambda c=client, i=i: (
                        ids[i] in _info_text(c.execute_command("CLUSTER", "NODES"))
                    ),
                    CLUSTER_OK_DEADLINE,
                    "a replica to learn its master",
                    interval=0.05,
                )
                client.execute_command("CLUSTER", "REPLICATE", ids[i])

        def ok() -> bool:
            infos = [_info_text(c.execute_command("CLUSTER", "INFO")) for c in clients]
            linked = all(
                c.info("replication").get("master_link_status") == "up" for c in clients[MASTERS:]
            )
            return linked and all(
                "cluster_state:ok" in i and f"cluster_known_nodes:{len(servers)}" in i
                for i in infos
            )

        wait_until(ok, CLUSTER_OK_DEADLINE, "cluster_state:ok on every node", interval=0.05)
        for client in clients:
            client.close()
        yield servers
    finally:
        for server in servers:
            server.close()


@pytest.fixture(scope="module")
def cluster_servers() -> Iterator[list[RedisServer]]:
    """The module's cluster (every test but the one that breaks its own)."""
    with running_cluster() as servers:
        yield servers


@pytest.fixture
def cluster(cluster_servers: list[RedisServer]) -> Iterator[Callable[..., RedisCluster]]:
    """Makes RedisCluster clients seeded from node ``seed`` (closed after the test)."""
    made: list[RedisCluster] = []

    def make(seed: int = 0, **kwargs: Any) -> RedisCluster:
        client = RedisCluster(host="127.0.0.1", port=cluster_servers[seed].port, **kwargs)
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()


@pytest.fixture
def managers(cluster: Callable[..., RedisCluster]) -> Iterator[Callable[..., LockManager]]:
    """Makes LockManagers on cluster clients, in one fresh namespace per test."""
    namespace = "c" + uuid.uuid4().hex[:8]
    made: list[LockManager] = []

    def make(seed: int = 0, client_kw: dict[str, Any] | None = None, **kw: Any) -> LockManager:
        kw.setdefault("owner_ttl", 2.0)
        mgr = LockManager(cluster(seed, **(client_kw or {})), namespace, **kw)
        made.append(mgr)
        return mgr

    yield make
    for mgr in made:
        mgr.close()


def _server_of(servers: list[RedisServer], client: RedisCluster, key: str) -> RedisServer:
    node = client.get_node_from_key(key)
    return next(s for s in servers if s.port == node.port)


def test_a_valkey_cluster_client_locks_waits_and_hands_off_on_the_cluster(
    cluster_servers: list[RedisServer], cluster: Callable[..., RedisCluster]
) -> None:
    """valkey-py's ValkeyCluster: the manager connects with redis-py's
    RedisCluster, seeded with the nodes the valkey-py client knows."""
    valkey_cluster = pytest.importorskip("valkey.cluster")
    source = valkey_cluster.ValkeyCluster(host="127.0.0.1", port=cluster_servers[1].port)
    namespace = "v" + uuid.uuid4().hex[:8]
    mgr = LockManager(source, namespace, owner_ttl=5)
    other = LockManager(cluster(), namespace, owner_ttl=5)
    try:
        assert isinstance(mgr.client, RedisCluster)
        assert mgr.url.startswith("redis+cluster://127.0.0.1:")
        lease = mgr.acquire("vk")
        with pytest.raises(LockTimeout):
            other.acquire("vk", timeout=0)
        got: list[Lease] = []
        waiter = threading.Thread(target=lambda: got.append(other.acquire("vk", timeout=20)))
        waiter.start()
        rc = cluster()
        wait_until(lambda: rc.zcard(mgr.keys.queue("vk")) == 1, what="the waiter queued")
        lease.release()
        waiter.join(30)
        assert got and got[0].fencing_token > lease.fencing_token
        assert mgr.holders("vk")[0].owner_id == other.owner_id
        got[0].release()
        assert not mgr.is_locked("vk")
    finally:
        other.close()
        mgr.close()
        source.close()


def test_namespaces_spread_over_the_masters_each_on_one_slot(
    cluster: Callable[..., RedisCluster],
) -> None:
    rc = cluster()
    assert len(rc.get_primaries()) == MASTERS
    mgr = LockManager(rc, "spread")
    try:
        keys = [
            mgr.keys.lock("r"),
            mgr.keys.queue("r"),
            mgr.keys.owners,
            mgr.keys.fence,
            mgr.keys.held("o"),
            mgr.keys.waits("o"),
            mgr.keys.contended("r"),
        ]
        assert {rc.keyslot(k) for k in keys} == {rc.keyslot("{spread}")}
        assert mgr.url.startswith("redis+cluster://127.0.0.1:")
    finally:
        mgr.close()
    owners = {rc.get_node_from_key(f"{{ns{i}}}:x").name for i in range(30)}
    assert len(owners) == MASTERS


def test_two_managers_on_different_seed_nodes_exclude_each_other(
    managers: Callable[..., LockManager],
) -> None:
    a, b = managers(0), managers(2)
    lease = a.acquire("repo:1", timeout=0)
    with pytest.raises(LockTimeout):
        b.acquire("repo:1", timeout=0)
    lease.release()
    second = b.acquire("repo:1", timeout=0)
    assert second.fencing_token > lease.fencing_token
    second.release()
    a.acquire("repo:1", timeout=0).release()


def test_blocked_waiter_is_handed_the_lock_on_release(
    managers: Callable[..., LockManager], cluster: Callable[..., RedisCluster]
) -> None:
    a, b = managers(0), managers(1)
    rc = cluster()
    held = a.acquire(["repo:2", "repo:3"], timeout=0)
    got: dict[str, Any] = {}

    def waiter() -> None:
        try:
            got["lease"] = b.acquire(["repo:2", "repo:3"], timeout=20)
        except BaseException as exc:  # reported by the assertion below
            got["error"] = exc

    thread = threading.Thread(target=waiter)
    thread.start()
    wait_until(lambda: rc.zcard(b.keys.queue("repo:2")) == 1, what="waiter queued")
    held.release()
    thread.join(20)
    assert "error" not in got, got
    lease: Lease = got["lease"]
    assert lease.fencing_token > held.fencing_token
    assert not lease.lost
    lease.release()
    assert rc.zcard(b.keys.queue("repo:2")) == 0


def test_wait_for_contender_reads_the_contended_streams_of_every_resource(
    managers: Callable[..., LockManager],
) -> None:
    # One XREAD on the streams of both resources (one slot), woken when a
    # request blocks on the second of them.
    holder, other = managers(0), managers(2)
    lease = holder.acquire(["repo:6", "repo:7"], timeout=0)
    woken = threading.Event()

    def wait() -> None:
        if lease.wait_for_contender(20):
            woken.set()

    t = threading.Thread(target=wait, daemon=True)
    t.start()
    wait_until(
        lambda: any(
            c.get("cmd") == "xread"
            for node in holder.client.get_primaries()
            for c in holder.client.client_list(target_nodes=node)
        ),
        what="the holder blocked in XREAD",
    )
    waiter = threading.Thread(
        target=lambda: other.acquire("repo:7", timeout=10).release(), daemon=True
    )
    waiter.start()
    assert woken.wait(20)
    assert lease.contenders() == 1
    lease.release()
    waiter.join(20)
    t.join(20)


def test_waiter_reblocks_past_a_short_cluster_socket_timeout(
    managers: Callable[..., LockManager],
    cluster: Callable[..., RedisCluster],
    cluster_servers: list[RedisServer],
) -> None:
    a = managers(0)
    b = managers(1, client_kw={"socket_timeout": 0.5})
    assert b.options.block_cap < 0.5
    held = a.acquire("slow", timeout=0)
    server = _server_of(cluster_servers, cluster(), a.keys.lock("slow"))
    direct = server.client()

    def blpops() -> int:
        stats = direct.info("commandstats").get("cmdstat_blpop")
        return int(stats["calls"]) if stats else 0

    before = blpops()
    got: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: got.update(lease=b.acquire("slow", timeout=20)))
    thread.start()
    # Three BLPOPs: the waiter has blocked longer than its 0.5 s socket timeout.
    wait_until(lambda: blpops() >= before + 3, what="waiter re-blocked")
    held.release()
    thread.join(20)
    direct.close()
    assert "lease" in got
    got["lease"].release()


def test_heartbeat_keeps_a_cluster_owner_alive_past_its_ttl(
    managers: Callable[..., LockManager], cluster: Callable[..., RedisCluster]
) -> None:
    a = managers(0, owner_ttl=1.0)
    lease = a.acquire("hb", timeout=0)
    # 1/3 s interval: six beats span twice the owner TTL.
    wait_until(lambda: a.heartbeat.ticks >= 6, what="six heartbeats")
    assert isinstance(a.liveness.heartbeat_client(), RedisCluster)
    assert a.liveness.heartbeat_client() is not a.client
    assert not lease.lost
    assert cluster().pttl(a.keys.alive(a.owner_id)) > 0
    lease.release()


def test_cleanup_owner_frees_a_dead_owner_and_its_lost_watch_is_told(
    managers: Callable[..., LockManager],
) -> None:
    a = managers(0)
    b = managers(2, owner_ttl=5.0, heartbeat=False)
    lease = b.acquire(["x1", "x2"], timeout=0)
    assert a.cleanup_owner(b.owner_id).status == "alive"
    report = a.cleanup_owner(b.owner_id, force=True)
    assert (report.status, report.released, report.errors) == ("cleaned", 2, ())
    wait_until(lambda: lease.lost, what="lost-owner watch marks the lease lost")
    a.acquire(["x1", "x2"], timeout=0).release()
    assert a.reconcile().errors == {}


def test_inspector_reports_status_and_locks(managers: Callable[..., LockManager]) -> None:
    a, b = managers(0), managers(1)
    lease = a.acquire("seen", shared=["also"], timeout=0)
    status = Inspector(b).status()
    assert (status.eviction_policy, status.may_evict) == ("noeviction", False)
    assert status.alive_owners == 1 and status.registered_locks == 2
    assert status.fence == lease.fencing_token
    locks = {info.resource: info for info in Inspector(b).locks()}
    assert set(locks) == {"seen", "also"}
    assert [h.owner_id for h in locks["seen"].holders] == [a.owner_id]
    lease.release()
    assert Inspector(b).locks() == []


def test_scripts_reload_after_script_flush_on_every_primary(
    managers: Callable[..., LockManager], cluster_servers: list[RedisServer]
) -> None:
    a = managers(0)
    a.acquire("f", timeout=0).release()
    for server in cluster_servers:
        client = server.client()
        client.script_flush()
        client.close()
    a.acquire("f", timeout=0).release()


def test_worker_node_starts_ticks_and_frees_its_owners_on_shutdown(
    managers: Callable[..., LockManager],
) -> None:
    a = managers(0)
    inc = new_incarnation()
    key = group_key(a.keys.prefix, inc)
    worker = managers(1, heartbeat_interval=0.2, heartbeat=False, group=lambda: key)
    node = Node(worker, "celery@cluster", inc)
    try:
        assert node.start() == "owner"
        worker.acquire("job", timeout=0)
        assert node.tick().owned
        info = Inspector(a).node("celery@cluster")
        assert info is not None and info.incarnation == inc
        reports = node.shutdown()
        assert [(r.status, r.released) for r in reports] == [("cleaned", 1)]
        a.acquire("job", timeout=0).release()
    finally:
        node._heartbeat.stop()


def test_eviction_check_asks_every_primary(
    cluster: Callable[..., RedisCluster], cluster_servers: list[RedisServer]
) -> None:
    rc = cluster()
    assert check_eviction(rc).may_evict is False
    last: redis.Redis = cluster_servers[-1].client()
    try:
        last.config_set("maxmemory-policy", "allkeys-lru")
        check = check_eviction(rc)
        assert (check.policy, check.may_evict) == ("allkeys-lru", True)
    finally:
        last.config_set("maxmemory-policy", "noeviction")
        last.close()


def test_a_cluster_that_lost_a_master_is_reported_as_redis_unavailable() -> None:
    # Its own cluster (it kills a master), with a short node timeout so the
    # survivors mark the cluster down quickly (full coverage is required).
    with running_cluster("--cluster-node-timeout", "500") as servers:
        client = RedisCluster(host="127.0.0.1", port=servers[0].port, socket_timeout=2)
        try:
            # A namespace served by the first master, which stays up: its
            # calls reach a live node that answers CLUSTERDOWN.
            ns = next(
                f"down{i}"
                for i in range(1000)
                if client.keyslot(f"{{down{i}}}:x") < SLOTS // MASTERS
            )
            mgr = LockManager(client, ns, heartbeat=False)
            mgr.acquire("r", timeout=0).release()

            servers[-1].kill()
            survivors = [s.client() for s in servers[:-1]]
            wait_until(
                lambda: all(
                    "cluster_state:fail" in _info_text(c.execute_command("CLUSTER", "INFO"))
                    for c in survivors
                ),
                CLUSTER_OK_DEADLINE,
                "the survivors to mark the cluster down",
            )
            for c in survivors:
                c.close()

            with pytest.raises(RedisUnavailable):
                mgr.acquire("r", timeout=0)
            mgr.close()
        finally:
            client.close()


def test_wait_replicas_is_refused_on_a_cluster_client(cluster: Callable[..., RedisCluster]) -> None:
    with pytest.raises(ConfigurationError) as err:
        LockManager(cluster(), "ns", wait_replicas=1)
    assert err.value.setting == "wait_replicas" and "Redis Cluster" in str(err.value)


def test_a_task_owner_acquires_and_a_process_adopts_on_a_cluster(
    managers: Callable[..., LockManager],
) -> None:
    """acquire_for_task's pipeline (HGET, EVALSHA, HGETALL) routes by the
    namespace's slot, and adopt.lua runs on the cluster like the others."""
    producer, worker = managers(0), managers(2)
    grant = producer.acquire_for_task("t1", "unique:a", ttl=60)
    assert grant.granted
    busy = worker.acquire_for_task("t2", "unique:a", ttl=60)
    assert not busy.granted and busy.holder_task_id == "t1"
    [lease] = worker.adopt("t1").leases
    assert lease.fencing_token == grant.fencing_token
    assert producer.acquire_for_task("t3", "unique:a", ttl=60).holder_owner == worker.owner_id
    lease.release()
    assert producer.acquire_for_task("t3", "unique:a", ttl=60).granted


# -- the redis+cluster:// URL: settings, RedisLock(app), the CLI ------------------

#: A password with characters a URL must encode (and that must never be shown).
CLUSTER_PW = "Kx7@pw/9"
CLUSTER_USER = "locks"


def _cluster_url(servers: list[RedisServer], *, auth: bool = False, query: str = "") -> str:
    seeds = ",".join(f"127.0.0.1:{s.port}" for s in servers[:2])  # two of the three seeds
    creds = f"{CLUSTER_USER}:{CLUSTER_PW.replace('@', '%40').replace('/', '%2F')}@" if auth else ""
    return f"redis+cluster://{creds}{seeds}/{query}"


@pytest.fixture
def cluster_user(cluster_servers: list[RedisServer]) -> Iterator[str]:
    """A password-protected ACL user on every node (ACLs are per node); its URL."""
    admins = [s.client() for s in cluster_servers]
    for admin in admins:
        admin.acl_setuser(
            CLUSTER_USER, enabled=True, passwords=[f"+{CLUSTER_PW}"], keys=["*"],
            channels=["*"], commands=["+@all"], reset=True,
        )  # fmt: skip
    yield _cluster_url(cluster_servers, auth=True, query="?socket_timeout=5")
    for admin in admins:
        admin.acl_deluser(CLUSTER_USER)
        admin.close()


def test_a_cluster_url_makes_a_manager_on_a_cluster_client_with_the_password_masked(
    cluster_user: str,
) -> None:
    mgr = LockManager(cluster_user, "curl" + uuid.uuid4().hex[:6], owner_ttl=2.0)
    try:
        assert isinstance(mgr.client, RedisCluster)
        assert len(mgr.client.get_primaries()) == MASTERS  # learnt from two seeds
        assert CLUSTER_PW not in mgr.url and "%40" not in mgr.url
        assert mgr.url.startswith(f"redis+cluster://{CLUSTER_USER}:***@127.0.0.1:")
        lease = mgr.acquire("r", timeout=0)
        # The heartbeat's clone carries the credentials and the socket timeout.
        wait_until(lambda: mgr.heartbeat.ticks >= 2, what="two heartbeats on the clone")
        assert isinstance(mgr.liveness.heartbeat_client(), RedisCluster)
        assert (
            mgr.liveness.heartbeat_client().nodes_manager.connection_kwargs["socket_timeout"] == 5.0
        )
        assert not lease.lost
        lease.release()
    finally:
        mgr.close()


def test_a_cluster_url_whose_nodes_do_not_answer_raises_redis_unavailable() -> None:
    url = f"redis+cluster://u:{CLUSTER_PW.replace('@', '%40').replace('/', '%2F')}@127.0.0.1:{free_port()}/"
    with pytest.raises(RedisUnavailable) as err:
        LockManager(url, "nobody")
    assert "%40" not in str(err.value) and CLUSTER_PW not in str(err.value)
    assert "u:***@" in str(err.value)


def _cli(app: Celery) -> Callable[..., Result]:
    runner = CliRunner()

    def invoke(*args: str) -> Result:
        obj = CLIContext(app=app, no_color=True, workdir=None)
        return runner.invoke(redislock, list(args), obj=obj)

    return invoke


def _ok(result: Result) -> Result:
    assert result.exit_code == 0, (result.output, result.exception)
    return result


def test_cli_status_locks_and_release_on_a_cluster_url(
    cluster_user: str, cluster_servers: list[RedisServer]
) -> None:
    ns = "ccli" + uuid.uuid4().hex[:6]
    app = Celery("clustercli", set_as_current=False)
    app.conf.redislock_url = cluster_user  # the setting path (RedisLock's config)
    app.conf.redislock_namespace = ns
    cli = _cli(app)
    live = LockManager(cluster_user, ns, owner_ttl=2.0, name="celery@live")
    # A dead owner: no heartbeat, its liveness key left to expire.
    dead = LockManager(cluster_user, ns, owner_ttl=1.0, heartbeat=False)
    try:
        held = live.acquire("live:1", timeout=0)
        dead.acquire(["dead:1", "dead:2"], timeout=0)
        dead_id = dead.owner_id  # it moves on to a new identity once it sees the loss
        rc = live.client
        wait_until(lambda: not rc.exists(dead.keys.alive(dead_id)), what="liveness expiry")

        out = _ok(cli("status")).output
        lines = [" ".join(line.split()) for line in out.splitlines()]
        assert "owners 2 (1 alive, 1 dead; 2 holding locks, 0 only waiting)" in lines, out
        assert "locks 3 registered (2 by dead owners)" in lines, out
        assert f"redis+cluster://{CLUSTER_USER}:***@" in out and CLUSTER_PW not in out

        rows = {ln.split()[0]: ln.split() for ln in _ok(cli("locks")).output.splitlines()[1:]}
        assert rows["live:1"][:4] == ["live:1", "exclusive", live.owner_id, "alive"]
        assert rows["dead:1"][:4] == ["dead:1", "exclusive", dead_id, "DEAD"]

        # --url on the command line wins over the app's setting (a wrong one here).
        app.conf.redislock_url = "redis://127.0.0.1:1/0"
        out = _ok(cli("release", "--url", cluster_user, "--owner", dead_id, "--yes")).output
        assert f"owner {dead_id}: cleaned, 2 grant(s) released" in out
        assert CLUSTER_PW not in out
        assert rc.exists(dead.keys.lock("dead:1"), dead.keys.lock("dead:2")) == 0
        assert rc.hkeys(live.keys.lock("live:1")) == [held.token]
        data = json.loads(_ok(cli("locks", "--url", cluster_user, "--json")).stdout)
        assert [d["resource"] for d in data] == ["live:1"]
        assert not held.lost
        held.release()
    finally:
        live.close()
        dead.close()


def test_redislock_app_on_a_cluster_url_runs_a_producer_and_the_node_scripts(
    cluster_user: str,
) -> None:
    """RedisLock(app) with redislock_url = a cluster URL: its config is the
    canonical URL, the producer-side manager (unique tasks, defer) and the
    worker-side one are cluster clients."""
    app = Celery("clusterapp", set_as_current=False)
    app.conf.redislock_url = cluster_user
    app.conf.redislock_namespace = "capp" + uuid.uuid4().hex[:6]
    locks = RedisLock(app)
    try:
        assert locks.config.url.startswith("redis+cluster://")
        producer = locks.manager
        assert isinstance(producer.client, RedisCluster)
        grant = producer.acquire_for_task("t1", "unique:x", ttl=60)
        assert grant.granted
        assert not producer.acquire_for_task("t2", "unique:x", ttl=60).granted
        assert CLUSTER_PW not in repr(app.conf.get("redislock_url"))
    finally:
        locks.close()


# -- least privilege on a cluster ---------------------------------------------------

CLUSTER_DOC = Path(__file__).resolve().parent.parent / "docs" / "cluster.md"


def documented_cluster_additions() -> frozenset[str]:
    """The commands docs/cluster.md adds to the ACL of docs/operations.md (lower case)."""
    text = CLUSTER_DOC.read_text(encoding="utf-8")
    lines = re.findall(r"^ACL SETUSER \S+ (\+.*)$", text, re.M)
    assert len(lines) == 1, f"expected one ACL SETUSER line in {CLUSTER_DOC}, found {lines}"
    tokens = lines[0].split()
    assert all(t.startswith("+") and not t.startswith("+@") for t in tokens), tokens
    return frozenset(t[1:].lower() for t in tokens)


def test_on_a_cluster_the_acl_is_the_documented_one_plus_the_documented_cluster_additions(
    cluster_servers: list[RedisServer],
) -> None:
    """test_acl.py's exercise (the engine, a worker node, the Inspector and
    every CLI command) as a least-privilege user on every node, through a
    redis+cluster:// URL: nothing is refused, and the commands used on all
    nodes together are exactly the documented ACL plus docs/cluster.md's
    additions (what redis-py's cluster client sends to learn the topology
    and route commands)."""
    base = acl_helpers.documented_acl().commands
    extra = documented_cluster_additions()
    assert not base & extra
    admins = [s.client() for s in cluster_servers]
    try:
        for admin in admins:
            admin.execute_command("ACL", "SETUSER", "exercise", "reset")
            acl_helpers.create_lock_user(admin, [acl_test.NS], user="exercise")
            admin.execute_command("ACL", "SETUSER", "exercise", *(f"+{c}" for c in sorted(extra)))
            admin.script_flush()  # so the library has to SCRIPT LOAD after NOSCRIPT
        rc = RedisCluster(host="127.0.0.1", port=cluster_servers[0].port)
        owner_port = rc.get_node_from_key("{" + acl_test.NS + "}:x").port
        rc.close()
        slot_admin = next(a for a, s in zip(admins, cluster_servers) if s.port == owner_port)
        for admin in admins:
            admin.config_resetstat()
        seeds = ",".join(f"127.0.0.1:{s.port}" for s in cluster_servers)
        url = f"redis+cluster://exercise:{acl_helpers.PASSWORD}@{seeds}/"
        outcomes: list[Any] = []
        acl_test._exercise(url, slot_admin, outcomes)

        used: set[str] = set()
        refused: dict[str, int] = {}
        for admin in admins:
            stats = acl_test.commandstats(admin)
            stats[next(n for n in ("config|resetstat", "config") if n in stats)]["calls"] -= 1
            for name, s in stats.items():
                if name in acl_test.IGNORED:
                    continue
                if s.get("rejected_calls"):
                    refused[name] = refused.get(name, 0) + s["rejected_calls"]
                if s["calls"]:
                    # +command grants COMMAND and its subcommands (GETKEYS);
                    # Redis < 7 names no subcommand of CLUSTER (only SLOTS is sent).
                    used.add(
                        "command"
                        if name.startswith("command|")
                        else "cluster|slots"
                        if name == "cluster"
                        else name
                    )
        assert not refused, f"the documented cluster ACL refused commands the code sends: {refused}"
        assert outcomes and isinstance(outcomes[0], ShuttingDown), outcomes
        derived = acl_test.lua_commands() | used
        documented = base | extra
        assert not derived - documented, (
            f"used on a cluster but missing from the docs: {sorted(derived - documented)}"
        )
        assert not documented - derived, (
            f"granted but never sent on a cluster: {sorted(documented - derived)}"
        )
    finally:
        for admin in admins:
            admin.execute_command("ACL", "DELUSER", "exercise")
            admin.close()


def test_a_rediss_cluster_url_reaches_a_tls_only_cluster(tmp_path: Path) -> None:
    """rediss+cluster:// with ssl_ca_certs/ssl_cert_reqs: the engine, its
    heartbeat's clone and the CLI speak TLS to every node; a plain
    redis+cluster:// URL to the same ports is RedisUnavailable."""
    if not supports_tls(resolve_binary()):
        pytest.skip("this redis-server binary is built without TLS")
    files = tmp_path / "tls"
    files.mkdir()
    ca = cluster_tls_files(files)
    with running_cluster(tls_files=files) as servers:
        seeds = ",".join(f"127.0.0.1:{s.port}" for s in servers[:2])
        ca_q = quote(str(ca), safe="/")
        url = f"rediss+cluster://{seeds}/?ssl_ca_certs={ca_q}&ssl_cert_reqs=required"
        ns = "ctls" + uuid.uuid4().hex[:6]
        mgr = LockManager(url, ns, owner_ttl=2.0)
        try:
            assert mgr.url == url  # no secret to mask
            lease = mgr.acquire("r", timeout=0)
            wait_until(lambda: mgr.heartbeat.ticks >= 2, what="two heartbeats over TLS")
            assert not lease.lost
            assert describe_client(mgr.client).startswith("rediss+cluster://127.0.0.1:")
            result = CliRunner().invoke(redislock, ["--url", url, "--namespace", ns, "locks"])
            assert result.exit_code == 0, result.output
            row = result.output.splitlines()[1].split()
            assert row[:3] == ["r", "exclusive", mgr.owner_id], result.output
            lease.release()
        finally:
            mgr.close()
        with pytest.raises(RedisUnavailable):
            LockManager(f"redis+cluster://{seeds}/?socket_timeout=2", ns)


def test_every_option_of_a_cluster_url_reaches_the_node_connections(
    cluster_servers: list[RedisServer],
) -> None:
    """No accepted option is dropped on the way (redis-py's cluster client
    silently drops the connection arguments it does not pass to nodes)."""
    seeds = ",".join(f"127.0.0.1:{s.port}" for s in cluster_servers[:1])
    url = (
        f"redis+cluster://{seeds}/0?socket_timeout=3&socket_connect_timeout=2"
        "&max_connections=7&client_name=locks-w1&require_full_coverage=false&db=0"
    )
    mgr = LockManager(url, "copts", heartbeat=False)
    try:
        client = mgr.client
        assert isinstance(client, RedisCluster)
        assert client.nodes_manager._require_full_coverage is False
        for node in client.get_nodes():
            pool = node.redis_connection.connection_pool
            kw = pool.connection_kwargs
            assert (kw["socket_timeout"], kw["socket_connect_timeout"]) == (3.0, 2.0)
            assert (kw["client_name"], pool.max_connections) == ("locks-w1", 7)
        mgr.acquire("r", timeout=0).release()
        node = client.get_node_from_key(mgr.keys.fence)
        assert "locks-w1" in {c["name"] for c in client.client_list(target_nodes=node)}
    finally:
        mgr.close()


def test_a_child_forked_while_a_parent_thread_holds_the_slot_map_lock_can_lock(
    managers: Callable[..., LockManager],
) -> None:
    # A prefork pool child inherits the parent's RedisCluster object. If a
    # parent thread held its slot-map lock at the fork (a topology refresh,
    # a slot look-up), the child's copy of the lock stays held for ever and
    # its first lock call would hang: the child gets new locks at the fork.
    import multiprocessing

    mgr = managers()
    mgr.acquire("warm", timeout=5).release()
    nodes = mgr.client.nodes_manager
    held, done = threading.Event(), threading.Event()

    def hold() -> None:
        with nodes._initialization_lock, nodes._lock:
            held.set()
            done.wait(30)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    assert held.wait(5)
    try:
        ctx = multiprocessing.get_context("fork")
        child = ctx.Process(target=_child_locks, args=(mgr,))
        child.start()
        child.join(20)
        hung = child.is_alive()
        if hung:
            child.kill()
            child.join(5)
    finally:
        done.set()
        holder.join(5)
    assert not hung, "the forked child blocked on the inherited cluster lock"
    assert child.exitcode == 0


def _child_locks(mgr: LockManager) -> None:
    with mgr.lock("in-child", timeout=5):
        pass


# -- the asyncio front-end on a cluster URL -----------------------------------


def test_an_async_manager_on_a_cluster_url_locks_waits_and_hands_off(
    cluster_user: str, cluster: Callable[..., RedisCluster]
) -> None:
    import asyncio

    import redis.asyncio

    from async_helpers import run, until
    from celery_redislock.asyncio import AsyncLockManager

    namespace = "ac" + uuid.uuid4().hex[:6]
    sync = LockManager(cluster(), namespace, owner_ttl=2.0)

    async def main() -> None:
        async with AsyncLockManager(
            cluster_user, namespace, owner_ttl=2.0, heartbeat_interval=0.2
        ) as mgr:
            assert isinstance(mgr.client, redis.asyncio.RedisCluster)
            assert CLUSTER_PW not in mgr.url
            assert mgr.url.startswith(f"redis+cluster://{CLUSTER_USER}:***@127.0.0.1:")
            lease = await mgr.acquire("r", shared="s", timeout=5)
            assert [h.token for h in await mgr.holders("r")] == [lease.token]
            assert [h.token for h in await asyncio.to_thread(sync.holders, "r")] == [lease.token]
            waiter = asyncio.create_task(asyncio.to_thread(sync.acquire, "r", timeout=20))
            assert await lease.wait_for_contender(20)
            await lease.release()  # handed to the thread by push
            held = await waiter
            assert held.fencing_token > lease.fencing_token
            coro = asyncio.create_task(mgr.acquire("r", timeout=20))
            queue = f"{{{namespace}}}:q:r"
            await until(lambda: sync.client.zcard(queue) == 1, "the coroutine queued")
            await asyncio.to_thread(held.release)
            got = await coro
            assert got.fencing_token > held.fencing_token
            await got.release()
            with pytest.raises(ConfigurationError, match="wait_replicas"):
                AsyncLockManager(cluster_user, namespace, wait_replicas=1)

    try:
        run(main())
    finally:
        sync.close()
