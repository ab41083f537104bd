"""The catalog: model ids (Hugging Face config.json dicts) and hardware ids (YAML) resolved to specs."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from waferline.errors import ConfigError
from waferline.spec.configs import parse_hf_config, spec_from_config_file, spec_from_pretrained
from waferline.spec.model import ModelSpec

CATALOG_DIR = Path(__file__).parent
MODELS_DIR = CATALOG_DIR / "models"
HARDWARE_DIR = CATALOG_DIR / "hardware"
_NOT_DEVICES = {"links"}


def _is_id(s: str) -> bool:
    """A catalog id is a bare name: a path (absolute, or with a directory part) is never looked up as one."""
    return bool(s) and Path(s).name == s and not s.startswith(".")


def is_catalog_model(s: str) -> bool:
    """Whether ``s`` names a catalog model (a bare id with a catalog config; never a path)."""
    return _is_id(s) and (MODELS_DIR / f"{s}.json").is_file()


def list_models() -> list[str]:
    """Catalog model ids."""
    return sorted(p.stem for p in MODELS_DIR.glob("*.json"))


def list_hardware() -> list[str]:
    """Catalog hardware ids (links.yaml is not a device)."""
    return sorted(p.stem for p in HARDWARE_DIR.glob("*.yaml") if p.stem not in _NOT_DEVICES)


def model_config(name: str) -> dict:
    """The raw config.json dict of a catalog model id."""
    path = MODELS_DIR / f"{name}.json"
    if not _is_id(name) or not path.is_file():
        raise ConfigError(f"unknown model {name!r}: not a catalog id ({', '.join(list_models())}), "
                          "nor a config.json path or checkpoint directory")
    return json.loads(path.read_text())


def _looks_like_path(s: str) -> bool:
    """A name with a directory part or a file suffix: meant as a path, not a catalog id."""
    return "/" in s or s.endswith((".yaml", ".yml", ".json")) or s.startswith((".", "~"))


@lru_cache(maxsize=64)
def _load_model_cached(name: str) -> ModelSpec:
    return parse_hf_config(model_config(name), name=name)


def load_model(name_or_path: str | Path) -> ModelSpec:
    """A ModelSpec from a catalog id, a config.json path, or a checkpoint directory."""
    s = str(name_or_path)
    p = Path(s)
    if is_catalog_model(s):
        return _load_model_cached(s)
    if p.is_dir():
        return spec_from_pretrained(p)
    if p.is_file():
        return spec_from_config_file(p, name=p.stem if p.name != "config.json" else p.parent.name)
    if _looks_like_path(s):  # (a path that is not there: say so, not which catalog ids exist)
        raise ConfigError(f"no such checkpoint directory or config.json: {s}")
    raise ConfigError(
        f"unknown model {s!r}: use a catalog id ({', '.join(list_models())}), a config.json path or a checkpoint "
        "directory"
    )


@lru_cache(maxsize=64)
def _load_hw_cached(name: str):
    from waferline.spec.hardware import load_hardware_file

    return load_hardware_file(HARDWARE_DIR / f"{name}.yaml", require_source=True)


def load_hardware(name_or_path: str | Path):
    """A HardwareSpec from a catalog id or a user YAML file."""
    from waferline.spec.hardware import load_hardware_file

    s = str(name_or_path)
    if _is_id(s) and s not in _NOT_DEVICES and (HARDWARE_DIR / f"{s}.yaml").is_file():
        return _load_hw_cached(s)
    p = Path(s)
    if p.is_file():
        return load_hardware_file(p)
    if _looks_like_path(s):
        raise ConfigError(f"no such hardware YAML file: {s}")
    raise ConfigError(
        f"unknown hardware {s!r}: use a catalog id ({', '.join(list_hardware())}) or a path to a YAML file"
    )
