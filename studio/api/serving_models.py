"""``GET /v1/models`` and ``GET /v1/models/{model}``."""

from __future__ import annotations

from studio.api.audio_io import produced, voices
from studio.api.protocol import ModelCard, ModelList
from studio.api.serving_base import OpenAIServing


class OpenAIServingModels(OpenAIServing):
    def list(self) -> ModelList:
        return ModelList(data=[self.card()])

    def retrieve(self, model: str) -> ModelCard:
        """The served model by name (the SDK's ``models.retrieve``); 404 naming what is served."""
        self.check_model(model)
        return self.card()

    def card(self) -> ModelCard:
        config = self.engine.config
        return ModelCard(
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
            modalities=[m.value for m in produced(self.engine)],
            voices=list(voices(self.engine)),
        )
