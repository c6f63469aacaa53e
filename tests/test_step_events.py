"""The engine's step events (common/metrics/step_events.py) and vLLM's KV
events (common/metrics/kv_events.py), on a tiny random Llama: what the live
view draws must be the engine's state at that step."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from common.config import EngineConfig, KVEventsConfig
from common.engine.parts import watch_if_asked
from common.metrics.kv_events import KVEventBatch, offset_endpoint_port
from common.metrics.step_events import JsonlRecorder, recording_path
from common.sampling_params import SamplingParams
from tests.engine_helpers import make_engine, run_all

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".vllm-venv" / "bin" / "python"

SHARED = list(range(10, 30))  # a system prompt: 5 full blocks of 4
PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def shared_prefix_prompts(n: int = 8) -> dict[str, list[int]]:
    return {f"req-{i}": SHARED + [100 + i] * (2 * i + 1) for i in range(n)}


def watched_run(engine, prompts, params=PARAMS) -> list[dict]:
    """Run to the end, keeping each step's frame with the engine's own
    figures at that step (read in the same subscriber call)."""
    frames = []

    def keep(frame: dict) -> None:
        bm, scheduler = engine.block_manager, engine.scheduler
        frame["_engine"] = {
            "num_used_blocks": bm.num_used_blocks,
            "cached_hashes": set(bm.hash_to_block),
            "running": [s.request_id for s in scheduler.running],
            "waiting": [s.request_id for s in scheduler.waiting]}
        frames.append(frame)

    engine.enable_step_events().subscribe(keep)
    run_all(engine, prompts, params)
    return frames


@pytest.fixture
def small_pool(tiny_llama):
    """Prefix caching on a pool too small for everyone: preemptions and evictions."""
    return make_engine(tiny_llama, num_blocks=40, block_size=4, enable_prefix_caching=True,
                       max_num_batched_tokens=64)


def test_events_are_off_by_default(tiny_llama):
    engine = make_engine(tiny_llama, num_blocks=40, block_size=4)
    run_all(engine, shared_prefix_prompts(2), PARAMS)
    assert engine.step_events is None


def test_each_frame_is_the_engine_at_that_step(small_pool):
    frames = watched_run(small_pool, shared_prefix_prompts())
    assert [f["step"] for f in frames] == list(range(1, len(frames) + 1))
    for frame in frames:
        truth = frame.pop("_engine")
        assert len(frame["blocks"]) == frame["num_blocks"] == 40
        drawn_used = sum(letter in "us" for letter in frame["blocks"])
        assert drawn_used == truth["num_used_blocks"] == frame["figures"]["num_used_blocks"]
        assert [r["request_id"] for r in frame["running"]] == truth["running"]
        queued = frame["waiting"] + frame["preempted"]
        assert sorted(r["request_id"] for r in queued) == sorted(truth["waiting"])
        in_tables = [b for r in frame["running"] for b in r["block_table"]]
        assert all(frame["blocks"][b] in "us" for b in in_tables)
        shared = {b for b in in_tables if in_tables.count(b) > 1}
        assert all(frame["blocks"][b] == "s" for b in shared)
        json.dumps(frame)  # the stream and the recording are JSON


def test_the_batch_says_prefill_decode_and_recompute(small_pool):
    frames = watched_run(small_pool, shared_prefix_prompts())
    kinds = {row["kind"] for f in frames for row in f["batch"]}
    assert kinds == {"prefill", "decode", "recompute"}  # the small pool preempts
    first = frames[0]["batch"]
    assert first and all(row["kind"] == "prefill" for row in first)
    for frame in frames:
        rows = frame["batch"]
        assert sum(row["num_tokens"] for row in rows) <= 64  # the step's token budget
        assert all(row["num_tokens"] == 1 for row in rows if row["kind"] == "decode")
        fed = [row["request_id"] for row in rows]
        after = {r["request_id"] for r in frame["running"] + frame["finished"]}
        assert len(set(fed)) == len(fed) and set(fed) <= after


def test_a_preempted_request_is_in_the_preempted_queue(small_pool):
    frames = watched_run(small_pool, shared_prefix_prompts())
    assert small_pool.scheduler.num_preemptions > 0
    preempted = [r for f in frames for r in f["preempted"]]
    assert preempted and all(r["num_preemptions"] >= 1 for r in preempted)
    # ... and it is not running at that step: it lost its blocks.
    for f in frames:
        running = {r["request_id"] for r in f["running"]}
        assert not running & {r["request_id"] for r in f["preempted"]}


def test_finished_requests_leave_their_blocks_free(small_pool):
    frames = watched_run(small_pool, shared_prefix_prompts())
    finished = [r["request_id"] for f in frames for r in f["finished"]]
    assert sorted(finished) == sorted(shared_prefix_prompts())
    last = frames[-1]
    assert last["running"] == [] and set(last["blocks"]) <= {".", "c"}
    assert last["figures"]["num_used_blocks"] == 0


def test_kv_events_replayed_give_the_prefix_cache(small_pool):
    """Applying each step's BlockStored / BlockRemoved to a set of hashes
    gives exactly the block manager's cached hashes at that step: what a
    KV-aware router following vLLM's events would know."""
    frames = watched_run(small_pool, shared_prefix_prompts())
    known: set[int] = set()
    types = set()
    for frame in frames:
        for event in frame["kv_events"]:
            types.add(event["type"])
            if event["type"] == "BlockStored":
                known |= set(event["block_hashes"])
            elif event["type"] == "BlockRemoved":
                known -= set(event["block_hashes"])
        assert known == frame["_engine"]["cached_hashes"], f"step {frame['step']}"
    assert types == {"BlockStored", "BlockRemoved"}  # the small pool evicts


