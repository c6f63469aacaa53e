"""The live view's screenshots for chapters 03, 04 and 05: each chapter's own pool.

    python -m pictures.make.screenshots            # make screenshots (~3 min)
    python -m pictures.make.screenshots 04         # one chapter

For each chapter, its server on the demo card with `--live-view` (what
`make watch CH=NN CARD=1.1` starts), the page open in headless Chromium,
then the load a learner runs next to it (`make loadtest`: CLIENTS clients,
MAX_TOKENS tokens each). Once the load is done, the page is paused on its
busiest step (the middle one of those with the most requests running) and saved as
pictures/screenshots/live-view-chNN.png: chapter 03's one region, chapter
04's static batch of blocks, chapter 05's continuous batch.

Chapter 05 under 32 clients on a smaller card, preempting, is the
README's picture (pictures/screenshots/live-view.png), taken by
tests/test_live_view_browser.py.

Left out: checking the picture (the browser test checks what the page
draws against the engine's /stats); needs Debian's chromium and
chromium-driver, and selenium.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench.loadtest import ChapterServer, run_load
from common.net import free_port

ROOT = Path(__file__).resolve().parents[2]
OUT_DIR = ROOT / "pictures" / "screenshots"
CARD = "1.1"  # the demo card
CLIENTS, MAX_TOKENS = 8, 32
CHAPTERS = ["03", "04", "05"]


def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,1000",
                "--disable-dev-shm-usage"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)


def wait_until(driver, condition, what: str, timeout: float = 120.0) -> None:
    from selenium.webdriver.support.ui import WebDriverWait
    WebDriverWait(driver, timeout, poll_frequency=0.2).until(condition, message=what)


def busiest(frames: list[dict]) -> int:
    """The middle one of the steps with the most requests running: a
    decode step, its blocks half filled."""
    most = max(len(f["running"]) for f in frames)
    steps = [f["step"] for f in frames if len(f["running"]) == most]
    return steps[len(steps) // 2]


def screenshot(chapter: str, driver, log_dir: Path) -> Path:
    server = ChapterServer(chapter, free_port(), ["--dtype", "float32", "--device-memory-gb",
                                                  CARD, "--live-view"],
                           log_dir / f"ch{chapter}.log")
    try:
        driver.get(server.url + "/ui/")
        wait_until(driver, lambda d: d.execute_script("return document.body.dataset.status")
                   == "live", "the page live")
        summary = run_load(server.url, CLIENTS, 1, MAX_TOKENS)
        if summary["failed"]:
            raise RuntimeError(f"chapter {chapter}: {summary['failed']} requests failed")
        last = server_steps(server.url)
        wait_until(driver, lambda d: d.execute_script("return document.body.dataset.step")
                   == str(last), "the last step drawn")
        driver.execute_script("window.liveView.pause();")
        step = busiest(driver.execute_script("return window.liveView.frames;"))
        driver.execute_script("window.liveView.show(arguments[0]);", step)
        wait_until(driver, lambda d: d.execute_script("return document.body.dataset.step")
                   == str(step), f"step {step} drawn")
        time.sleep(0.3)  # the page draws at most every 100 ms
        path = OUT_DIR / f"live-view-ch{chapter}.png"
        driver.save_screenshot(str(path))
        return path
    finally:
        server.stop()


def server_steps(url: str) -> int:
    import requests
    return requests.get(url + "/stats", timeout=30).json()["num_steps"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("chapters", nargs="*", metavar="CHAPTER", help=f"among {CHAPTERS}")
    args = parser.parse_args(argv)
    args.chapters = args.chapters or CHAPTERS
    if set(args.chapters) - set(CHAPTERS):
        parser.error(f"the chapters with a screenshot are {', '.join(CHAPTERS)}")
    if not (shutil.which("chromium") and shutil.which("chromedriver")):
        print("needs Debian's chromium and chromium-driver (apt-get install chromium "
              "chromium-driver)", file=sys.stderr)
        return 2
    driver = browser()
    try:
        with tempfile.TemporaryDirectory(prefix="llm-course-screenshots-") as logs:
            for chapter in args.chapters:
                print(f"[screenshots] {screenshot(chapter, driver, Path(logs))}", flush=True)
    finally:
        driver.quit()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
