"""The live view's server side (common/entrypoints/live_view.py): one
stream per viewer, bounded; the frames are the engine's state at each
step; the page's routes and the API key; chapter 09's data-parallel
engines, a stream each. The page itself, in a real browser:
tests/test_live_view_browser.py."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading

import pytest
import requests

from bench.loadtest import run_load
from common.metrics.kv_events import KVEventBatch
from common.entrypoints.live_view import HISTORY, VIEWER_QUEUE, LiveView
from tests.conftest import ROOT, wait_for

SMALL_CARD = "0.7"  # 12 blocks of 16 tokens: 8 clients preempt one another


class Browser:
    """What LiveView.stream reads of the request: has the tab gone?"""
    gone = False

    async def is_disconnected(self) -> bool:
        return self.gone


def parse(write: str) -> list[tuple[str, dict]]:
    """One write of the stream: its events (the frames waiting go out together)."""
    events = []
    for event in write.strip().split("\n\n"):
        head, data = event.split("\n")
        events.append((head.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return events


async def read(stream, count: int) -> list[tuple[str, dict]]:
    """The stream's next `count` events, over as many writes as they take."""
    events = []
    while len(events) < count:
        events += parse(await anext(stream))
    assert len(events) == count, events
    return events


async def joined(view: LiveView):
    """A viewer's stream, past its config event (no history before it)."""
    stream = view.stream(Browser())
    assert [kind for kind, _ in await read(stream, 1)] == ["config"]
    return stream


def test_a_slow_viewer_loses_its_oldest_frames_and_is_told():
    """The engine never waits: frames beyond VIEWER_QUEUE push the oldest
    out, and the viewer is told how many it missed."""
    async def scenario():
        view = LiveView({"chapter": "05"})
        stream = await joined(view)
        for step in range(1, VIEWER_QUEUE + 11):
            view.on_frame({"step": step})  # returns at once, whoever reads
        await asyncio.sleep(0)  # the event loop hands them out
        events = await read(stream, VIEWER_QUEUE + 1)
        assert events[0] == ("gap", {"dropped": 10})
        assert [data["step"] for _, data in events[1:]] == list(range(11, VIEWER_QUEUE + 11))
    asyncio.run(scenario())


def test_ten_viewers_get_every_frame():
    async def scenario():
        view = LiveView({"chapter": "05"})
        streams = [await joined(view) for _ in range(10)]
        for step in range(1, 6):
            view.on_frame({"step": step})
        await asyncio.sleep(0)
        for stream in streams:
            assert [data["step"] for _, data in await read(stream, 5)] == [1, 2, 3, 4, 5]
        assert len(view.viewers) == 10
    asyncio.run(scenario())


def test_a_new_viewer_gets_the_last_frames_at_once():
    async def scenario():
        view = LiveView({"chapter": "05"})
        for step in range(1, HISTORY + 6):
            view.on_frame({"step": step})  # no viewer yet: kept in the history
        stream = view.stream(Browser())
        config, *first = parse(await anext(stream))  # one write
        assert config[0] == "config"
        assert [data["step"] for _, data in first] == list(range(6, HISTORY + 6))
    asyncio.run(scenario())


def test_streams_end_when_the_server_stops():
    async def scenario():
        view = LiveView({"chapter": "05"})
        stream = await joined(view)
        view.stop()
        with pytest.raises(StopAsyncIteration):
            await anext(stream)
        assert not view.viewers
    asyncio.run(scenario())


