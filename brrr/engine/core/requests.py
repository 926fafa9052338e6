"""Request validation shared by the engine core and the server process (which checks requests before they reach
the engine process)."""
from __future__ import annotations

from brrr.engine.guided.feature import grammars
from brrr.sampling_params import SamplingParams
from brrr.engine.sequence import Request
from brrr.errors import BrrrError
from brrr.lora.serving import LoRARequest


def check_request(request_id: str, prompt: str | list[int], params: SamplingParams | None, tokenizer,
                  vocab_size: int, max_model_len: int, block_size: int, num_blocks: int,
                  eos_token_ids: tuple[int, ...] | None = None, lora_request: LoRARequest | None = None,
                  kv_budget_blocks: int | None = None, kv_whole_prompt: bool = False) -> Request:
    """A validated, tokenized Request for an engine of these limits, or a BrrrError naming what is wrong. Shared by
    `EngineCore.make_request` and the server process, which checks requests before they reach the engine process.
    A structured_outputs constraint is compiled here (cached per tokenizer), so a bad one fails the request now;
    eos_token_ids: the engine's (the tokenizer's EOS when not given), which the grammar lets through. lora_request:
    the adapter the request runs with (the engine loads and checks it when the request is queued). kv_budget_blocks:
    the most blocks a sequence holds under KV eviction (None: all of its tokens'); kv_whole_prompt: its prefill
    holds the whole prompt's blocks first (snapkv, h2o)."""
    params = params or SamplingParams()
    if lora_request is not None and not isinstance(lora_request, LoRARequest):
        raise BrrrError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
    if not isinstance(params, SamplingParams):
        raise BrrrError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise BrrrError("this engine has no tokenizer: pass the prompt as token ids")
        ids, text = tokenizer.encode(prompt), prompt
    elif isinstance(prompt, list) and set(map(type, prompt)) <= {int}:  # C loops: a server checks every request
        ids, text = list(prompt), None
    else:
        raise BrrrError("prompt must be a string or a list of token ids")
    if not ids:
        raise BrrrError("prompt is empty: it must have at least one token")
    if min(ids) < 0 or max(ids) >= vocab_size:
        bad = next(t for t in ids if not 0 <= t < vocab_size)
        raise BrrrError(f"prompt token id {bad} is outside the vocabulary [0, {vocab_size})")
    if len(ids) + params.max_tokens > max_model_len:
        raise BrrrError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = "
                        f"{len(ids) + params.max_tokens} exceeds the model's context of {max_model_len} tokens")
    need = -(-(len(ids) + params.max_tokens) // block_size)
    if kv_budget_blocks is not None:
        need = min(need, kv_budget_blocks)
    if kv_whole_prompt:
        need = max(need, -(-len(ids) // block_size))
    if need > num_blocks:
        raise BrrrError(f"prompt + max_tokens needs {need} KV blocks; the cache has {num_blocks}")
    if params.logit_bias:
        bad = next((t for t in params.logit_bias if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise BrrrError(f"logit_bias: token id {bad} is outside the vocabulary [0, {vocab_size})")
    if params.structured_outputs is not None:
        grammars(tokenizer, vocab_size, eos_token_ids).compile(params.structured_outputs)
    return Request(request_id, text, ids, params, lora_request=lora_request)
