"""The models a server answers for: the base model and its adapters (ch10;
vLLM's OpenAIServingModels).

Chapters 01-09 serve one model: a request's `model` is its name or
nothing. With `--enable-lora` the server also answers for each adapter
by its name:

- `/v1/models` lists the base model, then each adapter with its `parent`
  (the base model's name) and its `root` (its folder);
- a request's `model` picks its adapter (`lora_request`); a name that is
  neither gets vLLM's 404, and the answer's `model` is the name asked for;
- `--lora-modules name=path` are loaded at start (a folder that cannot be
  served stops the server there, as vLLM's `init_static_loras`);
- with VLLM_ALLOW_RUNTIME_LORA_UPDATING=true in the environment (vLLM's
  switch, off by default: anyone who can reach the server could then
  make it read any folder), `/v1/load_lora_adapter` and
  `/v1/unload_lora_adapter` add and remove adapters while it serves.
  Each adapter gets the next integer id, never reused, so the prefix
  cache (its hashes start from the adapter's id) never mixes two.

An adapter is checked here, in the server's process, by reading its
folder (common/lora/lora_model.py); the engine loads it again when its
first request arrives and keeps it in its memory cache.

Left out: vLLM's LoRA resolvers (plugins that find an adapter by name on
first use), `load_inplace`, several base models, an adapter's
`base_model_name` other than the served model.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from itertools import count
from typing import Callable

import torch
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from prometheus_client.core import GaugeMetricFamily
from pydantic import BaseModel

from common.config import LoRAModulePath
from common.entrypoints.middleware import APIError
from common.entrypoints.responses import ModelCard, ModelList
from common.lora.lora_model import LoRALoadError, LoRAModel
from common.lora.request import LoRARequest

log = logging.getLogger("llm-course")

RUNTIME_UPDATES = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"  # vLLM's switch, its values


def runtime_updates_allowed() -> bool:
    return os.environ.get(RUNTIME_UPDATES, "0").strip().lower() in ("1", "true")


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str = ""
    lora_path: str = ""


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str = ""


def invalid_input(message: str) -> APIError:
    return APIError(400, message, "InvalidUserInput")


class OpenAIServingModels:
    def __init__(self, base_model_name: str, max_loras: int, max_lora_rank: int,
                 lora_modules: list[LoRAModulePath], base_model_path: str | None = None):
        """`base_model_path`: where the base model's weights come from (its
        card's `root`, as vLLM shows it)."""
        self.base_model_name, self.base_model_path = base_model_name, base_model_path
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self.static_lora_modules = lora_modules
        self.lora_requests: dict[str, LoRARequest] = {}  # by name, the `model` asked for
        self.lora_ids = count(1)  # vLLM's lora_id_counter: 0 is "no adapter"
        self.created = int(time.time())

    def init_static_loras(self) -> None:
        """`--lora-modules`: each one read now; one that fails stops the
        server (a ValueError, vLLM's message)."""
        for module in self.static_lora_modules:
            try:
                self.add(LoadLoRAAdapterRequest(lora_name=module.name, lora_path=module.path))
            except APIError as exc:
                raise ValueError(exc.message) from None

    # ------------------------------------------------------ a request
    def lora_request(self, requested: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names; None for the base model.
        Any other name: vLLM's 404."""
        if requested in self.lora_requests:
            return self.lora_requests[requested]
        if requested is None or requested == self.base_model_name:
            return None
        raise APIError(404, f"The model `{requested}` does not exist. Valid aliases: "
                       f"{self.base_model_name}.", "NotFoundError", "model", "model_not_found")

    def model_name(self, lora_request: LoRARequest | None) -> str:
        """The `model` an answer names: the adapter's, or the base model's."""
        return self.base_model_name if lora_request is None else lora_request.lora_name

    def show_available_models(self, max_model_len: int) -> ModelList:
        base = ModelCard(id=self.base_model_name, created=self.created,
                         max_model_len=max_model_len, root=self.base_model_path)
        return ModelList(data=[base] + [
            ModelCard(id=lora.lora_name, created=self.created, root=lora.lora_path,
                      parent=self.base_model_name) for lora in self.lora_requests.values()])

    # ------------------------------------------- adding and removing
    def add(self, request: LoadLoRAAdapterRequest) -> str:
        """Check `request`, read the adapter's folder, then serve it."""
        if not request.lora_name or not request.lora_path:
            raise invalid_input("Both 'lora_name' and 'lora_path' must be provided.")
        if request.lora_name == self.base_model_name:
            raise invalid_input(f"The lora adapter '{request.lora_name}' conflicts with "
                                "a served base model.")
        if request.lora_name in self.lora_requests:
            raise invalid_input(f"The lora adapter '{request.lora_name}' has already "
                                "been loaded.")
        lora = LoRARequest(request.lora_name, next(self.lora_ids), request.lora_path)
        try:  # read once here: a folder that cannot be served is refused now
            LoRAModel.from_local_checkpoint(lora.lora_path, lora.lora_int_id,
                                            self.max_lora_rank, torch.float32)
        except LoRALoadError as exc:
            status = 404 if "No adapter found" in str(exc) else 400
            raise APIError(status, f"Loading lora {lora.lora_name} failed: {exc}",
                           "NotFoundError" if status == 404 else "BadRequestError") from None
        self.lora_requests[lora.lora_name] = lora
        log.info("Loaded new LoRA adapter: name '%s', path '%s'", lora.lora_name,
                 lora.lora_path)
        return f"Success: LoRA adapter '{lora.lora_name}' added successfully."

    async def load_lora_adapter(self, request: LoadLoRAAdapterRequest) -> str:
        return await asyncio.to_thread(self.add, request)  # reads a folder: off the loop

    def unload_lora_adapter(self, request: UnloadLoRAAdapterRequest) -> str:
        """Requests already running with it finish; new ones get a 404."""
        if not request.lora_name:
            raise invalid_input("'lora_name' needs to be provided to unload a LoRA adapter.")
        if request.lora_name not in self.lora_requests:
            raise APIError(404, f"The lora adapter '{request.lora_name}' cannot be found.",
                           "NotFoundError")
        del self.lora_requests[request.lora_name]
        log.info("Removed LoRA adapter: name '%s'", request.lora_name)
        return f"Success: LoRA adapter '{request.lora_name}' removed successfully."

    def add_routes(self, app: FastAPI) -> None:
        """The two routes, only where the environment allows them (vLLM's rule)."""
        if not runtime_updates_allowed():
            return
        log.warning("LoRA dynamic loading & unloading is enabled in the API server. "
                    "This should ONLY be used for local development!")

        @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
        async def load_lora_adapter(request: LoadLoRAAdapterRequest) -> str:
            return await self.load_lora_adapter(request)

        @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
        def unload_lora_adapter(request: UnloadLoRAAdapterRequest) -> str:
            return self.unload_lora_adapter(request)

    def add_metrics(self, metrics, snapshot: Callable[[], dict]) -> None:
        """vllm:lora_requests_info on /metrics (`metrics`: a Metrics)."""
        metrics.registry.register(LoRARequestsInfo(snapshot, self.max_loras))


class LoRARequestsInfo:
    """vLLM's `vllm:lora_requests_info`: a gauge whose labels carry the
    state (the adapters of the running and of the waiting requests, names
    joined by commas, and max_lora) and whose value is the last time that
    state was seen, in seconds since the epoch. Every state seen stays, as
    in vLLM: the current one has the latest time. Read at each scrape
    (vLLM sets it at each stats interval)."""

    LABELS = ["max_lora", "waiting_lora_adapters", "running_lora_adapters"]

    def __init__(self, snapshot: Callable[[], dict], max_loras: int):
        self.snapshot, self.max_loras = snapshot, max_loras
        self.last_seen: dict[tuple[str, str, str], float] = {}  # labels -> time

    def collect(self):
        s = self.snapshot()
        state = (str(self.max_loras), ",".join(s.get("waiting_lora_adapters", {})),
                 ",".join(s.get("running_lora_adapters", {})))
        self.last_seen[state] = time.time()
        family = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                                   labels=self.LABELS)
        for labels, seen in self.last_seen.items():
            family.add_metric(list(labels), seen)
        yield family
