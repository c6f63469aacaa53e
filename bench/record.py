"""What every measurement of the course writes down, and the quiet machine it waits for.

Every script that measures (the bench, the profiles, the experiments, the
peers' checks, the exercises' measure scripts) records the same things
with its figures, so that a results file says where they came from:

- the machine (`machine`): host, CPU, cores, GPU, the CPU's bf16 support
  (`bf16_words` puts it in words), the library versions, and the real
  vLLM's version for a run that used it;
- a record's head (`record_head`: date, machine, command) and its files,
  `bench/results/DATE-HOST-KIND.{json,md}` (`write_results`);
- an exercise's measurement: the machine with the load average at its
  start (`measurement_machine`) and at its end (`write_measurement`).

A measurement on 2 cores means little while something else computes, so
the scripts that time a step first wait for the 1-minute load average to
fall below 1.5 (`wait_for_quiet_machine`, flags `--wait-quiet` and
`--quiet-load`); `add_quiet_run_args` adds those with `--out-dir` and
`--render` (the markdown of a results file written again from its JSON).

Left out: the bench's own table and figure (bench/table.py,
bench/plot.py), and anything that runs a load (bench/loadtest.py).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import transformers

from bench.peers import vllm_peer
from common.loader import cpu_bf16_flags, cpu_model

RESULTS_DIR = Path(__file__).resolve().parent / "results"
QUIET_LOAD = 1.5  # a 1-minute load average below this: a quiet machine


# ------------------------------------------------------------ the machine
def machine(with_vllm: bool = False) -> dict:
    """The machine, its bf16 support, the library versions; with_vllm: also the
    real vLLM's version (a subprocess that imports it: only for runs that use it)."""
    cpu = cpu_model()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"host": socket.gethostname(), "cpu": cpu, "cores": os.cpu_count(), "gpu": gpu,
            "cpu_bf16": cpu_bf16_flags(),
            "vllm": vllm_peer.installed_version() if with_vllm else None,
            "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__}


def bf16_words(m: dict) -> str:
    flags = m.get("cpu_bf16")
    if flags is None:  # a results file from before the field
        return "bf16 support not recorded"
    return f"bf16 in hardware: {', '.join(flags)}" if flags else "no bf16 in hardware"


# ------------------------------------------------------------- the record
def record_head(command: str) -> dict:
    """A results record's first fields: when, on what machine, by which command."""
    return {"date": datetime.datetime.now().isoformat(timespec="seconds"),
            "machine": machine(), "command": command}


def write_results(out_dir: Path, kind: str, rec: dict, markdown_text: str) -> Path:
    """bench/results/DATE-HOST-KIND.{json,md}: the record and its table,
    printed too. Returns the path without its suffix."""
    stem = out_dir / f"{datetime.date.today()}-{socket.gethostname()}-{kind}"
    out_dir.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(rec, indent=1))
    stem.with_suffix(".md").write_text(markdown_text)
    print(markdown_text)
    print(f"wrote {stem}.json and .md")
    return stem


def render_again(results_json: Path, markdown: Callable[[dict], str]) -> None:
    """--render: the markdown of a results file, from its JSON."""
    results_json.with_suffix(".md").write_text(markdown(json.loads(results_json.read_text())))


# ------------------------------------------------ an exercise's measurement
def measurement_machine() -> dict:
    """`machine()` with the date and the load average at the start: the
    record the exercises' measure scripts begin with."""
    return {**machine(), "date": datetime.date.today().isoformat(),
            "load_average_at_start": list(os.getloadavg())}


def write_measurement(path: Path, record: dict) -> None:
    """An exercise's measurement: the load average at the end goes into
    `record["machine"]`, then the record is written as JSON."""
    record["machine"]["load_average_at_end"] = list(os.getloadavg())
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")


# ------------------------------------------------------ a quiet machine
def add_wait_quiet_args(p: argparse.ArgumentParser, wait_s: float = 300.0,
                        below: float = QUIET_LOAD) -> None:
    """--wait-quiet and --quiet-load: how long to wait for a quiet machine."""
    p.add_argument("--wait-quiet", type=float, default=wait_s,
                   help="seconds to wait for a quiet machine first (0: do not wait)")
    p.add_argument("--quiet-load", type=float, default=below,
                   help="quiet: a 1-minute load average below this")


def add_quiet_run_args(p: argparse.ArgumentParser) -> None:
    """The flags of a measurement that waits for a quiet machine and writes
    bench/results/ (the tensor-parallel experiment's, the step profile's,
    the vLLM steps')."""
    add_wait_quiet_args(p)
    p.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--render", type=Path, default=None, metavar="JSON",
                   help="measure nothing: write the markdown of a results file again")


def wait_for_quiet_machine(max_wait_s: float, below: float = QUIET_LOAD) -> float:
    """Wait until the 1-minute load average is below `below` (or give up)."""
    deadline = time.monotonic() + max_wait_s
    while os.getloadavg()[0] >= below and time.monotonic() < deadline:
        print(f"load average {os.getloadavg()[0]:.2f}: waiting for a quiet machine",
              file=sys.stderr)
        time.sleep(15)
    return os.getloadavg()[0]
