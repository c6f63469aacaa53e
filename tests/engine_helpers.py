"""Helpers for engine tests: build engines on a loaded model, run to the end."""
from __future__ import annotations

from common.config import EngineConfig
from common.core.scheduler import StaticScheduler
from common.engine.parts import EngineParts, assemble_engine
from common.sampling_params import SamplingParams
from tests.components import Components
from tests.invariants import checked


CHECKED_POOL = 512  # blocks


def make_engine(loaded, policy="continuous", num_blocks=None, impl=None,
                structured_outputs=False, **config):
    """policy: "static" (ch03-04) or "continuous" (ch05). `impl`: the
    components to build it with (tests/components.py; default: reference);
    an engine on a small pool (`num_blocks` up to CHECKED_POOL, the tests
    that put the cache under pressure) has its block manager check its
    invariants after every change (tests/invariants.py's `checked`; each
    check reads the whole pool, too slow for thousands of blocks).
    `structured_outputs`: chapter 07's grammar step (imports xgrammar).
    `config`: EngineConfig's fields (`block_size=None`: chapter 03's regions;
    `speculative_config`: chapter 07's drafts, on the scheduler given)."""
    impl = impl or Components()
    config.setdefault("device_memory_gb", 2.0)
    scheduler_cls = StaticScheduler if policy == "static" else impl.ContinuousScheduler
    structured_output_cls = None
    if structured_outputs:
        from common.structured_output.manager import StructuredOutputManager
        structured_output_cls = StructuredOutputManager
    block_manager_cls = impl.BlockManager
    if num_blocks is not None and num_blocks <= CHECKED_POOL:
        block_manager_cls = checked(block_manager_cls)
    engine_config = EngineConfig(**config)
    parts = EngineParts(scheduler_cls=scheduler_cls, block_manager_cls=block_manager_cls,
                        structured_output_cls=structured_output_cls)
    if engine_config.speculative_config is not None:  # ch07: drafts on this scheduler
        from common.spec_decode.speculative import with_drafts
        parts = with_drafts(parts, engine_config.speculative_config)
    return assemble_engine(engine_config, parts, loaded=loaded, num_blocks=num_blocks,
                           attention_ops=impl.attention_ops)


# Steps in a row with no token out: a request that is never scheduled (or
# never finishes) fails its test instead of hanging it. Prefill chunks emit
# nothing for a few steps; a thousand is far more than any test needs.
MAX_STEPS_WITHOUT_OUTPUT = 1000


def run_all(engine, prompts: dict[str, list[int]] | None = None,
            params: SamplingParams | None = None, on_step=None,
            max_steps: int = 10_000) -> dict:
    """Add `prompts` (request id -> token ids), step until done.
    Returns request id -> its final CompletionOutput (`.outputs[0]`)."""
    for request_id, ids in (prompts or {}).items():
        engine.add_request(request_id, ids, params or SamplingParams(temperature=0, max_tokens=32))
    done = {}
    idle = 0
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return done
        outputs = engine.step()
        idle = 0 if outputs else idle + 1
        assert idle < MAX_STEPS_WITHOUT_OUTPUT, (
            f"{idle} steps without a token out: is a request never scheduled?")
        for output in outputs:
            if output.finished:
                done[output.request_id] = output.outputs[0]
        if on_step is not None:
            on_step(engine)
    raise AssertionError(f"requests still unfinished after {max_steps} steps")


def greedy(max_tokens=32, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def fail_rows_seeded(engine, seed: int = 666) -> None:
    """Fault injection: sampling any row whose request has this seed raises."""
    sampler = engine.worker.model_runner.sampling.sampler
    original = sampler._sample_row

    def faulty(row, state):
        if state.params.seed == seed:
            raise IndexError("simulated fault in one row")
        return original(row, state)

    sampler._sample_row = faulty
