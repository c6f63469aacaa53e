"""The seeded loads of the comparison with the real vLLM (bench/vs_vllm.py).

Each load of `WORKLOADS` is a number of clients, an answer length, and
its requests' chat messages, made from (seed, client, request index)
alone: one seed gives chapter 06 and vLLM the same requests. A client
sends its requests one after another (`Client`); `run_workload` runs them
all at once for a duration (bench/loadtest.py `run_for_duration`),
streamed, greedy, EOS ignored.

- `chat-32`, `chat-64`: the load test's short prompts behind its system
  prompt (bench/loadtest.py `prompt_messages`), 32 clients x 64 tokens
  and 64 clients x 128 tokens;
- `long`: 16 clients, each request a document of 1,000-1,500 tokens
  (uniform) and "Summarize the document above.", 128 tokens out;
- `shared-prefix`: 16 clients, every request the same 1,000-token
  document followed by its own question (20-40 tokens), 128 tokens out;
- `multi-turn`: 16 conversations at once, 4 turns each, every turn sent
  with the whole history (system prompt, the earlier user turns, the
  answers the server streamed), as chat clients do; the first turn a
  400-token document, the others short questions; 128 tokens out per
  turn. A client whose conversation ends starts a new one.

A document is vLLM's `random` dataset's kind of text: token ids drawn from
the embedded model's vocabulary, special tokens excluded, decoded to text,
encoded again and cut or topped up until it is exactly its length
(`random_document`).

Each load gives the closest `vllm bench serve` command
(`Workload.vllm_bench_command`), to run the vLLM side with vLLM's own
tool. Where ours differs:

- ours sends chat requests (`/v1/chat/completions`, the model's chat
  template); the command does too (`--backend openai-chat`), with the
  prompt as one user message and no system prompt;
- vLLM's tool sends `--num-prompts` requests, ours sends for a duration:
  give it about as many requests as a run of ours completed (the
  results file's command does);
- `long`: vLLM's prompt is consecutive vocabulary ids from a random
  offset, with no instruction; ours draws every id, then asks for a
  summary. vLLM's `--random-range-ratio` also varies the answer's
  length unless given per side, as the command does;
- `shared-prefix`: `prefix_repetition`'s suffix is 30 random tokens;
  ours is a question in words;
- `chat-32`, `chat-64`: no vLLM dataset holds the load test's prompts:
  the command is `random` prompts of their mean length;
- `multi-turn`: `vllm bench serve` has no multi-turn dataset (vLLM's
  repository has a separate script, benchmarks/multi_turn/): the command
  is `random` prompts of a last turn's length, without the history.

Left out: open-loop arrival rates, think time between turns, answer
lengths that vary, real text (ShareGPT and its like need a download).
"""
from __future__ import annotations

import functools
import random
import statistics
import threading
from dataclasses import dataclass, field

from bench.loadtest import PROMPTS, SYSTEM_PROMPT, RequestResult, run_for_duration
from bench.scale import WORDS, chat_turn
from common.loader import load_tokenizer

SUMMARIZE = "Summarize the document above."
TOKENIZER_LOCK = threading.Lock()


# ------------------------------------------------------------ documents
@functools.lru_cache(maxsize=1)
def tokenizer():
    """The embedded model's tokenizer (offline), loaded once."""
    return load_tokenizer("smollm2")


@functools.lru_cache(maxsize=1)
def allowed_token_ids() -> list[int]:
    """The vocabulary without its special and added tokens (`<|im_start|>`, ...)."""
    tok = tokenizer()
    banned = set(tok.all_special_ids) | set(tok.added_tokens_decoder)
    return [i for i in range(tok.vocab_size) if i not in banned]


def token_count(text: str) -> int:
    return len(tokenizer().encode(text, add_special_tokens=False))


def random_document(rng: random.Random, num_tokens: int, max_tries: int = 50) -> str:
    """Text of exactly `num_tokens` tokens, encoded alone or followed by a
    paragraph break (so a question after it leaves its tokens whole):
    random ids, decoded, encoded again, cut or topped up until it holds.
    One client thread at a time: a fast tokenizer shared by threads may
    refuse a call ("Already borrowed")."""
    tok, allowed = tokenizer(), allowed_token_ids()
    ids = [rng.choice(allowed) for _ in range(num_tokens)]
    with TOKENIZER_LOCK:
        for _ in range(max_tries):
            text = tok.decode(ids)
            ids = tok.encode(text, add_special_tokens=False)
            if len(ids) == num_tokens:
                if tok.encode(text + "\n\n", add_special_tokens=False)[:num_tokens] == ids:
                    return text
                ids[-1] = rng.choice(allowed)  # its last token merges with the break: another
            ids = ids[:num_tokens] + [rng.choice(allowed) for _ in range(num_tokens - len(ids))]
    raise RuntimeError(f"no text of exactly {num_tokens} tokens after {max_tries} tries")


