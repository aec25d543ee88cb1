"""Tokenizers that are custom code in the model directory (Kimi-K2's tiktoken tokenizer): found
from ``tokenizer_config.json`` and loaded only when the operator trusts the directory.

A directory's tokenizer needs its own code when ``tokenizer_config.json`` names one in ``auto_map``
(``{"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", null]}``) and the class is not one
transformers ships: transformers would import that Python file from the model directory. That is a
trust decision (the file can do anything the engine can), so it is off unless ``--trust-remote-code``
(``model.trustRemoteCode`` in a ModelDeployment) says so; otherwise loading stops with an error
naming the flag before any weight is read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pagoda.node_agent.models.config import ModelLoadError

TRUST_FLAG = "--trust-remote-code"


class UntrustedCodeError(ModelLoadError):
    """The model's tokenizer is custom code and the directory is not trusted."""


@dataclass(frozen=True)
class TokenizerCode:
    """The custom tokenizer class a directory names: ``module.py`` in the directory, ``cls`` in it."""

    module: str
    cls: str

    @property
    def file(self) -> str:
        return f"{self.module}.py"


def _tokenizer_config(model_dir: str | Path) -> dict:
    path = Path(model_dir) / "tokenizer_config.json"
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path} cannot be read as JSON: {exc}") from exc
    return raw if isinstance(raw, dict) else {}


def _auto_map_ref(auto_map: object) -> str | None:
    """The slow-or-fast class reference of ``auto_map.AutoTokenizer`` (a pair or one string)."""
    if not isinstance(auto_map, dict):
        return None
    ref = auto_map.get("AutoTokenizer")
    refs = ref if isinstance(ref, list | tuple) else [ref]
    return next((r for r in refs if isinstance(r, str) and r), None)


def _transformers_has(name: str | None) -> bool:
    if not name:
        return False
    import transformers

    return hasattr(transformers, name)


def tokenizer_code(model_dir: str | Path) -> TokenizerCode | None:
    """The custom tokenizer code ``model_dir`` needs, None when transformers' own classes serve it."""
    cfg = _tokenizer_config(model_dir)
    ref = _auto_map_ref(cfg.get("auto_map"))
    if ref is None or "." not in ref:
        return None
    module, cls = ref.rsplit(".", 1)
    if "--" in module:  # "repo--module.Class": code from another Hub repository
        raise ModelLoadError(f"{model_dir}: the tokenizer's code {ref!r} lives in another repository")
    if _transformers_has(cfg.get("tokenizer_class")) or _transformers_has(cls):
        return None
    code = TokenizerCode(module, cls)
    if not (Path(model_dir) / code.file).is_file():
        raise ModelLoadError(f"{model_dir}: tokenizer_config.json names {ref!r} but {code.file} is missing")
    return code


def check_tokenizer_trust(model_dir: str | Path, trust_remote_code: bool) -> TokenizerCode | None:
    """The directory's custom tokenizer code, or UntrustedCodeError naming ``--trust-remote-code``
    when it has some and ``trust_remote_code`` is off."""
    code = tokenizer_code(model_dir)
    if code is not None and not trust_remote_code:
        raise UntrustedCodeError(
            f"{model_dir}: the tokenizer is custom code ({code.file}, class {code.cls}) that would run "
            f"Python from the model directory. Pass {TRUST_FLAG} (ModelDeployment: "
            "model.trustRemoteCode: true) only if you trust that directory's code."
        )
    return code


def _known_model_type(model_dir: str | Path) -> bool:
    """Whether transformers has a config class for the directory's ``model_type`` (kimi_k2 has none:
    reading its config.json would fail on its YaRN fields, so the tokenizer is loaded without it)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    try:
        raw = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return isinstance(raw, dict) and raw.get("model_type") in CONFIG_MAPPING_NAMES


def load_dir_tokenizer(model_dir: str, trust_remote_code: bool = False):
    """transformers' tokenizer of a model directory; custom code only when trusted."""
    from transformers import AutoTokenizer, PreTrainedConfig

    code = check_tokenizer_trust(model_dir, trust_remote_code)
    kwargs: dict = {}
    if not _known_model_type(model_dir):
        kwargs["config"] = PreTrainedConfig()  # the tokenizer's own files say what it is
    if code is not None:
        kwargs["trust_remote_code"] = True
    return AutoTokenizer.from_pretrained(model_dir, **kwargs)
