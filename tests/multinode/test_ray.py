"""tensorshm.ray in a two-node Ray cluster on this machine (ray.cluster_utils.Cluster: a head
with the custom resource node_a, a second node with node_b), each node with its own tensorshmd:
movers run as actors pinned by those resources and call each other as Ray actors; every byte
shipped is checked on the destination by a separate consumer process. One cluster, one pair of
daemons and one pair of movers serve the whole module (a cluster takes seconds to start)."""

from __future__ import annotations

import os

# Ray's nodes on loopback only (with it unset they take the machine's other address, where a
# node started with node_ip_address="127.0.0.1" alone hung). Ray reads it at import.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import pytest  # noqa: E402
import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

import tensorshm  # noqa: E402
import tensorshm.ray  # noqa: E402
from conftest import TOKEN_FILE, Daemon, wait_for  # noqa: E402
from test_ship import SHIPS, consume, nothing_held, publish  # noqa: E402

NODES = ("node_a", "node_b")


@pytest.fixture(scope="module")
def cluster():
    node = {"num_cpus": 1, "include_dashboard": False, "object_store_memory": 100 << 20}
    c = Cluster(initialize_head=True, head_node_args={**node, "resources": {"node_a": 1}})
    try:
        c.add_node(**node, resources={"node_b": 1})
        ray.init(address=c.address, log_to_driver=False)
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


@pytest.fixture(scope="module")
def node_daemons():
    a, b = Daemon("ray-a", host_pool="1Gi"), Daemon("ray-b", host_pool="1Gi")
    yield a, b
    assert a.stop() == 0 and b.stop() == 0


@pytest.fixture(scope="module")
def movers(cluster, node_daemons):
    a, b = node_daemons
    movers = tensorshm.ray.start_movers({"node_a": a.socket, "node_b": b.socket},
                                        token_file=TOKEN_FILE)
    yield movers
    tensorshm.ray.stop_movers(movers)


def named_actors() -> set[str]:
    return {n["name"] for n in ray.util.list_named_actors(all_namespaces=True)}


def node_ids() -> dict[str, str]:
    """Custom resource -> the id of the node that has it."""
    return {r: n["NodeID"] for n in ray.nodes() if n["Alive"] for r in NODES if r in n["Resources"]}


def test_each_mover_is_an_actor_on_its_node_and_a_client_of_its_daemon(node_daemons, movers):
    assert list(movers) == list(NODES)
    infos = ray.get([m.info.remote() for m in movers.values()])
    ids = node_ids()
    assert ids["node_a"] != ids["node_b"]
    for node, daemon, info in zip(NODES, node_daemons, infos):
        assert info["node"] == node and info["node_id"] == ids[node], info
        assert info["resources"] == {node: tensorshm.ray.RESOURCE_SHARE}, info
        assert info["socket"] == daemon.socket and info["pid"] != os.getpid()
        with tensorshm.connect(daemon.socket) as c:
            assert info["pid"] in {s["pid"] for s in c.sessions()}, c.sessions()
    assert infos[0]["pid"] != infos[1]["pid"]
    # Named actors: ships from anywhere in the namespace find them.
    assert ray.get(tensorshm.ray.get_mover("node_b").info.remote())["pid"] == infos[1]["pid"]


@pytest.mark.parametrize("name,kind", SHIPS, ids=["1KiB", "64MiB", "strided"])
def test_ship_moves_every_byte_to_a_consumer_on_the_destination(node_daemons, movers, name, kind):
    a, b = node_daemons
    with tensorshm.connect(a.socket) as ca, tensorshm.connect(b.socket) as cb:
        publish(ca, f"ray/{name}", kind)
        assert tensorshm.ray.ship(f"ray/{name}", "node_a", "node_b", timeout=60) == f"ray/{name}"
        print(consume(b, f"ray/{name}", kind))
        assert f"ray/{name}" in ca  # the source keeps its tensor
        assert wait_for(lambda: nothing_held(ca)), ca.stat()
        assert wait_for(lambda: nothing_held(cb)), cb.stat()


