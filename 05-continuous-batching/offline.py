"""Offline batch inference with the engine: summarize a list of texts.

No server: `LLM.chat` hands every conversation to the engine at once and
continuous batching runs them together.

    python 05-continuous-batching/offline.py
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.entrypoints.llm import LLM  # noqa: E402
from common.sampling_params import SamplingParams  # noqa: E402

TEXTS = [
    "The Eiffel Tower was built for the 1889 World's Fair in Paris. At first "
    "many artists hated it, but it became the symbol of the city.",
    "Photosynthesis lets plants turn sunlight, water and carbon dioxide into "
    "sugar and oxygen. It happens in the chloroplasts of leaves.",
    "A KV cache stores the keys and values of past tokens so that a language "
    "model does not recompute them at every new token.",
    "Bees communicate the direction and distance of flowers to each other "
    "with a dance performed inside the hive.",
    "The Great Wall of China is a series of fortifications built over many "
    "centuries to protect Chinese states from invasions.",
    "Python lists are mutable sequences, while tuples cannot be changed once "
    "they are created, which makes them usable as dictionary keys.",
]


def conversations() -> list[list[dict]]:
    """One chat per text (bench/peers/vllm_checks.py gives the real vLLM these same ones)."""
    return [[{"role": "user", "content": f"Summarize in one sentence: {t}"}] for t in TEXTS]


def main() -> None:
    llm = LLM(model="smollm2", max_num_seqs=16)
    start = time.perf_counter()
    outputs = llm.chat(conversations(), SamplingParams(temperature=0, max_tokens=48))
    elapsed = time.perf_counter() - start
    for text, output in zip(TEXTS, outputs):
        print(f"- {text[:60]}...\n  -> {output.outputs[0].text.strip()}\n")
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"{len(outputs)} summaries, {tokens} tokens in {elapsed:.1f} s "
          f"({tokens / elapsed:.1f} output tokens/s)")


if __name__ == "__main__":
    main()
