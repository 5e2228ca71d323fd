"""vLLM 0.33.0's real Mooncake classes on kvfs: the store connector's worker, the EC embedding
store client, and (once kvfs has ``mooncake.engine``) the P/D ``MooncakeConnector``.

* ``MooncakeStoreWorker`` (``vllm/distributed/kv_transfer/kv_connector/v1/mooncake/store/
  worker.py``), the worker half of ``MooncakeStoreConnector``: built from a
  ``MOONCAKE_CONFIG_PATH`` file with the distributed-group getters and ``get_ip`` patched
  exactly as vLLM's own ``test_mooncake_store_worker.py`` patches them, a fake model config as
  there, and vLLM's real ``CacheConfig``, ``KVCacheConfig`` and ``FullAttentionSpec``. Its real
  ``register_kv_caches`` registers the CPU KV tensors and starts its real transfer threads;
  saves go to its sending thread (what ``wait_for_save`` does, minus the CUDA event it records),
  loads through ``start_load_kv`` / ``get_finished``, lookups through ``lookup`` and through
  the scheduler's ZMQ ``LookupKeyClient``, removal through ``LookupKeyClient.reset()``
  (``remove_all(force=True)`` on rank 0), teardown through ``close()``.
* ``MooncakeEmbeddingStoreClient`` (``vllm/distributed/ec_transfer/ec_connector/
  mooncake_store_embedding/store_client.py``) from ``create_mooncake_embedding_store_client``.
* ``MooncakeConnector`` (``.../kv_connector/v1/mooncake/mooncake_connector.py``), P/D
  disaggregation over ``mooncake.engine.TransferEngine``: a prefill process and a decode process
  with real ``VllmConfig``s (a tiny local Llama config, CPU platform), the real bootstrap HTTP
  server and ZMQ side channel, the bytes moved by kvfs's ``mooncake.engine``.
"""

import ctypes
import hashlib
import itertools
import json
import os
import sys
import tempfile
import time
from types import SimpleNamespace
from unittest import mock

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from _common import (  # noqa: E402
    MIB,
    Child,
    child_main,
    emit,
    master_addr,
    pattern,
    wait_for_quit,
)

if __name__ != "__main__":
    import pytest

    pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker")

import torch  # noqa: E402
from vllm.config import CacheConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import worker as store_worker  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (  # noqa: E402
    LoadSpec,
    MooncakeStoreConnectorMetadata,
    ReqMeta,
)
from vllm.v1.core.kv_cache_utils import BlockHash  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)

SCRIPT = os.path.abspath(__file__)
BS, NB, HEADS, HEAD = 16, 32, 4, 32  # store worker: block size, blocks, KV heads, head size
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
_ids = itertools.count(1)
_tmp = tempfile.mkdtemp(prefix="kvfs-engines-vllm-")
os.environ.setdefault("VLLM_RPC_BASE_PATH", _tmp)


def write_mooncake_config(mode, segment, local_buffer="64mb"):
    """The MOONCAKE_CONFIG_PATH file vLLM reads; returns its path."""
    path = os.path.join(_tmp, f"mooncake-{os.getpid()}-{next(_ids)}.json")
    with open(path, "w") as f:
        json.dump(
            {
                "metadata_server": "P2PHANDSHAKE",
                "master_server_address": master_addr(),
                "protocol": "tcp",
                "device_name": "",
                "mode": mode,
                "global_segment_size": segment,
                "local_buffer_size": local_buffer,
            },
            f,
        )
    return path


def block_hashes(tag, n):
    return [BlockHash(hashlib.sha256(f"{tag}/{i}".encode()).digest()) for i in range(n)]


# ----- MooncakeStoreWorker ----------------------------------------------------------------------


class _FakeModelConfig:  # as vLLM's test_mooncake_store_worker.py
    model = "kvfs/test-model"
    use_mla = False

    def get_num_layers(self, parallel_config):
        return len(LAYERS)

    def get_total_num_kv_heads(self):
        return HEADS


class _KVTransferConfig:
    def __init__(self, extra):
        self.kv_role = "kv_both"
        self.kv_connector_extra_config = extra

    def get_from_extra_config(self, key, default):
        return self.kv_connector_extra_config.get(key, default)