def test_ship_by_handles_as_another_name_and_replace(node_daemons, movers):
    a, b = node_daemons
    with tensorshm.connect(a.socket) as ca:
        publish(ca, "ray/named", "bytes:4096")
    ship = tensorshm.ray.ship
    assert ship("ray/named", movers["node_a"], movers["node_b"], "in/named") == "in/named"
    consume(b, "in/named", "bytes:4096")
    with pytest.raises(tensorshm.AlreadyExistsError):
        ship("ray/named", "node_a", "node_b", "in/named")
    assert ship("ray/named", "node_a", "node_b", "in/named", replace=True) == "in/named"
    consume(b, "in/named", "bytes:4096")
    with tensorshm.connect(b.socket) as cb:
        assert "ray/named" not in cb and nothing_held(cb)


def test_ship_prefix_ships_every_name_under_it(node_daemons, movers):
    a, b = node_daemons
    with tensorshm.connect(a.socket) as ca:
        for i in range(3):
            publish(ca, f"ray/batch/{i}", f"bytes:{1000 + i}")
    names = tensorshm.ray.ship_prefix("ray/batch/", "node_a", "node_b")
    assert names == ["ray/batch/0", "ray/batch/1", "ray/batch/2"]
    for i in range(3):
        consume(b, f"ray/batch/{i}", f"bytes:{1000 + i}")


def test_movers_ship_both_ways_at_once(node_daemons, movers):
    """Each mover pulls from the other while serving the other's pull (its own ``pull`` and its
    ``serve`` run in separate concurrency groups); the ObjectRef form of ship."""
    a, b = node_daemons
    with tensorshm.connect(a.socket) as ca, tensorshm.connect(b.socket) as cb:
        publish(ca, "ray/from-a", f"f32:{4 << 20}")
        publish(cb, "ray/from-b", "bytes:100000")
    refs = [movers["node_b"].pull.remote("node_a", "ray/from-a", timeout=60),
            movers["node_a"].pull.remote("node_b", "ray/from-b", timeout=60)]
    assert ray.get(refs, timeout=70) == ["ray/from-a", "ray/from-b"]
    consume(b, "ray/from-a", f"f32:{4 << 20}")
    consume(a, "ray/from-b", "bytes:100000")


def test_a_name_not_published_is_not_found_and_a_node_without_a_mover_unreachable(
        node_daemons, movers):
    a, b = node_daemons
    with pytest.raises(tensorshm.NotFoundError) as e:
        tensorshm.ray.ship("ray/missing", "node_a", "node_b", timeout=10)
    assert 'name = "ray/missing"' in str(e.value), e.value
    assert "mover tensorshm-mover:node_a" in str(e.value), e.value
    with tensorshm.connect(b.socket) as cb:
        assert nothing_held(cb) and "ray/missing" not in cb
    with pytest.raises(tensorshm.ConnectionError, match='node = "node_c": no mover runs'):
        tensorshm.ray.ship("ray/tiny", "node_a", "node_c")


def test_movers_on_every_node_by_node_id(cluster, node_daemons, movers):
    """start_movers without a mapping: a mover on every alive node, named and pinned by its
    node id, each on the one socket given (here both nodes' movers are daemon b's clients: the
    two nodes share this machine)."""
    a, b = node_daemons
    started = tensorshm.ray.start_movers(socket=b.socket, token_file=TOKEN_FILE)
    try:
        ids = node_ids()
        assert set(started) == set(ids.values())
        for node_id, info in zip(started, ray.get([m.info.remote() for m in started.values()])):
            assert info["node_id"] == node_id and info["socket"] == b.socket, info
        with tensorshm.connect(a.socket) as ca:
            publish(ca, "ray/by-id", "bytes:2048")
        assert tensorshm.ray.ship("ray/by-id", "node_a", ids["node_b"], "by-id") == "by-id"
        consume(b, "by-id", "bytes:2048")
    finally:
        tensorshm.ray.stop_movers(started)


