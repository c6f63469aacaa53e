"""The live view's page (common/entrypoints/live_view/) in a real browser:
Debian's Chromium, headless, driven by Selenium. Chapter 05 on a small
card under a 32-client load that preempts; the page must draw the engine's state
of each step, replay a recording the same way, and reconnect by itself
when the server restarts. The screenshot of the first test is the
README's picture of the view (pictures/screenshots/live-view.png).
Chapter 09 with two engine processes: a tab per engine, each drawing its own.
Chapter 10's recording, replayed: requests coloured by adapter.

Skipped, saying why, where Chromium or its driver cannot be installed
(`.ci/run` installs them with apt-get)."""
from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

from bench.loadtest import ChapterServer, run_load
from common.net import free_port
from tests.conftest import ROOT

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
try:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait
except ImportError:  # pragma: no cover - requirements.txt has it
    webdriver = None

pytestmark = pytest.mark.skipif(
    not (CHROMIUM and DRIVER and webdriver),
    reason="needs Debian's chromium and chromium-driver (apt-get install chromium "
           "chromium-driver) and selenium")

CARD = "0.75"  # about 80 blocks of 16 tokens: 32 clients preempt one another
CLIENTS, MAX_TOKENS = 32, 32
SCREENSHOT = ROOT / "pictures" / "screenshots" / "live-view.png"  # a screenshot, not drawn


@pytest.fixture(scope="module")
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,1000",
                "--disable-dev-shm-usage"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    yield driver
    driver.quit()


def page_state(browser, key: str) -> str | None:
    return browser.execute_script(f"return document.body.dataset.{key};")


def wait_for_page(browser, what: str, condition, timeout: float = 120) -> None:
    WebDriverWait(browser, timeout, poll_frequency=0.2).until(
        lambda driver: condition(driver), message=what)


def show(browser, step: int) -> None:
    browser.execute_script("window.liveView.show(arguments[0]);", step)
    wait_for_page(browser, f"step {step} drawn", lambda d: page_state(d, "step") == str(step))


def drawn_blocks(browser) -> dict[int, tuple[str, str | None]]:
    """block -> (its class among free/cached/used/shared, its owner)."""
    return {int(e["block"]): (e["cls"], e["owner"]) for e in browser.execute_script("""
        return [...document.querySelectorAll('[data-block]')].filter(e => e.id.startsWith('block-'))
          .map(e => ({block: e.dataset.block, owner: e.dataset.owner || null,
                      cls: ['free', 'cached', 'used', 'shared'].find(c => e.classList.contains(c))}));
    """)}


def frames_in_page(browser) -> list[dict]:
    return browser.execute_script("return window.liveView.frames;")


@pytest.fixture(scope="module")
def watched(start_server, tmp_path_factory, browser):
    """The page open on chapter 05 while 32 clients load it; /stats polled
    all along (its step number and used blocks)."""
    recording = tmp_path_factory.mktemp("rec") / "run.jsonl"
    args = ("--device-memory-gb", CARD, "--live-view", "--record-events", str(recording))
    server = start_server("05", *args)
    browser.get(server.url + "/ui/")
    wait_for_page(browser, "the page live", lambda d: page_state(d, "status") == "live")
    load = threading.Thread(target=run_load, args=(server.url, CLIENTS, 1, MAX_TOKENS))
    load.start()
    polled, seen_steps = {}, set()
    while load.is_alive():
        stats = requests.get(server.url + "/stats", timeout=30).json()
        polled[stats["num_steps"]] = stats["kv_used_blocks"]
        seen_steps.add(page_state(browser, "step"))
    load.join()
    final = requests.get(server.url + "/stats", timeout=30).json()
    wait_for_page(browser, "the last step drawn",
                  lambda d: page_state(d, "step") == str(final["num_steps"]))
    return server, args, recording, polled, seen_steps, final


def test_the_page_is_live_under_load(watched, browser):
    _, _, _, _, seen_steps, final = watched
    assert len(seen_steps - {None, "", "0"}) >= 3  # it moved while the load ran
    frames = frames_in_page(browser)
    last = final["num_steps"]  # every step, the last 500 kept
    assert [f["step"] for f in frames] == list(range(max(1, last - 499), last + 1))
    browser.execute_script("window.liveView.pause();")
    busiest = max(frames, key=lambda f: (bool(f["preempted"]), len(f["running"]),
                                         len(f["waiting"])))
    show(browser, busiest["step"])
    browser.save_screenshot(str(SCREENSHOT))  # the README's picture


