"""``use_beam_search`` on ``/v1/completions`` and ``/v1/chat/completions`` (vLLM's fields).

The beam width is ``best_of`` when given (completions), else ``n``; the ``n`` best hypotheses
come back as the choices, best first, scored by ``cum_logprob / len ** length_penalty``
(``kvserve/beam_search.py``). A beam search answers once, when it is done: ``stream`` is
refused, as is every field that would change decoding but that beam search does not apply
(a stop string, a penalty, a seed, logprobs...), with a 400 naming it.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import Response

from kvserve.beam_search import BeamSearchParams
from kvserve.engine.async_engine import AsyncLLMEngine, RequestStream
from kvserve.sampling_params import SamplingParams
from kvserve.server.errors import bad_request
from kvserve.server.protocol import (
    NEUTRAL_SAMPLING,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
)
from kvserve.server.serving import (
    Limits,
    PromptInfo,
    check_fan_out,
    engine_error,
    final_outputs,
    is_batch_line,
    new_id,
    resolve_max_tokens,
    run_watching_disconnect,
    tokenize,
    usage_info,
)

# Request fields beam search does not apply: sent with a value other than their default
# (or, for the sampling knobs, their neutral value), they are a 400 naming them.
UNSUPPORTED = (
    "stream", "echo", "suffix", "stop", "stop_token_ids", "logprobs", "top_logprobs",
    "prompt_logprobs", "seed", "logit_bias", "allowed_token_ids", "bad_words", "min_tokens",
    "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar", "vllm_xargs", "tools", "thinking_token_budget", "skip_special_tokens",
    *NEUTRAL_SAMPLING,
)  # fmt: skip


def check_beam_fields(req: Any) -> None:
    """400 for a field that beam search would not honour; ``max_tokens: 0`` too (only echo,
    which beam search refuses, makes it useful)."""
    defaults = type(req).model_fields
    for name in UNSUPPORTED:
        if name not in defaults or name == "temperature":
            continue
        value = getattr(req, name)
        if value is None or value == defaults[name].default:
            continue
        if name in NEUTRAL_SAMPLING and value == NEUTRAL_SAMPLING[name]:
            continue  # top_p 1, a penalty of 0...: greedy either way
        raise bad_request(f"{name} is not supported with use_beam_search", name)
    if req.temperature:
        raise bad_request(
            "use_beam_search scores beams by the model's raw log-probabilities: temperature "
            f"must be 0 or unset, got {req.temperature}",
            "temperature",
        )
    if getattr(req, "max_tokens", None) == 0:
        raise bad_request("max_tokens must be at least 1, got 0.", "max_tokens")


def _prompt_items(prompt: Any) -> list[Any]:
    """The completion prompt forms as a list of prompts (text or token ids)."""
    if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    return list(prompt)


def beam_params(req: Any, max_tokens: int, best_of: int | None = None) -> BeamSearchParams:
    """The request's ``BeamSearchParams`` (width: ``best_of``, else ``n``)."""
    width = req.n if best_of is None else best_of
    if req.n > width:
        raise bad_request(f"n ({req.n}) must not exceed best_of ({width}), the beam width", "n")
    try:
        return BeamSearchParams(
            beam_width=width,
            max_tokens=max_tokens,
            ignore_eos=req.ignore_eos,
            length_penalty=req.length_penalty,
            include_stop_str_in_output=req.include_stop_str_in_output,
        )
    except ValueError as e:
        raise bad_request(str(e), getattr(e, "param", None)) from e


def start_beam_streams(
    engine: AsyncLLMEngine,
    prompts: list[PromptInfo],
    params: BeamSearchParams,
    num_outputs: int,
    base_id: str,
    priority: int = 0,
    background: bool = False,
) -> list[RequestStream]:
    """One beam search per prompt; all or nothing (an error is a 400 naming its field).
    ``background``: batch lines (``Request.background``)."""
    streams: list[RequestStream] = []
    try:
        for i, p in enumerate(prompts):
            rid = base_id if len(prompts) == 1 else f"{base_id}-{i}"
            prompt = {"prompt": p.text, "prompt_token_ids": p.token_ids}
            streams.append(
                engine.beam_search(prompt, params, rid, num_outputs, priority, background)
            )
    except BaseException as e:
        for s in streams:
            s.abort()
        if isinstance(e, ValueError):
            raise bad_request(str(e), getattr(e, "param", None)) from e
        raise engine_error(e) from e
    return streams


def submit_beam_search(
    req: Any,
    raw: Request,
    engine: AsyncLLMEngine,
    prompts: list[PromptInfo],
    max_tokens: int,
    request_id: str,
    best_of: int | None = None,
) -> list[RequestStream]:
    """Build the request's ``BeamSearchParams`` and start one search per prompt (its fields
    already checked by ``check_beam_fields``); the request metrics see it as ``n`` greedy
    completions of ``max_tokens``."""
    params = beam_params(req, max_tokens, best_of)
    streams = start_beam_streams(
        engine, prompts, params, req.n, request_id, req.priority, is_batch_line(raw)
    )
    shadow = SamplingParams(n=req.n, temperature=0.0, max_tokens=max_tokens)
    raw.app.state.kvserve.observe_streams(engine, shadow, streams, raw.headers)
    return streams


async def create_beam_completion(
    req: CompletionRequest, raw: Request, engine: AsyncLLMEngine, limits: Limits
) -> Response:
    check_beam_fields(req)
    items = _prompt_items(req.prompt)
    if req.best_of is not None and req.best_of > limits.max_n:
        raise bad_request(
            f"best_of is {req.best_of}, above this server's limit of {limits.max_n} (--max-n)",
            "best_of",
        )
    # every beam is a running sequence: the width counts as n (--max-num-seqs-per-request)
    check_fan_out(limits, req.n if req.best_of is None else max(req.n, req.best_of), len(items))
    prompts = [
        PromptInfo(p, await tokenize(engine, p)) if isinstance(p, str) else PromptInfo(None, p)
        for p in items
    ]
    # null: vLLM's "the room left in the context" (under --max-tokens-limit)
    max_tokens = min(
        resolve_max_tokens(engine, len(p.token_ids), req.max_tokens, limits)
        or engine.max_model_len - len(p.token_ids)
        for p in prompts
    )
    request_id = new_id("cmpl")
    streams = submit_beam_search(req, raw, engine, prompts, max_tokens, request_id, req.best_of)
    outputs = await run_watching_disconnect(raw, final_outputs(streams))
    choices = [
        CompletionChoice(
            index=i * req.n + c.index,
            text=c.text,
            logprobs=None,
            finish_reason=c.finish_reason,
            token_ids=list(c.token_ids) if req.return_token_ids else None,
            prompt_token_ids=list(out.prompt_token_ids) if req.return_token_ids else None,
        )
        for i, out in enumerate(outputs)
        for c in out.outputs
    ]
    body = CompletionResponse(
        id=request_id, model=engine.model_name, choices=choices, usage=usage_info(outputs)
    )
    return Response(body.model_dump_json(), media_type="application/json")
