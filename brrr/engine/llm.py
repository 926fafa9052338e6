"""`LLM`: offline batch generation through the engine, the way vLLM's LLM class is used."""
from __future__ import annotations

from brrr.config import EngineConfig
from brrr.engine.build import build_engine
from brrr.engine.engine_process_warmup import warm_up
from brrr.engine.outputs import RequestOutput
from brrr.errors import BrrrError
from brrr.kernels.quant import quant_tuning
from brrr.lora.serving import LoRARequest
from brrr.quant.linear import QuantLinear
from brrr.sampling_params import SamplingParams
from brrr.threads import use_cpu_threads


class LLM:
    def __init__(self, model=None, dtype="auto", device=None, **engine_args):
        self.pretrained, self.engine = build_engine(model, dtype, device, EngineConfig(**engine_args))
        self._counter = 0
        if self.engine.runner.device.type == "cpu":
            use_cpu_threads()  # brrr's one policy; torch.set_num_threads afterwards overrides it
        if self.engine.runner.device.type == "cuda" and _quantized(self.engine.model):
            # the quantized matmuls' prefill shapes are tuned at start-up, as `brrr serve`'s engine does: timing
            # candidates is never done mid-run (an untuned shape takes the nearest tuned config)
            with quant_tuning():
                warm_up(self.engine)

    @property
    def tokenizer(self):
        return self.pretrained.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request: LoRARequest | list[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """prompts, as vLLM takes them: a string, a list of token ids, {"prompt": text}, {"prompt_token_ids": ids},
        or a list of those. lora_request: the adapter every prompt runs with, or one per prompt (None: the base
        model); the engine needs enable_lora=True. Returns one finished RequestOutput per prompt, in order."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise BrrrError(f"prompts must be a string, a list of token ids, a prompt dict or a list of those, got "
                            f"{type(prompts).__name__}")
        prompts = [_prompt(p, i) for i, p in enumerate(prompts)]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise BrrrError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise BrrrError(f"got {len(loras)} lora requests for {len(prompts)} prompts")
        for lora in dict.fromkeys(lr for lr in loras if lr is not None):  # each adapter loaded and checked first
            self.engine.add_lora(lora)
        requests = [self.engine.make_request(self._request_id(), p, sp, lr)
                    for p, sp, lr in zip(prompts, params, loras)]
        for request in requests:  # all validated first: a bad prompt leaves nothing half-queued
            self.engine.enqueue(request, stream=False)
        finished: dict[str, RequestOutput] = {}
        with _progress(len(requests), use_tqdm) as advance:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():  # only finished requests' outputs (stream=False)
                    finished[out.request_id] = out
                    advance()
        return [finished[r.request_id] for r in requests]

    def chat(self, messages: list[dict], sampling_params: SamplingParams | None = None) -> RequestOutput:
        return self.generate([self.tokenizer.encode_chat(messages)], sampling_params, use_tqdm=False)[0]

    def _request_id(self) -> str:
        self._counter += 1
        return f"llm-{self._counter}"


PROMPT_KEYS = ("prompt", "prompt_token_ids")


def _prompt(prompt, i: int) -> str | list[int]:
    """One prompt as the engine takes it: text or token ids, from vLLM's dict spellings too."""
    if not isinstance(prompt, dict):
        return prompt
    given = [key for key in PROMPT_KEYS if key in prompt]
    unknown = sorted(set(prompt) - set(PROMPT_KEYS))
    if unknown or len(given) != 1:
        what = f"unknown field(s) {', '.join(map(repr, unknown))}" if unknown else f"{len(given)} of them"
        raise BrrrError(f"prompts[{i}]: a prompt dict takes exactly one of 'prompt' (text) or 'prompt_token_ids' "
                        f"(a list of token ids); got {what}")
    key = given[0]
    value = prompt[key]
    if key == "prompt" and not isinstance(value, str):
        raise BrrrError(f"prompts[{i}]['prompt'] must be a string, got {type(value).__name__}")
    if key == "prompt_token_ids" and not (isinstance(value, list) and all(type(t) is int for t in value)):
        raise BrrrError(f"prompts[{i}]['prompt_token_ids'] must be a list of token ids (ints)")
    return value


class _progress:
    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled, self.progress = total, enabled and total > 1, None

    def __enter__(self):
        if not self.enabled:
            return lambda: None
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

        self.progress = Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), transient=True, console=Console(stderr=True))
        self.progress.start()
        task = self.progress.add_task("generating", total=self.total)
        return lambda: self.progress.advance(task)

    def __exit__(self, *exc):
        if self.progress:
            self.progress.stop()


def _quantized(model) -> bool:
    return any(isinstance(m, QuantLinear) for m in model.modules())
