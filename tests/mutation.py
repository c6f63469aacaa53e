"""Mutation testing of each exercise's reference component (`make mutants CH=04`).

mutmut (https://github.com/boxed/mutmut) makes small changes to the
reference component, one at a time (a `<` for a `<=`, a `+ 1` for a
`- 1`, a deleted line, ...), and runs the tests on each mutant. A mutant
the tests do not notice *survived*: either the tests miss a bug, or the
change makes no difference (an *equivalent* mutant). Two suites, each on
its own run:

- `grading`: the exercise's grading tests (`-m exNN`), the tests a learner's
  code must pass: a surviving mutant is a wrong solution that passes;
- `engine`: the engine's own tests that touch the component (the files in
  `Target.engine_tests`), what `make test` relies on.

Each run writes bench/results/mutants-exNN-<suite>.md: killed, survived,
and every survivor with its diff and either the reason it is equivalent
(`EQUIVALENT` below) or "not explained". The run exits non-zero if a
survivor is not explained.

    python -m tests.mutation 04                 # both suites
    python -m tests.mutation 04 --suite grading
    python -m tests.mutation 04 --suite grading --resume   # after a new test

`--resume` keeps the last run's copy: it refreshes the copy's tests and
sources, runs the mutants not checked yet (an interrupted run, a changed
function) and the survivors again, and adds its time to the last run's.

It runs in .mutants/exNN-<suite>/ (git ignores it), a copy of the tree,
with mutmut's forked workers (2 on 2 cores); only the tests that execute
the mutated function run on its mutants, fastest first, stopping at the
first failure. Left out: mutants of code the exercise does not ask for
(chapter 07's lookahead in the block manager, chapter 03-04's static
scheduler).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


@dataclass(frozen=True)
class Target:
    source: str  # the reference file mutated
    functions: tuple[str, ...]  # mutmut name patterns: what the exercise writes
    engine_tests: tuple[str, ...]  # tests/ files of `make test` that touch it
    # Leave out the tests that load the 135M model or start a server (they
    # take minutes per surviving mutant on 2 cores) when the model-free
    # tests exercise the same code: why, in the results file.
    why_model_free: str = ""

    @property
    def skip_model_tests(self) -> bool:
        return bool(self.why_model_free)


def method(cls: str, name: str = "*") -> str:
    return f"xǁ{cls}ǁ{name}__mutmut_*"


def function(name: str) -> str:
    return f"x_{name}__mutmut_*"


BOOKKEEPING = "the bookkeeping they would catch is what tests/invariants.py checks without a model"

TARGETS: dict[str, Target] = {
    "01": Target("common/autoregressive.py",
                 (function("sample_next_token"), function("generate_without_cache")),
                 ("test_ch01_foundation.py",), why_model_free="the same loop runs on a tiny random Llama (tiny_llama)"),
    "02": Target("common/memory.py",
                 (function("kv_cache_shape"), function("kv_bytes_per_token"),
                  function("static_cache_bytes")),
                 ("test_ch02_naive.py",)),
    "03": Target("common/layers/attention.py",
                 # TorchOps' three are module functions (staticmethod aliases,
                 # which mutmut does not mutate in the class): mutate those,
                 # and the two helpers they use to find a sequence's slots
                 tuple(function(f) for f in ("store_kvcache", "gather_slots", "gather_kv",
                                             "paged_decode_attention",
                                             "paged_prefill_attention")),
                 ("test_ch03_kv_cache.py", "test_ch04_paged.py", "test_cpu_attention.py"),
                 why_model_free="the same attention runs in the forward passes of tiny random "
                 "Llama and Qwen2 models, compared with Hugging Face's"),
    "04": Target("common/core/block_manager.py",
                 (function("compute_block_hash"),
                  *(method("BlockManager", m) for m in (
                      "__init__", "blocks_needed", "num_free_blocks", "num_used_blocks",
                      "_full_block_hashes", "_block_tokens", "_cached_prefix",
                      "_take_free_block", "_reuse", "can_allocate", "allocate", "can_append",
                      "may_append", "cache_full_blocks", "deallocate", "_release", "usage"))),
                 ("test_block_manager_invariants.py", "test_scheduler_invariants.py",
                  "test_scheduler_unit.py", "test_ch03_kv_cache.py", "test_ch04_paged.py",
                  "test_ch05_scheduler.py", "test_lora.py"), why_model_free=BOOKKEEPING),
    "05": Target("common/core/scheduler.py",
                 (method("ScheduledSeq"), method("Scheduler"), method("ContinuousScheduler")),
                 ("test_scheduler_invariants.py", "test_scheduler_unit.py",
                  "test_ch05_scheduler.py", "test_ch04_paged.py", "test_ch03_kv_cache.py"),
                 why_model_free=BOOKKEEPING),
    "06": Target("common/entrypoints/metrics.py",
                 # not the tokens-per-step histogram nor chapter 07's draft
                 # counters (`_step_tokens`, `_spec_decode`): the exercise leaves them out
                 (*(method("EngineCollector", m) for m in ("__init__", "_gauge", "_counter",
                                                           "collect")),
                  method("LatencyStatLogger")),
                 ("test_ch06_server.py", "test_stats.py"), why_model_free="the served test reads the same collector through /metrics "
                 "that the model-free tests scrape directly"),
    "07a": Target("common/layers/token_bitmask.py", (function("apply_token_bitmask"),),
                  ("test_structured_outputs.py",)),
    "07b": Target("common/layers/rejection_sampler.py", (function("rejection_sample"),),
                  ("test_speculative.py",)),
    "08": Target("common/layers/quantization.py",
                 (function("quantize_int8"), function("int8_linear")),
                 ("test_quantization.py", "test_ch08_quantization.py")),
    # the prefix-aware policy only: the other policies and ring_point are given
    "09": Target("common/entrypoints/routing.py",
                 (function("prefix_block_hashes"), method("HashRing"),
                  method("PrefixAwarePolicy")),
                 ("test_routing.py", "test_router.py")),
    # chapter 10: the gathered products and the mapping (not the grouped
    # product nor PunicaWrapper), then the adapter budget (not _admit)
    "10a": Target("common/lora/punica.py",
                  (function("bgmv_shrink"), function("bgmv_expand"),
                   function("add_lora_gathered"), method("LoRAMapping", "from_indices")),
                  ("test_lora.py", "test_ch10_server.py")),
    "10b": Target("common/lora/scheduler.py",
                  (method("LoRAScheduler", "running_loras"),
                   method("LoRAScheduler", "over_lora_budget")),
                  ("test_lora.py", "test_ch10_server.py")),
}

ON_THE_CPU = ("device=None is the default device, the CPU, where the tests run here; on a "
              "GPU tests/test_triton_kernels.py runs this reference on CUDA tensors, and a "
              "CPU arange beside them fails")

# Survivors that are not bugs: (exercise, suite, the mutant's changed line
# as mutmut shows it, "+ ..." stripped) -> why no test can tell.
EQUIVALENT: dict[tuple[str, str], str] = {
    # ------------------------------------------------------- 01, the loop
    ("01", "if temperature <= SAMPLING_EPS:"):
        "greedy at exactly 1e-5 instead of a draw at 1e-5, where softmax(logits / 1e-5) is "
        "the argmax unless the two largest logits are within about 2e-4; the exercise asks only "
        "that 0 be greedy (vLLM's bound, below 1e-5, is the engine's: SamplingParams.greedy)",
    # ----------------------------------------------------- 03, attention
    **{("03", line): ON_THE_CPU for line in (
        "positions = torch.arange(num_positions, device=None)",
        "positions = torch.arange(num_positions, )",
        "valid = torch.arange(max_len, device=None)[None, :] < context_lens[:, None]",
        "valid = torch.arange(max_len, )[None, :] < context_lens[:, None]",
        "q_pos = torch.arange(context_len - query_len, context_len, device=None)",
        "q_pos = torch.arange(context_len - query_len, context_len, )",
        "causal = torch.arange(context_len, device=None)[None, :] <= q_pos[:, None]",
        "causal = torch.arange(context_len, )[None, :] <= q_pos[:, None]")},
    **{("03", line): "the head counts only set SDPA's enable_gqa, and enable_gqa=True with "
       "as many KV heads as query heads repeats each KV head once: the same attention; the "
       "flag turns off (an error) only where head_dim equals a head count, and head_dim is "
       "larger than the head counts in every model and test here (64 against 9 and 3 heads "
       "in SmolLM2-135M; 8 or 16 against at most 6 in the tests)"
       for line in ("num_heads, num_kv_heads = query.shape[2], k_cache.shape[2]",
                    "num_heads, num_kv_heads = query.shape[1], k_cache.shape[3]")},
    ("03", "slots = gather_slots(block_tables[i:i + 2], context_len, k_cache.shape[1])"):
        "the next sequence's table comes along: SDPA broadcasts the batch of one query over "
        "both, and `[0]` keeps sequence i's result (the same values, twice the work)",
    # ------------------------------------------------- 04, block manager
    ("04", "prev = seq.block_hashes[-1] if j else (seq.lora_int_id and None)"):
        "chapter 10's line: every request of chapter 04's grading runs the base model "
        "(lora_int_id 0), for which `0 or None` and `0 and None` are both None; the engine "
        "suite's tests/test_lora.py kills it (an adapter's first block would be named as the "
        "base model's: test_the_same_prompt_under_two_adapters_shares_no_kv_block)",
    ("04", 'self.free_blocks[block_id] = ""'):
        "the free list is an OrderedDict used as an ordered set: its values are never read",
    ("04", "block_id, _ = self.free_blocks.popitem(last=None)"):
        "None is false like False: popitem still takes the oldest freed block",
    ("04", 'assert not seq.block_table, "XXsequence already has blocksXX"'):
        "the wording of an internal assertion (a scheduler bug, never a user's input)",
    ("04", 'assert not seq.block_table, "SEQUENCE ALREADY HAS BLOCKS"'):
        "the wording of an internal assertion (a scheduler bug, never a user's input)",
    ("04", "for j in range(len(hashes)):"):
        "re-visiting the blocks registered already changes nothing: a block with a hash "
        "is skipped (`if block.hash is None`), and hash_to_block.setdefault keeps its entry",
    ("04", "missing = self.blocks_needed(seq.num_tokens - num_lookahead_tokens) - "
           "len(seq.block_table)"):
        "chapter 07's draft slots: every call outside speculative decoding passes "
        "num_lookahead_tokens = 0 (exercise 04 leaves it out); tests/test_speculative.py "
        "runs it with drafts",
    ("04", "while len(seq.block_table) < self.blocks_needed(seq.num_tokens - "
           "num_lookahead_tokens):"):
        "chapter 07's draft slots: every call outside speculative decoding passes "
        "num_lookahead_tokens = 0 (exercise 04 leaves it out); tests/test_speculative.py "
        "runs it with drafts",
    ("04", "seq.num_registered_blocks = None"):
        "nothing reads a deallocated sequence's count: allocate sets it again first",
    ("04", "seq.num_registered_blocks = 1"):
        "nothing reads a deallocated sequence's count: allocate sets it again first",
    # ---------------------------------------------------- 05, the scheduler
    **{("05", line): "a default no caller reads: the engine builds its scheduler with every "
       "value from EngineConfig (common/engine/llm_engine.py), and every test passes its own"
       for line in ("def __init__(self, block_manager: BlockManager, max_num_seqs: int = 65,",
                    "max_num_batched_tokens: int = 513, eos_token_ids: set[int] = frozenset(),",
                    "max_model_len: int = 8193, long_prefill_token_threshold: int = 0):",
                    "max_model_len: int = 8192, long_prefill_token_threshold: int = 1):")},
    ("05", "if 0 < self.long_prefill_token_threshold <= num_new:  # ch05: room for newcomers"):
        "when num_new equals the cap, capping it sets it to the same number",
    ("05", "return"):
        "the budget never runs out with running sequences left over (`if budget == 0` at the "
        "top of the loop): each was admitted within a step's budget, a decode asks 1 token, "
        "a capped chunk no more than it got, and a prompt cut short by the budget took all of "
        "it, so nobody was admitted behind it; the random workloads of "
        "tests/test_scheduler_invariants.py never reach it (`return` would hand the engine None)",
    ("05", "break  # preempted a moment ago to make room for an older one"):
        "the sequences preempted during the loop are the newest, the end of `running` "
        "(make_room takes running[-1]): nothing after them is still running, so stopping "
        "there skips no one",
    ("05", "break  # seq itself was the newest: preempted"):
        "seq was running[-1], the newest, when it preempted itself: nothing after it is "
        "left in the loop",
    # ------------------------------------------------------- 06, the metrics
    **{("06", line): "the tokens-per-step histogram is not the exercise's (the table at "
       "the top of its metrics.py): no grading snapshot has the key; tests/test_ch06_server.py "
       "reads vllm:iteration_tokens_total from a served engine"
       for line in ('if "XXiteration_tokensXX" in s:  # the exercise\'s snapshot may have none',
                    'if "ITERATION_TOKENS" in s:  # the exercise\'s snapshot may have none',
                    "yield self._step_tokens(None)",
                    'yield self._step_tokens(s["XXiteration_tokensXX"])',
                    'yield self._step_tokens(s["ITERATION_TOKENS"])')},
    **{("06", line): "chapter 07's draft counters are not the exercise's: no grading "
       "snapshot has them; tests/test_structured_outputs.py reads vllm:spec_decode_* from a "
       "served engine with drafts"
       for line in ('if "XXspec_decode_num_draftsXX" in s:', 'if "SPEC_DECODE_NUM_DRAFTS" in s:',
                    "yield from self._spec_decode(None)")},
    # -------------------------------------------------- 07a, the token mask
    ("07a", 'logits.masked_fill_(~allowed, float("-INF"))'):
        'float() parses "-INF" as -inf, as "-inf"',
    ("07a", "bit = torch.arange(BITS_PER_WORD, device=None, dtype=torch.int32)  # (32,)"):
        "device=None is the default device, the CPU, where every test's bitmask is; on "
        "CUDA it would fail (a CUDA word shifted by CPU bits): the engine moves the bitmask "
        "to the logits' device first",
    ("07a", "bit = torch.arange(BITS_PER_WORD, dtype=torch.int32)  # (32,)"):
        "without device: the default device, the CPU, where every test's bitmask is; on "
        "CUDA it would fail (a CUDA word shifted by CPU bits)",
    ("07a", "bit = torch.arange(BITS_PER_WORD, device=bitmask.device, dtype=None)  # (32,)"):
        "int64 bits: the int32 words are promoted to int64 with their sign, so (word >> j) "
        "& 1 is the same bit (the (rows, words, 32) tensor takes twice the bytes)",
    ("07a", "bit = torch.arange(BITS_PER_WORD, device=bitmask.device, )  # (32,)"):
        "int64 bits: the int32 words are promoted to int64 with their sign, so (word >> j) "
        "& 1 is the same bit (the (rows, words, 32) tensor takes twice the bytes)",
    # ------------------------------------------- 07b, the rejection sampler
    ("07b", "if torch.rand((), generator=generator) <= probs[draft]:  # accept with p(d)"):
        "torch.rand draws from [0, 1) in steps of 2**-24: `<=` accepts more only when the "
        "draw equals p(d) exactly, once in 16 million draws (a draft of probability 0 "
        "accepted when the draw is 0.0)",
    # ------------------------------------------------------ 08, int8 weights
    ("08", "q = torch.round(w / scales[:, None]).clamp(None, 127).to(torch.int8)"):
        "a dead clamp in float32: each scale is its row's largest |w| / 127, from the same "
        "float32 w, so |w / scale| <= 127 within a rounding (127.00003 at most), which "
        "torch.round makes 127; the clamp guards a scale computed in lower precision "
        "(bfloat16: test_bfloat16_weights_are_quantized_in_float32 catches that)",
    ("08", "q = torch.round(w / scales[:, None]).clamp(-127, None).to(torch.int8)"):
        "a dead clamp in float32: |w / scale| <= 127 within a rounding, which torch.round "
        "makes 127 (see the clamp(None, 127) mutant)",
    ("08", "q = torch.round(w / scales[:, None]).clamp(-127, ).to(torch.int8)"):
        "a dead clamp in float32: |w / scale| <= 127 within a rounding, which torch.round "
        "makes 127 (see the clamp(None, 127) mutant)",
    ("08", "q = torch.round(w / scales[:, None]).clamp(-128, 127).to(torch.int8)"):
        "a dead clamp in float32: w / scale never rounds below -127 (see the "
        "clamp(None, 127) mutant)",
    ("08", "q = torch.round(w / scales[:, None]).clamp(-127, 128).to(torch.int8)"):
        "a dead clamp in float32: w / scale never rounds above 127 (see the "
        "clamp(None, 127) mutant)",
    # ------------------------------------------- 09, the prefix-aware policy
    **{("09", line): "int.to_bytes and int.from_bytes take byteorder=\"big\" by default "
       "since Python 3.11, the course's Python: the same bytes, the same names"
       for line in ('digest.update((hashes[-1] if hashes else 0).to_bytes(8, ))',
                    'digest.update(int(token).to_bytes(4, ))',
                    'hashes.append(int.from_bytes(digest.digest(), ))')},
    **{("09", line): "the wording of NoReplicaError, which no client reads: the router "
       "answers its own 503 message (Router.pick), naming how many replicas are up"
       for line in ('raise NoReplicaError(None)',
                    'raise NoReplicaError("XXno usable replica on the ringXX")',
                    'raise NoReplicaError("NO USABLE REPLICA ON THE RING")',
                    'raise NoReplicaError("XXthe ring is emptyXX")',
                    'raise NoReplicaError("THE RING IS EMPTY")')},
    ("09", "def __init__(self, names: Sequence[str] = (), points_per_replica: int = 101):"):
        "a default the policy never uses (PrefixAwarePolicy passes its own points_per_replica); "
        "a ring built with it, as one grading test builds one, behaves alike with 100 or 101 "
        "points per replica: the test checks shares, not points",
    **{("09", line): "a default no caller reads: the router builds the policy with its "
       "--block-size and --prefix-blocks, and every test passes its own block size; the "
       "constructor is given in the exercise's stub"
       for line in ("def __init__(self, block_size: int = 17, prefix_blocks: int = 4,",
                    "def __init__(self, block_size: int = 16, prefix_blocks: int = 5,")},
    ("09", "self.ring.remove(None)"):
        "a replica no longer listed then keeps its points, but is never usable (choose "
        "passes only the listed healthy names): its keys go to the next point clockwise, "
        "exactly where removing it sends them; only the ring's memory differs",
    ("09", "return self.fallback.choose(None, alive)"):
        "LeastLoadedPolicy reads the replicas' loads, never the prompt",
    # ------------------------------------------- 10a, the LoRA products
    **{("10a", line): "einsum's subscripts may be upper-case letters as well: the same "
       "names, the same sums, the same product"
       for line in ('return torch.einsum("TI,TRI->TR", x, a) * scaling[indices, None]',
                    'return torch.einsum("TR,TOR->TO", h, b)')},
}

STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests",
          34: "skipped", 36: "timeout", 24: "timeout", -24: "timeout", 152: "timeout",
          255: "timeout", None: "not checked"}


def prepare(workdir: Path, exercise: str, suite: str) -> None:
    """A copy of the tree for mutmut, and its configuration."""
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    copy_tree(workdir)
    shutil.copy2(ROOT / "pytest.ini", workdir / "pytest.ini")
    target = TARGETS[exercise]
    if suite == "grading":
        selection = [f"-m ex{exercise}", "tests/"]
    else:
        selection = [f"tests/{name}" for name in target.engine_tests]
    if target.skip_model_tests:
        selection.append("--skip-model-tests")
    (workdir / "setup.cfg").write_text(
        "[mutmut]\n"
        "source_paths = common\n"
        f"only_mutate = {target.source}\n"
        "also_copy =\n" + "".join(f"    {name}\n" for name in EXTRA_FOLDERS) +
        # torch is not fork-safe once it has run: workers fork from a
        # server that has only imported and collected the tests
        "process_isolation = forkserver\n"
        "pytest_add_cli_args = -p no:cacheprovider -p no:warnings\n"
        "pytest_add_cli_args_test_selection =\n"
        + "".join(f"    {arg}\n" for arg in " ".join(selection).split()) )
    # The compiled C++ kernels: a copy (ninja rebuilds them once for the
    # copy's source paths). A link would make this tree and the copy
    # rebuild them in turn, each time either imports them.
    extensions = ROOT / ".cache" / "torch_extensions"
    if extensions.exists():
        shutil.copytree(extensions, workdir / "mutants" / ".cache" / "torch_extensions",
                        ignore=shutil.ignore_patterns("*.flock", "lock"))


# What the tests import beside common/ and tests/: bench/, the pictures'
# scripts, and the chapters' server.py files (their `engine_parts`).
EXTRA_FOLDERS = ("bench", "pictures", *sorted(p.name for p in ROOT.glob("[0-9][0-9]-*")))


def copy_tree(workdir: Path) -> None:
    """The sources and tests mutmut copies from: a fresh copy, or for
    --resume today's over the last run's (mutmut then re-mutates only the
    functions whose source changed)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".cache")
    for name in ("common", "tests", *EXTRA_FOLDERS):
        shutil.copytree(ROOT / name, workdir / name, ignore=ignore, dirs_exist_ok=True)


