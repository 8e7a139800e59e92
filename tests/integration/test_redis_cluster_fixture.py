"""The Redis Cluster the cluster tests run on: its shape, key spread, failover, restart and resharding."""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.exceptions import AskError, MovedError

from tests.conftest import wait_for
from tests.servers import HASH_SLOTS, ClusterNotSupported, RedisCluster, parse_cluster_nodes


def keys_in_slots(slots: set[int], per_slot: int) -> list[str]:
    """``per_slot`` key names in each of ``slots``."""
    found: dict[int, list[str]] = collections.defaultdict(list)
    index = 0
    while any(len(found[slot]) < per_slot for slot in slots):
        key = f"key:{index}"
        slot = RedisCluster.slot_of(key)
        if slot in slots and len(found[slot]) < per_slot:
            found[slot].append(key)
        index += 1
    return [key for slot in sorted(slots) for key in found[slot]]


def layout(cluster: RedisCluster) -> list[tuple[int, str, int | None, tuple[tuple[int, int], ...]]]:
    """Each node's port, role, master's port and slots."""
    nodes = cluster.nodes()
    port_of = {node.node_id: node.port for node in nodes}
    return sorted((n.port, n.role, port_of.get(n.master_id or ""), n.slots) for n in nodes)


class Counters:
    """A thread that INCRs each of ``keys`` in turn through its own cluster client and checks every reply.

    A reply that is not one more than the last one of that key means a write
    was lost or applied twice; errors are kept. ``passes`` counts rounds over
    every key, so a test can wait until each key was touched after a step.
    """

    def __init__(self, cluster: RedisCluster, keys: list[str]) -> None:
        self.client = cluster.client()
        self.keys = keys
        self.expected = dict.fromkeys(keys, 0)
        self.passes = 0
        self.errors: list[str] = []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stopping.is_set():
            for key in self.keys:
                try:
                    value = self.client.incr(key)
                    read = self.client.get(key)
                except redis.RedisError as exc:
                    self.errors.append(f"{key}: {type(exc).__name__}: {exc}")
                    continue
                self.expected[key] += 1
                if value != self.expected[key] or int(read or 0) != self.expected[key]:
                    self.errors.append(f"{key}: INCR said {value}, GET {read!r}, {self.expected[key]} expected")
                    self.expected[key] = value
            self.passes += 1

    def one_more_pass(self) -> None:
        """Wait until every key was written and read again, from now on."""
        start = self.passes
        wait_for(lambda: self.passes >= start + 2 or self.errors, 60, "the writer did not go round its keys")

    def __enter__(self) -> Counters:
        self.thread.start()
        self.one_more_pass()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self.thread.join(60)
        self.client.close()


@pytest.fixture
def client(cluster: RedisCluster) -> Iterator[redis.cluster.RedisCluster]:
    with cluster.client() as connected:
        yield connected


def test_three_masters_share_every_slot_and_each_has_a_replica_in_sync(cluster: RedisCluster) -> None:
    masters, replicas = cluster.masters(), cluster.replicas()
    assert len(masters) == 3
    assert len(replicas) == 3
    assert [port for _, port in cluster.seeds] == [m.port for m in masters]
    assert cluster.url == "redis+cluster://" + ",".join(f"127.0.0.1:{m.port}" for m in masters)
    slots = sorted(slot for m in masters for first, last in m.slots for slot in range(first, last + 1))
    assert slots == list(range(HASH_SLOTS))
    assert all(m.slot_count > 5000 for m in masters)
    assert sorted(r.master_id or "" for r in replicas) == sorted(m.node_id for m in masters)
    for port in cluster.ports:
        with redis.Redis(port=port, decode_responses=True) as node:
            info = node.execute_command("CLUSTER", "INFO")
            assert "cluster_state:ok" in info
            assert "cluster_known_nodes:6" in info
            assert "cluster_slots_assigned:16384" in info
            replication = node.info("replication")
        if port in {r.port for r in replicas}:
            assert replication["role"] == "slave"
            assert replication["master_link_status"] == "up"
            assert replication["master_sync_in_progress"] == 0
        else:
            assert replication["connected_slaves"] == 1
            assert replication["slave0"]["state"] == "online"


