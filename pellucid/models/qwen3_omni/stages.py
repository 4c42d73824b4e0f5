"""Registers Qwen3-Omni's stage models as "Qwen3OmniMoeForConditionalGeneration:<stage>"."""
from __future__ import annotations

from pellucid.models.qwen3_omni.code2wav import Qwen3OmniCode2Wav
from pellucid.models.qwen3_omni.configs import ARCHITECTURE
from pellucid.models.qwen3_omni.talker import Qwen3OmniTalker
from pellucid.models.qwen3_omni.thinker import Qwen3OmniThinker
from pellucid.models.registry import register_model

register_model(f"{ARCHITECTURE}:thinker")(Qwen3OmniThinker)
register_model(f"{ARCHITECTURE}:talker")(Qwen3OmniTalker)
register_model(f"{ARCHITECTURE}:code2wav")(Qwen3OmniCode2Wav)
