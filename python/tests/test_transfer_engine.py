"""``mooncake.engine.TransferEngine`` between two real processes.

A target process (this file run as a script) initializes an engine, allocates a managed buffer
and registers a numpy array, prints its name and addresses, and serves until told to stop; the
test process writes and reads both regions with the sync, batch and async calls, checks every
byte, and checks the reference's return codes for bad input and unreachable peers. Both the
shared-memory path (managed buffers on one host) and TCP (``MC_FORCE_TCP``) are exercised.
"""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from mooncake.engine import TransferEngine, TransferNotify, TransferOpcode

MIB = 1 << 20


def serve():
    """Target side: print what the initiator needs, then answer commands on stdin."""
    te = TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    managed = te.allocate_managed_buffer(8 * MIB)
    assert managed != 0
    arr = np.zeros(4 * MIB, dtype=np.uint8)
    assert te.register_memory(arr.ctypes.data, arr.nbytes) == 0
    name = f"127.0.0.1:{te.get_rpc_port()}"
    print(json.dumps({"name": name, "managed": managed, "array": arr.ctypes.data}), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "sum":  # blake-free check: the bytes of a range, as hex of their sha256
            import hashlib

            addr, n = int(cmd[1]), int(cmd[2])
            print(hashlib.sha256(te.read_bytes_from_buffer(addr, n)).hexdigest(), flush=True)
        elif cmd[0] == "notifies":
            print(json.dumps([[n.name, n.msg] for n in te.get_notifies()]), flush=True)
        elif cmd[0] == "quit":
            break


@pytest.fixture(params=["shm", "tcp"])
def target(request):
    env = dict(os.environ)
    if request.param == "tcp":
        env["MC_FORCE_TCP"] = "true"
    p = subprocess.Popen(
        [sys.executable, __file__, "serve"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    info = json.loads(p.stdout.readline())

    def ask(line):
        p.stdin.write(line + "\n")
        p.stdin.flush()
        return p.stdout.readline().strip()

    info["ask"] = ask
    info["proc"] = p
    info["mode"] = request.param
    yield info
    if p.poll() is None:
        p.stdin.write("quit\n")
        p.stdin.flush()
        p.wait(timeout=10)


@pytest.fixture
def initiator(target):
    if target["mode"] == "tcp":
        os.environ["MC_FORCE_TCP"] = "true"
    te = TransferEngine()
    try:
        assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    finally:
        os.environ.pop("MC_FORCE_TCP", None)
    assert 15000 <= te.get_rpc_port() <= 17000
    return te


def sha(b):
    import hashlib

    return hashlib.sha256(bytes(b)).hexdigest()


def test_sync_and_batch_transfers_move_every_byte(target, initiator):
    te, name = initiator, target["name"]
    local = te.allocate_managed_buffer(8 * MIB)
    assert local != 0
    rng = np.random.default_rng(7)
    data = rng.integers(0, 256, 8 * MIB, dtype=np.uint8).tobytes()
    for peer in (target["managed"], target["array"]):
        assert te.write_bytes_to_buffer(local, data, len(data)) == 0
        # one write of 3 MiB + 17 bytes, read back into another part of the local buffer
        n = 3 * MIB + 17
        assert te.transfer_sync_write(name, local, peer, n) == 0
        assert target["ask"](f"sum {peer} {n}") == sha(data[:n])
        assert te.transfer_sync_read(name, local + 4 * MIB, peer, n) == 0
        assert te.read_bytes_from_buffer(local + 4 * MIB, n) == data[:n]
        assert te.write_bytes_to_buffer(local, data, len(data)) == 0  # undo that read
        # a batch of small and large items at odd offsets
        sizes = [1, 4095, 64 << 10, 1 * MIB, 7]
        offs, o = [], 0
        for s in sizes:
            offs.append(o)
            o += s + 13
        srcs = [local + 5 * MIB + x for x in offs]
        dsts = [peer + x for x in offs]
        assert te.batch_transfer_sync_write(name, srcs, dsts, sizes) == 0
        for x, s in zip(offs, sizes):
            want = data[5 * MIB + x : 5 * MIB + x + s]
            assert target["ask"](f"sum {peer + x} {s}") == sha(want), (x, s)
        assert te.batch_transfer_sync_read(name, [local + x for x in offs], dsts, sizes) == 0
        for x, s in zip(offs, sizes):
            assert te.read_bytes_from_buffer(local + x, s) == data[5 * MIB + x : 5 * MIB + x + s]
    assert te.get_first_buffer_address(name) in (target["managed"], target["array"])
    assert te.free_managed_buffer(local, 8 * MIB) == 0


def test_async_batches_and_status(target, initiator):
    te, name = initiator, target["name"]
    local = te.allocate_managed_buffer(2 * MIB)
    payload = bytes(range(256)) * (MIB // 256)
    te.write_bytes_to_buffer(local, payload, MIB)
    ids = [
        te.batch_transfer_async_write(name, [local], [target["managed"] + i * MIB], [MIB])
        for i in range(2)
    ]
    assert all(ids) and len(set(ids)) == 2
    assert te.get_batch_transfer_status(ids) == 0
    assert target["ask"](f"sum {target['managed'] + MIB} {MIB}") == sha(payload)
    rid = te.batch_transfer_async_read(name, [local + MIB], [target["managed"]], [MIB])
    deadline = time.monotonic() + 10
    while (st := te.transfer_check_status(rid)) == 0 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert st == 1
    assert te.read_bytes_from_buffer(local + MIB, MIB) == payload
    assert te.transfer_check_status(rid) == -1, "a finished id is forgotten"
    sid = te.transfer_submit_write(name, local, target["managed"], 4096)
    assert te.get_batch_transfer_status([sid]) == 0
    # a write out of the peer's registered memory fails, and so does its batch status
    bad = te.batch_transfer_async_write(name, [local], [target["managed"] + 8 * MIB - 10], [100])
    assert bad != 0 and te.get_batch_transfer_status([bad]) == -1


def test_notifications_ride_after_the_transfer(target, initiator):
    te, name = initiator, target["name"]
    local = te.allocate_managed_buffer(MIB)
    n = TransferNotify("decode-0", "req-17 done")
    rc = te.transfer_sync(name, local, target["managed"], 4096, TransferOpcode.Write, notify=n)
    assert rc == 0
    rc = te.batch_transfer_sync(
        name, [local], [target["managed"]], [16], TransferOpcode.Read, TransferNotify("a", "b")
    )
    assert rc == 0
    got = []
    deadline = time.monotonic() + 5
    while len(got) < 2 and time.monotonic() < deadline:
        got += json.loads(target["ask"]("notifies"))
    assert got == [["decode-0", "req-17 done"], ["a", "b"]]


def test_bad_input_gets_the_reference_codes(target, initiator):
    te, name = initiator, target["name"]
    local = te.allocate_managed_buffer(MIB)
    peer = target["managed"]
    # outside the peer's registered memory / unregistered local memory / mismatched lists
    assert te.transfer_sync_write(name, local, peer + 8 * MIB, 16) == -1
    assert te.transfer_sync_write(name, local, peer + 8 * MIB - 8, 16) == -1
    scratch = np.zeros(4096, dtype=np.uint8)
    assert te.transfer_sync_write(name, scratch.ctypes.data, peer, 16) == -1
    assert te.batch_transfer_sync_write(name, [local, local], [peer], [1, 1]) == -1
    assert te.transfer_sync(name, local, peer, 16, 7) == -1
    # the connection stays usable after refused items
    assert te.transfer_sync_write(name, local, peer, 16) == 0
    # unreachable peers: sync -1, async 0, probe non-zero; all within their deadline
    t0 = time.monotonic()
    assert te.transfer_sync_write("127.0.0.1:9", local, 0, 16) == -1
    assert te.batch_transfer_async_write("unreachable_peer:9", [local], [0], [16]) == 0
    assert te.send_probe("127.0.0.1:9") != 0
    assert te.send_probe(name) == 0
    assert time.monotonic() - t0 < 30
    assert te.get_batch_transfer_status([123456789]) == -1
    # registration codes
    assert te.register_memory(scratch.ctypes.data, 0) == -1
    assert te.register_memory(scratch.ctypes.data, scratch.nbytes) == 0
    assert te.register_memory(scratch.ctypes.data, scratch.nbytes) == -7
    assert te.unregister_memory(scratch.ctypes.data) == 0
    assert te.unregister_memory(scratch.ctypes.data) == -3
    assert te.write_bytes_to_buffer(scratch.ctypes.data, b"x", 1) == -1, "not registered"
    a, b = np.zeros(4096, np.uint8), np.zeros(4096, np.uint8)
    assert te.batch_register_memory([a.ctypes.data, b.ctypes.data], [4096, 4096]) == 0
    assert te.batch_unregister_memory([a.ctypes.data, b.ctypes.data]) == 0


def test_a_dead_peer_is_an_error_within_the_deadline(target, initiator):
    te, name = initiator, target["name"]
    local = te.allocate_managed_buffer(MIB)
    assert te.transfer_sync_write(name, local, target["managed"], 4096) == 0
    target["proc"].kill()
    target["proc"].wait()
    t0 = time.monotonic()
    assert te.transfer_sync_write(name, local, target["managed"], 4096) == -1
    assert te.transfer_sync_read(name, local, target["managed"], 4096) == -1
    assert time.monotonic() - t0 < 30


def test_uninitialized_engine_answers_codes():
    te = TransferEngine()
    assert te.get_rpc_port() == 0
    assert te.transfer_sync_write("127.0.0.1:1", 1, 1, 1) == -1
    assert te.batch_transfer_async_read("127.0.0.1:1", [1], [1], [1]) == 0
    assert te.allocate_managed_buffer(4096) == 0
    assert te.get_notifies() == []
    assert TransferEngine.TransferOpcode.Write == 1


if __name__ == "__main__" and sys.argv[1:] == ["serve"]:
    serve()
