"""Which layers a hybrid conversion turns into MHLA."""

from __future__ import annotations

STRATEGIES = ("spread", "first", "last")


def plan_layers(num_layers: int, *, ratio: float = 1.0, strategy: str = "spread", layers=None) -> list[int]:
    """Sorted indices of the layers to convert.

    `spread` converts k = round(ratio·L) layers and keeps softmax at floor(j·L/(L−k)),
    j = 0 … L−k−1 — for 30 layers at ratio 2/3 that keeps 0, 3, …, 27 (the published Wan hybrid).
    `first` / `last` convert the first / last k; an explicit `layers` list wins over all.
    """
    if layers is not None:
        chosen = sorted({int(i) for i in layers})
        bad = [i for i in chosen if not 0 <= i < num_layers]
        if bad:
            raise ValueError(f"layer indices {bad} out of range: the model has {num_layers} layers (0 … {num_layers - 1})")
        return chosen
    if not isinstance(ratio, (int, float)) or not 0.0 <= ratio <= 1.0:
        raise ValueError(f"ratio must be in [0, 1] (the fraction of layers to convert); got {ratio!r}")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {list(STRATEGIES)}; got {strategy!r}")
    k = round(ratio * num_layers)
    if strategy == "first":
        return list(range(k))
    if strategy == "last":
        return list(range(num_layers - k, num_layers))
    keep = {j * num_layers // (num_layers - k) for j in range(num_layers - k)}
    return [i for i in range(num_layers) if i not in keep]
