"""Model specs for the simulator: the project's presets (`jenga.presets`), by name."""

from __future__ import annotations

from jenga import presets
from jenga.specs import ModelSpec, SpecError


class UnknownModel(KeyError):
    """No preset of that name."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def get_model(name: str) -> ModelSpec:
    try:
        return presets.get(name)
    except (KeyError, SpecError) as exc:
        raise UnknownModel(f"unknown model {name!r}; presets: {list(presets.names())}") from exc


def model_names() -> list[str]:
    return list(presets.names())