def test_block_stored_carries_the_chain_and_the_tokens(small_pool):
    frames = watched_run(small_pool, shared_prefix_prompts())
    stored = [e for f in frames for e in f["kv_events"] if e["type"] == "BlockStored"]
    first = stored[0]
    assert first["parent_block_hash"] is None and first["block_size"] == 4
    assert first["token_ids"] == SHARED[:4 * len(first["block_hashes"])]
    assert set(first) == {"type", "block_hashes", "parent_block_hash", "token_ids",
                          "block_size", "lora_id", "medium", "lora_name"}
    for event in stored:
        assert len(event["token_ids"]) == 4 * len(event["block_hashes"])


def test_chapter_03s_region_is_one_block(tiny_llama):
    engine = make_engine(tiny_llama, "static", num_blocks=3, block_size=None,
                         max_model_len=96)
    frames = watched_run(engine, shared_prefix_prompts(4))
    assert frames[0]["block_size"] == 96
    for frame in frames:
        frame.pop("_engine")
        for row in frame["running"]:
            assert len(row["block_table"]) == 1  # a contiguous region each
    assert any(f["waiting"] for f in frames)  # 4 requests, 3 regions


def test_recording_is_the_frames_as_json_lines(small_pool, tmp_path):
    path = tmp_path / "run.jsonl"
    recorder = JsonlRecorder(str(path), small_pool.describe())
    small_pool.enable_step_events().subscribe(recorder)
    frames = watched_run(small_pool, shared_prefix_prompts(3))
    recorder.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0]["type"] == "config" and lines[0]["num_blocks"] == 40
    for frame in frames:
        frame.pop("_engine")
    assert lines[1:] == frames


def test_record_events_flag_writes_the_file(tiny_llama, tmp_path):
    path = tmp_path / "flag.jsonl"
    engine = make_engine(tiny_llama, num_blocks=40, block_size=4, record_events=str(path))
    run_all(engine, shared_prefix_prompts(2), PARAMS)
    lines = path.read_text().splitlines()
    assert json.loads(lines[0])["scheduler"] == "ContinuousScheduler"
    assert len(lines) > 2 and json.loads(lines[-1])["running"] == []


# ------------------------------------------------------------ ZeroMQ
def test_kv_events_config_is_vllms():
    config = KVEventsConfig.parse('{"enable_kv_cache_events": true}')
    assert config.publisher == "zmq" and config.endpoint == "tcp://*:5557"
    assert KVEventsConfig.parse("{}").publisher == "null"
    with pytest.raises(ValueError, match="unknown keys"):
        KVEventsConfig.parse('{"enable_kv_events": true}')


def subscribe(endpoint: str):
    import zmq
    socket = zmq.Context.instance().socket(zmq.SUB)
    socket.setsockopt(zmq.SUBSCRIBE, b"")
    socket.setsockopt(zmq.RCVTIMEO, 10_000)
    socket.connect(endpoint)
    return socket


def test_kv_events_over_zeromq_as_vllm_sends_them(tiny_llama, tmp_path):
    """Three frames per batch (topic, 8-byte sequence number, msgpack of
    [ts, events, data_parallel_rank]); the events as msgspec encodes vLLM's
    tagged structs. An ipc socket: no port to collide on."""
    import msgpack
    import zmq
    endpoint = f"ipc://{tmp_path}/kv-events"
    engine = make_engine(tiny_llama, num_blocks=40, block_size=4, enable_prefix_caching=True,
                         max_num_batched_tokens=64,
                         kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq",
                                           "endpoint": endpoint, "topic": "kv"})
    socket = subscribe(endpoint)
    # A PUB socket drops what it sends before a subscriber has joined:
    # send batches until the first one arrives.
    poller = zmq.Poller()
    poller.register(socket, zmq.POLLIN)
    for _ in range(200):
        engine.step_events.kv_publisher.publish(KVEventBatch(0.0, []))
        if poller.poll(50):
            socket.recv_multipart()
            break
    run_all(engine, shared_prefix_prompts(), PARAMS)
    batches = []
    while poller.poll(2000):  # the publisher's thread sends what the run queued
        topic, seq, payload = socket.recv_multipart()
        assert topic == b"kv" and len(seq) == 8
        batches.append((int.from_bytes(seq, "big"), msgpack.unpackb(payload)))
    engine.close()
    types = {e["type"] for _, batch in batches for e in batch[1]}
    assert types == {"BlockStored", "BlockRemoved"}
    numbers = [n for n, _ in batches]
    assert numbers == sorted(numbers) and len(set(numbers)) == len(numbers)
    ts, events, rank = batches[0][1]
    assert isinstance(ts, float) and rank == 0 and events
    assert events[0]["type"] == "BlockStored" and events[0]["medium"] == "GPU"


