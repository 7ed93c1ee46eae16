"""Pre-quantized projections (GGUF, compressed-tensors) fused as kvserve's Llama fuses them."""

from __future__ import annotations

from collections.abc import Iterable

from kvserve.quantization.qweight import QuantizedWeight, concat_rows

# Hugging Face projection -> (kvserve's module, its place in the fusion, parts in the fusion)
FUSED = {
    "q_proj": ("qkv_proj", 0, 3),
    "k_proj": ("qkv_proj", 1, 3),
    "v_proj": ("qkv_proj", 2, 3),
    "gate_proj": ("gate_up_proj", 0, 2),
    "up_proj": ("gate_up_proj", 1, 2),
    "o_proj": ("o_proj", 0, 1),
    "down_proj": ("down_proj", 0, 1),
}


def fused_modules(
    quantized: Iterable[str],
    dense: set[str] = frozenset(),  # type: ignore[assignment]
) -> dict[str, list[str]]:
    """``layers.3.self_attn.q_proj``-style projection names -> kvserve's module
    (``layers.3.self_attn.qkv_proj``) -> its parts' names in fusion order.

    ``dense`` names projections the checkpoint stores unquantized: a fusion must be all
    quantized or all dense, since one layer holds one kind of weight.
    """
    parts: dict[str, dict[int, str]] = {}
    want: dict[str, int] = {}
    for name in quantized:
        prefix, proj = name.rsplit(".", 1)
        if proj not in FUSED:
            raise ValueError(f"quantized weight {name!r} is not a projection kvserve knows")
        target, index, count = FUSED[proj]
        module = f"{prefix}.{target}"
        parts.setdefault(module, {})[index] = name
        want[module] = count
    dense_fused = {f"{n.rsplit('.', 1)[0]}.{FUSED[n.rsplit('.', 1)[1]][0]}" for n in dense
                   if n.rsplit(".", 1)[1] in FUSED}  # fmt: skip
    out = {}
    for module, pieces in parts.items():
        if module in dense_fused or len(pieces) != want[module]:
            raise ValueError(
                f"the checkpoint stores the parts of {module} with a mix of float and quantized "
                "weights; kvserve needs all of them quantized"
            )
        out[module] = [pieces[i] for i in range(want[module])]
    return out


def fuse_projections(
    found: dict[str, QuantizedWeight],
    dense: set[str] = frozenset(),  # type: ignore[assignment]
) -> dict[str, QuantizedWeight]:
    """``layers.3.self_attn.q_proj``-style weights -> ``layers.3.self_attn.qkv_proj`` ones
    (``fused_modules`` checks the parts)."""
    out = {}
    for module, parts in fused_modules(found, dense).items():
        try:
            out[module] = concat_rows([found[p] for p in parts])
        except ValueError as e:
            raise ValueError(f"{module}: {e}") from e
    return out