class StoreDriver:
    """One vLLM worker (TP 1) with MooncakeStoreConnector's worker over CPU KV tensors."""

    def __init__(self, mode="standalone-store", segment="0"):
        os.environ["MOONCAKE_CONFIG_PATH"] = write_mooncake_config(mode, segment)
        spec = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float16)
        page = spec.page_size_bytes
        self.kv_cache_config = KVCacheConfig(
            num_blocks=NB,
            kv_cache_tensors=[
                KVCacheTensor(size=NB * page, layers=[n], layer_stride=NB * page, block_stride=page)
                for n in LAYERS
            ],
            kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)],
        )
        cache_config = CacheConfig(block_size=BS)
        cache_config.num_gpu_blocks = NB
        self.vllm_config = SimpleNamespace(
            model_config=_FakeModelConfig(),
            parallel_config=SimpleNamespace(
                pipeline_parallel_size=1, rank=0, data_parallel_index=0, world_size=1,
                decode_context_parallel_size=1, prefill_context_parallel_size=1,
            ),
            kv_transfer_config=_KVTransferConfig({"lookup_rpc_port": f"{os.getpid()}{next(_ids)}"}),
            cache_config=cache_config,
            kv_events_config=None,
            speculative_config=None,
        )
        one = SimpleNamespace(world_size=1, rank_in_group=0)
        with mock.patch.object(store_worker, "get_tensor_model_parallel_rank", lambda: 0), \
                mock.patch.object(store_worker, "get_tensor_model_parallel_world_size", lambda: 1), \
                mock.patch.object(store_worker, "get_pcp_group", lambda: one), \
                mock.patch.object(store_worker, "get_dcp_group", lambda: one), \
                mock.patch.object(store_worker, "get_ip", lambda: "127.0.0.1"):
            self.worker = store_worker.MooncakeStoreWorker(self.vllm_config, self.kv_cache_config)
        # vLLM's KV layout: one tensor per layer, blocks outermost.
        self.kv = {n: torch.zeros(NB, 2, BS, HEADS, HEAD, dtype=torch.float16) for n in LAYERS}
        self.worker.register_kv_caches(self.kv)
        self.block_bytes = self.kv[LAYERS[0]][0].numel() * 2

    # -- block contents
    def fill(self, tag, blocks, first=0):
        for j, b in enumerate(blocks):
            for li, n in enumerate(LAYERS):
                data = pattern(tag, f"{li}/{first + j}", self.block_bytes)
                ctypes.memmove(self.kv[n][b].data_ptr(), data, len(data))

    def bad_blocks(self, tag, blocks, first=0):
        bad = []
        for j, b in enumerate(blocks):
            for li, n in enumerate(LAYERS):
                got = ctypes.string_at(self.kv[n][b].data_ptr(), self.block_bytes)
                if got != pattern(tag, f"{li}/{first + j}", self.block_bytes):
                    bad.append(first + j)
                    break
        return bad

    def zero(self, blocks):
        for n in LAYERS:
            self.kv[n][blocks] = 0

    # -- the connector's operations
    def save(self, tag, blocks, tokens=None):
        """A save job of ``tokens`` (default: all blocks) tokens; returns the put results
        recorded by the worker's own stats: (keys put, keys failed)."""
        hashes = block_hashes(tag, len(blocks))
        req = ReqMeta(
            req_id=f"save-{tag}-{next(_ids)}",
            token_len_chunk=tokens if tokens is not None else len(blocks) * BS,
            block_ids=(list(blocks),),
            block_hashes=hashes,
            can_save=True,
            store_job_id=next(_ids),
        )
        thread = self.worker.kv_send_thread
        thread.add_request(req)  # what wait_for_save does after recording its CUDA event
        thread.request_queue.join()
        stats = self.worker.get_kv_connector_stats()
        puts = stats.data.get("save_put", []) if stats is not None else []
        return sum(p["num_keys"] for p in puts), sum(p["num_failed_keys"] for p in puts)

    def lookup(self, tag, n, num_tokens):
        return self.worker.lookup(num_tokens, block_hashes(tag, n)).hit_length

    def load(self, tag, blocks, timeout=20.0):
        """start_load_kv of the tag's first len(blocks) blocks into ``blocks``; returns the
        block ids the worker reported as failed to load."""
        req_id = f"load-{tag}-{next(_ids)}"
        req = ReqMeta(
            req_id=req_id,
            token_len_chunk=len(blocks) * BS,
            block_ids=(list(blocks),),
            block_hashes=block_hashes(tag, len(blocks)),
            load_spec=LoadSpec(vllm_cached_tokens=0, kvpool_cached_tokens=len(blocks) * BS, can_load=True),
        )
        meta = MooncakeStoreConnectorMetadata(set(), set())
        meta.add_request(req)
        self.worker.start_load_kv(meta)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            _, done = self.worker.get_finished(set(), MooncakeStoreConnectorMetadata(set(), set()))
            if req_id in done:
                return self.worker.get_block_ids_with_load_errors()
            time.sleep(0.01)
        raise TimeoutError(f"load {req_id} did not finish")

    def close(self):
        # Not LookupKeyServer.close(): it closes the ZMQ socket under its serving thread's
        # blocking recv, which aborts the process (libzmq asserts); vLLM never calls it at
        # worker teardown either. Its thread is a daemon.
        self.worker.close()


