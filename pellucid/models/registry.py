"""Architecture registry: `config.architectures[0]` -> the Pellucid model class that implements it."""
from __future__ import annotations

from typing import Callable

from torch import nn

_MODELS: dict[str, type[nn.Module]] = {}


def register_model(arch_name: str) -> Callable[[type[nn.Module]], type[nn.Module]]:
    """Class decorator: `@register_model("LlamaForCausalLM")`. One class may register several names."""
    def wrap(cls: type[nn.Module]) -> type[nn.Module]:
        if arch_name in _MODELS and _MODELS[arch_name] is not cls:
            raise ValueError(f"architecture {arch_name!r} is already registered to {_MODELS[arch_name].__name__}")
        _MODELS[arch_name] = cls
        return cls
    return wrap


def get_model_class(arch_name: str) -> type[nn.Module]:
    _import_builtin_models()
    if arch_name not in _MODELS:
        raise ValueError(f"unsupported model architecture {arch_name!r}; supported: {', '.join(supported_architectures())}")
    return _MODELS[arch_name]


def supported_architectures() -> list[str]:
    _import_builtin_models()
    return sorted(_MODELS)


def _import_builtin_models() -> None:
    # Imported here, not at module top, because the model modules import this one to register.
    import pellucid.models.lfm2  # noqa: F401
    import pellucid.models.llama  # noqa: F401
    import pellucid.models.moe_models  # noqa: F401
    import pellucid.models.qwen3  # noqa: F401
