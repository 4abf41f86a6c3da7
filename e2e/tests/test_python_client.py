"""The Python client (`clients/python`, `kvpick_client`) against the real `kvpick` binary.

The client is pip-installed from the checkout into a temporary directory (no build isolation, so
no network: the venv's setuptools builds it), which checks that the package installs and that
these tests exercise the checkout's code, not a copy installed earlier. Every call is made against
a `kvpick serve` with a static catalog of two fake ranks (nothing listens on them: the selection
API never contacts a rank), h2c, `--selection-api --worker-api --allow-pins`. Each test starts its
own kvpick, so no booking or cached prefix leaks between tests. Readiness is the gRPC readiness
service.
"""

from __future__ import annotations

import asyncio
import importlib
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import grpc
import pytest

import harness
from harness import wait_until, worker

CLIENT_DIR = harness.REPO_DIR / "clients" / "python"
MODEL = "m1"
BLOCK = 16  # kvpick's default block size: a 64-token prompt is 4 blocks


@pytest.fixture(scope="module")
def kc(tmp_path_factory) -> ModuleType:
    """``kvpick_client``, installed from the checkout with pip into a fresh target directory."""
    target = tmp_path_factory.mktemp("kvpick_client_install")
    build = tmp_path_factory.mktemp("kvpick_client_src")
    # pip builds in the source tree (build/, *.egg-info): build from a copy to keep it clean.
    src = shutil.copytree(CLIENT_DIR, build / "python",
                          ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet",
                    "--disable-pip-version-check", "--no-deps", "--no-build-isolation",
                    "--no-index", "--target", str(target),
                    str(src)], check=True)
    sys.path.insert(0, str(target))
    for name in [m for m in sys.modules if m == "kvpick_client" or m.startswith("kvpick_client.")]:
        del sys.modules[name]
    module = importlib.import_module("kvpick_client")
    assert Path(module.__file__).is_relative_to(target), module.__file__
    yield module
    sys.path.remove(str(target))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_kvpick(*flags: str) -> harness.Kvpick:
    """kvpick with worker w0 = two fake ranks of model m1, ready to select."""
    kv = harness.Kvpick([worker("w0", ports=[free_port(), free_port()])], secure=False,
                        extra_args=list(flags)).start()
    wait_until(lambda: kv.health("readiness", port=kv.health_port) == "SERVING", 30,
               desc="kvpick readiness SERVING")
    return kv


@pytest.fixture
def kv():
    k = start_kvpick("--selection-api", "--worker-api", "--allow-pins")
    yield k
    k.stop()


@pytest.fixture
def client(kc, kv):
    with kc.KvpickClient(f"127.0.0.1:{kv.grpc_port}") as c:
        yield c


def prompt(seed: int, blocks: int = 4) -> list[int]:
    """A prompt of ``blocks`` full blocks no other prompt of the test shares."""
    return list(range(seed * 1000, seed * 1000 + blocks * BLOCK))


def loads(client) -> list[tuple[int, int, int]]:
    """(active requests, prefill tokens, decode blocks) per rank of w0."""
    [w] = client.loads(MODEL)
    return [(r.active_requests, r.active_prefill_tokens, r.active_decode_blocks) for r in w.ranks]


def other(rank: int) -> int:
    return 1 - rank


# ------------------------------------------------------------------------------------------------
# the generated stubs


