"""The server's LoRA adapters: served names -> `LoRARequest`, from --lora-modules at start-up and, only when the
server was started with --enable-runtime-lora (vLLM gates these the same way), vLLM's /v1/load_lora_adapter and
/v1/unload_lora_adapter at run time, from inside --lora-dirs when that is given. A request picks one with "model": "<name>"; the
LoRARequest (name, id, path) travels with the request to the engine process, which loads the adapter from its path
when it first needs it.

Every adapter is checked here before its name is served (PEFT format, rank within --max-lora-rank, the base's
shapes), so a bad one fails its load call (or start-up), never a request. Ids are never reused: the prefix cache
and the engine's slots key on them. Unloading stops new requests at once; requests already admitted finish on the
adapter (the engine keeps it while they run, and reads it again from its path for one still queued)."""
from __future__ import annotations

import json
import threading
from pathlib import Path

from brrr.errors import BrrrError
from brrr.lora.serving import LoRARequest, load_servable
from brrr.server.protocol import APIError


def parse_lora_modules(values: list[str] | None) -> list[tuple[str, str]]:
    """--lora-modules entries, vLLM's two spellings: name=path, or JSON {"name": ..., "path": ...}."""
    modules = []
    for value in values or ():
        if value.lstrip().startswith("{"):
            try:
                spec = json.loads(value)
            except json.JSONDecodeError as e:
                raise BrrrError(f"--lora-modules {value!r}: not valid JSON ({e})") from None
            if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or \
                    not isinstance(spec.get("path"), str):
                raise BrrrError(f"--lora-modules {value!r}: the JSON form needs string fields 'name' and 'path'")
            name, path = spec["name"], spec["path"]
        else:
            name, sep, path = value.partition("=")
            if not sep:
                raise BrrrError(f"--lora-modules {value!r}: expected name=path (or JSON with 'name' and 'path')")
        if not name or not path:
            raise BrrrError(f"--lora-modules {value!r}: the name and the path must not be empty")
        modules.append((name, path))
    return modules


class LoraAdapters:
    def __init__(self, llm, base_name: str, runtime_updates: bool = False, allowed_dirs: list[str] | None = None):
        self.llm, self.base_name, self.runtime_updates = llm, base_name, runtime_updates
        self.allowed_dirs = [Path(d).expanduser().resolve() for d in allowed_dirs] if allowed_dirs else None
        info = llm.info
        self.max_lora_rank, self.shapes = info.max_lora_rank, info.lora_shapes
        self.served: dict[str, LoRARequest] = {}
        self._next_id = 1
        self._loading = threading.Lock()  # loads run in worker threads: one at a time, so a name is taken once

    @property
    def enabled(self) -> bool:
        return self.max_lora_rank is not None

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's "model" names (None: the base model); 404 in OpenAI's shape for other names."""
        if model is None or model == self.base_name:
            return None
        lora = self.served.get(model)
        if lora is None:
            known = ", ".join(repr(n) for n in [self.base_name, *self.served])
            raise APIError(404, f"the model {model!r} does not exist; this server serves {known}", param="model",
                           code="model_not_found")
        return lora

    def check_runtime_update(self, path: str | None = None) -> None:
        """A client's load or unload: 403 unless the server opted in; a path outside --lora-dirs is a 400 that
        reads the same whether or not the path exists (the check is on the resolved path's text alone)."""
        if not self.runtime_updates:
            raise APIError(403, "loading and unloading LoRA adapters at run time is off on this server: start it "
                           "with --enable-runtime-lora (and --lora-dirs to limit where adapters are read from)",
                           code="runtime_lora_disabled")
        if path is None or self.allowed_dirs is None:
            return
        real = Path(path).expanduser().resolve()  # links and ".." resolved: a link out of a directory is out
        if not any(real.is_relative_to(d) for d in self.allowed_dirs):
            raise APIError(400, "lora_path is not inside the directories this server loads adapters from "
                           "(--lora-dirs)", param="lora_path", code="invalid_value")

    def load(self, name: str, path: str, inplace: bool = False) -> tuple[LoRARequest, LoRARequest | None]:
        """Check the adapter and serve it under `name`: (the new adapter, the one it replaced). inplace (vLLM's
        load_inplace): a name already served gets the new adapter, under a new id; requests already admitted finish
        on the old one. BrrrError says what is wrong."""
        with self._loading:
            return self._load(name, path, inplace)

    def _load(self, name: str, path: str, inplace: bool) -> tuple[LoRARequest, LoRARequest | None]:
        if not self.enabled:
            raise BrrrError("LoRA is not enabled on this server: start it with --enable-lora (and --max-loras, "
                            "--max-lora-rank)")
        if not name:
            raise BrrrError("lora_name must not be empty")
        if name == self.base_name:
            raise BrrrError(f"lora_name {name!r} is the base model's name")
        if name in self.served and not inplace:
            raise BrrrError(f"lora_name {name!r} is already served (load_inplace: true replaces it)")
        request = LoRARequest(name, self._next_id, path)
        load_servable(request, self.shapes, self.max_lora_rank)
        self._next_id += 1
        replaced = self.served.get(name)
        self.served[name] = request
        return request, replaced

    def unload(self, name: str) -> LoRARequest:
        lora = self.served.pop(name, None)
        if lora is None:
            raise APIError(404, f"the LoRA adapter {name!r} is not loaded", param="lora_name",
                           code="model_not_found")
        return lora