def run_mutmut(workdir: Path, exercise: str, names: list[str] | None = None) -> float:
    """mutmut on the exercise's functions (the mutants not checked yet), or
    on the named mutants (checked again); returns the seconds it took."""
    patterns = names or [f"{module_name(exercise)}.{p}" for p in TARGETS[exercise].functions]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRITON_INTERPRET="1")
    start = time.monotonic()
    mutmut = Path(sys.executable).with_name("mutmut")
    subprocess.run([str(mutmut), "run", "--max-children", str(os.cpu_count() or 2), *patterns],
                   cwd=workdir, env=env, check=True)
    return time.monotonic() - start


def last_run_minutes(exercise: str, suite: str) -> float:
    """The time the results file records (0 when there is none)."""
    import re
    path = RESULTS / f"mutants-ex{exercise}-{suite}.md"
    if not path.exists():
        return 0.0
    row = re.search(r"^\|(?: [\d.]+ \|){6} ([\d.]+) min", path.read_text(), re.M)
    return float(row.group(1)) if row else 0.0


def module_name(exercise: str) -> str:
    return TARGETS[exercise].source.removesuffix(".py").replace("/", ".")


def collect(workdir: Path, exercise: str) -> dict[str, str]:
    """Mutant name -> status, for the exercise's functions only."""
    import fnmatch
    meta = workdir / "mutants" / (TARGETS[exercise].source + ".meta")
    codes = json.loads(meta.read_text())["exit_code_by_key"]
    patterns = [f"{module_name(exercise)}.{p}" for p in TARGETS[exercise].functions]
    return {name: STATUS.get(code, "suspicious") for name, code in codes.items()
            if any(fnmatch.fnmatch(name, p) for p in patterns)}