def test_endpoints_and_recordings_of_data_parallel_engines_by_vllms_rule():
    assert offset_endpoint_port("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint_port("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint_port("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"
    assert recording_path("/tmp/run.jsonl", 0) == "/tmp/run.jsonl"
    assert recording_path("/tmp/run.jsonl", 1) == "/tmp/run_dp1.jsonl"


def test_engine_1_publishes_on_its_own_endpoint_and_says_its_rank(tiny_llama, tmp_path):
    """ch09: the second data-parallel engine's KV events go to the endpoint
    + `_dp1`, each batch with data_parallel_rank 1; its recording to FILE_dp1."""
    import msgpack
    import zmq
    endpoint = f"ipc://{tmp_path}/kv-events"
    engine = make_engine(tiny_llama, num_blocks=40, block_size=4, enable_prefix_caching=True)
    config = EngineConfig(kv_events_config={"enable_kv_cache_events": True,
                                            "endpoint": endpoint},
                          record_events=str(tmp_path / "run.jsonl"))
    watch_if_asked(engine, config, data_parallel_rank=1)
    socket = subscribe(endpoint + "_dp1")
    poller = zmq.Poller()
    poller.register(socket, zmq.POLLIN)
    for _ in range(200):  # until the subscriber has joined (see above)
        engine.step_events.kv_publisher.publish(KVEventBatch(0.0, [], 1))
        if poller.poll(50):
            socket.recv_multipart()
            break
    run_all(engine, shared_prefix_prompts(), PARAMS)
    batches = []
    while poller.poll(2000):
        batches.append(msgpack.unpackb(socket.recv_multipart()[2]))
    engine.close()
    assert any(events for _, events, _ in batches)
    assert {rank for _, _, rank in batches} == {1}
    assert (tmp_path / "run_dp1.jsonl").exists() and not (tmp_path / "run.jsonl").exists()


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="the real vLLM is not installed "
                    "(`make vllm`): its decoder is the check")
def test_vllms_own_decoder_reads_our_kv_events(tiny_llama, tmp_path):
    """vLLM's KVEventBatch (msgspec) decodes our payload, with our values."""
    import msgpack
    engine = make_engine(tiny_llama, num_blocks=40, block_size=4, enable_prefix_caching=True,
                         max_num_batched_tokens=64)
    frames = watched_run(engine, shared_prefix_prompts())
    batch = next(f for f in frames if any(e["type"] == "BlockRemoved" for e in f["kv_events"]))
    wire = [batch["ts"], batch["kv_events"], 0]
    path = tmp_path / "payload.bin"
    path.write_bytes(msgpack.packb(wire))
    script = (
        "import sys, json, msgspec\n"
        "from vllm.distributed.kv_events import KVEventBatch\n"
        "b = msgspec.msgpack.Decoder(type=KVEventBatch).decode(open(sys.argv[1], 'rb').read())\n"
        "print(json.dumps([b.ts, b.data_parallel_rank, [[type(e).__name__, e.block_hashes,"
        " getattr(e, 'token_ids', None), getattr(e, 'parent_block_hash', None)]"
        " for e in b.events]]))\n")
    out = subprocess.run([str(VLLM_PYTHON), "-c", script, str(path)], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    ts, rank, events = json.loads(out.stdout.splitlines()[-1])
    assert ts == batch["ts"] and rank == 0
    assert events == [[e["type"], e["block_hashes"], e.get("token_ids"),
                       e.get("parent_block_hash")] for e in batch["kv_events"]]


def test_a_recording_draws_the_kv_pool_over_time(small_pool, tmp_path):
    """The pictures' KV pool (pictures/make/pictures.py) from a recording:
    each step's column is that frame's pool, coloured by request."""
    import numpy as np

    from pictures.make.pictures import pool_cells, trace_from_recording
    path = tmp_path / "run.jsonl"
    recorder = JsonlRecorder(str(path), small_pool.describe())
    small_pool.enable_step_events().subscribe(recorder)
    frames = watched_run(small_pool, shared_prefix_prompts(4))
    recorder.close()
    trace = trace_from_recording(path)
    image, _, _ = pool_cells(trace)
    assert image.shape[:2] == (40, len(frames))  # a row per block of 4, a column per step
    for x, frame in enumerate(frames):
        drawn = {b for b in range(40) if not np.allclose(image[b, x], 1.0)}
        assert drawn == {b for r in frame["running"] for b in r["block_table"]}