def question(rng: random.Random, client: int, index: int) -> str:
    """A question about the document above, 20-40 tokens."""
    a, b, c = rng.sample(WORDS, 3)
    return (f"Question {index} from reader {client}: according to the document above, "
            f"how does the {a} relate to the {b} and to the {c}? Answer in two sentences.")


def follow_up(rng: random.Random) -> str:
    """A later turn of a conversation: a short question."""
    a, b = rng.sample(WORDS, 2)
    return f"Tell me more about the {a} and the {b}."


# -------------------------------------------------------- conversations
@dataclass(frozen=True)
class Conversation:
    """A system prompt (or none) and the user's turns, one request each."""
    system: str | None
    turns: tuple[str, ...]

    def messages(self, answers: list[str]) -> list[dict]:
        """The next request's messages, after as many turns as `answers`:
        the system prompt, each earlier turn with the answer it got, the
        next turn."""
        said = [{"role": "system", "content": self.system}] if self.system else []
        for turn, answer in zip(self.turns, answers):
            said += [{"role": "user", "content": turn}, {"role": "assistant", "content": answer}]
        return said + [{"role": "user", "content": self.turns[len(answers)]}]


@dataclass(frozen=True)
class Workload:
    """A load: its clients, its answers' length, its conversations."""
    name: str
    clients: int
    max_tokens: int
    about: str  # in words, for the results table
    # A run's steady state: long enough for each client's second request to
    # start out of step with the others' (a long prompt's request: ~30 s here)
    duration_s: float = 30.0

    def conversation(self, seed: int, client: int, index: int) -> Conversation:
        """Client `client`'s `index`-th conversation, from these three alone."""
        raise NotImplementedError

    def rng(self, seed: int, client: int, index: int) -> random.Random:
        return random.Random(f"{self.name}/{seed}/{client}/{index}")

    def vllm_dataset_flags(self) -> str:
        raise NotImplementedError

    def vllm_bench_command(self, model: str = "$MODEL", num_prompts: int | None = None,
                           seed: int = 0, base_url: str = "http://127.0.0.1:8000") -> str:
        """The closest `vllm bench serve` command (the module's docstring
        says where it differs). `model`: the embedded model's folder."""
        return (f"vllm bench serve --backend openai-chat --endpoint /v1/chat/completions "
                f"--base-url {base_url} --model {model} --served-model-name smollm2 "
                f"{self.vllm_dataset_flags()} --max-concurrency {self.clients} "
                f"--num-prompts {num_prompts or 10 * self.clients} --num-warmups 1 "
                f"--ignore-eos --temperature 0 --seed {seed} "
                "--percentile-metrics ttft,itl,e2el --metric-percentiles 50,95")


def random_flags(input_len: int, output_len: int, range_ratio: float = 0.0) -> str:
    """vLLM's `random` dataset; the answer's length fixed, the prompt's within `range_ratio`."""
    ratio = (f" --random-range-ratio '{{\"input\": {range_ratio}, \"output\": 0.0}}'"
             if range_ratio else "")
    return (f"--dataset-name random --random-input-len {input_len} "
            f"--random-output-len {output_len}{ratio}")


@dataclass(frozen=True)
class Chat(Workload):
    """The load test's prompts, one request per conversation."""

    def conversation(self, seed: int, client: int, index: int) -> Conversation:
        prompt = PROMPTS[(seed + client + index) % len(PROMPTS)]
        return Conversation(SYSTEM_PROMPT, (prompt,))

    def vllm_dataset_flags(self) -> str:
        lengths = [sum(token_count(m["content"]) for m in self.conversation(0, 0, i).messages([]))
                   for i in range(len(PROMPTS))]  # the system prompt and the question
        return random_flags(round(statistics.fmean(lengths)), self.max_tokens)


