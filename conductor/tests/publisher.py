"""A KV event publisher as the engines run it: ZeroMQ PUB `[topic, seq (8 bytes big-endian),
msgpack batch]` plus a ROUTER replay endpoint that answers `[b"", start_seq]` with every
buffered batch from there on and an end marker (`seq` -1), as vLLM's and SGLang's
`ZmqEventPublisher` do (vllm/distributed/kv_events.py, sglang/srt/disaggregation/kv_events.py).

Formats: `tagged` (newer vLLM: events are maps with a "type" tag), `array` (older vLLM and
SGLang: events are positional arrays, tag first), `sglang` (tagged maps with SGLang's media and
fields). Driven by JSON lines on stdin, one batch each:
  {"events": [{"type": "stored", "hashes": [..], "medium": "GPU"} |
              {"type": "stored_tokens", "tokens": [..], "block_size": 16,
               "algorithm": "sha256_cbor", "seed": null} |
              {"type": "removed", "hashes": [..]} | {"type": "cleared"}],
   "live": true}
`live: false` keeps the batch in the replay buffer only (a batch the subscriber missed).
Prints `ready <pub endpoint> <replay endpoint>` once bound and `ok <seq>` after each batch.
"""

import argparse
import json
import os
import queue
import sys
import threading
import time

import msgpack
import zmq

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vllm_hash import transcription  # noqa: E402


def event(e, fmt):
    kind = e["type"]
    if kind == "stored_tokens":
        case = {"algorithm": e["algorithm"], "seed": e.get("seed"), "tokens": e["tokens"],
                "block_size": e["block_size"], "lora": None, "cache_salt": None}
        _, digests = transcription(case)
        # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES (the default): the low 8 bytes, big-endian. As
        # vLLM, the event carries the stored blocks' tokens.
        full = len(digests) * e["block_size"]
        e = {"type": "stored", "hashes": [int.from_bytes(d[-8:], "big") for d in digests],
             "medium": e.get("medium", "GPU"), "block_size": e["block_size"],
             "token_ids": e["tokens"][:full]}
        kind = "stored"
    if kind == "stored":
        fields = {"block_hashes": e["hashes"], "parent_block_hash": None,
                  "token_ids": e.get("token_ids", []),
                  "block_size": e.get("block_size", 16), "lora_id": None,
                  "medium": e.get("medium")}
        if fmt == "array":
            return ["BlockStored", fields["block_hashes"], None, fields["token_ids"],
                    fields["block_size"], None, fields["medium"]]
        out = {"type": "BlockStored", **fields}
        return {k: v for k, v in out.items() if v is not None}
    if kind == "removed":
        if fmt == "array":
            return ["BlockRemoved", e["hashes"], e.get("medium")]
        out = {"type": "BlockRemoved", "block_hashes": e["hashes"], "medium": e.get("medium")}
        return {k: v for k, v in out.items() if v is not None}
    if kind == "cleared":
        return ["AllBlocksCleared"] if fmt == "array" else {"type": "AllBlocksCleared"}
    raise ValueError(kind)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--format", choices=["tagged", "array", "sglang"], default="tagged")
    ap.add_argument("--dp-rank", type=int, default=0)
    ap.add_argument("--pub-port", type=int, default=0)
    ap.add_argument("--replay-port", type=int, default=0)
    a = ap.parse_args()
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(f"tcp://127.0.0.1:{a.pub_port}")
    replay = ctx.socket(zmq.ROUTER)
    replay.setsockopt(zmq.LINGER, 0)
    replay.bind(f"tcp://127.0.0.1:{a.replay_port}")
    print("ready", pub.getsockopt_string(zmq.LAST_ENDPOINT),
          replay.getsockopt_string(zmq.LAST_ENDPOINT), flush=True)

    lines = queue.Queue()

    def read():
        for line in sys.stdin:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    buffer, seq = [], 0
    while True:
        if replay.poll(10):
            client, _, start = replay.recv_multipart()
            start = int.from_bytes(start, "big")
            for s, payload in buffer:
                if s >= start:
                    replay.send_multipart([client, b"", b"", s.to_bytes(8, "big"), payload])
            replay.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])
        try:
            line = lines.get_nowait()
        except queue.Empty:
            continue
        if line is None:
            break
        cmd = json.loads(line)
        fmt = "array" if a.format == "array" else "tagged"
        batch = [time.time(), [event(e, fmt) for e in cmd["events"]], a.dp_rank]
        payload = msgpack.packb(batch, use_bin_type=True)
        if cmd.get("live", True):
            pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
        buffer.append((seq, payload))
        print("ok", seq, flush=True)
        seq += 1


if __name__ == "__main__":
    main()
