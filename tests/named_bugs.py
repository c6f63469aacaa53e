"""The mistakes learners make, kept as small patches of the reference.

Each `NamedBug` turns the reference component of one exercise into a
wrong solution by replacing one snippet (`old`, found exactly once) with
another (`new`). `make exercises-check` (tests/check_exercises.py) grades
each wrong solution as if a learner had written it and asserts that the
grading tests fail, on an assertion (not a crash), with a message that
sends the learner to the README hint about the concept (`hint`), not to
the answer.

`caught_by` names the grading test that must fail: the check then runs
only that test (a second or two), and its README row must point to the
bug's hint. Without it, the check runs all the exercise's grading tests
until the first failure.

A bug belongs here when a learner could write it in good faith and it
once passed, or could pass, a weaker test: the first two of exercise 04
passed the whole grading suite before the invariants of
tests/invariants.py existed, and handed out wrong K/V.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tests.components import EXERCISES, ROOT


@dataclass(frozen=True)
class NamedBug:
    exercise: str  # a key of EXERCISES
    name: str  # short, for the report
    why: str  # what goes wrong for users
    old: str  # a snippet of the reference, found exactly once
    new: str  # what the learner wrote instead
    hint: int  # the README hint the failure must point to
    caught_by: str = ""  # the grading test that must catch it ("file.py::test"); "" = any

    @property
    def reference(self) -> Path:
        return ROOT / EXERCISES[self.exercise].reference

    def patched_source(self) -> str:
        source = self.reference.read_text()
        count = source.count(self.old)
        if count != 1:
            raise ValueError(f"named bug {self.exercise} '{self.name}': its snippet is found "
                             f"{count} times in {self.reference.relative_to(ROOT)}, not once "
                             "(the reference changed: update the bug)")
        return source.replace(self.old, self.new)


NAMED_BUGS: list[NamedBug] = [
    # ----------------------------------------------------- 04, block manager
    NamedBug(
        "04", "a reused cached block stays on the free list",
        "a later prompt is given the same physical block as a running one and overwrites its K/V",
        old="""        if block.ref_count == 0:
            del self.free_blocks[block_id]
        else:
            self.num_shared_refs += 1""",
        new="""        if block.ref_count != 0:
            self.num_shared_refs += 1""",
        hint=8,
        caught_by="test_block_manager_invariants.py::test_a_reused_free_cached_block_leaves_the_free_list"),
    NamedBug(
        "04", "a block taken from the free list keeps its hash in the cache",
        "a later prompt 'hits' a block another prompt has overwritten: wrong K/V, wrong tokens",
        old="""        if block.hash is not None and self.hash_to_block.get(block.hash) == block_id:
            del self.hash_to_block[block.hash]  # evict its old contents