@dataclass(frozen=True)
class LongDocument(Workload):
    """A document of `low`-`high` tokens (uniform), then the instruction."""
    low: int = 1000
    high: int = 1500

    def conversation(self, seed: int, client: int, index: int) -> Conversation:
        rng = self.rng(seed, client, index)
        document = random_document(rng, rng.randint(self.low, self.high))
        return Conversation(None, (f"{document}\n\n{SUMMARIZE}",))

    def vllm_dataset_flags(self) -> str:
        middle = (self.low + self.high) // 2
        return random_flags(middle, self.max_tokens, (self.high - middle) / middle)


@dataclass(frozen=True)
class SharedPrefix(Workload):
    """One document of `prefix_tokens` for every request (per seed), then
    each request's own question."""
    prefix_tokens: int = 1000

    def document(self, seed: int) -> str:
        return _document(self.name, seed, self.prefix_tokens)

    def conversation(self, seed: int, client: int, index: int) -> Conversation:
        ask = question(self.rng(seed, client, index), client, index)
        return Conversation(None, (f"{self.document(seed)}\n\n{ask}",))

    def vllm_dataset_flags(self) -> str:
        return (f"--dataset-name prefix_repetition --prefix-repetition-prefix-len "
                f"{self.prefix_tokens} --prefix-repetition-suffix-len 30 "
                f"--prefix-repetition-num-prefixes 1 "
                f"--prefix-repetition-output-len {self.max_tokens}")


@functools.lru_cache(maxsize=8)
def _document(name: str, seed: int, num_tokens: int) -> str:
    """A load's one shared document for a seed, made once."""
    return random_document(random.Random(f"{name}/{seed}/document"), num_tokens)


@dataclass(frozen=True)
class MultiTurn(Workload):
    """Conversations of `turns` turns: a document of `document_tokens`
    first, then short questions; each turn resends the history."""
    turns: int = 4
    document_tokens: int = 400

    def conversation(self, seed: int, client: int, index: int) -> Conversation:
        rng = self.rng(seed, client, index)
        first = f"{random_document(rng, self.document_tokens)}\n\nWhat is this document about?"
        return Conversation(SYSTEM_PROMPT,
                            (first, *(follow_up(rng) for _ in range(self.turns - 1))))

    def vllm_dataset_flags(self) -> str:
        # The last turn's prompt: the document, every turn's question and
        # the answers before it.
        last = self.document_tokens + 20 * self.turns + self.max_tokens * (self.turns - 1)
        return random_flags(last, self.max_tokens)


WORKLOADS: dict[str, Workload] = {w.name: w for w in [
    Chat("chat-32", 32, 64, "32 clients, the load test's short prompts, 64 tokens out"),
    Chat("chat-64", 64, 128, "64 clients, the load test's short prompts, 128 tokens out"),
    LongDocument("long", 16, 128, "16 clients, a 1,000-1,500-token document each, "
                 "128 tokens out", duration_s=60.0),
    SharedPrefix("shared-prefix", 16, 128, "16 clients, one 1,000-token document, "
                 "a question each, 128 tokens out", duration_s=60.0),
    MultiTurn("multi-turn", 16, 128, "16 conversations x 4 turns resending the history, "
              "a 400-token document first, 128 tokens out per turn", duration_s=60.0),
]}


# --------------------------------------------------------------- a client
@dataclass
class Client:
    """One client's requests, in order: its conversations one after another,
    each turn sent with the answers the earlier turns got."""
    workload: Workload
    seed: int
    client: int
    index: int = 0  # of its conversation
    current: Conversation | None = None
    answers: list[str] = field(default_factory=list)

    def next_messages(self) -> list[dict]:
        if self.current is None:
            self.current = self.workload.conversation(self.seed, self.client, self.index)
        return self.current.messages(self.answers)

    def answered(self, text: str) -> None:
        """The answer to the last messages (what the server streamed): the
        next turn, or the next conversation after the last turn."""
        self.answers.append(text)
        if len(self.answers) == len(self.current.turns):
            self.current, self.answers, self.index = None, [], self.index + 1


def run_workload(url: str, workload: Workload, seed: int, duration_s: float,
                 model: str | None = None) -> dict:
    """The load on a running server for `duration_s` (steady state): the
    load test's summary of the requests sent."""
    clients = [Client(workload, seed, c) for c in range(workload.clients)]

    def send(c: int, _: int) -> RequestResult:
        result, text, _ = chat_turn(url, model, clients[c].next_messages(), workload.max_tokens)
        clients[c].answered(text)
        return result

    summary = run_for_duration(send, workload.clients, duration_s)
    summary["load"].update(name=workload.name, seed=seed, max_tokens=workload.max_tokens)
    return summary