def diff_of(workdir: Path, name: str) -> str:
    mutmut = Path(sys.executable).with_name("mutmut")
    out = subprocess.run([str(mutmut), "show", name], cwd=workdir, capture_output=True,
                         text=True, check=True).stdout
    lines = out.splitlines()
    return "\n".join(line for line in lines[1:] if line.startswith(("-", "+", "@"))
                     and not line.startswith(("---", "+++")))


def changed_line(diff: str) -> str:
    added = [line[1:].strip() for line in diff.splitlines() if line.startswith("+")]
    removed = [line[1:].strip() for line in diff.splitlines() if line.startswith("-")]
    return " / ".join(added) if added else "deleted: " + " / ".join(removed)


HELP_TEXT = ("a metric's HELP text, written for people reading /metrics: Prometheus keeps "
             "it as a description, and no query, alert or dashboard reads it (vLLM's Grafana "
             "dashboard selects by name and label, as the tests do)")
# prometheus_client's metric families and the collector's helpers, and
# where each takes the doc: (name, doc, ...), or _by_label's (family, name, doc, ...).
METRIC_BUILDERS = {"_gauge": 1, "_counter": 1, "GaugeMetricFamily": 1,
                   "CounterMetricFamily": 1, "HistogramMetricFamily": 1, "_by_label": 2}