""",
        new="",
        hint=11,
        caught_by="test_block_manager_invariants.py::test_a_block_taken_from_the_free_list_no_longer_hits"),
    NamedBug(
        "04", "usage counts a shared block once per reader",
        "the KV waste of /stats and the log is wrong (negative) as soon as prompts share a prefix",
        old="""        used = (sum(seq.num_computed_tokens for seq in seqs)
                - self.num_shared_refs * self.block_size)""",
        new="""        used = sum(seq.num_computed_tokens for seq in seqs)""",
        hint=4,
        caught_by="test_block_manager_invariants.py::test_usage_counts_a_shared_block_once"),
    NamedBug(
        "04", "can_allocate ignores the cached blocks already in use",
        "a prompt that shares its prefix with a running one waits for blocks it does not need",
        old="""        return needed - in_use <= self.num_free_blocks""",
        new="""        return needed <= self.num_free_blocks""",
        hint=8,
        caught_by="test_block_manager_invariants.py::test_can_allocate_counts_only_blocks_it_must_take"),
    NamedBug(
        "04", "can_allocate counts a free cached block as costing nothing",
        "allocate runs out of free blocks in the middle of admitting a prompt (a crash)",
        old="""        in_use = sum(1 for b in cached if self.blocks[b].ref_count > 0)""",
        new="""        in_use = len(cached)""",
        hint=8,
        caught_by="test_block_manager_invariants.py::test_can_allocate_counts_only_blocks_it_must_take"),
    NamedBug(
        "04", "prefix_queries counts every prompt token's block, partial included",
        "the prefix-cache hit rate of /metrics is too low",
        old="""            self.prefix_queries += seq.num_prompt_tokens // self.block_size""",
        new="""            self.prefix_queries += self.blocks_needed(seq.num_prompt_tokens)""",
        hint=9,
        caught_by="test_block_manager_invariants.py::test_prefix_cache_queries_and_hits_are_counted_per_full_prompt_block"),
    NamedBug(
        "04", "a hit on the block holding the last token",
        "a fully cached prompt computes no token: no logits to sample from",
        old="""            if j == max_reusable or block_id is None:""",
        new="""            if block_id is None:""",
        hint=6,
        caught_by="test_ch04_paged.py::test_full_prefix_hit_recomputes_the_last_block"),
    NamedBug(
        "04", "a hit trusted on the hash alone",
        "two prompts whose blocks collide share K/V they do not have in common",
        old="""            if self.blocks[block_id].token_ids != self._block_tokens(seq, j):
                break  # a hash collision, caught by the token check
""",
        new="",
        hint=7,
        caught_by="test_ch04_paged.py::test_hash_collision_is_caught_by_the_token_check"),
    NamedBug(
        "04", "blocks registered as soon as they are full, before their K/V are computed",
        "a prompt admitted in the same step reuses K/V that are not written yet",
        old="""        hashes = self._full_block_hashes(seq, seq.num_computed_tokens)""",
        new="""        hashes = self._full_block_hashes(seq, seq.num_tokens)""",
        hint=10,
        caught_by="test_block_manager_invariants.py::test_a_block_enters_the_prefix_cache_only_once_computed"),
    # ---------------------------------------------------------- 05, scheduler
    NamedBug(
        "05", "preemption frees nothing",
        "a preempted sequence keeps its blocks while it waits: the pool leaks until it stalls",
        old="""        self.running.remove(seq)
        self.bm.deallocate(seq)
        seq.status = SequenceStatus.WAITING""",
        new="""        self.running.remove(seq)
        seq.status = SequenceStatus.WAITING""",
        hint=6,
        caught_by="test_scheduler_invariants.py::test_a_preempted_sequence_recomputes_from_its_cached_prefix"),
    NamedBug(
        "05", "the oldest is preempted",
        "the request that has waited longest loses its work again and again",
        old="""            victim = self.running[-1]  # ch05: preempt the newest""",
        new="""            victim = self.running[0]""",
        hint=5,
        caught_by="test_scheduler_unit.py::test_preemption_takes_the_newest_and_requeues_it_first"),
    NamedBug(
        "05", "a preempted sequence goes to the back of the queue",
        "first come, first served breaks: a preempted request waits behind newer ones",
        old="""        self.waiting.appendleft(seq)""",
        new="""        self.waiting.append(seq)""",
        hint=5,
        caught_by="test_scheduler_unit.py::test_preemption_takes_the_newest_and_requeues_it_first"),
    NamedBug(
        "05", "a prompt chunk ignores the step's token budget",
        "one long prompt takes the whole step: max_num_batched_tokens means nothing",
        old="""        num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)  # ch05: chunks""",
        new="""        num_new = seq.num_tokens - seq.num_computed_tokens""",
        hint=3,
        caught_by="test_scheduler_unit.py::test_the_token_budget_is_shared_by_decodes_and_a_new_prefill"),
    NamedBug(
        "05", "a chunk that does not sample is not counted as computed",
        "a long prompt is fed again and again: it never finishes its prefill",
        old="""            if tokens is None:  # a prefill chunk that is not the last
                seq.num_computed_tokens += item.num_new_tokens  # writer: after a step
                self.bm.cache_full_blocks(seq)  # ch04: blocks that just filled
                continue""",
        new="""            if tokens is None:  # a prefill chunk that is not the last
                continue""",
        hint=3,
        caught_by="test_scheduler_unit.py::test_chunked_prefill_boundaries_and_sampling_only_at_the_last_chunk"),
    NamedBug(
        "05", "a sequence preempted in this step still runs",
        "the step feeds a sequence whose blocks were just freed: its K/V go to blocks others own",
        old="""            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted a moment ago to make room for an older one
""",
        new="",
        hint=6,
        caught_by="test_scheduler_invariants.py::test_a_preempted_sequence_recomputes_from_its_cached_prefix"),
    NamedBug(
        "05", "newcomers admitted while the step preempts",
        "a sequence is admitted into the room that a preemption just made for an older one",
        old="""        if self.num_preemptions == preemptions_before:  # ch05: no admission under pressure
            scheduled += self._admit(budget)""",
        new="""        scheduled += self._admit(budget)""",
        hint=5,
        caught_by="test_scheduler_invariants.py::test_nobody_joins_in_a_step_that_preempts"),
    NamedBug(
        "05", "a decode step without room for its token",
        "the new token's K/V is written past the end of the sequence's last block",
        old="""            victim = self.running[-1]  # ch05: preempt the newest
            self.preempt(victim)
            if victim is seq:
                return False
        self.bm.may_append(seq)""",
        new="""            victim = self.running[-1]  # ch05: preempt the newest
            self.preempt(victim)
            if victim is seq:
                return False""",
        hint=5,
        caught_by="test_scheduler_invariants.py::test_scheduler_invariants_under_random_workloads"),
    NamedBug(
        "05", "the cap on a long prompt's chunk is ignored",
        "a long prompt takes every step's budget: newcomers wait for its whole prefill",
        old="""        if 0 < self.long_prefill_token_threshold < num_new:  # ch05: room for newcomers
            num_new = self.long_prefill_token_threshold
""",
        new="",
        hint=3,
        caught_by="test_scheduler_unit.py::test_a_long_prefill_leaves_room_for_a_newcomer"),
    # ------------------------------------------------ 01, the loop by hand
    NamedBug(
        "01", "the loop stops one token early",
        "every answer is one token shorter than max_tokens asks: usage and finish reasons lie",
        old="""    for _ in range(max_new_tokens):""",
        new="""    for _ in range(max_new_tokens - 1):""",
        hint=4,
        caught_by="test_ch01_foundation.py::test_the_loop_stops_at_max_new_tokens_or_eos"),
    NamedBug(
        "01", "the temperature divides the probabilities, not the logits",
        "the temperature does nothing (multinomial renormalizes): T = 0.2 samples as T = 1",
        old="""    probs = torch.softmax(logits.float() / temperature, dim=-1)  # (vocab,)""",
        new="""    probs = torch.softmax(logits.float(), dim=-1) / temperature  # (vocab,)""",
        hint=2,
        caught_by="test_ch01_foundation.py::test_sample_next_token_greedy_seeded_and_temperature"),
    NamedBug(
        "01", "no stop at the end-of-sequence token",
        "the model keeps talking after its answer, up to max_tokens, past <|im_end|>",
        old="""        if next_id in eos_token_ids:
            return new_ids, "stop"
""",
        new="",
        hint=4,
        caught_by="test_ch01_foundation.py::test_the_loop_stops_at_max_new_tokens_or_eos"),
    NamedBug(
        "01", "a generator made anew at every step",
        "a seeded answer draws the same random number at every step: not the seed's answer",
        old="""        next_id = sample_next_token(logits.cpu(), temperature, generator)""",
        new="""        if seed is not None:
            generator = torch.Generator(device="cpu").manual_seed(seed)
        next_id = sample_next_token(logits.cpu(), temperature, generator)""",
        hint=3,
        caught_by="test_ch01_foundation.py::test_one_seeded_generator_draws_the_whole_answer"),
    # --------------------------------------------- 02, the KV cache's bytes
    NamedBug(
        "02", "4 bytes per element, whatever the dtype",
        "a bfloat16 server reserves twice the cache it needs: half the requests fit",
        old="""    element = torch.empty((), dtype=dtype).element_size()
    return 2 * layers * kv_heads * head_dim * element""",
        new="""    element = 4  # float32
    return 2 * layers * kv_heads * head_dim * element""",
        hint=4,
        caught_by="test_ch02_naive.py::test_kv_bytes_count_k_and_v_in_every_layer_at_the_dtypes_size"),
    NamedBug(
        "02", "K and V counted once",
        "the cache is sized at half its real bytes: the card runs out of memory it had budgeted",
        old="""    return 2 * layers * kv_heads * head_dim * element""",
        new="""    return layers * kv_heads * head_dim * element""",
        hint=4,
        caught_by="test_ch02_naive.py::test_kv_bytes_count_k_and_v_in_every_layer_at_the_dtypes_size"),
    NamedBug(
        "02", "the query heads cached instead of the KV heads",
        "with GQA the cache is sized 3 times too big (SmolLM2): a third of the requests fit",
        old="""    kv_heads = getattr(config, "num_key_value_heads", None) or heads""",
        new="""    kv_heads = heads""",
        hint=1,
        caught_by="test_ch02_naive.py::test_only_the_kv_heads_are_cached"),
    NamedBug(
        "02", "head_dim divided by the KV heads",
        "SmolLM2's head_dim comes out 192, not 64: the cache is sized 3 times too big",
        old="""    head_dim = getattr(config, "head_dim", None) or hidden // heads""",
        new="""    head_dim = getattr(config, "head_dim", None) or hidden // kv_heads""",
        hint=3,
        caught_by="test_ch02_naive.py::test_head_dim_is_stated_or_hidden_size_over_query_heads"),
    # ----------------------------------------------- 03, attention and cache
    NamedBug(
        "03", "slots computed as one contiguous region",
        "fine with chapter 03's regions, wrong K/V as soon as a sequence's blocks are not "
        "consecutive (chapter 04): garbage tokens under load",
        old="""    blocks = block_tables[:, positions // block_size].long()  # (num_seqs, num_positions)
    return blocks * block_size + positions % block_size""",
        new="""    return block_tables[:, :1].long() * block_size + positions  # region * block_size + p""",
        hint=1,
        caught_by="test_ch03_kv_cache.py::test_each_position_is_found_through_the_block_table"),
    NamedBug(
        "03", "decode does not attend to its own token",
        "every generated token ignores the token before it: text drifts from HF's at once",
        old="""    valid = torch.arange(max_len, device=query.device)[None, :] < context_lens[:, None]""",
        new="""    valid = torch.arange(max_len, device=query.device)[None, :] < context_lens[:, None] - 1""",
        hint=3,
        caught_by="test_ch03_kv_cache.py::test_decode_attends_to_the_whole_context_itself_included"),
    NamedBug(
        "03", "the scale given is ignored",
        "a model whose attention scale is not head_dim ** -0.5 (or one written with einsum "
        "and no scale) gives other logits",
        old="""        attn_mask=valid[:, None, None, :], scale=scale,""",
        new="""        attn_mask=valid[:, None, None, :], scale=1.0,""",
        hint=3,
        caught_by="test_ch03_kv_cache.py::test_decode_attends_to_the_whole_context_itself_included"),
    NamedBug(
        "03", "query heads paired with KV heads by repeat, not repeat_interleave",
        "with GQA each query head reads another group's K/V: wrong logits for SmolLM2",
        old="""        keys.transpose(1, 2), values.transpose(1, 2),  # (num_seqs, H_kv, max_len, D)""",
        new="""        keys.repeat(1, 1, num_heads // num_kv_heads, 1).transpose(1, 2),
        values.repeat(1, 1, num_heads // num_kv_heads, 1).transpose(1, 2),""",
        hint=2,
        caught_by="test_ch03_kv_cache.py::test_query_heads_read_the_kv_head_of_their_group"),
    NamedBug(
        "03", "prefill without the causal mask",
        "each prompt token sees the tokens after it: the prompt's K/V and the first token "
        "are wrong",
        old="""            attn_mask=causal, scale=scale,""",
        new="""            attn_mask=None, scale=scale,""",
        hint=4,
        caught_by="test_ch03_kv_cache.py::test_store_then_attend_equals_plain_attention"),
    NamedBug(
        "03", "prefill queries placed at positions 0..q_len-1",
        "right for whole prompts, wrong as soon as part of the context is cached (prefix "
        "caching, chunked prefill, a preempted sequence's recompute)",
        old="""        q_pos = torch.arange(context_len - query_len, context_len, device=query.device)""",
        new="""        q_pos = torch.arange(query_len, device=query.device)""",
        hint=4,
        caught_by="test_ch03_kv_cache.py::test_a_prefill_chunk_attends_to_the_context_already_cached"),
    # -------------------------------------------------------- 06, /metrics
    NamedBug(
        "06", "the latencies observed in milliseconds",
        "every latency lands in the +Inf bucket: vLLM's dashboard shows TTFT p50 of 500 s",
        old="""        for ttft in iteration_stats.time_to_first_tokens_iter:
            m.ttft.observe(ttft)
        for itl in iteration_stats.inter_token_latencies_iter:
            m.itl.observe(itl)""",
        new="""        for ttft in iteration_stats.time_to_first_tokens_iter:
            m.ttft.observe(ttft * 1000)  # ms
        for itl in iteration_stats.inter_token_latencies_iter:
            m.itl.observe(itl * 1000)""",
        hint=4,
        caught_by="test_ch06_server.py::test_the_latency_stat_logger_observes_ttft_itl_e2e_and_queue_time"),
    NamedBug(
        "06", "TTFT taken from the request's first step, at its end",
        "the time spent waiting in the queue is missing from TTFT, and TTFT is observed only "
        "once a request finishes",
        old="""        for ttft in iteration_stats.time_to_first_tokens_iter:
            m.ttft.observe(ttft)
""",
        new="""        for finished in iteration_stats.finished_requests:
            m.ttft.observe(finished.prefill_time)
""",
        hint=4,
        caught_by="test_ch06_server.py::test_the_latency_stat_logger_observes_ttft_itl_e2e_and_queue_time"),
    NamedBug(
        "06", "a counter reports what changed since the last scrape",
        "the counters go down between scrapes: Prometheus sees a reset at every scrape and "
        "rate() is garbage",
        old="""    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, doc, labels=["model_name"])  # adds "_total"
        family.add_metric([self.model_name], value)""",
        new="""    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, doc, labels=["model_name"])  # adds "_total"
        last = getattr(self, "_last", {})
        self._last = {**last, name: value}
        family.add_metric([self.model_name], value - last.get(name, 0))""",
        hint=1,
        caught_by="test_ch06_server.py::test_every_scrape_reads_the_engine_anew"),
    NamedBug(
        "06", "the snapshot read once, when the collector is built",
        "/metrics shows the figures of the server's start forever",
        old="""        self.snapshot = snapshot
        self.model_name = model_name""",
        new="""        first = snapshot()
        self.snapshot = lambda: first
        self.model_name = model_name""",
        hint=1,
        caught_by="test_ch06_server.py::test_every_scrape_reads_the_engine_anew"),
    NamedBug(
        "06", "one counter family per finish reason",
        "a second # TYPE line for vllm:request_success_total: Prometheus rejects the scrape",
        old="""        yield self._by_label(CounterMetricFamily, "vllm:request_success", "Finished requests "
                             "by finish reason.", "finished_reason", s["finished"])""",
        new="""        for reason, count in sorted(s["finished"].items()):
            yield self._by_label(CounterMetricFamily, "vllm:request_success", "Finished "
                                 "requests by finish reason.", "finished_reason",
                                 {reason: count})""",
        hint=3,
        caught_by="test_ch06_server.py::test_request_success_is_one_metric_with_a_sample_per_reason"),
    # ------------------------------------------------- 07a, the token mask
    NamedBug(
        "07a", "the bits of each word read from the top",
        "the grammar's allowed tokens are scrambled: the JSON breaks at the first token",
        old="""    bit = torch.arange(BITS_PER_WORD, device=bitmask.device, dtype=torch.int32)  # (32,)""",
        new="""    bit = BITS_PER_WORD - 1 - torch.arange(BITS_PER_WORD, device=bitmask.device,
                                           dtype=torch.int32)  # (32,)""",
        hint=1,
        caught_by="test_structured_outputs.py::test_apply_token_bitmask_equals_xgrammars_kernel"),
    NamedBug(
        "07a", "the sign bit tested with > 0",
        "token 31 of every word is never allowed: some valid JSON cannot be written",
        old="""    allowed = ((bitmask.unsqueeze(-1) >> bit) & 1).bool()""",
        new="""    allowed = (bitmask.unsqueeze(-1) & (1 << bit)) > 0""",
        hint=2,
        caught_by="test_structured_outputs.py::test_the_sign_bit_is_token_31_of_its_word"),
    NamedBug(
        "07a", "the padding bits of the last word kept",
        "a vocabulary that is not a multiple of 32 crashes the step (a shape mismatch)",
        old="""    allowed = allowed.reshape(num_rows, -1)[:, :vocab]  # (num_rows, vocab)""",
        new="""    allowed = allowed.reshape(num_rows, -1)  # (num_rows, words * 32)""",
        hint=3,
        caught_by="test_structured_outputs.py::test_the_last_words_padding_is_ignored"),
    NamedBug(
        "07a", "disallowed tokens set to 0, not -inf",
        "a disallowed token keeps a probability (e^0 beats every negative logit): the JSON breaks",
        old="""    logits.masked_fill_(~allowed, float("-inf"))""",
        new="""    logits.masked_fill_(~allowed, 0.0)""",
        hint=4,
        caught_by="test_structured_outputs.py::test_a_disallowed_token_gets_minus_inf_in_place"),
    # ------------------------------------------------------ 08, int8 weights
    NamedBug(
        "08", "one scale for the whole tensor",
        "rows of small weights are crushed to a few levels (or to 0): the model's answers "
        "degrade, unlike per-channel int8",
        old="""    scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127  # (N,)""",
        new="""    scales = w.abs().amax().clamp(min=1e-12).expand(w.shape[0]) / 127  # (N,)""",
        hint=1,
        caught_by="test_ch08_quantization.py::test_quantize_int8_keeps_int8_and_one_float32_scale_per_row"),
    NamedBug(
        "08", "rounded down with floor",
        "every weight is biased down by half a step on average: the outputs drift",
        old="""    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)""",
        new="""    q = torch.floor(w / scales[:, None]).clamp(-127, 127).to(torch.int8)""",
        hint=2,
        caught_by="test_ch08_quantization.py::test_every_weight_is_within_half_a_step"),
    NamedBug(
        "08", "a bfloat16 weight quantized in bfloat16",
        "with --dtype bfloat16 the scales are bfloat16 and w / scale only good to 8 bits: "
        "weights a step off",
        old="""    w = weight.float()
    scales = w.abs().amax(dim=1)""",
        new="""    w = weight
    scales = w.abs().amax(dim=1)""",
        hint=3,
        caught_by="test_ch08_quantization.py::test_bfloat16_weights_are_quantized_in_float32"),
    NamedBug(
        "08", "the scales applied along the input axis",
        "a crash for most layers, and wrong outputs for a square one",
        old="""    out = (acc * scales.float()).to(x.dtype)  # (M, N) * (N,): column n times s[n]""",
        new="""    out = (acc * scales.float()[:, None]).to(x.dtype)""",
        hint=5,
        caught_by="test_ch08_quantization.py::test_int8_linear_is_the_linear_layer_of_the_dequantized_weight"),
    # ------------------------------------------- 07b, the rejection sampler
    NamedBug(
        "07b", "a draft accepted when it is the most likely token, without a draw",
        "sampled text becomes greedy wherever a draft is the argmax: the answers lose the "
        "distribution temperature asked for",
        old="""        if torch.rand((), generator=generator) < probs[draft]:  # accept with p(d)""",
        new="""        if probs[draft] >= probs.max():  # the model agrees with the draft""",
        hint=2,
        caught_by="test_speculative.py::test_each_draft_is_accepted_with_its_probability"),
    NamedBug(
        "07b", "the replacement sampled from p itself, the draft still in it",
        "a rejected draft comes out anyway, too often: the text is no longer the model's "
        "distribution",
        old="""        residual[draft] = 0.0  # p with d removed; multinomial renormalizes
""",
        new="",
        hint=3,
        caught_by="test_speculative.py::test_the_first_token_keeps_the_target_distribution"),
    NamedBug(
        "07b", "each draft judged by the row after it",
        "drafts are checked against the distribution one token later: plausible text, "
        "not the model's",
        old="""        probs = target_probs[j]  # (vocab,)""",
        new="""        probs = target_probs[j + 1]  # (vocab,)""",
        hint=1,
        caught_by="test_speculative.py::test_each_draft_is_judged_by_the_row_before_it"),
    NamedBug(
        "07b", "no bonus token when every draft is accepted",
        "the step computed a row it throws away: one token fewer per fully accepted step",
        old="""    tokens.append(int(torch.multinomial(target_probs[-1], 1, generator=generator)))  # bonus
""",
        new="",
        hint=4,
        caught_by="test_speculative.py::test_one_hot_rows_are_greedy_and_a_seed_replays"),
    NamedBug(
        "07b", "the replacement drawn from torch's global generator",
        "a seeded request does not replay once a draft is rejected",
        old="""        tokens.append(int(torch.multinomial(residual, 1, generator=generator)))""",
        new="""        tokens.append(int(torch.multinomial(residual, 1)))""",
        hint=5,
        caught_by="test_speculative.py::test_every_draw_comes_from_the_generator_and_ids_are_ints"),
    # --------------------------------------------- 09, the prefix-aware router
    NamedBug(
        "09", "block names from Python's hash(), as the engine's compute_block_hash",
        "a restarted router, or a second one, names every prefix differently: "
        "conversations land where their blocks are not cached",
        old="""        digest = hashlib.blake2b(digest_size=8)
        digest.update((hashes[-1] if hashes else 0).to_bytes(8, "big"))
        for token in token_ids[j * block_size:(j + 1) * block_size]:
            digest.update(int(token).to_bytes(4, "big"))
        hashes.append(int.from_bytes(digest.digest(), "big"))""",
        new="""        block = tuple(token_ids[j * block_size:(j + 1) * block_size])
        hashes.append(hash((hashes[-1] if hashes else None, block)))""",
        hint=2,
        caught_by="test_ch09_routing_exercise.py::test_block_names_are_the_same_in_every_process"),
    NamedBug(
        "09", "each block named alone, not chained",
        "two prompts that share a block at the same place but not what comes before "
        "it get the same key: the key no longer names a prefix",
        old="""        digest.update((hashes[-1] if hashes else 0).to_bytes(8, "big"))
""",
        new="",
        hint=1,
        caught_by="test_ch09_routing_exercise.py::test_each_block_name_depends_on_every_token_before_it"),
    NamedBug(
        "09", "the partial last block named too",
        "a short conversation's key changes as its first block fills: it moves between "
        "replicas, and a prompt under one block never goes to the least loaded",
        old="""    for j in range(min(len(token_ids) // block_size, max_blocks)):""",
        new="""    for j in range(min(-(-len(token_ids) // block_size), max_blocks)):""",
        hint=1,
        caught_by="test_ch09_routing_exercise.py::test_block_names_cover_full_blocks_only"),
    NamedBug(
        "09", "one point per replica",
        "the arcs between a few points are of any length: one replica takes a large share "
        "of the prefixes, another almost none",
        old="""        for i in range(self.points_per_replica):
            point = ring_point(f"{name}#{i}")""",
        new="""        for i in range(1):
            point = ring_point(f"{name}#{i}")""",
        hint=3,
        caught_by="test_ch09_routing_exercise.py::test_different_conversations_spread_over_every_replica"),
    NamedBug(
        "09", "a key past the last point stays on the last point",
        "the arc after the largest point goes to the wrong replica: the ring is not a ring, "
        "and two routers that wrap would disagree",
        old="""            name = self._owner[self._points[(start + step) % len(self._points)]]""",
        new="""            name = self._owner[self._points[min(start + step, len(self._points) - 1)]]""",
        hint=3,
        caught_by="test_ch09_routing_exercise.py::test_a_key_belongs_to_the_first_point_clockwise"),
    NamedBug(
        "09", "a down replica's keys dealt out by modulo",
        "when a replica goes down its prefixes land anywhere, and move again when it is "
        "removed for good: caches go cold twice",
        old="""        for step in range(len(self._points)):
            name = self._owner[self._points[(start + step) % len(self._points)]]
            if usable is None or name in usable:
                return name
        raise NoReplicaError("no usable replica on the ring")""",
        new="""        name = self._owner[self._points[start % len(self._points)]]
        if usable is None or name in usable:
            return name
        if not usable:
            raise NoReplicaError("no usable replica on the ring")
        return sorted(usable)[key % len(usable)]""",
        hint=4,
        caught_by="test_ch09_routing_exercise.py::test_the_ring_skips_replicas_that_are_not_usable"),
    NamedBug(
        "09", "a replica that is down still owns its prefixes",
        "every conversation of a crashed replica is sent to it again, and fails or waits "
        "for a retry, as long as it is down",
        old="""        by_name = {r.name: r for r in alive}""",
        new="""        by_name = {r.name: r for r in replicas}""",
        hint=4,
        caught_by="test_ch09_routing_exercise.py::test_a_down_replica_moves_only_its_prefixes_and_gets_them_back"),
    NamedBug(
        "09", "the key from the whole prompt's blocks",
        "the key changes at every turn: a conversation moves to another replica each time, "
        "and finds none of its history cached",
        old="""        hashes = prefix_block_hashes(prompt_token_ids, self.block_size, self.prefix_blocks)""",
        new="""        hashes = prefix_block_hashes(prompt_token_ids, self.block_size,
                                     len(prompt_token_ids))""",
        hint=5,
        caught_by="test_ch09_routing_exercise.py::test_a_conversation_stays_on_one_replica_turn_after_turn"),
    NamedBug(
        "09", "the key from the first block alone",
        "every prompt that starts with the same system prompt goes to one replica: "
        "the others idle",
        old="""        return by_name[self.ring.owner(hashes[-1], set(by_name))]""",
        new="""        return by_name[self.ring.owner(hashes[0], set(by_name))]""",
        hint=5,
        caught_by="test_ch09_routing_exercise.py::test_prompts_that_differ_within_the_prefix_blocks_spread"),
    NamedBug(
        "09", "a replica removed from the ring keeps its points",
        "a replica that left still owns keys: requests are sent to a replica the router "
        "no longer has (a crash)",
        old="""        self._points = [p for p in self._points if self._owner[p] != name]
""",
        new="",
        hint=6,
        caught_by="test_ch09_routing_exercise.py::test_adding_a_replica_moves_keys_only_to_it_and_removing_it_moves_them_back"),
    NamedBug(
        "09", "a short prompt sent to the first replica listed",
        "every request shorter than a block lands on one replica, even when it is the "
        "busiest or down",
        old="""            return self.fallback.choose(prompt_token_ids, alive)""",
        new="""            return replicas[0]""",
        hint=7,
        caught_by="test_ch09_routing_exercise.py::test_a_prompt_shorter_than_a_block_goes_to_the_least_loaded_healthy_replica"),
    # ----------------------------------- 10a, the LoRA products of a mixed batch
    NamedBug(
        "10a", "one adapter for the whole batch, the first row's",
        "every request of a mixed step runs the first request's adapter: the base "
        "model's requests and the other adapters' answer in its style",
        old="""    a = lora_a[indices]  # (T, r, in): row t's A
    return torch.einsum("ti,tri->tr", x, a) * scaling[indices, None]""",
        new="""    a = lora_a[indices[0]]  # (r, in): the batch's A
    return torch.einsum("ti,ri->tr", x, a) * scaling[indices, None]""",
        hint=1,
        caught_by="test_ch10_lora_products_exercise.py::test_bgmv_shrink_gives_each_row_its_own_a"),
    NamedBug(
        "10a", "the scaling alpha / r forgotten",
        "every adapter's change comes out lora_alpha / r times too small or too large: "
        "not the model it was trained as (peft's merged model)",
        old="""    return torch.einsum("ti,tri->tr", x, a) * scaling[indices, None]""",
        new="""    return torch.einsum("ti,tri->tr", x, a)""",
        hint=3,
        caught_by="test_ch10_lora_products_exercise.py::"
                  "test_bgmv_shrink_scales_each_row_by_its_own_adapters_alpha_over_r"),
    NamedBug(
        "10a", "one scale for the batch, the first slot's",
        "adapters of different alpha / r in one step all get slot 0's scale: an "
        "adapter's answers change with the adapters it happens to share a step with",
        old="""    return torch.einsum("ti,tri->tr", x, a) * scaling[indices, None]""",
        new="""    return torch.einsum("ti,tri->tr", x, a) * scaling[0]""",
        hint=3,
        caught_by="test_ch10_lora_products_exercise.py::"
                  "test_bgmv_shrink_scales_each_row_by_its_own_adapters_alpha_over_r"),
    NamedBug(
        "10a", "A and B swapped, the shapes mended by transposes",
        "on a square projection (q_proj, o_proj) it runs and adds x @ (B A), the merged "
        "change untransposed: the adapter's answers are wrong; on the others it crashes",
        old="""    h = bgmv_shrink(x[rows], lora_a, slots, scaling)  # (R, r)
    y.index_add_(0, rows, bgmv_expand(h, lora_b, slots))""",
        new="""    h = bgmv_shrink(x[rows], lora_b.transpose(1, 2), slots, scaling)  # (R, r)
    y.index_add_(0, rows, bgmv_expand(h, lora_a.transpose(1, 2), slots))""",
        hint=2,
        caught_by="test_ch10_lora_products_exercise.py::"
                  "test_the_change_is_x_times_the_merged_weight_transposed"),
    NamedBug(
        "10a", "rows without an adapter given the last slot's (index -1 wraps round)",
        "a base model request that shares a step with adapters runs the adapter of the "
        "last slot: lora_a[-1] is a slot, not 'none'",
        old="""    rows = (indices != NO_LORA).nonzero().squeeze(1)  # (R,): the rows with an adapter
    if len(rows) == 0:
        return
    slots = indices[rows]  # (R,)
    h = bgmv_shrink(x[rows], lora_a, slots, scaling)  # (R, r)
    y.index_add_(0, rows, bgmv_expand(h, lora_b, slots))""",
        new="""    h = bgmv_shrink(x, lora_a, indices, scaling)  # (T, r)
    y += bgmv_expand(h, lora_b, indices)""",
        hint=4,
        caught_by="test_ch10_lora_products_exercise.py::test_rows_without_an_adapter_are_left_alone"),
    NamedBug(
        "10a", "the changes added to the first rows, not to the rows they came from",
        "in a step that mixes the base model and adapters, adapter rows' changes land "
        "on other requests' tokens",
        old="""    y.index_add_(0, rows, bgmv_expand(h, lora_b, slots))""",
        new="""    y[:len(rows)] += bgmv_expand(h, lora_b, slots)""",
        hint=4,
        caught_by="test_ch10_lora_products_exercise.py::test_rows_without_an_adapter_are_left_alone"),
    NamedBug(
        "10a", "the sum assigned to a new y instead of added in place",
        "the layer's output never changes: every adapter answers as the base model",
        old="""    y.index_add_(0, rows, bgmv_expand(h, lora_b, slots))""",
        new="""    y = y.index_add(0, rows, bgmv_expand(h, lora_b, slots))""",
        hint=5,
        caught_by="test_ch10_lora_products_exercise.py::test_the_change_is_added_in_place_to_a_view"),
    NamedBug(
        "10a", "NO_LORA grouped as if it were a slot",
        "the grouped product (the engine's on the CPU) gives the base model's tokens "
        "the last slot's adapter",
        old="""                  for slot in indices.unique().tolist() if slot != NO_LORA]""",
        new="""                  for slot in indices.unique().tolist()]""",
        hint=7,
        caught_by="test_ch10_lora_products_exercise.py::test_the_mapping_groups_each_slot_with_its_rows"),
    # ----------------------------------------- 10b, the scheduler's adapter budget
    NamedBug(
        "10b", "the base model counted as an adapter",
        "with base model requests running, one slot fewer for adapters: with "
        "--max-loras 1 no adapter runs beside the base model at all",
        old="""        return {seq.lora_int_id for seq in self.running} - {0}""",
        new="""        return {seq.lora_int_id for seq in self.running}""",
        hint=1,
        caught_by="test_ch10_lora_budget_exercise.py::"
                  "test_the_running_adapters_leave_the_base_model_and_the_queue_out"),
    NamedBug(
        "10b", "the waiting requests' adapters counted as running",
        "a waiting adapter counts itself as running and is admitted into full slots: "
        "the model manager refuses the step (RuntimeError)",
        old="""        return {seq.lora_int_id for seq in self.running} - {0}""",
        new="""        return {seq.lora_int_id for seq in [*self.running, *self.waiting]} - {0}""",
        hint=1,
        caught_by="test_ch10_lora_budget_exercise.py::"
                  "test_the_running_adapters_leave_the_base_model_and_the_queue_out"),
    NamedBug(
        "10b", "a base model request held back when the slots are full",
        "requests without an adapter wait for adapter slots they do not need",
        old="""        return bool(seq.lora_int_id) and seq.lora_int_id not in loras \\""",
        new="""        return seq.lora_int_id not in loras \\""",
        hint=2,
        caught_by="test_ch10_lora_budget_exercise.py::test_a_base_model_request_needs_no_slot"),
    NamedBug(
        "10b", "a request of a running adapter made to wait for a slot of its own",
        "once the slots are full, nobody else of a running adapter gets in: its "
        "requests run one batch after another instead of together",
        old="""        return bool(seq.lora_int_id) and seq.lora_int_id not in loras \\""",
        new="""        return bool(seq.lora_int_id) \\""",
        hint=2,
        caught_by="test_ch10_lora_budget_exercise.py::test_an_adapter_already_running_shares_its_slot"),
    NamedBug(
        "10b", "the slot budget off by one",
        "a step gets max_loras + 1 adapters: the model manager has no slot for the "
        "last one and refuses the step (RuntimeError)",
        old="""            and len(loras) >= self.max_loras""",
        new="""            and len(loras) > self.max_loras""",
        hint=3,
        caught_by="test_ch10_lora_budget_exercise.py::"
                  "test_a_new_adapter_waits_only_when_every_slot_is_taken"),
]


def bugs_for(exercise: str) -> list[NamedBug]:
    return [bug for bug in NAMED_BUGS if bug.exercise == exercise]
