"""``--lora-modules`` and the runtime-updating switch, without a server."""

from __future__ import annotations

import argparse

import pytest

from kvserve.server.cli import _model_specs, add_serve_parser
from kvserve.server.lora import LoRAModuleSpec, parse_lora_module, runtime_updating_allowed


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def test_lora_modules_both_forms() -> None:
    args = parse("--enable-lora", "--lora-modules", "sql=/a/sql",
                 '{"name": "chat", "path": "/a/chat", "base_model_name": "base"}')  # fmt: skip
    assert args.lora_modules == [
        LoRAModuleSpec("sql", "/a/sql"), LoRAModuleSpec("chat", "/a/chat", "base"),
    ]  # fmt: skip
    assert parse_lora_module("x=/p=q") == LoRAModuleSpec("x", "/p=q")  # the first '=' splits


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("just-a-name", "is not name=path"),
        ("=/path", "is not name=path"),
        ('{"name": "x"}', "needs string 'name' and 'path'"),
        ('{"name": "x", "path": "/p", "scaling": 2}', r"unknown keys: \['scaling'\]"),
        ("{broken", "is not JSON"),
    ],
)
def test_bad_lora_modules(value: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_lora_module(value)


def test_lora_modules_need_enable_lora(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="--lora-modules needs --enable-lora"):
        _model_specs(parse("--lora-modules", "a=/a"))
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    assert not runtime_updating_allowed(False)
    assert runtime_updating_allowed(True)
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
    assert runtime_updating_allowed(False)
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0")
    assert not runtime_updating_allowed(False)