def test_keys_spread_over_every_master(cluster: RedisCluster, client: redis.cluster.RedisCluster) -> None:
    keys = [f"order:{n}" for n in range(3000)]
    for key in keys:
        client.set(key, key)
    counted = collections.Counter(cluster.node_of_key(key).port for key in keys)
    stored = {m.port: redis.Redis(port=m.port).dbsize() for m in cluster.masters()}
    assert counted == stored
    assert len(stored) == 3
    assert all(count > 800 for count in stored.values()), stored
    # One hash tag, one slot, one master: what a multi-key script needs.
    assert len({cluster.node_of_key(f"{{order:7}}:{part}").port for part in ("gate", "lock", "status")}) == 1
    assert cluster.master_port_for_slot(cluster.slot_of("order:7")) == cluster.node_of_key("order:7").port


def test_flushall_empties_masters_and_replicas(cluster: RedisCluster, client: redis.cluster.RedisCluster) -> None:
    for n in range(300):
        client.set(f"k{n}", n)
    cluster.flushall()
    assert {port: redis.Redis(port=port).dbsize() for port in cluster.ports} == dict.fromkeys(cluster.ports, 0)


@pytest.mark.slow
def test_a_killed_master_is_replaced_by_its_replica_and_the_client_goes_on(
    cluster: RedisCluster, client: redis.cluster.RedisCluster
) -> None:
    keys = [f"order:{n}" for n in range(600)]
    for key in keys:
        client.set(key, key)
    victim = cluster.node_of_key(keys[0])
    its_replica = next(r for r in cluster.replicas() if r.master_id == victim.node_id)
    cluster.wait_replicated()

    cluster.kill_master(victim.port)
    promoted = cluster.wait_failover(victim.port)

    assert promoted == its_replica.port
    now = cluster.node_of_key(keys[0])
    assert (now.node_id, now.port, now.role, now.slots) == (its_replica.node_id, promoted, "master", victim.slots)
    assert victim.port not in cluster.master_ports()
    assert len(cluster.masters()) == 3
    # The client built before the failover finds the new master by itself, and nothing written is lost.
    assert [client.get(key) for key in keys] == [key.encode() for key in keys]
    client.set(keys[0], "after")
    assert client.get(keys[0]) == b"after"


@pytest.mark.slow
def test_a_restarted_master_comes_back_as_a_replica_of_its_replacement(
    cluster: RedisCluster, client: redis.cluster.RedisCluster
) -> None:
    victim = cluster.masters()[1]
    cluster.kill_master(victim.port)
    promoted = cluster.wait_failover(victim.port)
    key = next(f"order:{n}" for n in range(1000) if cluster.node_of_key(f"order:{n}").port == promoted)
    client.set(key, "written while it was down")

    back = cluster.restart_node(victim.port)

    assert back.node_id == victim.node_id
    assert back.role == "replica"
    assert back.master_id == cluster.node_ids[promoted]
    assert back.slots == ()
    cluster.wait_replicated()
    with redis.Redis(port=victim.port) as node:
        node.execute_command("READONLY")
        assert node.get(key) == b"written while it was down"


def test_a_slot_in_migration_answers_ask_then_moved(cluster: RedisCluster, client: redis.cluster.RedisCluster) -> None:
    source, target = cluster.masters()[0], cluster.masters()[2]
    slot = source.slots[0][0] + 7
    keys = keys_in_slots({slot}, 6)
    for key in keys:
        client.set(key, "before")
    raw = redis.Redis(port=source.port)

    with cluster.migrating(slot, target.port) as move:
        assert raw.get(keys[0]) == b"before"  # still on its master
        assert move(3) == 3
        left = {key.decode() for key in raw.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100)}
        moved = [key for key in keys if key not in left]
        assert len(moved) == 3
        with pytest.raises(AskError) as asked:
            raw.get(moved[0])
        assert (asked.value.slot_id, asked.value.node_addr) == (slot, ("127.0.0.1", target.port))
        with pytest.raises(AskError):
            raw.set("{" + keys[0] + "}:new", "x")  # a new key goes to the importing node
        # The cluster client follows ASK both ways, for moved keys and for keys still at the source.
        for key in keys:
            client.set(key, f"during {key}")
        client.set("{" + keys[0] + "}:new", "new")

    with pytest.raises(MovedError) as sent:
        raw.get(keys[0])
    assert (sent.value.slot_id, sent.value.node_addr) == (slot, ("127.0.0.1", target.port))
    assert cluster.master_port_for_slot(slot) == target.port
    assert [client.get(key) for key in keys] == [f"during {key}".encode() for key in keys]
    assert client.get("{" + keys[0] + "}:new") == b"new"
    assert redis.Redis(port=target.port).execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) == len(keys) + 1
    raw.close()