# ----- EC embedding store client ------------------------------------------------------------------


def make_embedding_client(segment="32mb"):
    from vllm.distributed.ec_transfer.ec_connector.mooncake_store_embedding import store_client

    os.environ["MOONCAKE_CONFIG_PATH"] = write_mooncake_config(
        "embedded" if segment != "0" else "standalone-store", segment, local_buffer="16mb"
    )
    with mock.patch.object(store_client, "get_ip", lambda: "127.0.0.1"):
        return store_client.create_mooncake_embedding_store_client(read_buffer_bytes=4 * MIB)


def embedding(tag, i, tokens=7, hidden=64):
    raw = bytearray(pattern(tag, i, tokens * hidden * 2))
    t = torch.frombuffer(raw, dtype=torch.int16).view(tokens, hidden)
    # bf16 bit patterns with the exponent kept finite (no NaN/Inf), so torch.equal holds.
    return (t & 0x3FFF).view(torch.bfloat16).clone()


def embedding_spec(t):
    from vllm.distributed.ec_transfer.ec_connector.mooncake_store_embedding.data import TensorSpec

    return TensorSpec(shape=tuple(t.shape), dtype=str(t.dtype), nbytes=t.numel() * t.element_size())


# ----- P/D MooncakeConnector ------------------------------------------------------------------------

PD_BS, PD_NB, PD_LAYERS = 32, 8, 2  # the CPU attention backend wants multiples of 32
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
    "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 4,
    "num_hidden_layers": PD_LAYERS, "vocab_size": 1000, "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6, "torch_dtype": "float16", "head_dim": 32,
}


def pd_connector(role, bootstrap_port):
    """A real MooncakeConnector (WORKER role) for ``kv_producer`` / ``kv_consumer`` on CPU.

    Patched as vLLM's test_mooncake_connector.py patches its worker: get_ip and the TP/PP group
    getters; plus
    torch.accelerator.current_device_index, which a CUDA build of torch cannot answer without a
    driver."""
    from vllm.config import KVTransferConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import mooncake_connector as mc

    model_dir = os.path.join(_tmp, "tiny-llama")
    os.makedirs(model_dir, exist_ok=True)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(TINY_LLAMA, f)
    os.environ["VLLM_MOONCAKE_BOOTSTRAP_PORT"] = str(bootstrap_port)
    extra = {"mooncake_protocol": "tcp", "num_workers": 2}
    model = ModelConfig(model=model_dir, dtype="float16", skip_tokenizer_init=True, seed=0, max_model_len=1024)
    vllm_config = VllmConfig(
        model_config=model,
        cache_config=CacheConfig(block_size=PD_BS),
        kv_transfer_config=KVTransferConfig(kv_connector="MooncakeConnector", kv_role=role,
                                            kv_connector_extra_config=extra),
    )
    spec = FullAttentionSpec(block_size=PD_BS, num_kv_heads=4, head_size=32, dtype=torch.float16)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(PD_LAYERS)]
    page = spec.page_size_bytes
    kv_cache_config = KVCacheConfig(
        num_blocks=PD_NB,
        kv_cache_tensors=[KVCacheTensor(size=PD_NB * page, layers=[n], layer_stride=PD_NB * page,
                                        block_stride=page) for n in names],
        kv_cache_groups=[KVCacheGroupSpec(names, spec)],
    )
    pp = SimpleNamespace(rank_in_group=0, world_size=1)
    patches = [
        mock.patch.object(mc, "get_ip", lambda: "127.0.0.1"),
        mock.patch.object(mc, "get_tensor_model_parallel_rank", lambda: 0),
        mock.patch.object(mc, "get_tensor_model_parallel_world_size", lambda: 1),
        mock.patch.object(mc, "get_pp_group", lambda: pp),
        mock.patch("torch.accelerator.current_device_index", lambda: 0),
    ]
    for p in patches:
        p.start()  # kept for the life of the process: the workers' threads call them later
    with set_current_vllm_config(vllm_config):
        conn = mc.MooncakeConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
    kv = {n: torch.zeros(PD_NB, 2, PD_BS, 4, 32, dtype=torch.float16) for n in names}
    return mc, conn, kv