def test_used_blocks_drawn_are_stats_at_the_same_step(watched, browser):
    polled = watched[3]
    steps = sorted(s for s in polled if s > 0)[:12]
    assert steps, "no /stats poll landed on a step"
    for step in steps:
        show(browser, step)
        blocks = drawn_blocks(browser)
        used = sum(cls in ("used", "shared") for cls, _ in blocks.values())
        figure = browser.find_element(By.ID, "figure-used-blocks").text
        assert used == polled[step] == int(figure), f"step {step}"


def test_a_preemption_is_drawn_in_the_preempted_queue(watched, browser):
    assert watched[5]["num_preemptions"] > 0
    frame = next(f for f in frames_in_page(browser) if f["preempted"])
    show(browser, frame["step"])
    listed = [e.get_attribute("data-request-id")
              for e in browser.find_elements(By.CSS_SELECTOR, "#preempted li[data-request-id]")]
    assert listed == [r["request_id"] for r in frame["preempted"]]


def test_a_finished_requests_blocks_are_drawn_free(watched, browser):
    frames = frames_in_page(browser)
    checked = 0
    for before, after in zip(frames, frames[1:]):
        for done in after["finished"]:
            table = next((r["block_table"] for r in before["running"]
                          if r["request_id"] == done["request_id"]), [])
            if not table:
                continue
            show(browser, after["step"])
            blocks = drawn_blocks(browser)
            for block in table:
                cls, owner = blocks[block]
                assert cls in ("free", "cached") or owner != done["request_id"], (block, cls)
            checked += 1
            if checked == 3:
                return
    assert checked


def test_a_click_shows_a_requests_block_table(watched, browser):
    frame = max(frames_in_page(browser), key=lambda f: len(f["running"]))
    show(browser, frame["step"])
    row = frame["running"][0]
    browser.find_element(By.CSS_SELECTOR,
                         f"#running li[data-request-id='{row['request_id']}']").click()
    panel = browser.find_element(By.ID, "block-table")
    assert panel.get_attribute("data-request-id") == row["request_id"]
    shown = [int(e.get_attribute("data-block"))
             for e in panel.find_elements(By.CSS_SELECTOR, "li[data-block]")]
    assert shown == row["block_table"]