def test_chapter_02_refuses_the_live_view():
    out = subprocess.run([sys.executable, str(ROOT / "02-minimal-pytorch-inference/server.py"),
                          "--live-view"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "chapter 03 adds it" in out.stderr


# ------------------------------------------------------------- served
def read_stream(url: str, frames: list, stop: threading.Event, **kwargs) -> None:
    """An SSE reader in a thread: every `step` frame into `frames`."""
    with requests.get(url, stream=True, timeout=120, **kwargs) as response:
        assert response.status_code == 200, response.text
        event = None
        for line in response.iter_lines(decode_unicode=True):
            if line.startswith("event: "):
                event = line.removeprefix("event: ")
            elif line.startswith("data: ") and event == "step":
                frames.append(json.loads(line.removeprefix("data: ")))
            if stop.is_set():
                return


@pytest.fixture(scope="module")
def watched(start_server, tmp_path_factory):
    """Chapter 05 on a small card with the view on and a recording, under a
    load of 8 clients; the frames a viewer received and /stats polled
    during the load."""
    recording = tmp_path_factory.mktemp("rec") / "run.jsonl"
    server = start_server("05", "--device-memory-gb", SMALL_CARD, "--live-view",
                          "--record-events", str(recording))
    frames, polled, stop = [], {}, threading.Event()
    reader = threading.Thread(target=read_stream, args=(server.url + "/ui/events", frames, stop))
    reader.start()
    load = threading.Thread(target=run_load, args=(server.url, 8, 1, 48))
    load.start()
    while load.is_alive():
        stats = requests.get(server.url + "/stats", timeout=30).json()
        polled[stats["num_steps"]] = stats["kv_used_blocks"]
    load.join()
    final = requests.get(server.url + "/stats", timeout=30).json()
    for _ in range(600):  # the viewer has the last step too
        if frames and frames[-1]["step"] == final["num_steps"]:
            break
        threading.Event().wait(0.1)
    stop.set()
    reader.join()
    for _ in range(100):  # the server notices the reader has gone (its next heartbeat)
        if "a viewer left (0 watching)" in server.log_path.read_text():
            break
        threading.Event().wait(0.1)
    return server, frames, polled, final, recording


def test_the_stream_is_every_step(watched):
    _, frames, _, final, _ = watched
    assert [f["step"] for f in frames] == list(range(1, final["num_steps"] + 1))


def test_blocks_drawn_are_the_stats_at_the_same_step(watched):
    _, frames, polled, _, _ = watched
    by_step = {f["step"]: sum(letter in "us" for letter in f["blocks"]) for f in frames}
    common = [step for step in polled if step in by_step and step > 0]
    assert common, "no /stats poll landed on a step"
    assert {step: by_step[step] for step in common} == {step: polled[step] for step in common}


def test_a_preemption_shows_in_the_preempted_queue(watched):
    _, frames, _, final, _ = watched
    assert final["num_preemptions"] > 0
    preempted = [r["request_id"] for f in frames for r in f["preempted"]]
    assert preempted


def test_a_finished_requests_blocks_are_free_at_once(watched):
    _, frames, _, _, _ = watched
    checked = 0
    for before, after in zip(frames, frames[1:]):
        owners_after = {b for r in after["running"] for b in r["block_table"]}
        for done in after["finished"]:
            rows = [r for r in before["running"] if r["request_id"] == done["request_id"]]
            for block in (rows[0]["block_table"] if rows else []):
                assert block in owners_after or after["blocks"][block] in ".c"
                checked += 1
    assert checked


def test_the_recording_is_the_stream(watched):
    _, frames, _, _, recording = watched
    lines = [json.loads(line) for line in recording.read_text().splitlines()]
    assert lines[0]["type"] == "config" and lines[0]["num_blocks"] == frames[0]["num_blocks"]
    assert lines[1:] == frames


def test_the_page_and_a_closed_tab_leave_one_line_each(watched):
    server = watched[0]
    page = requests.get(server.url + "/ui", timeout=30)
    assert page.status_code == 200 and "view.js" in page.text
    assert requests.get(server.url + "/ui/view.js", timeout=30).status_code == 200
    before = server.log_path.read_text().count("\n")
    bad = requests.get(server.url + "/ui/events?key=%ZZ&step=<script>", stream=True, timeout=30)
    assert bad.status_code == 200
    next(bad.iter_lines())  # the config event: a viewer, then the tab closes
    bad.close()
    assert requests.get(server.url + "/ui/?a=%%%", timeout=30).status_code == 200
    threading.Event().wait(2.5)  # the stream notices within HEARTBEAT_S
    new = server.log_path.read_text().splitlines()[before:]
    assert not [line for line in new if any(word in line for word in
                                            ("Traceback", "ERROR", "WARNING"))], new
    assert sum("a viewer left" in line for line in new) == 1


def first_event(url: str) -> dict:
    """A stream's first event: its config."""
    with requests.get(url, stream=True, timeout=30) as response:
        lines = response.iter_lines(decode_unicode=True)
        assert next(lines) == "event: config"
        return json.loads(next(lines).removeprefix("data: "))


@pytest.mark.ch09
def test_each_data_parallel_engine_has_its_own_stream(start_server, tmp_path):
    """Chapter 09 with two engine processes: each sends every step's frame
    to the API server, `/ui/events?engine=N` streams engine N's, and each
    request shows in one engine only; each engine records a file of its own."""
    recording = tmp_path / "run.jsonl"
    server = start_server("09", "--device-memory-gb", "1.1", "--data-parallel-size", "2",
                          "--live-view", "--record-events", str(recording))
    urls = [f"{server.url}/ui/events?engine={rank}" for rank in (0, 1)]
    configs = [first_event(url) for url in urls]
    assert [(c["data_parallel_rank"], c["data_parallel_size"]) for c in configs] == [(0, 2),
                                                                                      (1, 2)]
    frames, stop = ([], []), threading.Event()
    readers = [threading.Thread(target=read_stream, args=(url, kept, stop))
               for url, kept in zip(urls, frames)]
    for reader in readers:
        reader.start()
    summary = run_load(server.url, 8, 1, 16)
    assert summary["failed"] == 0, summary
    engines = requests.get(server.url + "/stats", timeout=30).json()["engines"]
    for kept, engine in zip(frames, engines):  # the viewers have every step
        wait_for(lambda: kept and kept[-1]["step"] == engine["num_steps"], "the last frame")
    stop.set()
    for kept, engine in zip(frames, engines):
        assert [f["step"] for f in kept] == list(range(1, engine["num_steps"] + 1))
    finished = [{row["request_id"] for f in kept for row in f["finished"]} for kept in frames]
    assert finished[0] and finished[1] and not finished[0] & finished[1]
    assert len(finished[0] | finished[1]) == 8
    recorded = [recording, tmp_path / "run_dp1.jsonl"]
    for path, kept in zip(recorded, frames):
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        assert lines[0]["type"] == "config" and lines[1:] == kept
    missing = requests.get(server.url + "/ui/events?engine=2", timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    for reader in readers:  # each ends at its next heartbeat
        reader.join(30)


def test_the_view_needs_the_api_key(start_server):
    server = start_server("06", "--api-key", "sesame", "--live-view")
    url = server.url + "/ui/events"
    refused = requests.get(url, timeout=30)
    assert refused.status_code == 401
    assert refused.json()["error"]["code"] == "invalid_api_key"
    assert requests.get(url + "?key=wrong", timeout=30).status_code == 401
    for kwargs in ({"params": {"key": "sesame"}},
                   {"headers": {"Authorization": "Bearer sesame"}}):
        with requests.get(url, stream=True, timeout=30, **kwargs) as response:
            assert response.status_code == 200
            assert next(response.iter_lines(decode_unicode=True)) == "event: config"
    assert requests.get(server.url + "/ui/", timeout=30).status_code == 200  # like /docs
    assert requests.get(server.url + "/stats", timeout=30).status_code == 401


def test_the_view_follows_kv_events_in_vllms_format(tiny_llama, tmp_path):
    """`--kv-events ENDPOINT` (make watch-vllm): the batches an engine
    publishes over ZeroMQ (ours here; the real vLLM's in tests/test_vllm.py
    decode the same) become `kv` frames, in order, with their events."""
    from common.entrypoints.live_view import follow_kv_events
    from common.sampling_params import SamplingParams
    from tests.engine_helpers import make_engine, run_all
    endpoint = f"ipc://{tmp_path}/kv"
    engine = make_engine(tiny_llama, num_blocks=40, block_size=4, enable_prefix_caching=True,
                         kv_events_config={"enable_kv_cache_events": True,
                                           "endpoint": endpoint})
    view = LiveView({"source": "kv-events"})
    follow_kv_events(view, endpoint)
    for _ in range(100):  # until the subscriber has joined (a PUB socket drops before)
        engine.step_events.kv_publisher.publish(KVEventBatch(0.0, []))
        threading.Event().wait(0.05)
        if view.history:
            break
    joined = len(view.history)
    prompts = {f"r{i}": list(range(10, 30)) + [100 + i] * 5 for i in range(4)}
    run_all(engine, prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    threading.Event().wait(1.0)
    engine.close()
    frames = [json.loads(text) for text in list(view.history)[joined:]]
    assert frames and all(f["type"] == "kv" for f in frames)
    assert [f["step"] for f in frames] == sorted(f["step"] for f in frames)
    stored = [e for f in frames for e in f["kv_events"] if e["type"] == "BlockStored"]
    assert stored and stored[0]["token_ids"][:4] == [10, 11, 12, 13]
