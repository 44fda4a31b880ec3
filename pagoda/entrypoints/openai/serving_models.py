"""The models a server answers to, as vLLM's OpenAIServingModels: the base model under its served
names, and its LoRA adapters (``--lora-modules``, and with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1
those loaded and unloaded at run time): a request whose ``model`` names an adapter runs with it.
Each adapter gets the next id (1, 2, ...), never reused, so an id names one folder in the engine."""
import asyncio
import itertools
import time
from dataclasses import dataclass

from fastapi.responses import JSONResponse, Response

from pagoda.engine.async_llm import AsyncLLM
from pagoda.entrypoints.openai.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from pagoda.entrypoints.openai.serving import error_response
from pagoda.lora.request import LoRARequest


@dataclass
class LoRAModulePath:
    """One ``--lora-modules`` adapter (vLLM's)."""
    name: str
    path: str
    base_model_name: str | None = None


class OpenAIServingModels:
    def __init__(self, engine: AsyncLLM, served_model_names: list[str],
                 lora_modules: list[LoRAModulePath] | None = None):
        self.engine = engine
        self.served_model_names = served_model_names
        self.created = int(time.time())
        self.lora_requests: dict[str, LoRARequest] = {}
        self._lora_ids = itertools.count(1)
        self._lock = asyncio.Lock()            # one load or unload at a time
        for module in lora_modules or ():
            lora = self._new_lora(module.name, module.path, module.base_model_name)
            self.lora_requests[lora.lora_name] = lora

    def _new_lora(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        if name in self.served_model_names:
            raise ValueError(f"The LoRA adapter name '{name}' is the base model's; give the adapter another.")
        if name in self.lora_requests:
            raise ValueError(f"The LoRA adapter '{name}' has already been loaded.")
        # (as vLLM: a base_model_name that is not served is dropped; the first served name is the parent)
        base = base_model_name if base_model_name in self.served_model_names else None
        return LoRARequest(name, next(self._lora_ids), path, base)

    async def init_static_loras(self) -> None:
        """The ``--lora-modules`` adapters checked (and read) by the engine before the server
        takes requests: a bad one raises its ValueError."""
        for lora in self.lora_requests.values():
            try:
                await self.engine.add_lora(lora)
            except ValueError as e:
                raise ValueError(f"--lora-modules {lora.lora_name}: {e}") from None

    # ------------------------------------------------------------------ a request's model
    def check_model(self, model: str | None) -> JSONResponse | None:
        """The 404 for a model the server does not have (None: the base model)."""
        if model is None or model in self.served_model_names or model in self.lora_requests:
            return None
        return error_response(f"The model `{model}` does not exist.", 404, "model")

    def lora_request(self, model: str | None) -> LoRARequest | None:
        """The adapter a (checked) model name runs with; None for the base model."""
        return self.lora_requests.get(model) if model is not None else None

    def show_available_models(self) -> dict:
        """/v1/models: the base model's names, then the adapters."""
        root = self.engine.model_config.model
        cards = [self._card(name, root, None) for name in self.served_model_names]
        cards += [self._card(lora.lora_name, lora.lora_path, lora.base_model_name or self.served_model_names[0])
                  for lora in self.lora_requests.values()]
        return {"object": "list", "data": cards}

    def _card(self, name: str, root: str, parent: str | None) -> dict:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "pagoda", "root": root,
                "parent": parent, "max_model_len": self.engine.max_model_len}

    # ------------------------------------------------------------------ runtime updates
    async def load_lora_adapter(self, request: LoadLoRAAdapterRequest) -> Response:
        """Add an adapter once the engine has checked it (400 with the engine's reason if not)."""
        if not request.lora_name or not request.lora_path:
            return error_response("Both 'lora_name' and 'lora_path' must be provided.", 400)
        async with self._lock:
            try:
                lora = self._new_lora(request.lora_name, request.lora_path)
            except ValueError as e:
                return error_response(str(e), 400, "lora_name")
            try:
                await self.engine.add_lora(lora)
            except ValueError as e:
                return error_response(str(e), 400, "lora_path")
            self.lora_requests[lora.lora_name] = lora
        return Response(f"Success: LoRA adapter '{lora.lora_name}' added successfully.")

    async def unload_lora_adapter(self, request: UnloadLoRAAdapterRequest) -> Response:
        """Forget an adapter (404 if unknown; 400 while requests use it): later requests naming
        it answer 404."""
        async with self._lock:
            lora = self.lora_requests.get(request.lora_name)
            if lora is None:
                return error_response(f"The lora adapter '{request.lora_name}' cannot be found.", 404, "lora_name")
            try:
                await self.engine.remove_lora(lora.lora_int_id)
            except ValueError as e:
                return error_response(str(e), 400, "lora_name")
            del self.lora_requests[lora.lora_name]
        return Response(f"Success: LoRA adapter '{lora.lora_name}' removed successfully.")
