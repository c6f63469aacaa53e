"""Chapter 10: many fine-tuned models on one engine (multi-LoRA serving).

Chapter 09's server and engine, with one component more: the adapter layer
(common/lora/). With `--enable-lora`, every projection of the model gets
`--max-loras` slots of LoRA weights beside its base weight, a request's
`model` names its adapter, and one step mixes requests of different
adapters (and of none): the base product once for the whole batch, each
token's own low-rank product added (common/lora/punica_wrapper.py, on the
CPU in its stacked form; the ops in common/lora/punica.py). The scheduler
admits at most `--max-loras` distinct adapters into a step
(common/lora/scheduler.py).

    make adapters                                   # train the two adapters (minutes)
    python 10-adapters/server.py --enable-lora \\
        --lora-modules pirate=10-adapters/adapters/pirate shout=10-adapters/adapters/shout
    curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"model": "pirate", "messages": [{"role": "user", "content": "Hello!"}]}'
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.config import EngineConfig  # noqa: E402
from common.engine.parts import EngineParts  # noqa: E402
from common.entrypoints.api_server import main  # noqa: E402
from common.entrypoints.chapters import chapter_server  # noqa: E402
from common.entrypoints.serving_models import OpenAIServingModels  # noqa: E402  ch10
from common.lora.model_manager import with_adapters  # noqa: E402  ch10


def engine_parts(config: EngineConfig) -> EngineParts:
    """Chapter 09's parts; with --enable-lora, the adapter slots and the
    scheduler that keeps a step within them."""
    parts = chapter_server("09").engine_parts(config)
    if config.enable_lora:  # ch10: the adapter layer
        parts = with_adapters(parts, config)
    return parts


def serving_models(config: EngineConfig) -> OpenAIServingModels | None:
    """The names a request's `model` may give: the base model's, and with
    --enable-lora each adapter's, the --lora-modules read now."""
    if not config.enable_lora:
        if config.lora_modules:
            raise ValueError("--lora-modules needs --enable-lora")
        return None
    models = OpenAIServingModels(config.model_name, config.max_loras, config.max_lora_rank,
                                 config.lora_modules, base_model_path=config.model)
    models.init_static_loras()
    return models


if __name__ == "__main__":
    sys.exit(main("10", "Chapter 10: many fine-tunes on one engine (multi-LoRA)",  # ch10
                  engine_parts, serving_models))