def test_start_movers_refuses_what_it_cannot_place_or_start(cluster, node_daemons, movers):
    a, _ = node_daemons
    with pytest.raises(tensorshm.InvalidArgumentError, match='node = "node_c"'):
        tensorshm.ray.start_movers({"node_c": a.socket},  # no node has it: not left pending
                                   token_file=TOKEN_FILE)
    with pytest.raises(tensorshm.AlreadyExistsError, match='node = "node_a"'):
        tensorshm.ray.start_movers({"node_a": a.socket}, token_file=TOKEN_FILE)
    # A node whose daemon is not there: the client's error, naming the socket; no actor stays.
    node_a = node_ids()["node_a"]
    with pytest.raises(tensorshm.ConnectionError, match="/nonexistent/tensorshm.sock"):
        tensorshm.ray.start_movers({node_a: "/nonexistent/tensorshm.sock"},
                                   token_file=TOKEN_FILE)
    # Without a token (and not insecure) a mover refuses to start; no actor stays.
    with pytest.raises(tensorshm.FailedPreconditionError, match="no credentials"):
        tensorshm.ray.start_movers({node_a: a.socket})
    assert wait_for(lambda: named_actors() == {tensorshm.ray.actor_name(n) for n in NODES}), \
        named_actors()


def test_a_ray_caller_without_the_token_gets_nothing_from_a_mover(node_daemons, movers):
    """A Ray namespace is no boundary: any driver can call a mover actor's serve. Without a
    proof of the fleet token (or with a replayed one) it gets UNAUTHENTICATED and nothing
    else."""
    from tensorshm._mover_auth import Token
    from tensorshm._mover_service import messages

    a, _ = node_daemons
    m = messages()
    with tensorshm.connect(a.socket) as ca:
        publish(ca, "ray/secret", "bytes:64")
        before = ca.stat()
        offer = m["OfferRequest"](name="ray/secret").SerializeToString()
        listing = m["ListRequest"](prefix="").SerializeToString()
        other = Token(b"another fleet's token, 32 bytes!")
        target = tensorshm.ray.actor_name("node_a")
        for method, request, proof in (
                ("Offer", offer, ""), ("Offer", offer, other.sign_call("Offer", offer, target)[0]),
                ("List", listing, ""),
                ("List", listing, Token.from_file(TOKEN_FILE).sign_call(
                    "List", listing, tensorshm.ray.actor_name("node_b"))[0])):
            reply, reply_proof, code, message = ray.get(
                movers["node_a"].serve.remote(method, request, proof))
            assert (reply, reply_proof, code) == (b"", "", 16), (method, message)
            print(method, message)
        proof, _ = Token.from_file(TOKEN_FILE).sign_call("List", listing, target)
        assert ray.get(movers["node_a"].serve.remote("List", listing, proof))[2] == 0
        replayed = ray.get(movers["node_a"].serve.remote("List", listing, proof))
        assert replayed[2] == 16 and "a replay" in replayed[3], replayed
        after = ca.stat()
        assert (after["leases"], after["tensors"]) == (before["leases"], before["tensors"])


def test_a_mover_killed_fails_the_ship_and_one_started_again_serves(node_daemons, movers):
    """Last in the module: it replaces node_a's mover (in `movers`, which teardown stops)."""
    a, b = node_daemons
    with tensorshm.connect(a.socket) as ca:
        publish(ca, "ray/again", f"f32:{1 << 20}")
    ray.kill(movers["node_a"])
    # ray.kill returns before the GCS drops the actor's name; a ship in between finds the dying
    # actor and fails on the call instead (also a ConnectionError). Wait for the name to go.
    assert wait_for(lambda: tensorshm.ray.actor_name("node_a") not in named_actors())
    with pytest.raises(tensorshm.ConnectionError, match='node = "node_a": no mover runs'):
        tensorshm.ray.ship("ray/again", "node_a", "node_b", timeout=10)
    with tensorshm.connect(a.socket) as ca, tensorshm.connect(b.socket) as cb:
        assert "ray/again" not in cb and wait_for(lambda: nothing_held(cb)), cb.stat()
        assert wait_for(lambda: nothing_held(ca)), ca.stat()
    movers.update(tensorshm.ray.start_movers({"node_a": a.socket}, token_file=TOKEN_FILE))
    assert tensorshm.ray.ship("ray/again", "node_a", "node_b") == "ray/again"
    consume(b, "ray/again", f"f32:{1 << 20}")
