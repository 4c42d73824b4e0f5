"""Architecture registry: `config.architectures[0]` -> the Pellucid model class that implements it.

A checkpoint of several models served as a pipeline (Qwen3-Omni: thinker, talker, code2wav) registers one
class per stage as "<architecture>:<stage>"; an engine serves one stage (`ModelConfig.submodel`).
"""
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


def get_model_class(arch_name: str, submodel: str | None = None) -> type[nn.Module]:
    _import_builtin_models()
    if submodel is not None:
        key = f"{arch_name}:{submodel}"
        if key not in _MODELS:
            stages = stages_of(arch_name)
            raise ValueError(f"{arch_name} has no stage {submodel!r}" + (f"; its stages: {', '.join(stages)}" if stages
                                                                          else " (it is not a multi-stage model)"))
        return _MODELS[key]
    if arch_name not in _MODELS:
        stages = stages_of(arch_name)
        if stages:
            raise ValueError(f"{arch_name} is a multi-stage model ({', '.join(stages)}): serve it as a pipeline "
                             "(pellucid.pipeline, `pellucid serve`) or pick one stage with submodel=")
        raise ValueError(f"unsupported model architecture {arch_name!r}; supported: {', '.join(supported_architectures())}")
    return _MODELS[arch_name]


def stages_of(arch_name: str) -> list[str]:
    """The stages registered for a multi-stage architecture ([] for a single model)."""
    _import_builtin_models()
    prefix = f"{arch_name}:"
    return [name[len(prefix):] for name in _MODELS if name.startswith(prefix)]


def supported_architectures() -> list[str]:
    _import_builtin_models()
    return sorted(_MODELS)


def _import_builtin_models() -> None:
    # Imported here, not at module top, because the model modules import this one to register.
    import pellucid.models.lfm2  # noqa: F401
    import pellucid.models.llama  # noqa: F401
    import pellucid.models.moe_models  # noqa: F401
    import pellucid.models.qwen3  # noqa: F401
    import pellucid.models.qwen3_omni.stages  # noqa: F401
    import pellucid.models.sequence_classification  # noqa: F401
