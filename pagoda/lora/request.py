"""vLLM's LoRARequest: which adapter a request runs with."""
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter by name, a unique positive integer id, and its folder (PEFT's
    ``adapter_config.json`` with ``adapter_model.safetensors`` or ``.bin``). Requests with the
    same id share one loaded copy; ``lora_name`` also names the adapter to the server's clients
    and keeps its cached prefixes apart from other adapters'."""
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self):
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest's lora_int_id must be an integer >= 1, got {self.lora_int_id!r}.")
        if not self.lora_path:
            raise ValueError(f"LoRARequest {self.lora_name!r} has no lora_path (the adapter's folder).")
