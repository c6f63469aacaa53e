"""Measure the answers of exercise 10b's "Predict, then measure" (solutions-10b.md).

    .venv/bin/python 10-adapters/exercises/measure_scheduler.py

The course's `LoRAScheduler` (common/lora/scheduler.py) stepped with fake
model outputs, no model: a second on any machine, and the same figures
on every one (a fixed workload, no clock). The workload: requests that
arrive together, prompts of 32 tokens, 64 tokens out each (never an
EOS), at most 32 sequences and 512 tokens a step, blocks enough for all.

1. slots and steps: 32 requests over 8 adapters (4 each, in turn: adapter
   1, 2, ..., 8, 1, 2, ...), with `--max-loras` 1, 2, 4 and 8: the steps
   until every request is done, and the sequences and adapters in an
   average step;
2. going past a held-back request: the same 32 and 8 requests of the
   base model among them (every fifth), `--max-loras` 2, with vLLM's
   rule (a request whose adapter has no slot waits, those behind it whose
   adapter fits go ahead: `LoRAScheduler._admit`) and with strict first
   come, first served (chapter 05's admission: the queue stops at the
   first request that cannot join): how many steps each kind of request
   waits before its first token, and the steps in all.

Writes `results/measured-DATE-10b.json` beside this file. Left out: time
(more slots make every step dearer, and more adapters a step of the
grouped form: exercise 10a's measure_punica.py times the products),
preemption (the blocks never run out here).
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

from bench.record import measurement_machine, write_measurement  # noqa: E402
from common.core.block_manager import BlockManager  # noqa: E402
from common.core.scheduler import Scheduler  # noqa: E402
from common.core.sequence import Sequence  # noqa: E402
from common.layers.sampler import SampledToken  # noqa: E402
from common.lora.scheduler import LoRAScheduler  # noqa: E402
from common.sampling_params import SamplingParams  # noqa: E402

COMMAND = "python 10-adapters/exercises/measure_scheduler.py"
PROMPT, OUTPUT = 32, 64  # tokens in, tokens out
MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS = 32, 512


class StrictFirstComeFirstServed(LoRAScheduler):
    """The same budget, chapter 05's admission: stop at the first request
    that cannot join, whatever waits behind it."""
    _admit = Scheduler._admit


def requests(adapters: list[int]) -> list[Sequence]:
    return [Sequence(f"r{i}", list(range(1, PROMPT + 1)),
                     SamplingParams(max_tokens=OUTPUT, ignore_eos=True), lora_int_id=lora)
            for i, lora in enumerate(adapters)]


def run(scheduler_cls: type, max_loras: int, adapters: list[int]) -> dict:
    """Step until every request is done: the steps, the average step's
    sequences and adapters, and the step of each request's first token."""
    sched = scheduler_cls(BlockManager(1024, 16), MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS,
                          eos_token_ids=set(), max_model_len=4096, max_loras=max_loras)
    seqs = requests(adapters)
    for seq in seqs:
        sched.add(seq)
    first_token: dict[str, int] = {}
    batch_sizes, adapters_per_step = [], []
    step = 0
    while sched.has_unfinished():
        step += 1
        batch = sched.schedule()
        loras = {item.seq.lora_int_id for item in batch} - {0}
        assert len(loras) <= max_loras
        batch_sizes.append(len(batch))
        adapters_per_step.append(len(loras))
        sampled = {item.seq: [SampledToken(7)] for item in batch if item.samples}
        for seq in sampled:
            first_token.setdefault(seq.request_id, step)
        sched.update_from_output(batch, sampled)
    return {"steps": step, "mean_sequences_per_step": round(statistics.mean(batch_sizes), 2),
            "mean_adapters_per_step": round(statistics.mean(adapters_per_step), 2),
            "first_token_step": [first_token[seq.request_id] for seq in seqs]}


def slots_and_steps() -> dict:
    adapters = [1 + i % 8 for i in range(32)]
    rows = []
    for max_loras in (1, 2, 4, 8):
        result = run(LoRAScheduler, max_loras, adapters)
        rows.append({"max_loras": max_loras, "steps": result["steps"],
                     "mean_sequences_per_step": result["mean_sequences_per_step"],
                     "mean_adapters_per_step": result["mean_adapters_per_step"],
                     "mean_first_token_step": round(
                         statistics.mean(result["first_token_step"]), 1)})
    return {"workload": "32 requests, adapters 1..8 in turn, 32 tokens in, 64 out",
            "rows": rows}


def going_past() -> dict:
    adapters = [0 if i % 5 == 4 else 1 + i % 8 for i in range(40)]
    out = {"workload": "40 requests: every fifth of the base model, the others over "
                       "adapters 1..8 in turn; max_loras 2"}
    for name, cls in (("going_past", LoRAScheduler),
                      ("strict_fcfs", StrictFirstComeFirstServed)):
        result = run(cls, 2, adapters)
        waits = result["first_token_step"]
        base = [w - 1 for w, lora in zip(waits, adapters) if lora == 0]
        adapted = [w - 1 for w, lora in zip(waits, adapters) if lora != 0]
        out[name] = {"steps": result["steps"],
                     "base_mean_steps_waited": round(statistics.mean(base), 1),
                     "base_max_steps_waited": max(base),
                     "adapter_mean_steps_waited": round(statistics.mean(adapted), 1),
                     "adapter_max_steps_waited": max(adapted)}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=HERE / "results" /
                   f"measured-{datetime.date.today()}-10b.json")
    args = p.parse_args(argv)
    record = {"command": COMMAND, "machine": measurement_machine(),
              "slots_and_steps": slots_and_steps(), "going_past": going_past()}
    write_measurement(args.out, record)
    print(args.out.read_text())
    print(f"wrote {args.out.relative_to(ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