def pd_fill(kv, tag, blocks):
    for li, (n, t) in enumerate(kv.items()):
        for j, b in enumerate(blocks):
            data = pattern(tag, f"{li}/{j}", t[b].numel() * 2)
            ctypes.memmove(t[b].data_ptr(), data, len(data))


def pd_bad(kv, tag, blocks):
    bad = []
    for li, (n, t) in enumerate(kv.items()):
        for j, b in enumerate(blocks):
            if ctypes.string_at(t[b].data_ptr(), t[b].numel() * 2) != pattern(tag, f"{li}/{j}", t[b].numel() * 2):
                bad.append((n, b))
    return bad


def pd_prefill_send(mc, conn, transfer_id, blocks):
    """The prefill scheduler's two metadata steps for a request whose KV the decode pulls."""
    meta = mc.MooncakeConnectorMetadata()
    meta.add_new_req("p-req", [], {"transfer_id": transfer_id}, load_remote_cache=False)
    conn.connector_worker.start_load_kv(meta)  # update_state_after_alloc
    meta = mc.MooncakeConnectorMetadata()
    meta.add_new_req("p-req", [list(blocks)], {"transfer_id": transfer_id}, load_remote_cache=False)
    conn.connector_worker.start_load_kv(meta)  # request_finished


def pd_decode_pull(mc, conn, transfer_id, blocks, prefill_engine_id, bootstrap_port):
    meta = mc.MooncakeConnectorMetadata()
    meta.add_new_req("d-req", [list(blocks)], {
        "transfer_id": transfer_id,
        "remote_engine_id": prefill_engine_id,
        "remote_bootstrap_addr": f"http://127.0.0.1:{bootstrap_port}",
    })
    conn.connector_worker.start_load_kv(meta)