def test_a_reshard_moves_slots_under_a_running_writer_and_loses_nothing(cluster: RedisCluster) -> None:
    source, target = cluster.masters()[1], cluster.masters()[0]
    first = source.slots[0][0]
    slots = set(range(first, first + 40))
    keys = keys_in_slots(slots, 5)

    with Counters(cluster, keys) as writer:
        moved = cluster.reshard(40, source.port, target.port, batch=3)
        writer.one_more_pass()

    assert writer.errors == []
    assert sorted(moved) == sorted(slots)
    assert {cluster.master_port_for_slot(slot) for slot in slots} == {target.port}
    assert [m.slot_count for m in cluster.masters() if m.port == target.port] == [target.slot_count + 40]
    with cluster.client() as reader:
        assert {key: int(reader.get(key) or 0) for key in keys} == writer.expected
    with redis.Redis(port=target.port) as node:
        assert all(node.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) == 5 for slot in slots)


def test_a_writer_sees_every_phase_of_a_migration(cluster: RedisCluster) -> None:
    source, target = cluster.masters()[2], cluster.masters()[1]
    slots = [source.slots[0][0] + n for n in (3, 300, 3000)]
    keys = keys_in_slots(set(slots), 8)

    with Counters(cluster, keys) as writer:
        for slot in slots:
            with cluster.migrating(slot, target.port) as move:
                writer.one_more_pass()  # every key still at its source
                assert move(4) == 4
                writer.one_more_pass()  # half of them moved: ASK
            writer.one_more_pass()  # the slot moved: MOVED, once, then the new map

    assert writer.errors == []
    assert writer.passes > 6 * len(slots)
    with cluster.client() as reader:
        assert {key: int(reader.get(key) or 0) for key in keys} == writer.expected
    assert {cluster.master_port_for_slot(slot) for slot in slots} == {target.port}


@pytest.mark.slow
def test_reset_brings_back_the_layout_of_the_start(cluster: RedisCluster, client: redis.cluster.RedisCluster) -> None:
    start = layout(cluster)
    victim = cluster.masters()[0]
    cluster.kill_master(victim.port)
    promoted = cluster.wait_failover(victim.port)
    cluster.reshard(25, cluster.masters()[2].port, promoted)
    for n in range(100):
        client.set(f"k{n}", n)
    assert layout(cluster) != start

    cluster.reset()

    assert layout(cluster) == start
    assert cluster.live_ports() == cluster.ports
    assert sum(redis.Redis(port=port).dbsize() for port in cluster.ports) == 0
    client.set("k1", "again")
    assert client.get("k1") == b"again"


def test_cluster_nodes_lines_are_read_with_open_slots_and_hostnames() -> None:
    text = (
        "07c3 127.0.0.1:30004@31004,host-a slave e7d1 0 1426238317239 4 connected\n"
        "e7d1 127.0.0.1:30001@31001 myself,master - 0 0 1 connected 0-5460 7000 [93->-292f] [77-<-67ed]\n"
        "6ec2 127.0.0.1:30005@31005 master,fail - 1426238316232 1426238315000 5 disconnected\n"
    )
    replica, mine, failed = parse_cluster_nodes(text)
    assert (replica.role, replica.master_id, replica.port, replica.slots) == ("replica", "e7d1", 30004, ())
    assert (mine.role, mine.slots, mine.open_slots) == ("master", ((0, 5460), (7000, 7000)), (93, 77))
    assert mine.slot_count == 5462
    assert mine.owns(7000)
    assert not mine.owns(7001)
    assert failed.failed
    assert not mine.failed


def test_a_server_older_than_seven_cannot_run_the_cluster(tmp_path: Path) -> None:
    old = tmp_path / "redis-server"
    old.write_text("#!/bin/sh\necho 'Redis server v=6.2.14 sha=00000000:0 malloc=jemalloc-5.1.0 bits=64'\n")
    old.chmod(0o755)
    with pytest.raises(ClusterNotSupported, match=r"6\.2\.14"):
        RedisCluster(binary=str(old))