def explain(exercise: str, diff: str) -> str | None:
    """Why a surviving mutant is equivalent, or None: its line in
    EQUIVALENT, or a change to nothing but a metric's HELP text."""
    reason = EQUIVALENT.get((exercise, changed_line(diff)))
    if reason is None and changes_only_help_text(exercise, diff):
        return HELP_TEXT
    return reason


def changes_only_help_text(exercise: str, diff: str) -> bool:
    """One line, one string literal changed as mutmut changes strings ("XX"
    around it, lower or upper case), and that literal is (part of) the doc
    argument of a metric family in the mutated source."""
    import re
    removed = [line[1:] for line in diff.splitlines() if line.startswith("-")]
    added = [line[1:] for line in diff.splitlines() if line.startswith("+")]
    literal = re.compile(r'"([^"]*)"')
    if len(removed) != 1 or len(added) != 1 or (
            literal.sub('""', removed[0]) != literal.sub('""', added[0])):
        return False
    changed = [(old, new) for old, new in zip(literal.findall(removed[0]),
                                              literal.findall(added[0])) if old != new]
    if len(changed) != 1:
        return False
    old, new = changed[0]
    return (new in (f"XX{old}XX", old.lower(), old.upper())
            and any(old in doc for doc in help_texts(ROOT / TARGETS[exercise].source)))