def test_the_committed_stubs_match_proto():
    """`generate.py --check` passes on the checkout."""
    out = subprocess.run([sys.executable, str(CLIENT_DIR / "generate.py"), "--check"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "up to date" in out.stdout


def test_the_stub_check_fails_when_proto_changes(tmp_path):
    """A proto edited without regenerating: `--check` names the stale stubs and fails."""
    repo = tmp_path / "repo"
    shutil.copytree(CLIENT_DIR, repo / "clients" / "python",
                    ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    proto = repo / "proto" / "kvpick" / "v1" / "selection.proto"
    proto.parent.mkdir(parents=True)
    text = (harness.REPO_DIR / "proto" / "kvpick" / "v1" / "selection.proto").read_text()
    proto.write_text(text.replace("message BookingAck { bool found = 1; }",
                                  "message BookingAck { bool found = 1; bool stale = 2; }"))
    out = subprocess.run([sys.executable, str(repo / "clients" / "python" / "generate.py"),
                          "--check"], capture_output=True, text=True)
    assert out.returncode == 1, out
    assert "clients/python/src/kvpick_client/_proto/selection_pb2.py" in out.stderr
    assert "clients/python/src/kvpick_client/_proto/selection.proto" in out.stderr


# ------------------------------------------------------------------------------------------------
# selection and bookings


def test_select_books_nothing_and_reserve_then_free_moves_the_load(client):
    tokens = prompt(1)
    pick = client.select(MODEL, tokens, fallbacks=1)
    assert pick.prompt_blocks == 4 and pick.request_id == ""
    assert len(pick.fallbacks) == 1 and pick.fallbacks[0].address != pick.primary.address
    assert pick.primary.worker_name == "w0" and pick.prefill is None
    assert loads(client) == [(0, 0, 0), (0, 0, 0)]

    booked = client.select_and_reserve("r1", MODEL, tokens)
    rank = booked.primary.dp_rank
    assert booked.request_id == "r1"
    assert loads(client)[rank] == (1, 64, 4)
    assert loads(client)[other(rank)] == (0, 0, 0)

    assert client.prefill_complete("r1") is True
    assert loads(client)[rank] == (1, 0, 4), "the prompt left the prefill load"
    assert client.free("r1") is True
    assert loads(client) == [(0, 0, 0), (0, 0, 0)]
    # Repeated or unknown ids are no-ops.
    assert client.free("r1") is False
    assert client.prefill_complete("never-booked") is False


def test_a_reservation_is_freed_when_its_block_raises(client):
    with pytest.raises(RuntimeError, match="the request failed"):
        with client.reservation("ctx", MODEL, prompt(2)) as pick:
            assert loads(client)[pick.primary.dp_rank][0] == 1
            raise RuntimeError("the request failed")
    assert loads(client) == [(0, 0, 0), (0, 0, 0)]
    assert client.free("ctx") is False


def test_overlap_scores_reflect_a_prior_request(client):
    tokens = prompt(3)
    before = client.overlap_scores(MODEL, tokens)
    assert before.prompt_blocks == 4
    assert sorted(s.gpu_blocks for s in before.scores) == [0, 0]

    booked = client.select_and_reserve("warm", MODEL, tokens)
    after = client.overlap_scores(MODEL, tokens)
    # The routed prompt is predicted cached on the picked rank; the engine computes the last
    # token, so 3 of the 4 blocks are credited. Tiers count "here or faster": gpu <= host <= disk.
    got = {s.rank.dp_rank: (s.gpu_blocks, s.host_blocks, s.disk_blocks) for s in after.scores}
    assert got == {booked.primary.dp_rank: (3, 3, 3), other(booked.primary.dp_rank): (0, 0, 0)}
    assert after.by_address()[booked.primary.address] == 3
    # Freed, the booking leaves its prediction: a pick of the same prompt now goes to the rank
    # that holds it, and says so. (While booked, the rank's queued prefill outweighs the 3 blocks.)
    assert client.free("warm")
    assert client.overlap_scores(MODEL, tokens).by_address()[booked.primary.address] == 3
    again = client.select(MODEL, tokens)
    assert (again.primary.dp_rank, again.overlap_blocks) == (booked.primary.dp_rank, 3)


def test_a_session_binds_to_its_rank_and_is_honoured(client):
    """A session's first booking binds it; later picks of the session stay on that rank even
    when the other rank holds the prompt (``--affinity-mode hard``, the default)."""
    session = client.session("chat-42")
    first = session.select_and_reserve("s1", MODEL, prompt(4))
    bound = first.primary
    assert client.free("s1")

    # Cache another prompt on the *other* rank (a pinned booking), so a free choice goes there.
    tokens = prompt(5)
    [w] = client.loads(MODEL)
    pinned = client.select_and_reserve("pin", MODEL, tokens, pin_worker_id=w.worker_id,
                                       pin_dp_rank=other(bound.dp_rank))
    assert pinned.primary.dp_rank == other(bound.dp_rank)
    assert client.free("pin")
    free_choice = client.select(MODEL, tokens)
    assert free_choice.primary.dp_rank == other(bound.dp_rank)
    assert free_choice.overlap_blocks == 3

    # The session keeps its rank, for a query and for a booking; an unbound session does not.
    assert session.select(MODEL, tokens).primary == bound
    with session.reservation("s2", MODEL, tokens) as pick:
        assert pick.primary == bound
        assert loads(client)[bound.dp_rank][0] == 1
    assert client.session("new-session").select(MODEL, tokens).primary.dp_rank \
        == other(bound.dp_rank)


def warm(client, name: str, tokens: list[int], rank: int) -> None:
    """Caches ``tokens`` on ``rank`` (a pinned booking, freed at once)."""
    [w] = client.loads(MODEL)
    pick = client.select_and_reserve(name, MODEL, tokens, pin_worker_id=w.worker_id,
                                     pin_dp_rank=rank)
    assert pick.primary.dp_rank == rank
    assert client.free(name)


def test_a_final_request_releases_its_sessions_binding(kv, client):
    session = client.session("short-lived")
    bound = session.select_and_reserve("f1", MODEL, prompt(12)).primary
    assert client.free("f1")
    tokens = prompt(13)
    warm(client, "f-warm", tokens, other(bound.dp_rank))
    # A query marked final only reads the binding.
    assert session.select(MODEL, tokens, session_final=True).primary == bound
    assert kv.metric("kvpick_session_bindings") == 1
    # The final booking is routed on the binding, which is released with it.
    with session.reservation("f2", MODEL, tokens, session_final=True) as last:
        assert last.primary == bound
    assert kv.metric("kvpick_session_invalidated_total", reason="final") == 1
    assert kv.metric("kvpick_session_bindings") == 0
    # The session id is free again: its next pick follows the cache, not the old rank.
    assert session.select(MODEL, tokens).primary.dp_rank == other(bound.dp_rank)


def test_a_child_session_starts_on_its_parents_rank(kc, kv, client):
    parent = client.session("agent")
    bound = parent.select_and_reserve("p1", MODEL, prompt(14)).primary
    assert client.free("p1")
    # The child's prompt is cached (3 blocks) on the other rank: within the soft margin
    # (--session-soft-margin, 64 blocks), the child still starts where its parent is.
    tokens = prompt(15)
    warm(client, "c-warm", tokens, other(bound.dp_rank))
    assert client.session("unrelated").select(MODEL, tokens).primary.dp_rank \
        == other(bound.dp_rank)
    child = parent.child("agent/sub-1")
    assert child.parent_session_id == "agent"
    with child.reservation("c1", MODEL, tokens) as pick:
        assert pick.primary == bound
    assert kv.metric("kvpick_session_events_total", event="parent_followed") == 1
    # The same through the plain option, and the id bounds (256 bytes passes, 257 does not).
    assert client.select(MODEL, tokens, session_id="agent/sub-2",
                         parent_session_id="agent").primary == bound
    assert client.select(MODEL, tokens, session_id="c", parent_session_id="p" * 256)
    with pytest.raises(kc.InvalidRequest, match="parent_session_id"):
        client.select(MODEL, tokens, session_id="c", parent_session_id="p" * 257)


def test_catalog_calls(kc, client):
    worker_id = client.upsert_worker("x", MODEL, "127.0.0.1", port=free_port(),
                                     data_parallel_size=2)
    x = {w.name: w for w in client.list_workers(MODEL)}["x"]
    assert (x.worker_id, x.namespace, len(x.ranks)) == (worker_id, "api", 2)
    assert x.lifecycle == "Schedulable"
    assert client.delete_worker("x") is True
    assert client.delete_worker("x") is False
    assert [w.name for w in client.list_workers()] == ["w0"]
    with pytest.raises(kc.InvalidRequest, match="IP address"):
        client.upsert_worker("y", MODEL, "not-an-ip", port=9000)


# ------------------------------------------------------------------------------------------------
# errors


def test_bad_input_maps_to_the_right_exception(kc, client):
    tokens = prompt(6)
    with pytest.raises(kc.InvalidRequest, match="model is required") as e:
        client.select("", tokens)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and e.value.http_status == 400
    with pytest.raises(kc.InvalidRequest, match="request_id is required"):
        client.select_and_reserve("", MODEL, tokens)
    with pytest.raises(kc.InvalidRequest, match="not both"):
        client.select(MODEL, tokens, block_hashes=[1, 2], prompt_tokens=32)
    with pytest.raises(kc.InvalidRequest, match="pin_dp_rank needs pin_worker_id"):
        client.select(MODEL, tokens, pin_dp_rank=0)
    [w] = client.loads(MODEL)
    with pytest.raises(kc.InvalidRequest, match="dp rank 2 is out of range"):
        client.select(MODEL, tokens, pin_worker_id=w.worker_id, pin_dp_rank=2)
    pinned = client.select(MODEL, tokens, pin_worker_id=w.worker_id, pin_dp_rank=1)
    assert pinned.primary.dp_rank == 1
    with pytest.raises(kc.Unavailable, match="pinned worker 7 is not available"):
        client.select(MODEL, tokens, pin_worker_id=7)
    # Caught before the wire: protobuf refuses a token id outside uint32.
    with pytest.raises(kc.InvalidRequest, match="out of range"):
        client.select(MODEL, [-1])
    with pytest.raises(kc.InvalidRequest):
        client.select(MODEL, [2**32])
    # The session id limit (256 bytes): at it passes, just over it is refused.
    assert client.select(MODEL, tokens, session_id="s" * 256).primary.worker_name == "w0"
    with pytest.raises(kc.InvalidRequest, match="session_id"):
        client.select(MODEL, tokens, session_id="s" * 257)
    with pytest.raises(kc.Unavailable) as e:
        client.select("no-such-model", tokens)
    assert e.value.http_status == 503
    with pytest.raises(TypeError, match="sesion_id"):
        client.select(MODEL, tokens, sesion_id="typo")

    # A live duplicate booking id conflicts, and the first booking is not lost.
    booked = client.select_and_reserve("dup", MODEL, tokens)
    with pytest.raises(kc.Conflict) as e:
        client.select_and_reserve("dup", MODEL, tokens)
    assert e.value.http_status == 409
    assert loads(client)[booked.primary.dp_rank][0] == 1
    assert client.free("dup")
    assert isinstance(e.value, kc.KvpickError)


def test_a_saturated_pool_is_overloaded_until_a_prefill_completes(kc):
    """Busy threshold of 64 prefill tokens per rank: two 64-token bookings fill both ranks, the
    third is refused (429), and a prefill marked complete makes room again."""
    kv = start_kvpick("--selection-api", "--active-prefill-tokens-threshold", "64")
    try:
        with kc.KvpickClient(f"127.0.0.1:{kv.grpc_port}") as c:
            first = c.select_and_reserve("b1", MODEL, prompt(16))
            second = c.select_and_reserve("b2", MODEL, prompt(17))
            assert {first.primary.dp_rank, second.primary.dp_rank} == {0, 1}
            with pytest.raises(kc.Overloaded) as e:
                c.select_and_reserve("b3", MODEL, prompt(18))
            assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert e.value.http_status == 429
            assert c.free("b3") is False, "a refused request books nothing"
            assert c.prefill_complete("b1")
            third = c.select_and_reserve("b3", MODEL, prompt(18))
            assert third.primary == first.primary
            assert all(c.free(r) for r in ("b1", "b2", "b3"))
    finally:
        kv.stop()


def test_bookings_without_the_selection_api_flag_are_permission_denied(kc):
    kv = start_kvpick()
    try:
        with kc.KvpickClient(f"127.0.0.1:{kv.grpc_port}") as c:
            with pytest.raises(kc.PermissionDenied, match="--selection-api"):
                c.select_and_reserve("r", MODEL, prompt(7))
            with pytest.raises(kc.PermissionDenied):
                c.free("r")
            with pytest.raises(kc.PermissionDenied, match="--worker-api"):
                c.upsert_worker("x", MODEL, "127.0.0.1", port=9000)
            assert c.select(MODEL, prompt(7)).primary.worker_name == "w0"
    finally:
        kv.stop()


def test_an_unreachable_or_silent_server_maps_to_unavailable_and_deadline(kc):
    # Nothing listens: the connection is refused at once.
    with kc.KvpickClient(f"127.0.0.1:{free_port()}") as c:
        with pytest.raises(kc.Unavailable):
            c.select(MODEL, prompt(8), timeout=10)
    # A TCP listener that never speaks HTTP/2: the call waits for its deadline.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        with kc.KvpickClient("127.0.0.1:%d" % silent.getsockname()[1], timeout=0.3) as c:
            with pytest.raises(kc.DeadlineExceeded):
                c.free("r")


# ------------------------------------------------------------------------------------------------
# asyncio


def test_the_asyncio_client_does_the_same(kc, kv):
    async def run() -> None:
        async with kc.AsyncKvpickClient(f"127.0.0.1:{kv.grpc_port}") as c:
            tokens = prompt(9)
            cold = await c.overlap_scores(MODEL, tokens)
            assert [s.gpu_blocks for s in cold.scores] == [0, 0]
            booked = await c.select_and_reserve("a1", MODEL, tokens)
            rank = booked.primary.dp_rank
            [w] = await c.loads(MODEL)
            assert w.ranks[rank].active_prefill_tokens == 64
            assert await c.prefill_complete("a1")
            [w] = await c.loads(MODEL)
            assert (w.ranks[rank].active_requests, w.ranks[rank].active_prefill_tokens) == (1, 0)
            with pytest.raises(kc.Conflict):
                await c.select_and_reserve("a1", MODEL, tokens)
            assert await c.free("a1")
            assert not await c.free("a1")
            scores = await c.overlap_scores(MODEL, tokens)
            assert scores.by_address()[booked.primary.address] == 3
            assert (await c.select(MODEL, tokens)).primary == booked.primary

            session = c.session("async-session")
            async with session.reservation("a2", MODEL, prompt(10)) as pick:
                [w] = await c.loads(MODEL)
                assert w.ranks[pick.primary.dp_rank].active_requests == 1
            assert (await session.select(MODEL, prompt(11))).primary == pick.primary
            [w] = await c.list_workers()
            assert [r.active_requests for r in w.ranks] == [0, 0]
            with pytest.raises(kc.InvalidRequest):
                await c.select("", tokens)
            wid = await c.upsert_worker("z", MODEL, "127.0.0.1", ports=[free_port()])
            assert wid and await c.delete_worker("z")

    asyncio.run(run())
