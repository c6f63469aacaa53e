"""KV cache events in vLLM's schema, and vLLM's ZeroMQ publisher for them (ch05).

vLLM tells tools outside the engine (a KV-aware router, a dashboard)
which blocks its prefix cache holds, as a stream of events
(vllm/distributed/kv_events.py):

- `BlockStored`: full blocks named by their hashes now hold these tokens
  (`block_hashes`, the hash of the block before them, `token_ids`);
- `BlockRemoved`: these hashes are gone (their blocks were handed out
  again: our lazy eviction);
- `AllBlocksCleared`: the whole prefix cache was dropped (vLLM's
  `/reset_prefix_cache`; this course has no such route and never sends
  it, but the view understands it in vLLM's stream).

A step's events travel as one `KVEventBatch` (`[ts, events, dp_rank]`).
With `--kv-events-config '{"enable_kv_cache_events": true, "publisher":
"zmq", "endpoint": "tcp://*:5557"}'` (vLLM's flag and keys), each batch
goes out on a ZeroMQ PUB socket as vLLM's does: three frames, the topic,
an 8-byte big-endian sequence number and the msgpack payload. A
subscriber written for vLLM's events decodes ours.

vLLM's block pool appends the events where it caches and evicts a block.
Here `KVEventTracker` finds them after the step instead, by comparing the
block manager's `hash_to_block` with the last step's copy: the block
manager stays as chapter 04 wrote it (a learner's too), and with the
events off nothing is compared.

Left out: the replay socket (`replay_endpoint`: a subscriber asks again for
batches it missed), LoRA names, `extra_keys`, KV-cache groups, and the
events of blocks reused from the cache (vLLM 0.32's `emit_cached_block_events`).
"""
from __future__ import annotations

import logging
import queue
import threading
from dataclasses import asdict, dataclass
from itertools import count

from common.config import KVEventsConfig

log = logging.getLogger("llm-course")

MEDIUM_GPU = "GPU"  # vLLM's name for the engine's own KV pool, its CPU build included


@dataclass
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None


@dataclass
class BlockRemoved:
    block_hashes: list[int]
    medium: str | None = MEDIUM_GPU


@dataclass
class AllBlocksCleared:
    pass


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


def event_to_dict(event: KVCacheEvent) -> dict:
    """As msgspec encodes vLLM's tagged structs: a map with the class name
    under "type", then the fields."""
    return {"type": type(event).__name__, **asdict(event)}


@dataclass
class KVEventBatch:
    ts: float  # time.time() of the step
    events: list[KVCacheEvent]
    data_parallel_rank: int | None = 0

    def to_wire(self) -> list:
        """vLLM's `EventBatch` is an array-like struct: [ts, events, rank]."""
        return [self.ts, [event_to_dict(e) for e in self.events], self.data_parallel_rank]


class KVEventTracker:
    """The prefix cache's changes in one step, from the block manager's state.

    `hash_to_block` names every cached block (a full, computed block, in
    use or free but not yet handed out again). A hash that appeared since
    the last call was stored; one that disappeared was removed."""

    def __init__(self, block_manager):
        self.block_manager = block_manager
        self.known: dict[int, int] = dict(block_manager.hash_to_block)  # hash -> block id

    def take_events(self, seqs) -> list[KVCacheEvent]:
        """The events since the last call. `seqs`: the sequences of the
        step (a stored block belongs to one of them: its hash chain gives
        the parent and the tokens)."""
        now = self.block_manager.hash_to_block
        gone = [h for h, b in self.known.items() if now.get(h) != b]
        new = {h for h, b in now.items() if self.known.get(h) != b}
        self.known = dict(now)
        events: list[KVCacheEvent] = [BlockRemoved(gone)] if gone else []
        if new:
            events.extend(self._stored(new, seqs))
        return events

    def _stored(self, new: set[int], seqs) -> list[BlockStored]:
        """One `BlockStored` per sequence and run of newly cached blocks, as
        vLLM's `cache_full_blocks` sends them."""
        block_size = self.block_manager.block_size
        events = []
        for seq in seqs:
            run: list[int] = []  # block indexes in seq
            for j, block_hash in enumerate(seq.block_hashes):
                if block_hash in new:
                    new.discard(block_hash)  # a hash two sequences share: stored once
                    run.append(j)
                elif run:
                    break
            if run:
                first, last = run[0], run[-1]
                events.append(BlockStored(
                    block_hashes=[seq.block_hashes[j] for j in run],
                    parent_block_hash=seq.block_hashes[first - 1] if first else None,
                    token_ids=seq.token_ids[first * block_size:(last + 1) * block_size],
                    block_size=block_size))
        return events


def offset_endpoint_port(endpoint: str, data_parallel_rank: int) -> str:
    """ch09: data-parallel engine N publishes on the configured port + N
    (ipc and inproc addresses get `_dpN`), vLLM's rule: a subscriber
    dials the base port plus the rank it wants."""
    if data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith(("ipc://", "inproc://")):
        return f"{endpoint}_dp{data_parallel_rank}"
    base, _, port = endpoint.rpartition(":")
    return f"{base}:{int(port) + data_parallel_rank}"


class ZmqEventPublisher:
    """vLLM's publisher: `publish` queues a batch (the engine never waits
    on the network); a thread encodes it with msgpack and sends
    (topic, sequence number, payload) on a PUB socket."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0):
        import msgpack
        import zmq
        self._pack = msgpack.Packer()
        self._context = zmq.Context.instance()
        self._socket = self._context.socket(zmq.PUB)
        self._socket.set_hwm(config.hwm)
        self.endpoint = offset_endpoint_port(config.endpoint, data_parallel_rank)
        self.data_parallel_rank = data_parallel_rank  # stamped on every batch, as vLLM does
        if "*" in self.endpoint or self.endpoint.startswith(("ipc://", "inproc://")):
            self._socket.bind(self.endpoint)
        else:
            self._socket.connect(self.endpoint)
        self._topic = config.topic.encode()
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(config.max_queue_size)
        self._seq = count()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, batch: KVEventBatch) -> None:
        try:
            self._queue.put_nowait(batch)
        except queue.Full:  # a subscriber cannot slow the engine: the batch is lost
            log.warning("kv events: queue full, a batch dropped")

    def _run(self) -> None:
        while (batch := self._queue.get()) is not None:
            payload = self._pack.pack(batch.to_wire())
            self._socket.send_multipart((self._topic, next(self._seq).to_bytes(8, "big"),
                                         payload))

    def shutdown(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=1.0)
        self._socket.close(linger=0)