def help_texts(source: Path) -> list[str]:
    """The doc (HELP text) of every metric family the source builds."""
    import ast
    docs = []
    for node in ast.walk(ast.parse(source.read_text())):
        if not isinstance(node, ast.Call):
            continue
        position = METRIC_BUILDERS.get(getattr(node.func, "attr", getattr(node.func, "id", "")))
        if position is None or len(node.args) <= position:
            continue
        doc = node.args[position]
        if isinstance(doc, ast.Constant) and isinstance(doc.value, str):
            docs.append(doc.value)
    return docs


def write_results(exercise: str, suite: str, statuses: dict[str, str], seconds: float,
                  workdir: Path, resumed: bool = False) -> tuple[Path, list[str]]:
    from bench.record import bf16_words, measurement_machine
    counts: dict[str, int] = {}
    for status in statuses.values():
        counts[status] = counts.get(status, 0) + 1
    tested = sum(v for k, v in counts.items() if k in ("killed", "survived", "timeout"))
    killed = counts.get("killed", 0) + counts.get("timeout", 0)
    survivors = sorted(name for name, status in statuses.items() if status == "survived")
    unexplained = []
    rows = []
    for name in survivors:
        diff = diff_of(workdir, name)
        reason = explain(exercise, diff)
        if reason is None:
            unexplained.append(name)
        rows.append((name, diff, reason or "not explained"))
    machine = measurement_machine()
    target = TARGETS[exercise]
    tests = (f"the grading tests (`pytest -m ex{exercise}`)" if suite == "grading" else
             "the engine's tests: " + ", ".join(f"`tests/{t}`" for t in target.engine_tests))
    if target.skip_model_tests:
        tests += (", but those that load the 135M model or start a server "
                  f"(`--skip-model-tests`: minutes per surviving mutant on 2 cores; "
                  f"{target.why_model_free})")
    out = [f"# Mutation testing: exercise {exercise}, {suite} tests",
           "",
           f"Measured {date.today().isoformat()} with `make mutants CH={exercise} "
           f"SUITE={suite}{' RESUME=1' if resumed else ''}` (`python -m tests.mutation "
           f"{exercise} --suite {suite}{' --resume' if resumed else ''}`), mutmut "
           f"{mutmut_version()}" + (", after a first run: the time is both runs'."
                                    if resumed else "."),
           f"Machine: {machine['cpu']}, {machine['cores']} cores, {bf16_words(machine)}; "
           f"load average at the end {os.getloadavg()[0]:.1f}.",
           "",
           f"Mutated: `{target.source}` ({', '.join(f'`{p}`' for p in target.functions)}), "
           f"sha256 {source_digest(exercise)}.",
           f"Tests: {tests}.",
           "",
           "| mutants | killed | survived | timeout | no tests | killed % | time |",
           "|---|---|---|---|---|---|---|",
           f"| {len(statuses)} | {counts.get('killed', 0)} | {counts.get('survived', 0)} | "
           f"{counts.get('timeout', 0)} | {counts.get('no tests', 0)} | "
           f"{100.0 * killed / tested if tested else 0.0:.1f} | {seconds / 60:.1f} min |",
           "",
           "Killed % = (killed + timeout) / (killed + survived + timeout). A timeout is a",
           "mutant that made the tests hang (an infinite loop): caught.",
           ""]
    if counts.get("no tests"):
        out += ["Mutants with no tests: no test of this suite runs that function.", ""]
    out += ["## Survivors", ""]
    if not rows:
        out.append("None: every mutant the tests run is killed.")
    for name, diff, reason in rows:
        out += [f"### `{name.split('.')[-1]}`", "", "```diff", diff, "```", "",
                f"Equivalent: {reason}" if reason != "not explained" else
                "**Not explained**: a test should kill it.", ""]
    path = RESULTS / f"mutants-ex{exercise}-{suite}.md"
    path.write_text("\n".join(out).rstrip() + "\n")
    return path, unexplained


