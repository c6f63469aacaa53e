"""Chapter 01: an OpenAI-style chat server that generates by hand.

No KV cache: every new token re-runs the model over the whole sequence
(common/autoregressive.py). One request at a time.

    python 01-concepts/server.py --port 8000
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.autoregressive import eos_token_ids, generate_without_cache  # noqa: E402
from common.loader import load_model  # noqa: E402
from common.entrypoints.cli_args import parse_server_args, server_parser  # noqa: E402
from common.entrypoints.launcher import serve  # noqa: E402
from common.entrypoints.simple_app import Completion, build_chat_app  # noqa: E402
from common.entrypoints.protocol import ChatCompletionRequest  # noqa: E402


def main() -> int:
    args = parse_server_args(server_parser("Chapter 01: the autoregressive loop by hand", "01"),
                             "01")  # ch01: a later chapter's flag is an error, not ignored
    lm = load_model(args.model, args.dtype, args.device, args.load_format, args.seed)
    eos = eos_token_ids(lm.model, lm.tokenizer)

    def generate(prompt_ids: list[int], req: ChatCompletionRequest, max_tokens: int,
                 seed: int | None) -> Completion:
        stop_ids = set() if req.ignore_eos else eos  # the load test asks for ignore_eos
        new_ids, reason = generate_without_cache(
            lm.model, prompt_ids, max_tokens, req.temperature, stop_ids, seed)
        return Completion(new_ids, reason)

    app = build_chat_app(
        "Chapter 01: generation by hand", args.served_model_name or args.model,
        args.max_model_len or lm.max_model_len, lm.tokenizer, generate, serialize=True)
    return serve(app, args)


if __name__ == "__main__":
    sys.exit(main())