def pd_wait(conn, req_id, sending, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done_sending, done_recving = conn.connector_worker.get_finished()
        if req_id in ((done_sending if sending else done_recving) or set()):
            return True
        time.sleep(0.02)
    return False


# ----- child roles --------------------------------------------------------------------------------


def role_store_produce(tag, blocks, segment, hold=True, loop=False):
    """A vLLM worker saving ``blocks`` blocks (then new ones forever when ``loop``)."""
    d = StoreDriver(mode="embedded" if segment != "0" else "standalone-store", segment=segment)
    emit("setup", hostname=d.worker.store.get_hostname())
    ids = list(range(1, blocks + 1))  # block 0 is vLLM's null block
    d.fill(tag, ids)
    put, failed = d.save(tag, ids)
    emit("stored", put=put, failed=failed, hit=d.lookup(tag, blocks, blocks * BS + 1))
    n = 0
    while loop:
        d.fill(f"{tag}/{n}", ids)
        d.save(f"{tag}/{n}", ids)
        n += 1
        emit("progress", rounds=n)
    if hold:
        wait_for_quit()
    d.close()
    emit("closed")


def role_embed_produce(tag, count):
    c = make_embedding_client(segment="32mb")
    for i in range(count):
        c.put_tensor(f"{tag}-emb{i}", embedding(tag, i))
    emit("stored", exists=c.batch_exists([f"{tag}-emb{i}" for i in range(count)]))
    wait_for_quit()
    c.close()
    emit("closed")


def role_pd_prefill(tag, bootstrap_port, blocks):
    mc, conn, kv = pd_connector("kv_producer", bootstrap_port)
    pd_fill(kv, tag, blocks)
    conn.register_kv_caches(kv)  # batch_register_memory, sender listener, bootstrap registration
    pd_prefill_send(mc, conn, tag, blocks)
    emit("ready", engine_id=conn.engine_id)
    sent = pd_wait(conn, "p-req", sending=True)
    emit("sent", ok=sent)
    wait_for_quit()


def role_pd_decode(tag, bootstrap_port, blocks, prefill_engine_id):
    mc, conn, kv = pd_connector("kv_consumer", bootstrap_port)
    conn.register_kv_caches(kv)
    pd_decode_pull(mc, conn, tag, blocks, prefill_engine_id, bootstrap_port)
    got = pd_wait(conn, "d-req", sending=False)
    errors = sorted(conn.connector_worker.get_block_ids_with_load_errors())
    emit("received", ok=got, errors=errors, bad=[list(x) for x in pd_bad(kv, tag, blocks)])
    wait_for_quit()


ROLES = {
    "store_produce": role_store_produce,
    "embed_produce": role_embed_produce,
    "pd_prefill": role_pd_prefill,
    "pd_decode": role_pd_decode,
}


# ----- tests ----------------------------------------------------------------------------------------

if __name__ != "__main__":

    def _free_port():
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    @pytest.fixture
    def store(cluster):
        d = StoreDriver()
        yield d
        d.close()

    def test_store_save_lookup_load_byte_for_byte(store, tag):
        """Save 6 blocks (2 layer buffers each: batch_put_from_multi_buffers), look them up,
        load them into other blocks (batch_get_into_multi_buffers), compare every byte."""
        src, dst = list(range(1, 7)), list(range(10, 16))  # block 0 is vLLM's null block
        store.fill(tag, src)
        put, failed = store.save(tag, src)
        assert (put, failed) == (6, 0)
        assert store.lookup(tag, 6, 6 * BS + 1) == 6 * BS
        assert store.lookup(tag, 6, 6 * BS) == 5 * BS  # a full hit leaves the last token to compute
        assert store.load(tag, dst) == set()
        assert store.bad_blocks(tag, dst) == []
        # Saving the same blocks again puts nothing (batch_is_exist dedup).
        assert store.save(tag, src) == (0, 0)

    def test_store_partial_chunk_and_prefix(store, tag):
        """A save of 3.5 blocks stores 3; lookup and load of a prefix work; a 4th block misses."""
        src = [1, 2, 3, 4]
        store.fill(tag, src)
        assert store.save(tag, src, tokens=3 * BS + BS // 2) == (3, 0)
        assert store.lookup(tag, 4, 4 * BS + 1) == 3 * BS
        assert store.load(tag, [20, 21]) == set()
        assert store.bad_blocks(tag, [20, 21]) == []
        # A load of 4 blocks when only 3 exist reports the missing one as a load error.
        store.zero([24, 25, 26, 27])
        errors = store.load(tag, [24, 25, 26, 27])
        assert errors == {27}
        assert store.bad_blocks(tag, [24, 25, 26]) == []

    def test_store_scheduler_lookup_reset_close(cluster, tag):
        """The scheduler's LookupKeyClient over ZMQ: lookup, then reset (remove_all(force=True)),
        then the worker's close()."""
        d = StoreDriver()
        client = store_worker.LookupKeyClient(d.vllm_config)
        try:
            d.fill(tag, [1, 2])
            assert d.save(tag, [1, 2]) == (2, 0)
            hs = block_hashes(tag, 2)
            assert client.lookup("r1", 2 * BS + 1, hs).hit_length == 2 * BS
            assert client.reset() is True
            assert client.lookup("r2", 2 * BS + 1, hs).hit_length == 0
            assert d.load(tag, [5]) == {5}
        finally:
            client.close()
            store_ = d.worker.store
            d.close()
        assert store_.health_check() == 1

    def test_store_cross_process_embedded_segment(cluster, tag):
        """A worker process in embedded mode (its own 32 MiB segment) saves; this one loads."""
        p = Child(SCRIPT, "store_produce", tag=tag, blocks=8, segment="32mb")
        try:
            stored = p.wait_event("stored")
            assert (stored["put"], stored["failed"], stored["hit"]) == (8, 0, 8 * BS)
            d = StoreDriver()
            try:
                assert d.lookup(tag, 8, 8 * BS + 1) == 8 * BS
                assert d.load(tag, list(range(16, 24))) == set()
                assert d.bad_blocks(tag, list(range(16, 24))) == []
            finally:
                d.close()
        finally:
            p.finish()

    def test_store_sigkill_producer_then_new_producer(cluster, tag):
        """A worker killed mid-save (embedded segment, no close); the next worker's saves must all
        succeed at once and load back; the dead one's blocks load right or fail cleanly."""
        dead = Child(SCRIPT, "store_produce", tag=tag + "-dead", blocks=8, segment="32mb",
                     loop=True, hold=False)
        try:
            dead.wait_event("stored")
            dead.wait_event("progress")
        finally:
            dead.sigkill()
        nxt = Child(SCRIPT, "store_produce", tag=tag + "-next", blocks=16, segment="32mb")
        try:
            stored = nxt.wait_event("stored")
            assert (stored["put"], stored["failed"]) == (16, 0), f"next producer: {stored}"
            d = StoreDriver()
            try:
                assert d.load(tag + "-next", list(range(16))) == set()
                assert d.bad_blocks(tag + "-next", list(range(16))) == []
                errors = d.load(tag + "-dead", list(range(16, 24)))
                good = [b for b in range(16, 24) if b not in errors]
                bad = [b for b in good if d.bad_blocks(tag + "-dead", [b], first=b - 16)]
                assert bad == [], "a dead producer's block loaded with wrong bytes"
            finally:
                d.close()
        finally:
            nxt.finish()

    def test_embedding_client_put_exists_load_close(cluster, tag):
        """The EC embedding store client: put_tensor (header + tensor, multi-buffer), exists,
        batch_exists, load_tensors byte for byte, a miss, close()."""
        c = make_embedding_client(segment="32mb")
        keys = [f"{tag}-emb{i}" for i in range(3)]
        tensors = [embedding(tag, i) for i in range(3)]
        assert c.batch_exists(keys) == [False] * 3
        for k, t in zip(keys, tensors):
            c.put_tensor(k, t)
        assert c.exists(keys[0])
        assert c.batch_exists(keys + [f"{tag}-none"]) == [True, True, True, False]
        expected = {k: embedding_spec(t) for k, t in zip(keys, tensors)}
        expected[f"{tag}-none"] = embedding_spec(tensors[0])
        got = c.load_tensors(expected, "cpu")
        assert sorted(got) == sorted(keys)
        for k, t in zip(keys, tensors):
            assert torch.equal(got[k], t)
        c.close()

    def test_embedding_client_cross_process(cluster, tag):
        p = Child(SCRIPT, "embed_produce", tag=tag, count=4)
        try:
            assert p.wait_event("stored")["exists"] == [True] * 4
            c = make_embedding_client(segment="0")
            try:
                want = {f"{tag}-emb{i}": embedding(tag, i) for i in range(4)}
                got = c.load_tensors({k: embedding_spec(t) for k, t in want.items()}, "cpu")
                assert sorted(got) == sorted(want)
                for k in want:
                    assert torch.equal(got[k], want[k])
            finally:
                c.close()
        finally:
            p.finish()

    def test_pd_mooncake_connector_prefill_to_decode(cluster, tag):
        """vLLM P/D through mooncake.engine.TransferEngine: a prefill process writes 3 blocks of
        2 layers into a decode process's KV cache (batch_transfer_sync_write), kvfs's engine."""
        port = _free_port()
        prefill = Child(SCRIPT, "pd_prefill", tag=tag, bootstrap_port=port, blocks=[1, 2, 3])
        decode = None
        try:
            ready = prefill.wait_event("ready")
            decode = Child(SCRIPT, "pd_decode", tag=tag, bootstrap_port=port, blocks=[5, 6, 7],
                           prefill_engine_id=ready["engine_id"])
            received = decode.wait_event("received")
            assert received == {"ok": True, "errors": [], "bad": []}
            assert prefill.wait_event("sent") == {"ok": True}
        finally:
            if decode is not None:
                decode.finish()
            prefill.finish()


if __name__ == "__main__":
    child_main(ROLES)
