"""Custom batch-level logits processors (vLLM v1's interface) through the whole engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvserve.engine.arg_utils import EngineArgs
from kvserve.engine.llm import LLM
from kvserve.sample.custom_processors import BatchUpdate, LogitsProcessor, load_processor_class
from kvserve.sampling_params import SamplingParams
from tests.engine.utils import random_prompts

UPDATES: list[BatchUpdate | None] = []


class ForceToken(LogitsProcessor):
    """Rows whose request sets ``extra_args["force"]`` always produce that token."""

    def __init__(self, config: object, device: torch.device, is_pin_memory: bool) -> None:
        self.force: dict[int, int] = {}  # row -> token

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        force = (params.extra_args or {}).get("force")
        if force is not None and not 0 <= force < 256:
            raise ValueError(f"force must be a token id, got {force}")

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        UPDATES.append(batch_update)
        if batch_update is None:
            return
        for row in batch_update.removed:
            self.force.pop(row, None)
        for row, params, _prompt, _out in batch_update.added:
            force = (params.extra_args or {}).get("force")
            if force is not None:
                self.force[row] = force

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, token in self.force.items():
            logits[row] = float("-inf")
            logits[row, token] = 0.0
        return logits


class NotAProcessor:
    pass


def test_processor_forces_its_rows_only(tiny_llama: Path) -> None:
    prompts = [{"prompt_token_ids": p} for p in random_prompts([5, 7, 6])]
    greedy = SamplingParams(temperature=0, max_tokens=6)
    plain = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=64)
    base = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy, use_tqdm=False)]
    llm = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=64, logits_processors=[ForceToken])
    forced = [
        SamplingParams(temperature=0, max_tokens=6, extra_args={"force": 42}),
        greedy,
        SamplingParams(temperature=0.9, seed=1, max_tokens=6, extra_args={"force": 7}),
    ]
    UPDATES.clear()
    outs = llm.generate(prompts, forced, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == [42] * 6
    assert outs[1].outputs[0].token_ids == base[1]
    assert outs[2].outputs[0].token_ids == [7] * 6
    first = UPDATES[0]
    assert first is not None and first.batch_size == 3 and len(first.added) == 3
    assert None in UPDATES  # an unchanged batch is reported as None
    with pytest.raises(ValueError, match="force must be a token id"):
        llm.generate(prompts[:1], SamplingParams(extra_args={"force": 999}), use_tqdm=False)


def test_processor_classes_by_name() -> None:
    name = f"{__name__}:ForceToken"
    assert load_processor_class(name) is ForceToken
    assert load_processor_class(f"{__name__}.ForceToken") is ForceToken
    with pytest.raises(ValueError, match="cannot import"):
        load_processor_class("no_such_module:Thing")
    with pytest.raises(ValueError, match="not a subclass"):
        load_processor_class(f"{__name__}:NotAProcessor")
    with pytest.raises(ValueError, match="not a subclass"):
        EngineArgs(logits_processors=[f"{__name__}:NotAProcessor"])
