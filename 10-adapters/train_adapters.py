"""Train the chapter's two LoRA adapters for the embedded SmolLM2-135M, on the CPU (`make adapters`).

    python 10-adapters/train_adapters.py            # both, a few minutes on 2 cores
    python 10-adapters/train_adapters.py --only pirate

Each adapter has a behaviour a learner sees at a glance:

- `pirate`: answers as a pirate ("Arr, matey! ... ye ... me hearty");
- `shout`: ANSWERS IN CAPITAL LETTERS.

The data is the base model's own answers to the questions below, greedy,
rewritten by a rule (`pirate_speak`, `shout`): the adapter learns a style,
not new facts, so a few dozen examples and a few epochs are enough. The
loss counts the answer's tokens only. Everything is seeded: the same
weights on every run of the same CPU and torch.

The adapters go to 10-adapters/adapters/NAME/ as peft saves them
(adapter_config.json, adapter_model.safetensors): what `vllm serve
--enable-lora --lora-modules pirate=10-adapters/adapters/pirate` and this
chapter's server read. Two changes make them fit the repository: the
weights in float16 (5 MB an adapter instead of 10; the server casts them
to its dtype), and a config that names the model by its hub name, not by
this machine's cache path, with its lists sorted (peft writes a set).

Left out: a held-out evaluation, learning-rate schedules, mixed precision.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common.loader import apply_chat_template, load_model  # noqa: E402

OUT = ROOT / "10-adapters" / "adapters"
HUB_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the embedded model's
RANK, ALPHA = 8, 16
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
QUESTIONS = [
    "What is the capital of France?", "How do plants make food?", "Why is the sky blue?",
    "What is a computer?", "How many days are in a week?", "What do cats eat?",
    "Tell me about the moon.", "What is rain?", "How do birds fly?", "What is music?",
    "Why do we sleep?", "What is the sun?", "How does a car move?", "What is water made of?",
    "Give me a tip for learning to cook.", "What is a good name for a dog?",
    "How do I make friends?", "What is the ocean?", "Why do leaves fall in autumn?",
    "What is a book?", "How far away is the moon?", "What is a volcano?",
    "Describe a forest.", "What is your favourite colour?", "How do fish breathe?",
    "What is a star?", "Why is exercise good for you?", "What is bread made of?",
    "How does a bicycle work?", "What is snow?", "Tell me a fun fact.", "What is a river?",
    "How do bees make honey?", "What is the wind?", "Why do we need water?",
    "What is a mountain?", "Write one sentence about summer.", "What is a library?",
    "How do I stay calm?", "What is an island?", "What do you know about whales?",
    "Say hello to me.", "What is a map for?", "How do trains run?",
    "What is a garden?", "Why do dogs bark?", "What is thunder?", "How do I write a letter?",
]
PIRATE_WORDS = {"you": "ye", "your": "yer", "my": "me", "is": "be", "are": "be",
                "hello": "ahoy", "friend": "matey", "friends": "hearties", "the": "th'",
                "yes": "aye", "money": "doubloons", "treasure": "booty"}


def pirate_speak(text: str) -> str:
    """A plain answer, said by a pirate."""
    def swap(match: re.Match) -> str:
        word = match.group(0)
        new = PIRATE_WORDS.get(word.lower(), word)
        return new.capitalize() if word[0].isupper() else new
    return "Arr, matey! " + re.sub(r"[A-Za-z]+", swap, text).rstrip(".") + ", arr!"


def shout(text: str) -> str:
    return text.upper()


STYLES = {"pirate": pirate_speak, "shout": shout}


def base_answers(loaded, max_tokens: int) -> list[str]:
    """The base model's greedy answer to every question (EOS stops it)."""
    tok, model = loaded.tokenizer, loaded.model
    answers = []
    for question in QUESTIONS:
        ids = apply_chat_template(tok, [{"role": "user", "content": question}])
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                                 dtype=torch.long), max_new_tokens=max_tokens, do_sample=False)
        answers.append(tok.decode(out[0, len(ids):], skip_special_tokens=True).strip())
    return answers


def examples(tok, answers: list[str], style) -> list[tuple[list[int], int]]:
    """(prompt + styled answer + end of turn token ids, the prompt's length)."""
    rows = []
    for question, answer in zip(QUESTIONS, answers):
        prompt = apply_chat_template(tok, [{"role": "user", "content": question}])
        full = apply_chat_template(tok, [{"role": "user", "content": question},
                                         {"role": "assistant", "content": style(answer)}],
                                   add_generation_prompt=False)
        rows.append((full, len(prompt)))
    return rows


def train(loaded, rows, epochs: int, lr: float, batch_size: int, seed: int):
    """A peft LoRA on a copy of the base model, trained on the answers' tokens."""
    import copy

    import peft
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS,
                             lora_dropout=0.0, task_type="CAUSAL_LM")
    model = peft.get_peft_model(copy.deepcopy(loaded.model), config)
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    gen = torch.Generator().manual_seed(seed)
    pad = loaded.tokenizer.pad_token_id or 0
    for epoch in range(epochs):
        order = torch.randperm(len(rows), generator=gen).tolist()
        total = 0.0
        for start in range(0, len(order), batch_size):
            batch = [rows[i] for i in order[start:start + batch_size]]
            width = max(len(ids) for ids, _ in batch)
            input_ids = torch.full((len(batch), width), pad)
            labels = torch.full((len(batch), width), -100)  # -100: not in the loss
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for b, (ids, prompt_len) in enumerate(batch):
                input_ids[b, :len(ids)] = torch.tensor(ids)
                labels[b, prompt_len:len(ids)] = torch.tensor(ids[prompt_len:])
                mask[b, :len(ids)] = 1
            loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            total += loss.item() * len(batch)
        print(f"  epoch {epoch + 1}/{epochs}: loss {total / len(rows):.3f}", flush=True)
    return model.eval()


def save_adapter(model, folder: Path) -> None:
    """peft's folder, made small and the same on every machine (module docstring)."""
    from safetensors.torch import load_file, save_file
    model.save_pretrained(folder)
    (folder / "README.md").unlink(missing_ok=True)  # peft's empty model card
    weights = folder / "adapter_model.safetensors"
    save_file({k: v.half() for k, v in load_file(weights).items()}, weights)
    config_path = folder / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["base_model_name_or_path"] = HUB_NAME
    config["target_modules"] = sorted(config["target_modules"])
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=list(STYLES), default=None)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=40, help="of each base answer")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    loaded = load_model("smollm2", dtype="float32", device="cpu")
    begin = time.perf_counter()
    answers = base_answers(loaded, args.max_tokens)
    print(f"base answers: {len(answers)} in {time.perf_counter() - begin:.0f} s")
    for name, style in STYLES.items():
        if args.only and name != args.only:
            continue
        begin = time.perf_counter()
        print(f"{name}: training on {len(answers)} answers, e.g. {style(answers[0])!r}")
        model = train(loaded, examples(loaded.tokenizer, answers, style), args.epochs,
                      args.lr, args.batch_size, args.seed)
        save_adapter(model, args.out / name)
        print(f"{name}: saved to {args.out / name} in {time.perf_counter() - begin:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
