"""The small slice of pydantic this project uses, identical on pydantic 1.10 and 2.x."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

import pydantic

PYDANTIC_V2 = pydantic.VERSION.startswith("2.")
ValidationError = pydantic.ValidationError

M = TypeVar("M", bound="StrictModel")

if PYDANTIC_V2:

    class StrictModel(pydantic.BaseModel):
        """Immutable model that refuses unknown keys and accepts field names or aliases."""

        model_config = pydantic.ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

else:  # pragma: no cover - exercised by the pydantic 1.10 test run

    class StrictModel(pydantic.BaseModel):  # type: ignore[no-redef]
        """Immutable model that refuses unknown keys and accepts field names or aliases."""

        class Config:
            extra = "forbid"
            frozen = True
            allow_population_by_field_name = True


def load(cls: type[M], data: Mapping[str, Any]) -> M:
    """Validate ``data`` into ``cls``; raises ValidationError."""
    if PYDANTIC_V2:
        return cls.model_validate(dict(data))
    return cls.parse_obj(dict(data))


def dump(
    model: pydantic.BaseModel, by_alias: bool = True, exclude_defaults: bool = False
) -> dict[str, Any]:
    """The model's fields as a plain dict (Python values, not JSON)."""
    if PYDANTIC_V2:
        return model.model_dump(by_alias=by_alias, exclude_defaults=exclude_defaults)
    return model.dict(by_alias=by_alias, exclude_defaults=exclude_defaults)


def field_aliases(cls: type[pydantic.BaseModel]) -> dict[str, str]:
    """Public key (alias, or name where none) -> field name."""
    if PYDANTIC_V2:
        fields = cls.model_fields
        return {(f.alias or name): name for name, f in fields.items()}
    return {f.alias: name for name, f in cls.__fields__.items()}  # type: ignore[attr-defined]


def describe(error: ValidationError) -> str:
    """One line naming each bad key and what is wrong with it."""
    parts = []
    for item in error.errors():
        where = ".".join(str(p) for p in item["loc"]) or "value"
        parts.append(f"{where}: {item['msg']}")
    return "; ".join(parts)
