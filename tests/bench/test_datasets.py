"""Dataset loaders: ShareGPT pruning rules, the chatterbot corpus, synthetic prompts.

The byte tokenizer gives one token per UTF-8 byte, so every length below is exact.
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

import pytest

from kvserve.bench import options
from kvserve.bench.datasets import (
    get_samples,
    is_valid_sequence,
    load_chatterbot_conversations,
    sample_chatterbot,
    sample_sharegpt,
)
from kvserve.bench.synthetic import sample_random, sample_shared_prefix


def _conv(*turns: str) -> dict:
    return {"conversations": [{"from": "human" if i % 2 == 0 else "gpt", "value": t}
                              for i, t in enumerate(turns)]}  # fmt: skip


@pytest.fixture
def sharegpt_file(tmp_path: Path) -> Path:
    data = [
        _conv("abcdefgh", "0123456789"),  # kept: 8 + 10
        _conv("only one turn"),  # skipped: < 2 turns
        _conv("abc", "a long enough answer"),  # prompt_len 3 < 4
        _conv("hello there", "ok"),  # output_len 2 < 4
        _conv("x" * 1025, "fine answer"),  # prompt_len 1025 > 1024
        _conv("y" * 1000, "z" * 1048),  # kept: total exactly 2048
        _conv("w" * 1000, "v" * 1049),  # total 2049 > 2048
        _conv("p" * 1024, "four"),  # kept: prompt exactly 1024, output exactly 4
        _conv("four", "abcd", "a third turn is ignored"),  # kept: both exactly 4
        {"not_conversations": []},  # malformed: skipped
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    return path


def _prompts(samples: list) -> set[str]:
    return {s.prompt[:8] for s in samples}


def test_sharegpt_pruning_rules(sharegpt_file: Path, byte_tokenizer) -> None:
    with pytest.warns(UserWarning, match="only 4 usable"):
        samples = sample_sharegpt(sharegpt_file, 10, byte_tokenizer, oversample=False)
    assert _prompts(samples) == {"abcdefgh", "y" * 8, "p" * 8, "four"}
    by_prompt = {s.prompt[:8]: s for s in samples}
    assert (by_prompt["abcdefgh"].prompt_len, by_prompt["abcdefgh"].expected_output_len) == (8, 10)
    assert by_prompt["y" * 8].prompt_len + by_prompt["y" * 8].expected_output_len == 2048
    assert by_prompt["four"].reference_output == "abcd"


def test_sharegpt_limits_are_parameters(sharegpt_file: Path, byte_tokenizer) -> None:
    with pytest.warns(UserWarning):
        samples = sample_sharegpt(
            sharegpt_file, 10, byte_tokenizer, max_prompt_len=10, oversample=False
        )
    assert _prompts(samples) == {"abcdefgh", "four"}
    with pytest.warns(UserWarning):
        samples = sample_sharegpt(sharegpt_file, 10, byte_tokenizer, min_len=2, oversample=False)
    assert "hello th" in _prompts(samples) and "abc" in _prompts(samples)


def test_sharegpt_output_len_override(sharegpt_file: Path, byte_tokenizer) -> None:
    # With a fixed output length the dataset's short answers no longer matter.
    with pytest.warns(UserWarning):
        samples = sample_sharegpt(sharegpt_file, 10, byte_tokenizer, output_len=2, oversample=False)
    assert {s.expected_output_len for s in samples} == {2}
    assert _prompts(samples) == {"abcdefgh", "hello th", "y" * 8, "w" * 8, "p" * 8, "four"}


def test_sharegpt_seeded_shuffle_and_oversample(sharegpt_file: Path, byte_tokenizer) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        orders = [[s.prompt for s in sample_sharegpt(sharegpt_file, 4, byte_tokenizer, seed=k)]
                  for k in range(6)]  # fmt: skip
        assert orders[0] == [s.prompt for s in sample_sharegpt(sharegpt_file, 4, byte_tokenizer)]
        assert len({tuple(o) for o in orders}) > 1
        many = sample_sharegpt(sharegpt_file, 9, byte_tokenizer)
    assert len(many) == 9 and len({s.prompt for s in many}) == 4


def test_is_valid_sequence_boundaries() -> None:
    assert is_valid_sequence(4, 4) and is_valid_sequence(1024, 1024)
    assert not is_valid_sequence(3, 100) and not is_valid_sequence(100, 3)
    assert not is_valid_sequence(1025, 4) and not is_valid_sequence(1024, 1025)
    assert is_valid_sequence(100, 1, check_output_len=False)


def test_chatterbot_real_english_conversations(byte_tokenizer) -> None:
    pairs = load_chatterbot_conversations()
    assert len(pairs) > 100
    assert any(p == "What is AI?" and a.startswith("Artificial Intelligence") for p, a in pairs)
    samples = sample_chatterbot(150, byte_tokenizer, seed=3)
    assert len(samples) == 150
    assert [s.prompt for s in samples] == [
        s.prompt for s in sample_chatterbot(150, byte_tokenizer, seed=3)
    ]
    assert [s.prompt for s in samples] != [
        s.prompt for s in sample_chatterbot(150, byte_tokenizer, seed=4)
    ]
    s = samples[0]
    assert s.prompt_len == len(s.prompt.encode())
    assert s.expected_output_len == len(s.reference_output.encode())
    assert s.chat_messages == [{"role": "user", "content": s.prompt}]
    capped = sample_chatterbot(150, byte_tokenizer, seed=3, max_output_len=5)
    assert max(c.expected_output_len for c in capped) == 5
    fixed = sample_chatterbot(10, byte_tokenizer, output_len=32)
    assert {c.expected_output_len for c in fixed} == {32}


def test_random_dataset_fixed_and_ranged(byte_tokenizer) -> None:
    samples = sample_random(20, byte_tokenizer, input_len=64, output_len=16, seed=1)
    assert all(s.prompt_len == 64 and s.expected_output_len == 16 for s in samples)
    assert all(len(byte_tokenizer(s.prompt).input_ids) == s.prompt_len for s in samples)
    assert [s.prompt for s in samples] == [
        s.prompt for s in sample_random(20, byte_tokenizer, input_len=64, output_len=16, seed=1)
    ]
    ranged = sample_random(50, byte_tokenizer, input_len=40, output_len=10, range_ratio=0.5)
    assert all(20 <= s.prompt_len <= 60 and 5 <= s.expected_output_len <= 15 for s in ranged)
    assert len({s.prompt_len for s in ranged}) > 5
    with pytest.raises(ValueError):
        sample_random(1, byte_tokenizer, range_ratio=1.0)


def test_shared_prefix_groups(byte_tokenizer) -> None:
    samples = sample_shared_prefix(
        12, byte_tokenizer, prefix_len=40, suffix_len=8, num_groups=3, output_len=16
    )
    assert len(samples) == 12
    groups: dict[int, set[str]] = {}
    for s in samples:
        system, user = s.chat_messages
        assert s.prompt == system["content"] + user["content"]
        assert len(byte_tokenizer(system["content"]).input_ids) == 40
        assert s.prompt_len == len(byte_tokenizer(s.prompt).input_ids)
        groups.setdefault(s.metadata["prefix_group"], set()).add(system["content"])
    assert sorted(groups) == [0, 1, 2] and all(len(v) == 1 for v in groups.values())
    assert len({next(iter(v)) for v in groups.values()}) == 3  # distinct prefixes
    assert [s.metadata["prefix_group"] for s in samples] != [i % 3 for i in range(12)]  # shuffled


def test_get_samples_from_cli_options(byte_tokenizer) -> None:
    parser = argparse.ArgumentParser()
    options.add_dataset_args(parser)
    args = parser.parse_args(
        ["--dataset-name", "prefix_repetition", "--num-prompts", "4", "--prefix-len", "16",
         "--prefix-repetition-suffix-len", "4", "--prefix-num-groups", "2", "--output-len", "7"]
    )  # fmt: skip
    options.apply_general_lengths(args)
    samples = get_samples(args, byte_tokenizer)
    assert len(samples) == 4 and {s.expected_output_len for s in samples} == {7}
    args = parser.parse_args(["--dataset-name", "sharegpt"])
    with pytest.raises(ValueError, match="dataset-path"):
        get_samples(args, byte_tokenizer)
