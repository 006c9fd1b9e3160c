"""``GET /v1/models`` and ``GET /health``."""

from __future__ import annotations

from studio.api.protocol import ModelCard, ModelList
from studio.api.serving_base import OpenAIServing


class OpenAIServingModels(OpenAIServing):
    def list(self) -> ModelList:
        config = self.engine.config
        card = ModelCard(
            id=self.served_model_name,
            root=config.model_name,
            family=config.family,
            stages=[
                {
                    "stage_id": s.stage_id,
                    "kind": s.kind,
                    "output": s.engine_output_type,
                    "final": s.final_output,
                }
                for s in config.stages
            ],
            config_hash=config.config_hash(),
        )
        return ModelList(data=[card])