def source_digest(exercise: str) -> str:
    """The mutated file's digest, recorded in the results file: a test
    (tests/test_mutation_results.py) says when the reference has changed
    since the run."""
    import hashlib
    return hashlib.sha256((ROOT / TARGETS[exercise].source).read_bytes()).hexdigest()[:16]


def mutmut_version() -> str:
    from importlib.metadata import version
    return version("mutmut")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("exercise", choices=sorted(TARGETS))
    parser.add_argument("--suite", choices=["grading", "engine", "both"], default="both")
    parser.add_argument("--resume", action="store_true",
                        help="keep the last run's copy: check the mutants left and the survivors")
    args = parser.parse_args(argv)
    suites = ["grading", "engine"] if args.suite == "both" else [args.suite]
    failed = False
    for suite in suites:
        workdir = ROOT / ".mutants" / f"ex{args.exercise}-{suite}"
        resumed = args.resume and (workdir / "mutants").exists()
        if resumed:
            copy_tree(workdir)
            seconds = 60 * last_run_minutes(args.exercise, suite)
            seconds += run_mutmut(workdir, args.exercise)  # those not checked yet
            survivors = [name for name, status in collect(workdir, args.exercise).items()
                         if status == "survived"]
            if survivors:
                seconds += run_mutmut(workdir, args.exercise, survivors)
        else:
            prepare(workdir, args.exercise, suite)
            seconds = run_mutmut(workdir, args.exercise)
        statuses = collect(workdir, args.exercise)
        path, unexplained = write_results(args.exercise, suite, statuses, seconds, workdir,
                                          resumed)
        print(f"wrote {path.relative_to(ROOT)}")
        for name in unexplained:
            print(f"  survivor not explained: {name}")
        failed |= bool(unexplained)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