def test_a_replay_draws_the_same_frames(watched, browser):
    recording = watched[2]
    frames = frames_in_page(browser)
    steps = [f["step"] for f in frames][:: max(1, len(frames) // 8)]
    live = {}
    for step in steps:
        show(browser, step)
        live[step] = browser.execute_script("return window.liveView.summary();")
    with replayed(browser, recording, len(frames)):
        assert page_state(browser, "mode") == "replay"
        for step in steps:
            show(browser, step)
            assert browser.execute_script("return window.liveView.summary();") == live[step]


@contextlib.contextmanager
def replayed(browser, recording: Path, num_frames: int):
    """The page open on `recording`, replayed with no engine, all its frames loaded."""
    port = free_port()
    replay = subprocess.Popen([sys.executable, "-m", "common.entrypoints.live_view",
                               "--replay", str(recording), "--port", str(port)],
                              cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        url = replay.stdout.readline().split("open ", 1)[1].strip()  # the URL it prints
        for _ in range(100):
            try:
                requests.get(f"http://127.0.0.1:{port}/ui/", timeout=1)
                break
            except requests.ConnectionError:
                time.sleep(0.1)
        browser.get(url)
        wait_for_page(browser, "the recording loaded",
                      lambda d: len(frames_in_page(d) or []) == num_frames)
        yield
    finally:
        replay.terminate()
        replay.wait(timeout=30)


def test_requests_are_coloured_by_adapter(embedded, browser, tmp_path):
    """Chapter 10, one adapter slot, two adapters and the base model: a
    recording of the offline engine, replayed. At a step where one
    adapter runs and the other waits, every request of an adapter has its
    adapter's colour and name, the base model's another colour, and the
    batch says how many of the slots are taken."""
    from common.entrypoints.llm import LLM
    from common.lora.request import LoRARequest
    from common.metrics.step_events import JsonlRecorder
    from common.sampling_params import SamplingParams
    llm = LLM(loaded=embedded, chapter="10", enable_lora=True, max_loras=1, max_lora_rank=8,
              device_memory_gb=2.0)
    recording = tmp_path / "adapters.jsonl"
    recorder = JsonlRecorder(str(recording), llm.engine.describe())
    llm.engine.enable_step_events().subscribe(recorder)
    adapters = ROOT / "10-adapters" / "adapters"
    loras = [None, LoRARequest("pirate", 1, str(adapters / "pirate")),
             LoRARequest("shout", 2, str(adapters / "shout"))]
    llm.generate(["Hi"] * 6, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False,
                 lora_request=[loras[i % 3] for i in range(6)])
    recorder.close()
    frames = [json.loads(line) for line in recording.read_text().splitlines()[1:]]
    step = next(f["step"] for f in frames if f["lora"]["waiting_lora_adapters"])
    with replayed(browser, recording, len(frames)):
        show(browser, step)
        chips = browser.execute_script("""
            return [...document.querySelectorAll('#running li, #waiting li')]
              .map(li => [li.textContent, li.style.getPropertyValue('--hue')]);""")
        budget = browser.find_element(By.ID, "lora-budget").text
    hues: dict[str, set[str]] = {}
    for text, hue in chips:
        name = text.rsplit(" · ", 1)[1] if " · " in text else "base"
        hues.setdefault(name, set()).add(hue)
    assert set(hues) == {"base", "pirate", "shout"}, chips
    assert all(len(h) == 1 for h in hues.values()), hues  # one colour per adapter
    assert len(set().union(*hues.values())) == 3, hues  # and three colours
    assert budget.startswith("Adapters in the batch: 1 of 1 slots"), budget


def test_the_page_reconnects_after_a_restart(watched, browser):
    server, args, _, _, _, _ = watched
    browser.get(server.url + "/ui/")
    wait_for_page(browser, "live", lambda d: page_state(d, "status") == "live")
    server.stop()
    wait_for_page(browser, "reconnecting", lambda d: page_state(d, "status") == "reconnecting")
    port = int(server.url.rsplit(":", 1)[1])
    again = ChapterServer("05", port, ["--dtype", "float32", *args],
                          server.log_path.with_name("again.log"))
    try:
        requests.post(again.url + "/v1/chat/completions", timeout=120, json={
            "model": "smollm2", "max_tokens": 4,
            "messages": [{"role": "user", "content": "Hello"}]}).raise_for_status()
        wait_for_page(browser, "live again, on the new server's steps",
                      lambda d: page_state(d, "status") == "live"
                      and (frames_in_page(d) or [{}])[0].get("step") == 1)
    finally:
        again.stop()


@pytest.mark.ch09
def test_each_data_parallel_engine_has_its_tab(start_server, browser):
    """Chapter 09 with two engine processes: a tab per engine, each page
    drawing its own engine's steps; a click on the other tab shows the other."""
    server = start_server("09", "--device-memory-gb", "1.1", "--data-parallel-size", "2",
                          "--live-view")
    browser.get(server.url + "/ui/?engine=1")
    wait_for_page(browser, "the page live", lambda d: page_state(d, "status") == "live")
    tabs = browser.find_elements(By.CSS_SELECTOR, "#engines a")
    assert [t.text for t in tabs] == ["engine 0", "engine 1"]
    assert [t.get_attribute("aria-current") for t in tabs] == [None, "page"]
    assert run_load(server.url, 8, 1, 16)["failed"] == 0
    engines = requests.get(server.url + "/stats", timeout=30).json()["engines"]
    wait_for_page(browser, "engine 1's last step drawn",
                  lambda d: page_state(d, "step") == str(engines[1]["num_steps"]))
    ones = {row["request_id"] for f in frames_in_page(browser) for row in f["finished"]}
    browser.find_element(By.LINK_TEXT, "engine 0").click()
    wait_for_page(browser, "engine 0's page", lambda d: d.current_url.endswith("?engine=0")
                  and page_state(d, "step") == str(engines[0]["num_steps"]))
    zeros = {row["request_id"] for f in frames_in_page(browser) for row in f["finished"]}
    assert ones and zeros and not ones & zeros and len(ones | zeros) == 8
    current = browser.find_elements(By.CSS_SELECTOR, "#engines a[aria-current]")
    assert [t.text for t in current] == ["engine 0"]
